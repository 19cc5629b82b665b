"""``kvoffload demo``: start the service on the given config, run a multi-turn workload of
synthetic KV blocks through it, and verify every byte that comes back.

Each block's bytes are a pure function of its key (a chained prefix hash), so any block loaded
from any tier can be checked. Phases: (1) multi-turn conversations whose turns share growing
prefixes, served from the host pool; (2) a second engine process reuses every conversation;
(3) the host pool is reset and the prefixes come back from the disk tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .client import KVOffloadClient
from .config import Config
from .kvcache import SharedKVCache, unique_kv_name
from .logs import configure_logging


def chain_keys(conversation: int, num_blocks: int) -> list[bytes]:
    """Prefix-hash chain: key[i] = blake2b(key[i-1] || block content id), 32 bytes."""
    keys, prev = [], b"kvoffload-demo"
    for i in range(num_blocks):
        prev = hashlib.blake2b(prev + f"{conversation}:{i}".encode(), digest_size=32).digest()
        keys.append(prev)
    return keys


def block_content(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes of a block: a deterministic stream seeded by its key (the "computed KV")."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


@dataclass
class TurnReport:
    engine: str
    conversation: int
    turn: int
    blocks: int
    reused: int
    computed: int
    served_by: str
    seconds: float
    verified: bool


class DemoEngine:
    """A client that plays an inference engine: look up, load hits, compute the rest, store."""

    def __init__(self, endpoint: str, name: str, num_blocks: int) -> None:
        self.client = KVOffloadClient(endpoint, name=name, timeout_s=30.0)
        self.name = name
        self.block_bytes = self.client.info.block_bytes
        self.kv = SharedKVCache.create(unique_kv_name(), num_blocks, [self.block_bytes])
        self.client.register_kv(self.kv.handle(f"{name}-kv"))
        self.handle_id = f"{name}-kv"
        self._req = 0

    def run_prompt(self, conversation: int, turn: int, keys: list[bytes], served_by: str) -> TurnReport:
        self._req += 1
        req = f"{self.name}-{self._req}"
        started = time.perf_counter()
        self.client.new_request(req)
        reply = self.client.lookup(req, keys)
        while reply.must_wait:
            self.client.end_step()
            time.sleep(0.002)
            reply = self.client.lookup(req, keys)
        reused = reply.ready_prefix
        verified = True
        if reused:
            job = self.client.load(req, keys[:reused], list(range(reused)), self.handle_id)
            done = self.client.wait([job.job_id])[job.job_id]
            verified = done.success and all(
                np.array_equal(self.kv.tensors[0][i], block_content(keys[i], self.block_bytes))
                for i in range(reused)
            )
        for i in range(reused, len(keys)):
            self.kv.tensors[0][i] = block_content(keys[i], self.block_bytes)
        if reused < len(keys):
            job = self.client.store(req, keys[reused:], list(range(reused, len(keys))), self.handle_id)
            if job.job_id is not None:
                verified &= self.client.wait([job.job_id])[job.job_id].success
        self.client.finish_request(req)
        return TurnReport(
            self.name, conversation, turn, len(keys), reused, len(keys) - reused,
            served_by if reused else "-", time.perf_counter() - started, verified,
        )

    def close(self) -> None:
        self.client.close()
        self.kv.close()
        self.kv.unlink()


def replay(endpoint: str, conversations: int, blocks: int) -> list[TurnReport]:
    """What the second engine process runs: every conversation's full prompt once."""
    engine = DemoEngine(endpoint, f"engine-{os.getpid()}", blocks)
    try:
        return [engine.run_prompt(c, 0, chain_keys(c, blocks), "pool (other engine)") for c in range(conversations)]
    finally:
        engine.close()


def _wait_ready(endpoint: str, workers: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with KVOffloadClient(endpoint, timeout_s=2.0, name="demo-wait") as c:
                status = c.status()["workers"]
            if all(w in status and status[w]["index_complete"] for w in workers):
                return
        except TimeoutError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"workers {workers} did not connect in {timeout_s} s")


def _print_table(reports: list[TurnReport]) -> None:
    print(f"{'engine':<16}{'conv':>5}{'turn':>5}{'blocks':>7}{'reused':>7}{'computed':>9}  {'served by':<22}{'ms':>8}  ok")
    for r in reports:
        print(
            f"{r.engine[:15]:<16}{r.conversation:>5}{r.turn:>5}{r.blocks:>7}{r.reused:>7}{r.computed:>9}  "
            f"{r.served_by:<22}{r.seconds * 1000:>8.1f}  {'yes' if r.verified else 'NO'}"
        )


def run_demo(cfg: Config, args) -> int:
    from .supervisor import Supervisor

    configure_logging("demo", "warning")
    log_file = Path(tempfile.gettempdir()) / f"kvoffload-demo-{os.getpid()}.log"
    supervisor = Supervisor(cfg, log_path=log_file)
    spec = supervisor.start()
    endpoint = spec.client_endpoint
    per_turn = args.blocks_per_turn
    total_blocks = per_turn * args.turns
    reports: list[TurnReport] = []
    try:
        print(f"kvoffload demo: service up (pool {cfg.pool.num_slots} x {cfg.pool.block_bytes} B, "
              f"tiers: host pool{', disk' if cfg.disk.enabled else ''}{', object' if cfg.object.enabled else ''}); "
              f"logs in {log_file}")
        _wait_ready(endpoint, ["cpu"] + (["disk"] if cfg.disk.enabled else []))
        engine = DemoEngine(endpoint, "engine-main", total_blocks)
        try:
            print(f"phase 1: {args.conversations} conversations x {args.turns} turns, {per_turn} new blocks per turn")
            for turn in range(args.turns):
                for c in range(args.conversations):
                    keys = chain_keys(c, per_turn * (turn + 1))
                    reports.append(engine.run_prompt(c, turn, keys, "host pool"))
                    supervisor.watch_once()
            print("phase 2: a second engine process replays every conversation")
            out = subprocess.run(
                [sys.executable, "-m", "kvoffload.demo", endpoint, str(args.conversations), str(total_blocks)],
                capture_output=True, text=True, timeout=300,
            )
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            reports.extend(TurnReport(**r) for r in json.loads(out.stdout))
            if cfg.disk.enabled:
                print("phase 3: host pool reset; prefixes come back from the disk tier")
                _wait_cascades(engine.client)
                engine.client.reset_cache()
                for c in range(args.conversations):
                    reports.append(engine.run_prompt(c, args.turns, chain_keys(c, total_blocks), "disk tier"))
        finally:
            engine.close()
    finally:
        supervisor.stop()
    _print_table(reports)
    ok = all(r.verified for r in reports)
    reused = sum(r.reused for r in reports)
    print(f"\nblocks reused {reused}, computed {sum(r.computed for r in reports)}; "
          f"every loaded block bit-identical to its computed bytes: {'yes' if ok else 'NO'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0 if ok else 1


def _wait_cascades(client: KVOffloadClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.status()["tiering"]["jobs_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    configure_logging("demo-engine", "warning")
    endpoint_arg, conversations_arg, blocks_arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps([asdict(r) for r in replay(endpoint_arg, conversations_arg, blocks_arg)]))
