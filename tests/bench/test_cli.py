"""``kvoffload bench``: the suites it lists, quick end-to-end runs as a subprocess (JSON with
ratios, PNG charts), the peer suite's skip without LMCache, and the cell comparisons."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.bench.cells import Cell, merge_rounds
from kvoffload.bench.peer import LATENCY_OPS, OPS, kvoffload_round
from kvoffload.bench.runner import Suite
from kvoffload.testing.helpers import skip_without_extra

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_suite_with_a_line() -> None:
    done = bench("--help")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for suite in Suite:
        described = [line for line in lines if line.strip().startswith(f"{suite} ")]
        assert described and len(described[0].split()) > 3, f"{suite} not described"
    assert any(line.strip().startswith("all ") for line in lines)


def test_quick_tiering_and_cpu_write_json_with_ratios_and_a_chart(tmp_path: Path) -> None:
    skip_without_extra("bench")
    done = bench("tiering", "cpu", "--quick", "--plot", "--results", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "bench_summary.json").read_text())
    assert summary["run"]["quick"] is True
    for suite, raw in (("tiering", "bench_tiering.json"), ("cpu", "bench_cpu_worker.json")):
        entry = summary["suites"][suite]
        assert entry["status"] == "ok", entry
        json.loads((tmp_path / raw).read_text())
        ratios = [c["ratio_to_reference"] for c in entry["cells"] if c["reference"]]
        assert ratios and all(r > 0 for r in ratios)
        assert all("vs_baseline" in c for c in entry["cells"])
    cpu = summary["suites"]["cpu"]["cells"]
    assert {c["size"] for c in cpu} == {64 << 10, 1 << 20}
    assert any(c["metric"] == "device_store_process" for c in cpu), "the worker-process copies"
    # the packaged baseline has these sizes (with 4 job threads): each such cell is compared
    assert summary["baseline"] and summary["baseline"][0]["commit"]
    compared = [c for c in cpu if c["metric"].endswith(("_process", "_1thread"))]
    assert len(compared) == 8 and all(c["vs_baseline"] is not None for c in compared)
    chart = tmp_path / "bench_cpu.png"
    data = chart.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert f"chart: {chart}" in done.stdout
    assert "memcpy 1 thread" in done.stdout


def test_plot_without_matplotlib_names_the_bench_extra(tmp_path: Path) -> None:
    """Refused before any suite runs, in one line naming the extra."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; from kvoffload.cli import main; "
        f"sys.exit(main(['bench', 'tiering', '--quick', '--plot', '--results', {str(tmp_path)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvoffload: bench --plot needs matplotlib, which is not installed; install the bench "
        "extra: pip install 'kvoffload[bench]'"
    ]
    assert not (tmp_path / "bench_tiering.json").exists(), "no suite ran"


def test_peer_without_lmcache_says_skipped_and_why(tmp_path: Path) -> None:
    if importlib.util.find_spec("lmcache") is not None:
        pytest.skip("LMCache is installed in this interpreter")
    done = bench("peer", "--quick", "--results", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peer: skipped: LMCache is not installed" in done.stderr
    entry = json.loads((tmp_path / "bench_summary.json").read_text())["suites"]["peer"]
    assert entry["status"] == "skipped"
    assert "LMCache is not installed" in entry["reason"]


def test_peer_workload_on_kvoffload_runs_every_path_and_verifies_the_bytes(tmp_path: Path) -> None:
    """The kvoffload side of the peer suite (no LMCache needed): every operation of the table
    runs on small blocks, and its loads verify the bytes they brought back."""
    figures = kvoffload_round(64 << 10, 32, 8, "t", tmp_path)
    gbps = {name for _, name, *_ in OPS}
    latencies = {name for _, name, *_ in LATENCY_OPS}
    assert set(figures) == gbps | latencies
    assert all(figures[name] > 0 for name in figures)


def test_cells_merge_to_medians_and_compare_with_a_baseline() -> None:
    def cell(value: float, reference: float) -> Cell:
        return Cell("disk", "store", 1 << 20, "bytes", value, "GB/s", True, "dd", reference)

    merged = merge_rounds([[cell(1.0, 2.0)], [cell(3.0, 2.0)], [cell(2.0, 1.0)]])
    assert len(merged) == 1 and merged[0].value == 2.0 and merged[0].reference_value == 2.0
    assert merged[0].ratio_to_reference == 1.5  # median of 0.5, 1.5, 2.0
    now = cell(2.0, 4.0)
    now.compare(cell(1.0, 1.0))
    assert now.vs_baseline == 2.0 and now.vs_baseline_normalized == 0.5
    latency = Cell("service", "rtt", 1, "keys", 50.0, "us", False, "zmq", 25.0)
    latency.compare(Cell("service", "rtt", 1, "keys", 100.0, "us", False, "zmq", 25.0))
    assert latency.ratio_to_reference == 0.5 and latency.vs_baseline == 2.0


def test_quick_peer_tier_measures_a_peer_against_the_object_tier(tmp_path: Path) -> None:
    skip_without_extra("object")
    done = bench("peer-tier", "--quick", "--results", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads((tmp_path / "bench_summary.json").read_text())["suites"]["peer-tier"]
    assert entry["status"] == "ok", entry
    cells = {c["metric"]: c for c in entry["cells"]}
    pool = cells["prefix of 4 from a peer's pool"]
    assert pool["value"] > 0 and pool["reference_value"] > 0 and pool["ratio_to_reference"] > 0
    assert pool["others"]["local_disk_gb_s"] > 0
    assert cells["prefix of 4 from a peer's disk"]["value"] > 0
    one = cells["one block from a peer's pool, p50"]
    assert 0 < one["value"] <= one["others"]["p99_us"]
    raw = json.loads((tmp_path / "bench_peer_tier.json").read_text())
    assert raw["curve"] is True and "SeaweedFS" in raw["note"]
