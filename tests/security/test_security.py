"""Security properties of a running service: file modes, CURVE on TCP, hostile keys and ids,
and isolation between clients."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.config import ConfigError, ServiceConfig, load_config
from kvoffload.runtime.handshakes import LOG_BURST, fingerprint
from kvoffload.server.sockets import bind_client_socket
from kvoffload.soak.probe import ProbeEngine
from kvoffload.testing.helpers import free_port, keys_for
from kvoffload.testing.metrics import scrape_metrics
from kvoffload.testing.service import services
from kvoffload.wire import protocol as p

NO_DISK = {"enabled": False}
HOSTILE_KEYS = [
    b"../../etc/passwd".ljust(16),
    b"/etc/shadow\x00/../../..".ljust(32, b"/"),
    b"..\\..\\windows\\x".ljust(16, b"."),
    "ключ/../../".encode().ljust(24, b"."),
    b"\x00" * 16,
]


@pytest.fixture
def start_service(tmp_path):
    with services(tmp_path) as start:
        yield start


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def expect_error(code: str, call, *args) -> None:
    with pytest.raises(KVOffloadError) as err:
        call(*args)
    assert err.value.code == code, err.value


def test_runtime_dir_is_0700_and_pool_and_run_spec_are_0600(start_service):
    harness = start_service(disk=NO_DISK)
    assert mode(harness.runtime_dir) == 0o700
    pool = harness.status().pool.name
    assert pool == f"/kvoffload-{harness.run_id}-pool"
    assert mode(f"/dev/shm{pool}") == 0o600
    assert os.stat(f"/dev/shm{pool}").st_uid == os.getuid()
    assert mode(harness.runtime_dir / f"{harness.run_id}-runspec.json") == 0o600
    with ProbeEngine(harness) as engine:
        assert mode(f"/dev/shm{engine.kv.name}") == 0o600


def test_tcp_endpoint_without_curve_keys_is_refused(tmp_path):
    config = tmp_path / "tcp.toml"
    config.write_text(
        f'[service]\nclient_endpoint = "tcp://127.0.0.1:1"\nruntime_dir = "{tmp_path / "run"}"\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config(config, env={})
    assert err.value.key == "service.curve_server_secret_file" and "CURVE" in str(err.value)
    serve = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serve.returncode == 2 and "CURVE" in serve.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    with pytest.raises(ValueError, match="CURVE"):
        bind_client_socket(zmq.Context.instance(), "tcp://127.0.0.1:0", ServiceConfig())


@dataclass(frozen=True)
class CurveKeys:
    """A server's key pair, a directory authorizing one client's key, and the key triples
    (public, secret, server public) of that client, of a stranger and of the client expecting
    another server."""

    server_secret_file: Path
    server_public_file: Path
    client_secret_file: Path
    authorized: Path
    client: tuple[bytes, bytes, bytes]
    stranger: tuple[bytes, bytes, bytes]
    stranger_public_file: Path
    wrong_server: tuple[bytes, bytes, bytes]


def make_curve_keys(tmp_path: Path) -> CurveKeys:
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    server_public_file, server_secret_file = zmq.auth.create_certificates(keys, "server")
    client_public_file, client_secret_file = zmq.auth.create_certificates(keys, "client")
    stranger_public_file, stranger_secret_file = zmq.auth.create_certificates(keys, "stranger")
    shutil.copy(client_public_file, authorized)
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    client_public, client_secret = zmq.auth.load_certificate(client_secret_file)
    stranger_public, stranger_secret = zmq.auth.load_certificate(stranger_secret_file)
    assert client_secret is not None and stranger_secret is not None
    return CurveKeys(
        Path(server_secret_file),
        Path(server_public_file),
        Path(client_secret_file),
        authorized,
        (client_public, client_secret, server_public),
        (stranger_public, stranger_secret, server_public),
        Path(stranger_public_file),
        (client_public, client_secret, client_public),
    )


def test_curve_admits_the_authorized_key_only(tmp_path, start_service):
    curve = make_curve_keys(tmp_path)
    server_secret_file, authorized = curve.server_secret_file, curve.authorized
    client_keys, stranger_keys, wrong_server = curve.client, curve.stranger, curve.wrong_server
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    harness = start_service(
        curve_keys=client_keys,
        disk=NO_DISK,
        service={
            "client_endpoint": endpoint,
            "curve_server_secret_file": str(server_secret_file),
            "curve_authorized_dir": str(authorized),
        },
    )
    with KVOffloadClient(endpoint, curve_keys=client_keys, timeout_s=5.0) as client:
        assert "cpu" in client.status().workers
    for keys_tried in (stranger_keys, None, wrong_server):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            KVOffloadClient(endpoint, curve_keys=keys_tried, timeout_s=1.0)
        assert time.monotonic() - started < 3.0
    with ProbeEngine(harness, "authorized") as engine:
        req = engine.new_request()
        keys_stored = keys_for("curve", 2)
        assert engine.store(req, keys_stored).success
        done, wrong = engine.load(req, keys_stored)
        assert done.success and wrong == []


def test_refused_handshakes_are_logged_rate_limited_and_counted(tmp_path, start_service):
    """Unknown keys, clients without CURVE, a wrong server key and raw junk get no answer, as
    before; each is logged with the peer address, the key fingerprint (when the handshake got
    to the key) and the reason, at most LOG_BURST lines per window, and counted by reason in
    the status, the metrics and ``kvoffload status``."""
    curve = make_curve_keys(tmp_path)
    server_secret_file, authorized = curve.server_secret_file, curve.authorized
    client_keys, stranger_keys, wrong_server = curve.client, curve.stranger, curve.wrong_server
    stranger_public_file = curve.stranger_public_file
    client_secret_file, server_public_file = curve.client_secret_file, curve.server_public_file
    port, metrics_port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    harness = start_service(
        curve_keys=client_keys,
        disk=NO_DISK,
        service={
            "client_endpoint": endpoint,
            "curve_server_secret_file": str(server_secret_file),
            "curve_authorized_dir": str(authorized),
            "metrics_port": metrics_port,
        },
    )
    for keys_tried in (stranger_keys, None, wrong_server):
        with pytest.raises(TimeoutError):
            KVOffloadClient(endpoint, curve_keys=keys_tried, timeout_s=0.5)
    flood = 40
    for i in range(flood):
        with socket.create_connection(("127.0.0.1", port)) as junk:
            junk.sendall(b"GET / HTTP/1.0\r\n\r\n" if i % 2 else os.urandom(64))
    with KVOffloadClient(endpoint, curve_keys=client_keys, timeout_s=5.0) as client:
        assert "cpu" in client.status().workers, "the authorized client still gets in"

    def counted(status: dict) -> bool:
        refused = status["client_handshakes_refused"]
        # a client without CURVE: the server sees the mechanism mismatch, or, when the client
        # saw it first and hung up, a failed handshake
        return (
            refused["unknown_key"] >= 1
            and refused["no_curve"] + refused["handshake_failed"] >= 1
            and refused["bad_curve"] >= 1
            and sum(refused.values()) >= 3 + flood
        )

    status = harness.wait_status(counted, 20)
    assert status is not None, (harness.poll_status() or {}).get("client_handshakes_refused")
    refused = status["client_handshakes_refused"]
    total = sum(refused.values())
    events = [e for e in harness.log_events() if e["event"] == "client_handshake_refused"]
    stranger = zmq.auth.load_certificate(stranger_public_file)[0]
    unknown = [e for e in events if e["reason"] == "unknown_key"]
    assert unknown and unknown[0]["key_fingerprint"] == fingerprint(z85.decode(stranger))
    assert unknown[0]["key_fingerprint"] in Path(stranger_public_file).read_text()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", unknown[0]["peer"]), unknown[0]
    assert events[0]["reason"] == "unknown_key"
    # a peer gone before its address could be read is "unknown"
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+|unknown", e["peer"]) for e in events), events
    assert all(e["key_fingerprint"] is None for e in events if e["reason"] != "unknown_key")
    assert len(events) <= 2 * LOG_BURST < total, "a flood does not fill the log"

    def by_reason(families: dict) -> dict[str, float]:
        family = families.get("kvoffload_client_handshakes_refused")
        return {s.labels["reason"]: s.value for s in family.samples} if family else {}

    metrics = scrape_metrics(metrics_port, lambda f: sum(by_reason(f).values()) >= total)
    assert all(by_reason(metrics)[reason] >= n for reason, n in refused.items())
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffload.cli",
            "status",
            "--endpoint",
            endpoint,
            "--curve-secret",
            str(client_secret_file),
            "--curve-server-key",
            str(server_public_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("refused client handshakes:"))
    assert int(line.split()[3]) >= total and "unknown_key " in line and "bad_curve " in line, line


def test_keys_of_wrong_length_are_refused_and_path_like_keys_stay_opaque(start_service):
    harness = start_service()
    passwd_before = os.stat("/etc/passwd").st_mtime_ns
    with ProbeEngine(harness) as engine:
        req = engine.new_request()
        for bad in (b"x" * 15, b"x" * 65, b""):
            expect_error("bad_key", engine.client.lookup, req, [bad])
            expect_error("bad_key", engine.client.store, req, [bad], [0], engine.handle_id)
            expect_error("bad_key", engine.client.prepare_store, req, [bad])
        assert engine.store(req, HOSTILE_KEYS).success
        assert harness.wait_status(
            lambda s: s["tiering"]["tiers"]["disk"]["indexed_keys"] == len(HOSTILE_KEYS), 10
        )
        engine.client.finish_request(req)
        engine.client.reset_cache()
        req = engine.new_request()
        assert engine.lookup_ready(req, HOSTILE_KEYS).ready_prefix == len(HOSTILE_KEYS)
        done, wrong = engine.load(req, HOSTILE_KEYS)
        assert done.success and wrong == []
    names = [name for _, dirs, files in os.walk(harness.workdir) for name in dirs + files]
    assert not [
        n for n in names if any(part in n for part in ("passwd", "shadow", "..", "windows", "ключ"))
    ]
    assert sorted(p.name for p in harness.workdir.iterdir()) == [
        "disk",
        "kvoffload.toml",
        "service.log",
    ]
    assert os.stat("/etc/passwd").st_mtime_ns == passwd_before


def test_out_of_range_blocks_and_unprepared_completions_get_typed_errors(start_service):
    harness = start_service(disk=NO_DISK)
    keys = keys_for("range", 2)
    with ProbeEngine(harness, blocks=8) as engine:
        client, handle = engine.client, engine.handle_id
        req = engine.new_request()
        for blocks in ([0, 8], [-1, 0], [0, 2**40]):
            expect_error("block_out_of_range", client.store, req, keys, blocks, handle)
            expect_error("block_out_of_range", client.load, req, keys, blocks, handle)
        expect_error("bad_request", client.store, req, keys, [0], handle)
        expect_error("not_prepared", client.complete_store, req, keys)
        expect_error("not_ready", client.prepare_load, req, keys)
        expect_error("not_pinned", client.complete_load, req, keys)
        expect_error("unknown_request", client.lookup, "no-such-request", keys)
        tiering = harness.status().tiering
        assert (tiering.used_slots, tiering.pinned_slots, tiering.writing_slots) == (
            0,
            0,
            0,
        )


def test_a_client_cannot_touch_another_clients_requests_handles_pins_or_events(start_service):
    harness = start_service(disk=NO_DISK)
    keys = keys_for("owned", 3)
    with ProbeEngine(harness, "a") as a, ProbeEngine(harness, "b") as b:
        req = a.new_request()
        assert a.store(req, keys).success
        a.client.prepare_load(req, keys)
        open_store = keys_for("open", 1)
        a.client.prepare_store(req, open_store)
        b.client.new_request(req)  # the same name is another request in b's namespace
        expect_error("not_pinned", b.client.complete_load, req, keys)
        expect_error("not_prepared", b.client.complete_store, req, open_store)
        expect_error("unknown_handle", b.client.load, req, keys, [0, 1, 2], a.handle_id)
        expect_error("handle_taken", b.client.register_kv, a.kv.handle(a.handle_id))
        tiering = harness.status().tiering
        assert (tiering.pinned_slots, tiering.writing_slots) == (3, 1), (
            "a's pins and store must be intact"
        )
        accepted = a.client.load(req, keys, [3, 4, 5], a.handle_id)
        assert b.client.poll(wait_ms=300) == []
        assert accepted.job_id in a.client.wait([accepted.job_id])
        a.client.complete_load(req, keys)
        a.client.complete_store(req, open_store, success=False)
        tiering = harness.status().tiering
        assert (tiering.pinned_slots, tiering.writing_slots) == (0, 0)


def test_a_client_cannot_register_the_host_pool_as_its_kv_cache(start_service):
    harness = start_service(disk=NO_DISK)
    keys = keys_for("victim", 1)
    with ProbeEngine(harness, "victim") as victim, harness.client("attacker") as attacker:
        assert victim.store(victim.new_request(), keys).success
        info = attacker.info
        pool_as_kv = p.KVHandle(
            "pool",
            "shm",
            info.num_slots,
            [p.TensorSpec(row_bytes=info.block_bytes)],
            info.pool_name,
        )
        try:
            attacker.register_kv(pool_as_kv)
        except KVOffloadError:
            return
        attacker.new_request("a")
        junk = keys_for("junk", 1)
        stored = attacker.store("a", junk, [info.num_slots - 1], "pool")
        attacker.wait([stored.job_id])
        for slot in range(4):
            loaded = attacker.load("a", junk, [slot], "pool")
            attacker.wait([loaded.job_id])
        req = victim.new_request()
        assert victim.lookup_ready(req, keys).ready_prefix == 1
        done, wrong = victim.load(req, keys)
        assert done.success and wrong == []


def test_run_files_disappear_at_shutdown(tmp_path):
    with services(tmp_path) as start:
        harness = start(disk=NO_DISK)
        run_id, runtime_dir = harness.run_id, harness.runtime_dir
    assert not [n for n in os.listdir("/dev/shm") if run_id in n]
    assert not Path(runtime_dir).exists() or not [n for n in os.listdir(runtime_dir) if run_id in n]


def test_register_kv_refuses_bad_handles_and_says_why(start_service):
    harness = start_service(disk=NO_DISK)
    slot_table = harness.supervisor.spec.slot_table_name
    assert slot_table == f"/kvoffload-{harness.run_id}-slots"
    alias = f"/kvoffload-kv-alias-{harness.run_id}"
    os.link(f"/dev/shm{slot_table}", f"/dev/shm{alias}")
    try:
        with (
            ProbeEngine(harness, "owner", blocks=8) as engine,
            harness.client("attacker") as attacker,
        ):
            info, kv = attacker.info, engine.kv

            def shm(name=kv.name, blocks=8, rows=None, **fields) -> p.KVHandle:
                tensors = rows or [p.TensorSpec(row_bytes=info.block_bytes, **fields)]
                return p.KVHandle("h", "shm", blocks, tensors, name)

            half = info.block_bytes // 2
            cases = {
                "host pool": (shm(info.pool_name, info.num_slots), "segment of the service"),
                "slot header table": (shm(slot_table, 1), "segment of the service"),
                "slot table under another name": (
                    shm(alias, 1),
                    "another name of a segment of the service",
                ),
                "missing segment": (shm("/kvoffload-kv-no-such-segment"), "does not exist"),
                "negative offset": (shm(offset=-4096), "offset must be >= 0, got -4096"),
                "no blocks": (shm(blocks=0), "num_blocks must be > 0, got 0"),
                "2^40 blocks": (shm(blocks=2**40), "num_blocks must be <="),
                "past the segment": (shm(blocks=9), "outside the"),
                "rows too short": (shm(rows=[p.TensorSpec(row_bytes=half)]), f"sum to {half}"),
                "no tensors": (p.KVHandle("h", "shm", 8, [], kv.name), "at least one tensor"),
                "no handle id": (
                    p.KVHandle("", "shm", 8, [p.TensorSpec(row_bytes=info.block_bytes)], kv.name),
                    "handle_id",
                ),
            }
            for case, (handle, reason) in cases.items():
                with pytest.raises(KVOffloadError) as err:
                    attacker.register_kv(handle)
                assert err.value.code == "bad_handle" and reason in err.value.message, (
                    case,
                    err.value,
                )
            junk = p.KVHandle(
                "h", "cuda_ipc", 8, [p.TensorSpec(row_bytes=info.block_bytes, ipc={"junk": 1})]
            )
            with pytest.raises(KVOffloadError) as err:
                attacker.register_kv(junk)
            assert err.value.code == "bad_message" and "junk" in err.value.message, (
                "refused by decoding"
            )
            attacker.register_kv(kv.handle("same-cache"))
            assert harness.wait_status(
                lambda s: (s["workers"]["cpu"]["stats"]["medium"] or {}).get("kv_handles") == 2, 5
            )
    finally:
        os.unlink(f"/dev/shm{alias}")


def test_ipc_socket_files_are_0600(start_service):
    harness = start_service(disk=NO_DISK)
    sockets = sorted(harness.runtime_dir.glob(f"{harness.run_id}-*.sock"))
    assert [s.name.split("-", 1)[1] for s in sockets] == ["client.sock", "jobs.sock"]
    assert [mode(s) for s in sockets] == [0o600, 0o600]
    with harness.client("after-chmod") as client:
        assert "cpu" in client.status().workers
