"""``kvoffload bench gpu`` without a GPU: it skips, says why and exits 0 (the runner and the
module both). Its checks of the vLLM worker, run on CPU tensors with vLLM's own classes, and its
stand-ins for those classes (the GPU machine has no vLLM) against vLLM's."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.bench import gpu
from kvoffload.bench.cells import gpu_cells

needs_no_cuda = pytest.mark.skipif(
    gpu.cuda_missing() is None, reason="a CUDA device is present: the suite would run for real"
)


@needs_no_cuda
def test_without_cuda_the_suite_skips_and_says_why(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "bench", "gpu", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "gpu: skipped: " in done.stderr
    summary = json.loads((tmp_path / "bench_summary.json").read_text())
    assert summary["suites"]["gpu"]["status"] == "skipped"
    assert summary["suites"]["gpu"]["reason"] == gpu.cuda_missing()

    out = tmp_path / "bench_gpu.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.bench.gpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("bench gpu: skipped: ")
    assert json.loads(out.read_text()) == {"skipped": gpu.cuda_missing()}


def test_the_vllm_worker_checks_pass_on_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    run = gpu.vllm_worker_run(64 << 10, mib=1, reps=1, device=torch.device("cpu"), tensors=4)
    assert run["ok"], run["problems"]
    assert run["blocks"] == 16 and run["h2d_gbps"] > 0 and run["d2h_gbps"] > 0
    layout = gpu.vllm_layout_check(torch.device("cpu"))
    assert layout["ok"], layout["problems"]


def test_the_stand_ins_have_vllms_fields_and_signatures() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.kv_offload.base as real

    stand_ins = gpu.vllm_stand_ins()["vllm.v1.kv_offload.base"]
    for name in (
        "CanonicalKVCacheTensor",
        "CanonicalKVCacheRef",
        "CanonicalKVCaches",
        "GPULoadStoreSpec",
        "TransferResult",
        "LoadStoreSpec",
        "OffloadingWorker",
    ):
        ours, theirs = getattr(stand_ins, name), getattr(real, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name
    worker = stand_ins.OffloadingWorker
    for method in ("submit_store", "submit_load", "get_finished", "wait", "shutdown"):
        # vLLM 0.33's signatures, which extend 0.32's (submit_load's ``expedited``)
        ours = list(inspect.signature(getattr(worker, method)).parameters)
        theirs = list(inspect.signature(getattr(real.OffloadingWorker, method)).parameters)
        assert ours[: len(theirs)] == theirs, method
    assert (
        stand_ins.OffloadingWorker.__abstractmethods__ == real.OffloadingWorker.__abstractmethods__
    )


def test_cells_compare_each_path_with_the_torch_copy() -> None:
    row = {
        "block_bytes": 2 << 20,
        "torch": {"h2d_gbps": 50.0, "d2h_gbps": 40.0},
        "vllm_worker": {"h2d_gbps": 45.0, "d2h_gbps": 40.0},
        "cpu_worker": {"h2d_gbps": 25.0, "d2h_gbps": 20.0},
    }
    cells = {c.metric: c for c in gpu_cells({"gpu": {"results": [row]}})}
    assert set(cells) == {
        "vllm_worker_load",
        "vllm_worker_store",
        "cpu_worker_load",
        "cpu_worker_store",
    }
    assert cells["vllm_worker_load"].ratio_to_reference == pytest.approx(0.9)
    assert cells["cpu_worker_store"].ratio_to_reference == pytest.approx(0.5)


def test_the_vllm_worker_runs_on_the_stand_ins_alone() -> None:
    """What the GPU machine (no vLLM) runs: the worker imported with only the stand-ins."""
    pytest.importorskip("torch")
    code = (
        "import sys, torch\n"
        "from kvoffload.bench import gpu\n"
        "sys.modules.update(gpu.vllm_stand_ins())\n"
        "run = gpu.vllm_worker_run(64 << 10, 1, 1, torch.device('cpu'), tensors=4)\n"
        "layout = gpu.vllm_layout_check(torch.device('cpu'))\n"
        "import vllm.v1.kv_offload.base as base\n"
        "assert not hasattr(base, '__file__')  # the stand-in, not vLLM's module\n"
        "print(run['ok'], run['problems'], layout['ok'], 'vllm.config' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "True [] True False"
