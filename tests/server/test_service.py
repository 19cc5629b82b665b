"""The running service: real supervisor, manager, cpu worker, sockets and shared memory."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from kvoffload.client import KVOffloadError
from kvoffload.memory.cuda_host import cuda_device_count
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.runtime.rundir import cleanup_stale
from kvoffload.testing.helpers import free_port, keys_for, random_kv_cache, wait_until
from kvoffload.testing.metrics import sample_value, scrape_metrics
from kvoffload.testing.service import ServiceHarness
from kvoffload.tiering import LookupResult
from kvoffload.wire import protocol as p

BLOCK = 65536


@pytest.fixture
def kv():
    cache = random_kv_cache(32, [BLOCK // 2, BLOCK // 2], seed=7)
    yield cache
    cache.close()
    cache.unlink()


def block_bytes(cache, block: int) -> bytes:
    return b"".join(t[block].tobytes() for t in cache.tensors)


def store_and_wait(client, req, keys, blocks, handle_id="kv"):
    accepted = client.store(req, keys, blocks, handle_id)
    if accepted.job_id is None:
        return None
    return client.wait([accepted.job_id])[accepted.job_id]


def test_store_lookup_load_round_trip(start_service, kv):
    service = start_service()
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        c.new_request("r1")
        keys = keys_for("a", 8)
        done = store_and_wait(c, "r1", keys, list(range(8)))
        assert done.success and done.kind is p.JobKind.DEVICE_STORE
        reply = c.lookup("r1", keys)
        assert reply.results == [LookupResult.HIT] * 8 and reply.hit_prefix == 8
        accepted = c.load("r1", keys, list(range(16, 24)), "kv")
        assert c.wait([accepted.job_id])[accepted.job_id].success
        for i in range(8):
            assert block_bytes(kv, 16 + i) == block_bytes(kv, i)
        c.finish_request("r1")
    status = service.status().tiering
    assert status.pinned_slots == 0 and status.jobs_in_flight == 0


def test_two_clients_share_a_prefix(start_service, kv):
    service = start_service()
    keys = keys_for("shared", 4)
    with service.client("writer") as w, service.client("reader") as r:
        w.register_kv(kv.handle("kv-w"))
        w.new_request("x")
        assert store_and_wait(w, "x", keys, [0, 1, 2, 3], "kv-w").success
        w.finish_request("x")
        r.new_request("x")  # same request id in another client is another request
        assert r.lookup("x", keys).hit_prefix == 4


def test_errors_are_typed_and_manager_keeps_serving(start_service, kv):
    service = start_service()
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        with pytest.raises(KVOffloadError) as err:
            c.lookup("never-created", keys_for("k", 1))
        assert err.value.code == "unknown_request"
        c.new_request("r")
        with pytest.raises(KVOffloadError) as err:
            c.new_request("r")
        assert err.value.code == "duplicate_request"
        with pytest.raises(KVOffloadError) as err:
            c.lookup("r", [b"short"])
        assert err.value.code == "bad_key"
        with pytest.raises(KVOffloadError) as err:
            c.store("r", keys_for("k", 2), [0, 999], "kv")
        assert err.value.code == "block_out_of_range"
        with pytest.raises(KVOffloadError) as err:
            c.store("r", keys_for("k", 1), [0], "not-mine")
        assert err.value.code == "unknown_handle"
        with pytest.raises(KVOffloadError) as err:
            c.complete_load("r", keys_for("k", 1))
        assert err.value.code == "not_pinned"
        assert c.lookup("r", keys_for("k", 1)).results == [LookupResult.MISS]


def test_malformed_frames_on_client_channel(start_service):
    service = start_service()
    zctx = zmq.Context.instance()
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(service.endpoint)
    try:
        for frame in [
            b"\xc1\xc1",
            msgspec.msgpack.encode({"t": "lookup", "rid": 9, "keys": 3}),
            b"\x00" * (p.MAX_MESSAGE_BYTES + 10),
        ]:
            raw.send(frame)
            assert raw.poll(5000)
            reply = p.decode_client_reply(raw.recv())
            assert isinstance(reply, p.Error) and reply.code == "bad_message"
        raw.send(p.encode(p.Connect(rid=1, version=p.PROTOCOL_VERSION + 1)))
        assert raw.poll(5000)
        reply = p.decode_client_reply(raw.recv())
        assert reply.code == "version_mismatch"
        raw.send(p.encode(p.Lookup(rid=2, req_id="r", keys=[])))
        assert raw.poll(5000)
        assert p.decode_client_reply(raw.recv()).code == "not_connected"
    finally:
        raw.close()
    assert service.status().clients >= 0


def test_bad_worker_hello_is_refused(start_service):
    service = start_service()
    zctx = zmq.Context.instance()
    jobs_endpoint = service.job_endpoint
    for identity, hello, reason in [
        (
            b"cpu",
            p.WorkerHello(version=p.PROTOCOL_VERSION + 5, worker="cpu", medium="cpu", pid=1),
            "protocol version",
        ),
        (
            b"bogus",
            p.WorkerHello(version=p.PROTOCOL_VERSION, worker="bogus", medium="cpu", pid=1),
            "unknown worker",
        ),
    ]:
        sock = zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity + b"-probe" if identity == b"cpu" else identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(jobs_endpoint)
        try:
            sock.send(b"\xc1 garbage")
            sock.send(p.encode(hello))
            assert sock.poll(5000)
            ack = p.decode_manager_message(sock.recv())
            assert isinstance(ack, p.HelloAck) and not ack.accepted, reason
        finally:
            sock.close()
    assert "cpu" in service.status().workers


def test_killed_worker_fails_its_jobs_and_is_restarted(start_service):
    service = start_service()
    big = SharedKVCache.create(f"/kvoffload-kvbig-{os.getpid()}", 64, [BLOCK])
    try:
        with service.client("engine") as c:
            c.register_kv(big.handle("big"))
            c.new_request("r")
            old_pid = service.status().workers["cpu"].pid
            accepted = [
                c.store("r", keys_for(f"b{j}", 16), list(range(16 * j, 16 * j + 16)), "big")
                for j in range(4)
            ]
            os.kill(old_pid, signal.SIGKILL)
            results = c.wait([a.job_id for a in accepted], timeout_s=30)
            assert len(results) == 4  # every job got its one result, none hung
            workers = service.wait_workers(["cpu"], exclude_pids=[old_pid])
            assert workers["cpu"].pid != old_pid
            deadline = time.monotonic() + 10
            while service.status().tiering.pinned_slots and time.monotonic() < deadline:
                time.sleep(0.1)
            assert service.status().tiering.pinned_slots == 0
            c.new_request("r2")
            done = store_and_wait(c, "r2", keys_for("after", 2), [0, 1], "big")
            assert done.success
    finally:
        big.close()
        big.unlink()


def test_sigterm_with_jobs_in_flight_leaves_nothing_behind(start_service, kv):
    service = start_service()
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        c.new_request("r")
        for j in range(3):
            c.store("r", keys_for(f"t{j}", 8), list(range(8)), "kv")
    left = service.stop()
    assert left.exit_code == 0 and left.clean, left
    events = {e["event"] for e in service.log_events()}
    assert {"manager_stopping", "service_stopped"} <= events


STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def ignores_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_shutdown_kills_children_that_ignore_sigterm_after_the_grace_period(start_service):
    engine = f'[[engines]]\ncommand = ["{sys.executable}", "-c", "{STUBBORN}"]\n'
    service = start_service(extra_config="stop_grace_s = 1.0\n" + engine + engine)
    stubborn = [
        c for c in psutil.Process(service.supervisor_pid).children() if STUBBORN in c.cmdline()
    ]
    assert len(stubborn) == 2
    deadline = time.monotonic() + 10
    while not all(ignores_sigterm(c.pid) for c in stubborn):
        assert time.monotonic() < deadline, "the stubborn engines never ignored SIGTERM"
        time.sleep(0.05)
    started = time.monotonic()
    left = service.stop()
    assert left.exit_code == 0 and left.clean, left
    assert time.monotonic() - started < 4.0, "two stubborn children share one 1-second grace period"
    assert not [c for c in stubborn if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    killed = [
        e["child"] for e in service.log_events() if e.get("event") == "child_killed_after_grace"
    ]
    assert sorted(killed) == ["engine0", "engine1"]


def test_status_cli_and_metrics_endpoint(start_service, kv):
    import subprocess

    port = free_port()
    service = start_service(workers=("cpu", "disk"), service_options=f"metrics_port = {port}")
    out = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "status", "--config", str(service.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "cpu" in out.stdout and "slots used" in out.stdout
    assert "retry bound" in out.stdout, "cascade drops are shown per reason"

    keys = keys_for("metrics", 4)
    with service.client("engine") as c:
        c.register_kv(kv.handle("kv"))
        c.new_request("r")
        assert store_and_wait(c, "r", keys, [0, 1, 2, 3]).success
        assert c.lookup("r", keys + keys_for("absent", 2)).hit_prefix == 4
        accepted = c.load("r", keys, [4, 5, 6, 7], "kv")
        assert c.wait([accepted.job_id])[accepted.job_id].success
        c.finish_request("r")

    def traffic_seen(families) -> bool:
        return (
            sample_value(families, "kvoffload_tier_cascaded_keys", tier="disk") == 4
            and sample_value(families, "kvoffload_worker_bytes_loaded", worker="cpu") == 4 * BLOCK
            and sample_value(families, "kvoffload_worker_bytes_written", worker="disk") == 4 * BLOCK
        )

    families = scrape_metrics(port, traffic_seen)
    expected_types = {
        "kvoffload_tier_lookups": "counter",
        "kvoffload_tier_jobs": "counter",
        "kvoffload_tier_promoted_keys": "counter",
        "kvoffload_tier_cascade_dropped_keys": "counter",
        "kvoffload_worker_bytes_stored": "counter",
        "kvoffload_worker_jobs_done": "counter",
        "kvoffload_worker_restarts": "counter",
        "kvoffload_job_bytes": "counter",
        "kvoffload_jobs": "counter",
        "kvoffload_client_call_duration_seconds": "histogram",
        "kvoffload_job_duration_seconds": "histogram",
        "kvoffload_pool_pinned_slots": "gauge",
        "kvoffload_pool_used_slots": "gauge",
        "kvoffload_device_jobs_in_flight": "gauge",
        "kvoffload_tier_jobs_in_flight": "gauge",
        "kvoffload_cascade_backlog": "gauge",
        "kvoffload_tier_cascade_backlog": "gauge",
        "kvoffload_worker_up": "gauge",
        "kvoffload_worker_capacity_bytes": "gauge",
        "process_resident_memory_bytes": "gauge",
    }
    assert {
        name: families[name].type for name in expected_types if name in families
    } == expected_types
    for family in families.values():
        assert family.documentation, f"{family.name} has no HELP text"

    assert sample_value(families, "kvoffload_tier_lookups", tier="primary", result="hit") == 4
    assert sample_value(families, "kvoffload_tier_lookups", tier="primary", result="miss") == 1
    assert sample_value(families, "kvoffload_tier_lookups", tier="disk", result="miss") == 1
    assert sample_value(families, "kvoffload_tier_jobs", tier="disk", kind="cascade") >= 1
    for reason in ("evicted", "tier_full", "retry_bound"):
        assert (
            sample_value(
                families, "kvoffload_tier_cascade_dropped_keys", tier="disk", reason=reason
            )
            == 0
        )
    assert sample_value(families, "kvoffload_worker_bytes_stored", worker="cpu") == 4 * BLOCK
    assert sample_value(families, "kvoffload_worker_up", worker="cpu") == 1
    assert sample_value(families, "kvoffload_pool_pinned_slots") == 0
    assert sample_value(families, "kvoffload_pool_used_slots") == 4
    assert sample_value(families, "kvoffload_cascade_backlog") == 0
    assert sample_value(families, "kvoffload_device_jobs_in_flight") == 0

    calls = "kvoffload_client_call_duration_seconds"
    assert sample_value(families, calls, calls + "_count", call="lookup") == 1
    assert sample_value(families, calls, calls + "_bucket", call="lookup", le="+Inf") == 1
    assert 0 < sample_value(families, calls, calls + "_sum", call="lookup") < 1
    jobs = "kvoffload_job_duration_seconds"
    for worker, kind in (("cpu", "device_store"), ("cpu", "device_load")):
        assert sample_value(families, jobs, jobs + "_count", worker=worker, kind=kind) == 1
        assert sample_value(families, "kvoffload_jobs", worker=worker, kind=kind, outcome="ok") == 1
        assert sample_value(families, "kvoffload_job_bytes", worker=worker, kind=kind) == 4 * BLOCK
    assert sample_value(families, jobs, jobs + "_count", worker="disk", kind="cascade") >= 1
    assert sample_value(families, "kvoffload_job_bytes", worker="disk", kind="cascade") == 4 * BLOCK


@pytest.mark.skipif(cuda_device_count() > 0, reason="needs a machine without a CUDA device")
def test_a_cuda_handle_is_refused_at_registration_when_no_worker_has_cuda(start_service, kv):
    service = start_service()
    cpu_pid = service.status().workers["cpu"].pid
    ipc = {
        "size": [32, BLOCK // 2],
        "stride": [BLOCK // 2, 1],
        "tensor_offset": 0,
        "dtype": "torch.float16",
        "device": 0,
        "handle": b"\x01" * 64,
        "storage_size_bytes": 32 * BLOCK,
        "storage_offset_bytes": 0,
        "ref_counter_handle": b"\x02" * 16,
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
    }
    handle = p.KVHandle(
        "gpu", "cuda_ipc", 32, [p.TensorSpec(row_bytes=BLOCK, ipc=p.CudaIpcFields(**ipc))]
    )
    with service.client("engine") as c:
        started = time.monotonic()
        with pytest.raises(KVOffloadError) as err:
            c.register_kv(handle)
        assert err.value.code == "handle_unsupported" and "CUDA" in err.value.message
        assert time.monotonic() - started < 1.0
        c.register_kv(kv.handle("kv"))
        c.new_request("r")
        assert store_and_wait(c, "r", keys_for("after-cuda", 2), [0, 1]).success
    assert service.status().workers["cpu"].pid == cpu_pid


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("manager_dies_too", [False, True])
def test_manager_and_workers_shut_down_when_their_supervisor_dies(start_service, manager_dies_too):
    """Nothing would restart them or clean up after them: they must not keep the pool mapped.
    A live manager drains and stops its workers; workers left without a manager stop alone."""
    service = start_service(workers=("cpu", "disk"))
    supervisor = psutil.Process(service.supervisor_pid)
    children = supervisor.children(recursive=True)
    assert len(children) == 3
    if manager_dies_too:
        supervisor.suspend()  # so it does not restart the manager
        os.kill(service.status().pid, signal.SIGKILL)
    supervisor.kill()
    deadline = time.monotonic() + 20
    while any(_running(c) for c in children):
        assert time.monotonic() < deadline, [c.pid for c in children if _running(c)]
        time.sleep(0.1)
    gone = {e["proc"] for e in service.log_events() if e.get("event") == "supervisor_gone"}
    assert gone >= ({"cpu", "disk"} if manager_dies_too else {"manager"}), gone
    cleanup_stale(service.runtime_dir)  # what the next `kvoffload serve` there does first


def test_an_engine_with_restart_is_started_again_after_it_fails_and_one_without_is_not(
    start_service,
):
    failing = f'command = ["{sys.executable}", "-c", "import sys; sys.exit(1)"]'
    service = start_service(
        extra_config=(
            "restart_backoff_initial_s = 0.2\nrestart_backoff_max_s = 0.4\n"
            f"[[engines]]\n{failing}\nrestart = true\n[[engines]]\n{failing}\n"
        )
    )

    def starts(name: str) -> int:
        return sum(
            1
            for e in service.log_events()
            if e.get("event") == "child_started" and e.get("child") == name
        )

    wait_until(lambda: starts("engine0") >= 3, what="engine0 started again", timeout_s=30)
    assert starts("engine1") == 1
    exits = [e for e in service.log_events() if e.get("event") == "child_exited"]
    assert {e["child"] for e in exits} == {"engine0", "engine1"}
    assert all(e["exit_code"] == 1 for e in exits)


def test_a_service_that_never_gets_ready_is_stopped_and_leaves_nothing(tmp_path: Path):
    harness = ServiceHarness(tmp_path, {"service": {"log_level": "warning"}}, watch=False)
    with pytest.raises(TimeoutError, match="not ready"):
        harness.start(ready_timeout_s=2.0, wait_for=("absent",))
    left = harness.leftovers()
    assert harness.run_id and left.clean, left
