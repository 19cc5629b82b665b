"""``kvoffload bench``: runs the benchmark suites, each against its reference measured in the
same run, and writes their JSON, a summary and (``--plot``) PNG charts to ``--results``.

Every suite step runs as its own process (``python -m kvoffload.bench.<module>``), so a suite's
service, workers and shared memory end with it; ``--source DIR`` imports the suites from another
source tree (a worktree of an older commit) to measure that code instead. The summary
(``bench_summary.json``) holds one cell per suite, operation and size with the ratio to the
same-run reference and to the baseline recorded in ``kvoffload/bench/baseline.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import importlib.resources
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvoffload.bench.cells import (
    EXTRACTORS,
    Cell,
    merge_rounds,
    ratio_table,
    ratio_text,
    size_label,
)
from kvoffload.extras import missing_extra, require_extra


class Suite(enum.StrEnum):
    TIERING = "tiering"
    SERVICE = "service"
    CPU = "cpu"
    DISK = "disk"
    OBJECT = "object"
    TTFT = "ttft"
    VLLM = "vllm"
    PEER = "peer"
    PEER_TIER = "peer-tier"
    GPU = "gpu"


class Status(enum.StrEnum):
    """What became of a suite in a run."""

    OK = "ok"
    SKIPPED = "skipped"  # its requirements are absent (the reason says which)
    FAILED = "failed"  # a step exited non-zero (the reason quotes its log)


@dataclasses.dataclass(frozen=True)
class Step:
    """One suite module run; its JSON is ``bench_<name>.json``."""

    name: str
    module: str
    full: str
    quick: str


def _missing_modules(*names: str) -> str | None:
    absent = [n for n in names if importlib.util.find_spec(n) is None]
    return f"not installed: {', '.join(absent)}" if absent else None


def _object_missing(args: argparse.Namespace) -> str | None:
    if reason := missing_extra("object"):
        return reason
    from kvoffload.testing.s3server import S3ServerError, find_weed_binary

    try:
        find_weed_binary()
    except S3ServerError as exc:
        return f"no S3 server to measure against: {exc}"
    return None


def _gpu_missing() -> str | None:
    from kvoffload.bench.gpu import cuda_missing

    return cuda_missing()


def _peer_missing(args: argparse.Namespace) -> str | None:
    from kvoffload.bench.peer import lmcache_missing

    return lmcache_missing(args.peer_python or sys.executable)


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    suite: Suite
    summary: str
    steps: tuple[Step, ...]
    missing: Callable[[argparse.Namespace], str | None] = lambda args: None


SUITES = {
    spec.suite: spec
    for spec in (
        SuiteSpec(
            Suite.TIERING,
            "tiering library lookups and store bookkeeping vs a dict-membership loop",
            (Step("tiering", "kvoffload.bench.tiering", "", "--keys 200 --repeat 5"),),
        ),
        SuiteSpec(
            Suite.SERVICE,
            "lookup round trip vs bare ZeroMQ; one-block engine-side store/load vs two round "
            "trips + a copy; cold one-block disk load; device store/load vs memcpy",
            (
                Step(
                    "service",
                    "kvoffload.bench.service",
                    "--rounds 500 --total-mib 256",
                    "--rounds 30 --total-mib 4 --latency-rounds 5",
                ),
            ),
        ),
        SuiteSpec(
            Suite.CPU,
            "cpu worker copies, in-process and through a worker process, vs memcpy",
            (
                Step(
                    "cpu_worker",
                    "kvoffload.bench.cpu_worker",
                    "--sizes 64K,256K,1M,4M --mib 256 --reps 3 --process",
                    "--sizes 64K,1M --mib 4 --reps 1 --threads 2 --process",
                ),
            ),
        ),
        SuiteSpec(
            Suite.DISK,
            "disk store put/get (O_DIRECT and buffered) vs dd; restart scan",
            (
                Step(
                    "disk",
                    "kvoffload.bench.disk",
                    "--total-mib 256 --sizes-kib 64,256,1024,4096 --threads 1,4",
                    "--total-mib 8 --sizes-kib 64,1024 --threads 1 --parts-records 32",
                ),
                Step(
                    "disk_startup",
                    "kvoffload.bench.disk_startup",
                    "--blocks 20000",
                    "--blocks 500",
                ),
            ),
        ),
        SuiteSpec(
            Suite.OBJECT,
            "object tier S3BlockStore PUT/GET vs plain obstore and boto3 (SeaweedFS)",
            (
                Step(
                    "object",
                    "kvoffload.bench.object",
                    "--count 64 --threads 1,8",
                    "--count 8 --sizes 256KiB --threads 1",
                ),
            ),
            _object_missing,
        ),
        SuiteSpec(
            Suite.TTFT,
            "reference engine TTFT per prefix length: recompute vs host pool vs disk",
            (
                Step(
                    "ttft",
                    "kvoffload.bench.ttft",
                    "--lengths 1024 4096 --repeats 3",
                    "--lengths 256 --repeats 1",
                ),
            ),
            lambda args: missing_extra("engine"),
        ),
        SuiteSpec(
            Suite.VLLM,
            "vLLM TTFT per prefix length: recompute, resident, kvoffload pool and disk",
            (
                Step(
                    "vllm",
                    "kvoffload.bench.vllm",
                    "--lengths 2048 4096 8192",
                    "--lengths 512 --prompts 1 --no-native",
                ),
            ),
            lambda args: _missing_modules("vllm", "torch"),
        ),
        SuiteSpec(
            Suite.PEER,
            "kvoffload vs LMCache's storage backends: host and disk store/load (ratio table)",
            (
                Step(
                    "peer",
                    "kvoffload.bench.peer",
                    "--mib 256 --rounds 4",
                    "--mib 4 --rounds 1",
                ),
            ),
            _peer_missing,
        ),
        SuiteSpec(
            Suite.PEER_TIER,
            "peer tier on loopback with CURVE: a prefix from a peer's pool and disk vs the "
            "object tier (SeaweedFS) and a local disk promotion; one block's p50/p99",
            (
                Step(
                    "peer_tier",
                    "kvoffload.bench.peer_tier",
                    "--sizes 256K,1M --rounds 3 --samples 30",
                    "--sizes 256K --blocks 4 --rounds 1 --samples 3",
                ),
            ),
            _object_missing,
        ),
        SuiteSpec(
            Suite.GPU,
            "CUDA paths on an NVIDIA GPU: pool registration, vLLM and cpu worker copies (checked "
            "bit-exact) vs a pinned torch copy",
            (
                Step(
                    "gpu",
                    "kvoffload.bench.gpu",
                    "",
                    "--sizes 256K,2M --mib 64 --reps 2 --register-gib 1",
                ),
            ),
            lambda args: _gpu_missing(),
        ),
    )
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Run benchmark suites, each against its same-run reference.\n\nsuites:\n"
        + "\n".join(f"  {spec.suite:<9} {spec.summary}" for spec in SUITES.values())
        + "\n  all       every suite above (those whose requirements are absent are skipped)"
    )
    parser.add_argument(
        "suites",
        nargs="*",
        default=["all"],
        metavar="SUITE",
        choices=[*Suite, "all"],
        help="suites to run (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds per suite")
    parser.add_argument("--plot", action="store_true", help="also write PNG charts (matplotlib)")
    parser.add_argument("--rounds", type=int, default=1, help="run each suite N times; medians")
    parser.add_argument("--results", default="results", help="directory for JSON, logs and PNGs")
    parser.add_argument(
        "--peer-python", help="python of a virtualenv with LMCache (default: this one)"
    )
    parser.add_argument(
        "--source", help="import the suites from this source tree (e.g. a worktree of a commit)"
    )
    parser.add_argument(
        "--record-baseline", metavar="FILE", help="write this run's cells as a baseline file"
    )
    parser.add_argument(
        "--baseline", metavar="FILE", help="baseline to compare with (default: the packaged one)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    from kvoffload.bench.progress import Progress

    if args.plot:
        require_extra("bench --plot", "bench")
    chosen = list(Suite) if "all" in args.suites else [Suite(s) for s in dict.fromkeys(args.suites)]
    results = Path(args.results).resolve()
    (results / "logs").mkdir(parents=True, exist_ok=True)
    baseline = load_baseline(args.baseline)
    skipped = {s: r for s in chosen if (r := SUITES[s].missing(args)) is not None}
    planned = [s for s in chosen if s not in skipped]
    total = sum(len(SUITES[s].steps) for s in planned) * args.rounds
    summary: dict[str, Any] = {
        "run": run_info(args),
        "baseline": baseline.get("runs"),
        "suites": {},
    }
    for suite, reason in skipped.items():
        print(f"{suite}: skipped: {reason}", file=sys.stderr)
        summary["suites"][suite] = {"status": Status.SKIPPED, "reason": reason}
    with Progress(total) as progress:
        for suite in planned:
            summary["suites"][suite] = run_suite(SUITES[suite], args, results, progress)
    cells = [Cell.from_json(c) for s in summary["suites"].values() for c in s.get("cells", [])]
    compare(cells, baseline)
    for entry in summary["suites"].values():
        if "cells" in entry:
            entry["cells"] = [c.to_json() for c in cells if c.suite == entry["suite"]]
    summary["slower_than_baseline"] = [
        c.to_json() for c in cells if c.vs_baseline is not None and c.vs_baseline < 1.0
    ]
    out = results / "bench_summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        from kvoffload.bench.charts import plot_cells

        for path in plot_cells(cells, results):
            print(f"chart: {path}")
    print_summary(summary, cells)
    print(f"summary: {out}")
    if args.record_baseline:
        write_baseline(Path(args.record_baseline), summary, cells)
        print(f"baseline written: {args.record_baseline}")
    failed = [s for s, e in summary["suites"].items() if e["status"] == Status.FAILED]
    return 1 if failed else 0


def run_suite(spec: SuiteSpec, args: argparse.Namespace, results: Path, progress: Any) -> dict:
    """Run every step of a suite ``args.rounds`` times; the suite's merged cells."""
    rounds: list[list[Cell]] = []
    files: list[str] = []
    for round_no in range(args.rounds):
        outputs: dict[str, Any] = {}
        for step in spec.steps:
            suffix = f".{round_no + 1}" if args.rounds > 1 else ""
            out = results / f"bench_{step.name}{suffix}.json"
            log = results / "logs" / f"bench_{step.name}{suffix}.log"
            argv = [*shlex.split(step.quick if args.quick else step.full), "--out", str(out)]
            if step.name == "peer" and args.peer_python:
                argv += ["--peer-python", args.peer_python]
            label = f"{spec.suite}: {step.name}" + (f" round {round_no + 1}" if suffix else "")
            code = run_step(step.module, argv, log, args.source, partial(progress.note, label))
            progress.advance()
            if code != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                return {
                    "suite": spec.suite,
                    "status": Status.FAILED,
                    "reason": f"{step.module} exited with {code}; log {log}: " + " | ".join(tail),
                }
            outputs[step.name] = json.loads(out.read_text())
            files.append(str(out))
        if spec.suite == Suite.PEER and outputs["peer"].get("skipped"):
            return {
                "suite": spec.suite,
                "status": Status.SKIPPED,
                "reason": outputs["peer"]["skipped"],
            }
        rounds.append(EXTRACTORS[spec.suite](outputs))
    cells = merge_rounds(rounds)
    return {
        "suite": spec.suite,
        "status": Status.OK,
        "files": files,
        "cells": [c.to_json() for c in cells],
    }


def run_step(
    module: str, argv: list[str], log: Path, source: str | None, note: Callable[[str], None]
) -> int:
    """``python -m module argv`` (imported from ``source`` when given); output to ``log``."""
    env = dict(os.environ)
    cwd = None
    if source is not None:
        cwd = str(Path(source).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", module, *argv]
    with log.open("w") as sink:
        sink.write(f"$ {shlex.join(command)}\n")
        sink.flush()
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            if line.strip():
                note(line.strip())
        return proc.wait()


def compare(cells: list[Cell], baseline: dict[str, Any]) -> None:
    recorded = {c.key: c for c in (Cell.from_json(d) for d in baseline.get("cells", []))}
    for cell in cells:
        if (base := recorded.get(cell.key)) is not None:
            cell.compare(base)


def load_baseline(path: str | None) -> dict[str, Any]:
    if path is not None:
        return json.loads(Path(path).read_text())
    packaged = importlib.resources.files("kvoffload.bench") / "baseline.json"
    return json.loads(packaged.read_text()) if packaged.is_file() else {}


def run_info(args: argparse.Namespace) -> dict[str, Any]:
    source = Path(args.source or Path(__file__).parents[2]).resolve()
    commit = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["kvoffload", "bench", *sys.argv[2:]])
        if sys.argv[1:2] == ["bench"]
        else shlex.join(sys.argv),
        "commit": commit or None,
        "source": str(source),
        "quick": args.quick,
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
    }


def write_baseline(path: Path, summary: dict[str, Any], cells: list[Cell]) -> None:
    """Write this run's cells to ``path``; the suites it did not measure keep their cells."""
    kept = (
        *("suite", "metric", "size", "size_unit", "value", "unit", "higher_is_better"),
        *("reference", "reference_value", "ratio_to_reference"),
        *("limit", "limit_value", "ratio_to_limit"),
    )
    old = json.loads(path.read_text()) if path.is_file() else {}
    measured = {s for s, e in summary["suites"].items() if e["status"] == Status.OK}
    skipped = {s: e["reason"] for s, e in summary["suites"].items() if e["status"] != Status.OK}
    document = {
        "runs": [*old.get("runs", []), summary["run"]],
        "skipped": {
            **{s: r for s, r in old.get("skipped", {}).items() if s not in measured},
            **skipped,
        },
        "cells": [c for c in old.get("cells", []) if c["suite"] not in measured]
        + [{k: v for k, v in c.to_json().items() if k in kept} for c in cells],
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def print_summary(summary: dict[str, Any], cells: list[Cell]) -> None:
    """Per suite: one line per cell with the value, x reference, x limit and x baseline."""
    for suite, entry in summary["suites"].items():
        if entry["status"] != Status.OK:
            print(f"\n{suite}: {entry['status']}: {entry['reason']}")
            continue
        rows = [c for c in cells if c.suite == suite]
        print(
            f"\n{suite}  (x ref: performance / same-run reference; x limit: / the machine's "
            "same-run limit; x base: / baseline)"
        )
        print(
            f"  {'metric':<52}{'size':>12}{'value':>14}  {'x ref':>6}{'x limit':>8}{'x base':>8}"
            "  reference"
        )
        for c in rows:
            print(
                f"  {c.metric:<52}{size_label(c):>12}{c.value:>10.4g} {c.unit:<4}"
                f"{ratio_text(c.ratio_to_reference):>6}{ratio_text(c.ratio_to_limit):>8}"
                f"{ratio_text(c.vs_baseline):>8}  {c.reference or ''}"
            )
        if suite == Suite.PEER:
            print()
            print("\n".join(ratio_table(rows)))
