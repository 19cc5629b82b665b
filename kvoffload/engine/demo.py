"""``kvoffload demo``: the reference engine (a small torch transformer computing real attention
K/V) runs a multi-turn workload through the service and proves that reused K/V changes nothing.

Phases (each conversation's next prompt is everything so far plus new user tokens):
1. host pool: conversations x turns on the main engine; later turns reuse earlier turns' blocks;
2. a second engine process runs every conversation's next turn on the main engine's blocks;
3. the host pool is reset (``reset_cache``); the prefixes come back from the secondary tiers;
4. with ``--restart``: the whole service is stopped and started again on the same config; the
   disk tier (or object tier) still serves the prefixes.

Every prompt also runs on an engine without the service (full recompute). A row passes when the
generated tokens are identical, the logits agree within ``LOGITS_ATOL``, every loaded block is
bit-identical to the block as it was computed (its digest was recorded when it was offloaded),
every offload succeeded, and the phase reused blocks from the tier it demonstrates. The exit
status is 1 if any row fails. Token ids come from ``--seed`` (random by default, printed).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from kvoffload.client import KVOffloadClient
from kvoffload.config import Config
from kvoffload.logs import configure_logging
from kvoffload.wire.status import TierCounters

if TYPE_CHECKING:
    from kvoffload.engine import Engine
    from kvoffload.runtime.supervisor import Supervisor

LOGITS_ATOL = 1e-4
POOL = frozenset({"pool"})
SECONDARY = frozenset({"disk", "object", "secondary"})


@dataclass
class Row:
    phase: str
    engine: str
    conversation: int
    turn: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    served_by: dict[str, int]
    ttft_ms: float
    recompute_ms: float
    tokens_same: bool
    logits_max_diff: float
    kv: str  # "-" nothing loaded, "same", "DIFF", "unrecorded" (an earlier run's blocks)
    store_failures: int
    expected_from: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def demo_config(cfg: Config, block_bytes: int, layout_id: str) -> Config:
    """``cfg`` with the pool sized for the reference model's blocks and named for its layout."""
    return msgspec.structs.replace(
        cfg, pool=msgspec.structs.replace(cfg.pool, block_bytes=block_bytes, layout_id=layout_id)
    )


def user_tokens(seed: int, conversation: int, turn: int, count: int, vocab: int) -> list[int]:
    return np.random.default_rng([seed, conversation, turn]).integers(0, vocab, size=count).tolist()


def served_text(served_by: dict[str, int], block_tokens: int) -> str:
    if not served_by:
        return "-"
    return " + ".join(
        f"{tier} {blocks * block_tokens}" for tier, blocks in sorted(served_by.items())
    )


HEADER = (
    f"{'phase':<10}{'engine':<9}{'conv':>4}{'turn':>5}{'prompt':>8}{'reused':>8}{'computed':>9}  "
    f"{'served by (tokens)':<20}{'TTFT ms':>8}{'recompute':>10}{'speedup':>8}  {'tokens':<7}{'KV':<6}"
)


def format_row(r: Row, block_tokens: int) -> str:
    speedup = f"{r.recompute_ms / r.ttft_ms:.1f}x" if r.ttft_ms > 0 else "-"
    line = (
        f"{r.phase:<10}{r.engine[:8]:<9}{r.conversation:>4}{r.turn:>5}{r.prompt_tokens:>8}{r.reused_tokens:>8}"
        f"{r.computed_tokens:>9}  {served_text(r.served_by, block_tokens):<20}{r.ttft_ms:>8.1f}{r.recompute_ms:>10.1f}"
        f"{speedup:>8}  {'same' if r.tokens_same else 'DIFF':<7}{r.kv:<6}"
    )
    return line if r.ok else f"{line}  FAIL: {'; '.join(r.problems)}"


def _cascades_settled(c: TierCounters) -> int:
    """Keys a tier stored or gave up (evicted first, tier full, retry bound)."""
    return (
        c.cascaded_keys_ok
        + c.cascade_dropped_evicted
        + c.cascade_dropped_tier_full
        + c.cascade_dropped_retry_bound
    )


class Demo:
    """The demo's state: the service, the main engine, the reference engine, the conversations
    and the digests of every block offloaded in this run."""

    def __init__(self, cfg: Config, model, args, seed: int) -> None:
        from kvoffload.engine import Engine

        self.cfg = cfg
        self.model = model
        self.args = args
        self.seed = seed
        self.bt = model.cfg.block_tokens
        self.user_count = args.blocks_per_turn * self.bt
        phases_turns = args.turns + 3
        self.cache_blocks = phases_turns * (self.user_count + args.new_tokens) // self.bt + 4
        self.reference = Engine.local(model, self.cache_blocks)
        self.histories: list[list[int]] = [[] for _ in range(args.conversations)]
        self.record: dict[str, str] = {}
        self.stored_since_start = 0
        self.rows: list[Row] = []
        self.log_file = Path(tempfile.gettempdir()) / f"kvoffload-demo-{os.getpid()}.log"
        self.supervisor: Supervisor | None = None
        self.engine: Engine | None = None
        self.endpoint = ""

    # ---- service --------------------------------------------------------------------------

    def start_service(self) -> None:
        from kvoffload.engine import Engine
        from kvoffload.runtime.supervisor import Supervisor

        self.supervisor = Supervisor(self.cfg, log_path=self.log_file)
        self.endpoint = self.supervisor.start().client_endpoint
        _wait_ready(self.endpoint, ["cpu", *self.secondary_tiers])
        self.engine = Engine.connect(self.model, self.endpoint, self.cache_blocks, "main")
        self.stored_since_start = 0

    def stop_service(self) -> None:
        engine, self.engine = self.engine, None
        supervisor, self.supervisor = self.supervisor, None
        try:
            if engine is not None:
                engine.close()
        finally:
            if supervisor is not None:
                supervisor.stop()

    def _live(self) -> tuple[Supervisor, Engine, KVOffloadClient]:
        """The running service's supervisor, the main engine and its client."""
        if self.supervisor is None or self.engine is None or self.engine.client is None:
            raise DemoFailed("the service is not running")
        return self.supervisor, self.engine, self.engine.client

    @property
    def secondary_tiers(self) -> list[str]:
        return [
            name
            for name, on in (("disk", self.cfg.disk.enabled), ("object", self.cfg.object.enabled))
            if on
        ]

    def wait_cascades(self, timeout_s: float = 60.0) -> None:
        """Until every block offloaded since the service started reached every secondary tier
        (or was given up for a counted reason), and no tier job is in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            tiering = self._live()[2].status().tiering
            done = all(
                _cascades_settled(tiering.per_tier[t]) >= self.stored_since_start
                for t in self.secondary_tiers
            )
            if done and tiering.jobs_in_flight == 0 and tiering.cascade_backlog == 0:
                return
            time.sleep(0.05)
        print(f"  (cascades still running after {timeout_s:.0f} s; continuing)")

    # ---- turns ----------------------------------------------------------------------------

    def next_prompt(self, conversation: int, turn: int) -> list[int]:
        new = user_tokens(self.seed, conversation, turn, self.user_count, self.model.cfg.vocab_size)
        return self.histories[conversation] + new

    def main_turn(
        self, phase: str, conversation: int, turn: int, expect: frozenset[str] | None
    ) -> None:
        prompt = self.next_prompt(conversation, turn)
        supervisor, engine, _ = self._live()
        result = engine.generate(prompt, self.args.new_tokens).to_dict(with_logits=True)
        self.finish_row(phase, "main", conversation, turn, prompt, result, expect)
        supervisor.watch_once()

    def second_process_turns(self, phase: str, turn: int) -> bool:
        """Run every conversation's next turn in another engine process. False if it failed."""
        import torch

        prompts = [self.next_prompt(c, turn) for c in range(self.args.conversations)]
        with tempfile.TemporaryDirectory(prefix="kvoffload-demo-") as tmp:
            prompts_file, out_file = Path(tmp) / "prompts.json", Path(tmp) / "results.json"
            prompts_file.write_text(json.dumps(prompts))
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvoffload.engine",
                    "--endpoint",
                    self.endpoint,
                    "--prompts",
                    str(prompts_file),
                    "--model",
                    "demo",
                    "--max-new-tokens",
                    str(self.args.new_tokens),
                    "--cache-blocks",
                    str(self.cache_blocks),
                    "--threads",
                    str(torch.get_num_threads()),
                    "--name",
                    "second",
                    "--logits",
                    "--out",
                    str(out_file),
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode != 0:
                print(
                    f"the second engine process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                    file=sys.stderr,
                )
                return False
            results = json.loads(out_file.read_text())
        for conversation, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            self.finish_row(phase, "second", conversation, turn, prompt, result, POOL)
        return True

    def finish_row(self, phase, engine, conversation, turn, prompt, result: dict, expect) -> None:
        """Run the reference on ``prompt``, compare, record, print; extend the conversation."""
        import torch

        reference = self.reference.generate(prompt, self.args.new_tokens)
        logits = torch.tensor(result["logits"], dtype=torch.float32)
        tokens_same = result["tokens"] == reference.tokens
        max_diff = float((logits - reference.logits).abs().max())
        kv, unrecorded, differing = self.check_loaded(result["loaded"])
        self.record.update(result["stored"])
        self.stored_since_start += len(result["stored"])
        served = {t: int(n) for t, n in result["served_by"].items()}
        problems = []
        if not tokens_same:
            problems.append("generated tokens differ from the full recompute")
        if not max_diff <= LOGITS_ATOL:
            problems.append(f"logits differ by {max_diff:.2e} (> {LOGITS_ATOL})")
        if differing:
            problems.append(f"{differing} loaded blocks differ from the computed K/V")
        if result["store_failures"]:
            problems.append(f"{result['store_failures']} blocks failed to offload")
        if expect is not None and not any(served.get(t, 0) for t in expect):
            problems.append(
                f"expected blocks from {'/'.join(sorted(expect))}, got {served or 'none'}"
            )
        row = Row(
            phase,
            engine,
            conversation,
            turn,
            len(prompt),
            result["reused_blocks"] * self.bt,
            result["computed_tokens"],
            served,
            result["ttft_s"] * 1000,
            reference.ttft_s * 1000,
            tokens_same,
            max_diff,
            kv,
            result["store_failures"],
            sorted(expect or ()),
            problems,
        )
        if unrecorded:
            row.kv = "unrecorded"
        self.rows.append(row)
        print(format_row(row, self.bt), flush=True)
        self.histories[conversation] = prompt + result["tokens"]

    def check_loaded(self, loaded: dict[str, str]) -> tuple[str, int, int]:
        """(column text, blocks not offloaded in this run, blocks whose bytes differ)."""
        if not loaded:
            return "-", 0, 0
        unrecorded = sum(1 for k in loaded if k not in self.record)
        differing = sum(1 for k, d in loaded.items() if k in self.record and self.record[k] != d)
        return ("DIFF" if differing else "same"), unrecorded, differing

    # ---- the phases -----------------------------------------------------------------------

    def run(self) -> None:
        args = self.args
        tiers = ["host pool", *self.secondary_tiers]
        print(f"kvoffload demo: reference model {self.model.cfg.describe()}")
        print(f"seed {self.seed} (rerun with --seed {self.seed}); service logs in {self.log_file}")
        self.start_service()
        print(
            f"service up: pool {self.cfg.pool.num_slots} x {self.cfg.pool.block_bytes} B; tiers: {', '.join(tiers)}"
        )
        print(
            f"\nphase 1: {args.conversations} conversations x {args.turns} turns, {self.user_count} new user "
            f"tokens and {args.new_tokens} generated tokens per turn\n{HEADER}"
        )
        for turn in range(args.turns):
            for c in range(args.conversations):
                self.main_turn("1 pool", c, turn, POOL if turn else None)
        turn = args.turns
        print(
            "phase 2: a second engine process runs every conversation's next turn on the main engine's blocks"
        )
        if not self.second_process_turns("2 process", turn):
            raise DemoFailed("the second engine process failed")
        if not self.secondary_tiers:
            print("no secondary tier configured: skipping phases 3 and 4")
            return
        turn += 1
        print(
            f"phase 3: host pool reset; prefixes come back from the {' / '.join(self.secondary_tiers)} tier"
        )
        self.wait_cascades()
        self._live()[2].reset_cache()
        for c in range(args.conversations):
            self.main_turn("3 reset", c, turn, SECONDARY)
        if args.restart:
            turn += 1
            print(
                f"phase 4: the whole service is stopped and started again; the {' / '.join(self.secondary_tiers)} "
                f"tier still serves the prefixes"
            )
            self.wait_cascades()
            self.stop_service()
            self.start_service()
            for c in range(args.conversations):
                self.main_turn("4 restart", c, turn, SECONDARY)

    def close(self) -> None:
        try:
            self.stop_service()
        finally:
            self.reference.close()

    def summary(self) -> bool:
        rows = self.rows
        ok = bool(rows) and all(r.ok for r in rows)
        reused = [r for r in rows if r.reused_tokens]
        prompt_total = sum(r.prompt_tokens for r in rows)
        reused_total = sum(r.reused_tokens for r in rows)
        loaded_blocks = sum(r.reused_tokens // self.bt for r in rows if r.kv in ("same", "DIFF"))
        unrecorded = [r for r in rows if r.kv == "unrecorded"]
        print(
            f"\nprompt tokens {prompt_total}: reused {reused_total} "
            f"({100 * reused_total / max(prompt_total, 1):.0f}%), computed {prompt_total - reused_total}"
        )
        if reused:
            with_kvo = sum(r.ttft_ms for r in reused) / len(reused)
            without = sum(r.recompute_ms for r in reused) / len(reused)
            print(
                f"mean TTFT of turns with reuse: {with_kvo:.1f} ms with kvoffload vs {without:.1f} ms recomputing "
                f"({without / with_kvo:.1f}x)"
            )
        print(
            f"generated tokens identical to the full recompute: "
            f"{'yes' if all(r.tokens_same for r in rows) else 'NO'} ({len(rows)} prompts)"
        )
        print(
            f"loaded K/V bit-identical to the computed K/V: "
            f"{'NO' if any(r.kv == 'DIFF' for r in rows) else 'yes'} ({loaded_blocks} blocks checked)"
        )
        if unrecorded:
            print(
                f"note: {len(unrecorded)} prompts reused blocks offloaded by an earlier run with this seed; "
                f"only their tokens and logits were checked"
            )
        failed = [r for r in rows if not r.ok]
        print("PASS" if ok else f"FAIL: {len(failed)} of {len(rows)} rows failed")
        return ok


class DemoFailed(RuntimeError):
    """A phase could not run."""


def _wait_ready(endpoint: str, workers: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with KVOffloadClient(endpoint, timeout_s=2.0, name="demo-wait") as c:
                status = c.status().workers
            if all(w in status and status[w].index_complete for w in workers):
                return
        except TimeoutError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"workers {workers} did not connect in {timeout_s} s")


def run_demo(cfg: Config, args) -> int:
    """Run the demo on ``cfg`` (its pool geometry is set to the reference model's); 0 if every
    check passed, 1 otherwise, 2 if torch is missing."""
    try:
        from kvoffload.engine import DEMO_MODEL, TinyDecoder
    except ImportError as exc:
        print(
            f"kvoffload demo needs torch (the engine extra): pip install torch==2.13.0 -e '.[engine]' ({exc})",
            file=sys.stderr,
        )
        return 2
    configure_logging("demo", "warning")
    model = TinyDecoder(DEMO_MODEL)
    cfg = demo_config(cfg, model.cfg.block_bytes, model.layout_id)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    demo = Demo(cfg, model, args, seed)
    started = time.monotonic()
    try:
        demo.run()
    except DemoFailed as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    finally:
        demo.close()
    ok = demo.summary()
    print(f"demo took {time.monotonic() - started:.1f} s")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "seed": seed,
                    "model": asdict(model.cfg),
                    "ok": ok,
                    "rows": [{**asdict(r), "ok": r.ok} for r in demo.rows],
                },
                indent=2,
            )
        )
    return 0 if ok else 1
