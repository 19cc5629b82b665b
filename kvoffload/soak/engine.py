"""The synthetic engine of soak runs: a client process whose every block is verifiable.

Engines of a run share conversations (prefix chains of keys) whose blocks hold bytes derived
from their keys (``blocks``), so any block loaded from any tier, stored by any engine, is
checked byte for byte.

``python -m kvoffload.soak.engine --endpoint E --name N --seed S --report F --shm-prefix P``
plays requests until SIGTERM (or ``--duration``): lookup (waiting out HIT_PENDING/RETRY), load
the ready prefix and verify every key the job reports as loaded, store the rest. A fraction of
requests use the direct path instead: ``prepare_load`` + read and verify the pool slots while
pinned + ``complete_load``; ``prepare_store`` + write the slots + ``complete_store``.

It writes JSON lines to ``--report`` (line-buffered, so a kill -9 loses at most one line):
``stats`` (cumulative counters, every second and at exit), ``violation`` (wrong bytes, a
duplicate or foreign job result, an unexpected error code, a call that overran its timeout),
``timeout`` and ``job_lost`` (with monotonic start/end times, judged later against the fault
windows), ``lookup_stuck``, ``acked`` (the keys of each acknowledged store, hex) and ``exit``.
Direct stores send the checksums of the slots they wrote, so they survive a manager restart.

After a timeout, a lost job or a "not_connected" error the engine reconnects with a new client
and a new KV cache segment (an abandoned job may still write into the old one).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvoffload.client import KVOffloadClient, KVOffloadError, ServiceUnavailable
from kvoffload.logs import configure_logging
from kvoffload.memory.blockformat import payload_checksum
from kvoffload.memory.kvcache import SharedKVCache
from kvoffload.memory.pool import HostPool
from kvoffload.soak.blocks import POISON, conversation_keys, expected_block, mismatch
from kvoffload.wire.protocol import ErrorCode

log = structlog.get_logger()

STATS_INTERVAL_S = 1.0
CALL_OVERRUN_SLACK_S = 2.0
RECONNECT_CODES = frozenset(
    {ErrorCode.NOT_CONNECTED, ErrorCode.UNKNOWN_REQUEST, ErrorCode.UNKNOWN_HANDLE}
)
EXPECTED_CODES = frozenset(
    {ErrorCode.NO_SPACE, ErrorCode.NOT_READY, ErrorCode.WORKER_UNAVAILABLE, ErrorCode.DRAINING}
)


class JobLost(Exception):
    """A job's result did not arrive in time."""


class Reconnect(Exception):
    """The session is gone or unusable: start over with a new client and KV cache."""


@dataclass
class EngineOptions:
    """What an engine plays: ``conversations`` chains of up to ``max_blocks`` keys; a
    ``direct_fraction`` of requests on the direct (pool) path, holding pins up to
    ``hold_pins_s``; bounds for calls, jobs and HIT_PENDING waits."""

    endpoint: str
    name: str
    seed: int
    report: Path
    shm_prefix: str
    namespace: bytes = b"kvoffload-soak"
    conversations: int = 24
    max_blocks: int = 12
    direct_fraction: float = 0.25
    hold_pins_s: float = 0.05
    think_s: float = 0.01
    call_timeout_s: float = 5.0
    job_timeout_s: float = 20.0
    lookup_wait_s: float = 15.0
    duration_s: float = 0.0


class Report:
    """JSON-lines event writer (line buffered)."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - one line-buffered report for the engine's life

    def write(self, ev: str, **fields: Any) -> None:
        self._file.write(json.dumps({"ev": ev, "t": time.monotonic(), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


class SoakEngine:
    """One engine: ``run`` plays random requests until stopped; ``sweep`` checks every
    conversation once. Counters and events go to the report (see the module docstring)."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.report = Report(opts.report)
        self.counters: Counter[str] = Counter()
        self.chains = [
            conversation_keys(opts.namespace, c, opts.max_blocks) for c in range(opts.conversations)
        ]
        self.client: KVOffloadClient | None = None
        self.kv: SharedKVCache | None = None
        self.pool: HostPool | None = None
        self.handle_id = ""
        self.generation = 0
        self.block_bytes = 0
        self.stopping = False
        self._req_seq = 0
        self._submitted: dict[int, tuple[str, float]] = {}
        self._finished: set[int] = set()
        self._results: dict[int, Any] = {}
        self._last_stats = 0.0

    # ---- main loop ------------------------------------------------------------------------

    def run(self) -> int:
        deadline = time.monotonic() + self.opts.duration_s if self.opts.duration_s else float("inf")
        try:
            while not self.stopping and time.monotonic() < deadline:
                self._step()
                self._maybe_stats()
                time.sleep(self.rng.uniform(0, 2 * self.opts.think_s))
        finally:
            self._finish()
        return 0

    def sweep(self) -> None:
        """Look up, load and verify every conversation's whole chain once, storing nothing;
        any failure to get through is a ``sweep_failed`` violation."""
        try:
            if not self._connect():
                raise TimeoutError("the manager does not answer")
            for keys in self.chains:
                self._one_request(keys, store=False)
        except (TimeoutError, JobLost, Reconnect, KVOffloadError) as exc:
            self._violation("sweep_failed", error=repr(exc)[:300])
        finally:
            self._finish()

    def _finish(self) -> None:
        self._disconnect()
        if self.pool is not None:
            self.pool.close()
        self.report.write("stats", **self.counters)
        self.report.write("exit")
        self.report.close()

    def _step(self) -> None:
        if self.client is None and not self._connect():
            return
        started = time.monotonic()
        try:
            self._one_request()
        except TimeoutError as exc:  # ServiceUnavailable included
            self.counters["timeouts"] += 1
            self.report.write("timeout", t0=started, t1=time.monotonic(), error=str(exc))
            self._reconnect("timeout")
        except KVOffloadError as exc:
            self._on_error(exc)
        except JobLost as exc:
            self._reconnect(f"job_lost: {exc}")
        except Reconnect as exc:
            self._reconnect(str(exc))

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            self.report.write("stats", **self.counters)

    # ---- connection -----------------------------------------------------------------------

    def _connect(self) -> bool:
        """New client, KV cache and registration; False while the manager does not answer."""
        try:
            client = KVOffloadClient(
                self.opts.endpoint, timeout_s=self.opts.call_timeout_s, name=self.opts.name
            )
        except TimeoutError:
            self.counters["connect_timeouts"] += 1
            return False
        self.client = client
        self.generation += 1
        info = client.info
        self.block_bytes = info.block_bytes
        half = info.block_bytes // 2
        self.kv = SharedKVCache.create(
            f"{self.opts.shm_prefix}-{self.generation}",
            self.opts.max_blocks,
            [half, info.block_bytes - half],
        )
        self.handle_id = f"{self.opts.name}-{self.generation}"
        if self.pool is None or self.pool.name != info.pool_name:
            if self.pool is not None:
                self.pool.close()
            self.pool = HostPool.attach(info.pool_name, info.num_slots, info.block_bytes)
        self._submitted.clear()
        self._finished.clear()
        self._results.clear()
        self.counters["connects"] += 1
        try:
            self._call(client.register_kv, self.kv.handle(self.handle_id))
        except (TimeoutError, KVOffloadError, Reconnect) as exc:
            self._reconnect(f"register_kv: {exc!r}")
            return False
        return True

    @property
    def _client(self) -> KVOffloadClient:
        """The connected client (requests run only between connect and disconnect)."""
        if self.client is None:
            raise Reconnect("not connected")
        return self.client

    @property
    def _kv(self) -> SharedKVCache:
        if self.kv is None:
            raise Reconnect("not connected")
        return self.kv

    @property
    def _pool(self) -> HostPool:
        if self.pool is None:
            raise Reconnect("not connected")
        return self.pool

    def _reconnect(self, reason: str) -> None:
        self.counters["reconnects"] += 1
        log.warning("soak_engine_reconnect", reason=reason, engine=self.opts.name)
        self._disconnect()

    def _disconnect(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()
        kv, self.kv = self.kv, None
        if kv is not None:
            kv.close()
            kv.unlink()
        for job_id, (kind, t0) in self._submitted.items():
            if job_id not in self._finished:
                self.report.write("job_lost", job_id=job_id, kind=kind, t0=t0, t1=time.monotonic())
                self.counters["jobs_lost"] += 1
        self._submitted.clear()

    def _call(self, method, *args, **kwargs):
        """One client call: reconnect codes raise Reconnect, an overrun is a violation."""
        started = time.monotonic()
        try:
            return method(*args, **kwargs)
        except KVOffloadError as exc:
            if exc.code in RECONNECT_CODES:
                self.counters[f"error_{exc.code}"] += 1
                raise Reconnect(exc.code) from None
            raise
        finally:
            took = time.monotonic() - started
            limit = self.opts.call_timeout_s + CALL_OVERRUN_SLACK_S
            if took > limit:
                self._violation("call_overran", call=method.__name__, seconds=round(took, 3))

    def _violation(self, kind: str, **detail: Any) -> None:
        self.counters[f"violation_{kind}"] += 1
        self.report.write("violation", kind=kind, engine=self.opts.name, **detail)
        log.error("soak_violation", kind=kind, **detail)

    # ---- one request ----------------------------------------------------------------------

    def _one_request(self, keys: list[bytes] | None = None, store: bool = True) -> None:
        """One request over ``keys`` (default: a random conversation's random prefix)."""
        client = self._client
        if keys is None:
            conversation = self.rng.randrange(self.opts.conversations)
            keys = self.chains[conversation][: self.rng.randint(2, self.opts.max_blocks)]
        self._req_seq += 1
        req = f"r{self._req_seq}"
        self._call(client.new_request, req)
        self.counters["requests"] += 1
        try:
            direct = self.rng.random() < self.opts.direct_fraction
            ready = self._lookup(req, keys)
            if ready:
                (self._load_direct if direct else self._load_device)(req, keys[:ready])
            if store and ready < len(keys):
                (self._store_direct if direct else self._store_device)(req, keys, ready)
        except KVOffloadError as exc:
            self._on_error(exc)
        try:
            self._call(client.finish_request, req)
        except KVOffloadError as exc:
            self._on_error(exc)

    def _on_error(self, exc: KVOffloadError) -> None:
        """Count an error reply; a manager that does not answer is re-raised, for ``_step``."""
        if isinstance(exc, ServiceUnavailable):
            raise exc
        self.counters[f"error_{exc.code}"] += 1
        if exc.code not in EXPECTED_CODES:
            self._violation("unexpected_error", code=exc.code, message=exc.message[:200])

    def _lookup(self, req: str, keys: list[bytes]) -> int:
        """Length of the ready (HIT) prefix once nothing is pending any more."""
        client = self._client
        started = time.monotonic()
        while True:
            outcome = self._call(client.lookup, req, keys)
            self.counters["lookups"] += 1
            if not outcome.must_wait:
                break
            if time.monotonic() - started > self.opts.lookup_wait_s:
                self.report.write(
                    "lookup_stuck", t0=started, t1=time.monotonic(), results=repr(outcome)
                )
                self.counters["lookups_stuck"] += 1
                break
            self.counters["lookup_waits"] += 1
            self._call(client.end_step)
            time.sleep(0.005)
        self.counters["blocks_looked_up"] += len(keys)
        self.counters["blocks_hit"] += outcome.ready_prefix
        return outcome.ready_prefix

    # ---- device path ----------------------------------------------------------------------

    def _rows(self, block: int) -> list[np.ndarray]:
        return [t[block] for t in self._kv.tensors]

    def _write_block(self, block: int, key: bytes) -> None:
        data = expected_block(key, self.block_bytes)
        offset = 0
        for row in self._rows(block):
            row[:] = data[offset : offset + row.size]
            offset += row.size

    def _check_block(self, block: int, key: bytes, path: str, job_id: int | None) -> None:
        actual = np.concatenate(self._rows(block))
        self._verify(actual, key, path, job_id)

    def _verify(self, actual: np.ndarray, key: bytes, path: str, job_id: int | None) -> None:
        bad = mismatch(actual, expected_block(key, self.block_bytes))
        if bad is None:
            self.counters["blocks_verified"] += 1
            self.counters["bytes_verified"] += actual.size
            return
        self.counters["wrong_blocks"] += 1
        self._violation("wrong_bytes", path=path, key=key.hex()[:16], job_id=job_id, **bad)

    def recover(self, keys: list[bytes], attempts: int = 3) -> list[bytes]:
        """``reset_cache``, then bring each key back on its own (not as a prefix), load it and
        verify its bytes, with up to ``attempts`` fresh requests per key (a promotion or a copy
        may fail on an injected fault); returns the keys that never came back."""
        try:
            if not self._connect():
                raise TimeoutError("the manager does not answer")
            self._client.reset_cache()
            pending = list(keys)
            for _ in range(attempts):
                failed: list[bytes] = []
                for start in range(0, len(pending), self.opts.max_blocks):
                    failed += self._recover_batch(pending[start : start + self.opts.max_blocks])
                pending = failed
                if not pending:
                    break
            return pending
        finally:
            self._finish()

    def _recover_batch(self, keys: list[bytes]) -> list[bytes]:
        """One request that looks each key up alone, waits out HIT_PENDING/RETRY, loads the
        ready ones; the keys not loaded. A ready key is pinned by its lookup, so the promotions
        of the keys looked up after it cannot evict it before the load; the pins are released
        after the load."""
        self._req_seq += 1
        req = f"r{self._req_seq}"
        self._call(self._client.new_request, req)
        try:
            waiting, ready = list(keys), []
            deadline = time.monotonic() + self.opts.lookup_wait_s
            while waiting and time.monotonic() < deadline:
                still = []
                for key in waiting:
                    outcome = self._call(self._client.lookup, req, [key], pin=True)
                    if outcome.must_wait:
                        still.append(key)
                    elif outcome.ready_prefix:
                        ready.append(key)
                waiting = still
                if waiting:
                    self._call(self._client.end_step)
                    time.sleep(0.005)
            loaded = self._load_device(req, ready) if ready else set()
            if ready:
                self._call(self._client.complete_load, req, ready)
        finally:
            self._call(self._client.finish_request, req)
        return [key for key in keys if key not in loaded]

    def _load_device(self, req: str, keys: list[bytes]) -> set[bytes]:
        """Load into poisoned device blocks and verify every key reported loaded; those keys."""
        blocks = list(range(len(keys)))
        for block in blocks:
            for row in self._rows(block):
                row[:] = POISON
        accepted = self._call(self._client.load, req, keys, blocks, self.handle_id)
        done = self._wait_job(accepted.job_id, "load")
        loaded = set(keys) if done.success else set(done.successful_keys or ())
        self._count_outcome("load", done, len(keys), len(loaded))
        for block, key in zip(blocks, keys, strict=True):
            if key in loaded:
                self._check_block(block, key, "device_load", accepted.job_id)
        return loaded

    def _store_device(self, req: str, keys: list[bytes], first: int) -> None:
        blocks = list(range(first, len(keys)))
        for block in blocks:
            self._write_block(block, keys[block])
        accepted = self._call(self._client.store, req, keys[first:], blocks, self.handle_id)
        if accepted.job_id is None:
            self.counters["stores_nothing_new"] += 1
            return
        done = self._wait_job(accepted.job_id, "store")
        acked = list(accepted.keys) if done.success else list(done.successful_keys or ())
        self._acked(acked)
        self._count_outcome("store", done, len(accepted.keys), len(acked))
        self.counters["bytes_stored"] += len(acked) * self.block_bytes

    def _acked(self, keys: list[bytes]) -> None:
        if keys:
            self.report.write("acked", keys=[key.hex() for key in keys])

    def _count_outcome(self, kind: str, done, wanted: int, ok: int) -> None:
        outcome = "ok" if done.success else ("partial" if ok else "failed")
        self.counters[f"{kind}_jobs_{outcome}"] += 1
        self.counters[f"{kind}_blocks_ok"] += ok
        self.counters[f"{kind}_blocks_failed"] += wanted - ok

    def _wait_job(self, job_id: int, kind: str):
        """The job's one result; JobLost after ``job_timeout_s``."""
        self._submitted[job_id] = (kind, time.monotonic())
        self.counters["jobs_submitted"] += 1
        deadline = time.monotonic() + self.opts.job_timeout_s
        while job_id not in self._results:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobLost(
                    f"job {job_id} ({kind}) has no result after {self.opts.job_timeout_s} s"
                )
            for event in self._call(self._client.poll, wait_ms=int(min(remaining, 0.5) * 1000)):
                self._on_event(event)
        return self._results.pop(job_id)

    def _on_event(self, event) -> None:
        if event.job_id in self._finished:
            self._violation("duplicate_result", job_id=event.job_id)
        elif event.job_id not in self._submitted:
            self._violation("foreign_result", job_id=event.job_id, req_id=event.req_id)
        else:
            self._finished.add(event.job_id)
            self._results[event.job_id] = event
            self.counters["jobs_finished"] += 1

    # ---- direct path ----------------------------------------------------------------------

    def _load_direct(self, req: str, keys: list[bytes]) -> None:
        slots = self._call(self._client.prepare_load, req, keys)
        self.counters["direct_loads"] += 1
        for key, slot in zip(slots.keys, slots.slots, strict=True):
            self._verify(self._pool.slot_array(slot), key, "pool_read", None)
        time.sleep(self.rng.uniform(0, self.opts.hold_pins_s))
        self._call(self._client.complete_load, req, keys)

    def _store_direct(self, req: str, keys: list[bytes], first: int) -> None:
        out = self._call(self._client.prepare_store, req, keys[first:])
        self.counters["direct_stores"] += 1
        if not out.keys:
            return
        checksums = []
        for key, slot in zip(out.keys, out.slots, strict=True):
            block = self._pool.slot_array(slot)
            block[:] = expected_block(key, self.block_bytes)
            checksums.append([payload_checksum(block)])
        self._call(self._client.complete_store, req, out.keys, True, None, checksums)
        self._acked(out.keys)
        self.counters["store_blocks_ok"] += len(out.keys)
        self.counters["bytes_stored"] += len(out.keys) * self.block_bytes


def parse_args(argv: list[str] | None = None) -> EngineOptions:
    parser = argparse.ArgumentParser(
        prog="kvoffload-soak-engine", description="synthetic soak engine"
    )
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument(
        "--shm-prefix", required=True, help="KV cache segment names start with this"
    )
    parser.add_argument("--namespace", default="kvoffload-soak")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--max-blocks", type=int, default=12)
    parser.add_argument("--direct-fraction", type=float, default=0.25)
    parser.add_argument("--duration", type=float, default=0.0, help="seconds (0: until SIGTERM)")
    args = parser.parse_args(argv)
    return EngineOptions(
        endpoint=args.endpoint,
        name=args.name,
        seed=args.seed,
        report=args.report,
        shm_prefix=args.shm_prefix,
        namespace=args.namespace.encode(),
        conversations=args.conversations,
        max_blocks=args.max_blocks,
        direct_fraction=args.direct_fraction,
        duration_s=args.duration,
    )


def main(argv: list[str] | None = None) -> int:
    configure_logging("soak-engine", "warning")
    engine = SoakEngine(parse_args(argv))

    def stop(*_: Any) -> None:
        engine.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return engine.run()


if __name__ == "__main__":
    sys.exit(main())
