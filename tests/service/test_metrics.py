"""The manager's Prometheus endpoint as an operator sees it: counters that survive worker
restarts."""

from __future__ import annotations

import os
import signal

from tests.service.test_service import BLOCK, keys_for, kv, store_and_wait  # noqa: F401 (kv: fixture)
from tests.service_process import free_port, sample_value, scrape_metrics


def test_worker_counters_survive_a_worker_restart(start_service, kv):
    port = free_port()
    service = start_service(service_options=f"metrics_port = {port}")
    stored = "kvoffload_worker_bytes_stored"
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        c.new_request("r")
        assert store_and_wait(c, "r", keys_for("before", 2), [0, 1]).success
        scrape_metrics(port, lambda f: sample_value(f, stored, worker="cpu") == 2 * BLOCK)

        old_pid = service.status()["workers"]["cpu"]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        service.wait_workers(["cpu"], exclude_pids=[old_pid])
        assert store_and_wait(c, "r", keys_for("after", 1), [2]).success

    families = scrape_metrics(port, lambda f: sample_value(f, stored, worker="cpu") == 3 * BLOCK)
    assert sample_value(families, "kvoffload_worker_restarts") == 1
    assert sample_value(families, "kvoffload_worker_jobs_done", worker="cpu") == 2
    assert sample_value(families, "kvoffload_jobs", worker="cpu", kind="device_store", outcome="ok") == 2
