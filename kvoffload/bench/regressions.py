"""Before a change to the data path: ``kvoffload bench --quick`` against a committed baseline,
failing on any cell that dropped by more than ``--threshold`` (15% by default).

Runs the suites (``SUITES`` by default: those that need nothing outside this checkout) in
quick mode for ``--rounds`` rounds (5; cells are medians) against ``--baseline`` (the committed
``kvoffload/bench/baseline_quick.json``), then compares each cell with the baseline's: by its
value (``vs_baseline``) and, where both runs measured a reference, by its ratio to it
(``vs_baseline_normalized``, which divides out how busy the machine was). A cell under
``1 - threshold`` on both counts is slower (one count alone is the noise of the cell or of its
reference); the suites with slower cells run again, up to ``--confirm`` times, and a cell
slower in every run is a regression: it is listed and the exit status is 1 (a noisy machine
moves cells by 20-30% from one minute to the next, a real regression stays). ``--record`` writes
this run as the new baseline instead (after a change that moves the figures on purpose, say
why in its commit). Timings are noisy on shared machines, which is why this is a benchmark,
not a test: it is not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvoffload.bench.cells import Cell, ratio_text, size_label

SUITES = ("tiering", "service", "cpu", "disk")
BASELINE = Path(__file__).with_name("baseline_quick.json")
THRESHOLD = 0.15


def change(cell: Cell) -> float | None:
    """Performance now over the baseline's (> 1: better): the better of the raw and the
    normalized comparison, so both must have dropped for a cell to count as slower."""
    counts = [r for r in (cell.vs_baseline, cell.vs_baseline_normalized) if r is not None]
    return max(counts) if counts else None


def regressions(cells: list[Cell], threshold: float) -> list[Cell]:
    return [c for c in cells if (r := change(c)) is not None and r < 1.0 - threshold]


def run_bench(args: argparse.Namespace, suites: list[str], results: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "kvoffload.cli", "bench", "--quick", *suites]
    argv += ["--rounds", str(args.rounds), "--results", str(results)]
    if args.record:
        argv += ["--record-baseline", str(args.baseline)]
    else:
        argv += ["--baseline", str(args.baseline)]
    if args.peer_python:
        argv += ["--peer-python", args.peer_python]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kvoffload bench failed ({done.returncode}):\n{done.stdout[-3000:]}")
    summary: dict[str, Any] = json.loads((results / "bench_summary.json").read_text())
    return summary


def cells_of(summary: dict[str, Any]) -> list[Cell]:
    return [Cell.from_json(c) for s in summary["suites"].values() for c in s.get("cells", [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", default=list(SUITES), help="suites to compare")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each suite; medians")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="drop that fails")
    parser.add_argument(
        "--confirm", type=int, default=2, help="reruns of the suites with slower cells"
    )
    parser.add_argument("--record", action="store_true", help="write this run as the baseline")
    parser.add_argument("--peer-python", help="python with LMCache, for the peer suite")
    parser.add_argument("--results", type=Path, help="keep the run's JSON here")
    args = parser.parse_args(argv)
    results = args.results or Path(tempfile.mkdtemp(prefix="kvo-bench-check-"))
    summary = run_bench(args, list(args.suites), results)
    if args.record:
        print(f"baseline written: {args.baseline}")
        return 0
    cells = cells_of(summary)
    compared = [c for c in cells if change(c) is not None]
    worse = regressions(cells, args.threshold)
    for attempt in range(args.confirm):
        if not worse:
            break
        suites = sorted({c.suite for c in worse})
        print(f"{len(worse)} cells slower; running {', '.join(suites)} again ({attempt + 1})")
        again = {
            c.key: c
            for c in regressions(cells_of(run_bench(args, suites, results)), args.threshold)
        }
        worse = [again[c.key] for c in worse if c.key in again]
    print(f"{len(compared)} cells compared with {args.baseline} ({len(cells)} measured)")
    for cell in worse:
        print(
            f"REGRESSION {cell.suite}: {cell.metric} at {size_label(cell)}: "
            f"{ratio_text(change(cell))}x the baseline ({cell.value:.4g} {cell.unit}, "
            f"baseline {cell.baseline_value or 0:.4g})"
        )
    skipped = {s: e["reason"] for s, e in summary["suites"].items() if e["status"] != "ok"}
    for suite, reason in skipped.items():
        print(f"{suite}: not compared: {reason}")
    if worse:
        print(f"{len(worse)} cells dropped by more than {args.threshold:.0%}")
        return 1
    print(f"no cell dropped by more than {args.threshold:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
