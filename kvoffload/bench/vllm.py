"""Time to first token of a real vLLM engine for long shared prefixes: recompute vs vLLM's own
resident prefix cache vs kvoffload's host pool vs kvoffload's disk tier (and vLLM's own CPU
offloading where vLLM runs it), measured in one run (JSON out, table printed).

For each prefix length (default 2k, 4k and 8k tokens) and each of ``--prompts`` random prefixes
P, the prompts are P + s0, P + s1 and P + s2 (different 8-token suffixes); ``max_tokens=1``, so
the time of one ``LLM.generate`` call is the TTFT. Per length the medians over the prefixes of:
- recompute: vLLM without a connector, P + s0 (nothing cached: P is new);
- resident: the same engine right after, P + s1: vLLM's own prefix cache serves P (the floor:
  no bytes move);
- kvoffload cold: vLLM with ``KVOffloadConnector``, P + s0 (every lookup misses, P is stored);
- kvoffload pool: ``reset_prefix_cache``, then P + s1: P is loaded from kvoffload's host pool;
- kvoffload resident: then P + s2, served by vLLM's own prefix cache again: the floor measured in
  the same engine and minute as the pool hit (other load on the machine shifts both alike);
- kvoffload disk: after every block reached the disk tier, kvoffload ``reset_cache`` (host pool
  emptied) and ``reset_prefix_cache`` before each P + s1: P is promoted from disk and loaded;
- vllm native: vLLM's ``OffloadingConnector`` with its CPU spec, P + s0, reset, P + s1. vLLM
  refuses it on its CPU backend; the run records it as skipped with vLLM's reason.
Every hit run must report ``num_cached_tokens`` = the prefix (a run that does not is printed,
listed under ``problems`` and kept as a sample: its TTFT is what a user got), and its first token
must equal the resident run's (vLLM's prefix hit of the same tokens).

Model: a random-weight Llama (4 layers, hidden 1024, SwiGLU 2816, 16 query / 8 KV heads x 64,
vocab 1024, about 48 M parameters, bf16) written to a temp directory; one 32-token vLLM block is
256 KiB of KV. Engines run in child processes (this script with ``--engine``) with
``HF_HUB_OFFLINE=1``, ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``. The
service is started by the script in a temp directory: a host pool of 256 KiB blocks with room for
twice the longest prefix, a disk tier for every prefix, ``unread_promotion_cap`` 1.0.

Targets: kvoffload pool within 1.5x of the resident TTFT; at least 5x faster than recompute at
the longest prefix; disk never slower than recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from kvoffload.protocol import TieringStatus

VOCAB = 1024
BLOCK_TOKENS = 32
SUFFIX_TOKENS = 8
MODEL = {
    "layers": 4,
    "hidden": 1024,
    "intermediate": 2816,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 64,
}
POOL_VS_RESIDENT_MAX = 1.5
RECOMPUTE_VS_POOL_MIN = 5.0
DISK_VS_RECOMPUTE_MAX = 1.0
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}
KVOFFLOAD_CONNECTOR = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.integrations.vllm.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def kv_block_bytes() -> int:
    """Bytes of one vLLM block of the bench model (K and V of every layer, bf16)."""
    return 2 * MODEL["layers"] * MODEL["kv_heads"] * MODEL["head_dim"] * 2 * BLOCK_TOKENS


def make_model(directory: Path, max_positions: int) -> Path:
    """A seeded random Llama; large ``initializer_range`` so its logits are far from uniform."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=MODEL["hidden"],
        intermediate_size=MODEL["intermediate"],
        num_hidden_layers=MODEL["layers"],
        num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["kv_heads"],
        head_dim=MODEL["head_dim"],
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory


# ---- engine child ---------------------------------------------------------------------------


def engine_main(args: argparse.Namespace) -> None:
    """One vLLM engine driven by JSON lines on stdin; one reply per line on ``--reply-fd``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = json.loads(args.kv_transfer) if args.kv_transfer else None
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=BLOCK_TOKENS,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
    )
    replies = os.fdopen(args.reply_fd, "w", buffering=1)
    replies.write(json.dumps({"ready": True}) + "\n")
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    for line in iter(sys.stdin.readline, ""):
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset_prefix_cache":
            replies.write(json.dumps({"ok": bool(llm.reset_prefix_cache())}) + "\n")
            continue
        t0 = time.monotonic()
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], params, use_tqdm=False)[
            0
        ]
        seconds = time.perf_counter() - start
        t1 = time.monotonic()
        completion = out.outputs[0]
        token = completion.token_ids[0]
        logprob = completion.logprobs[0][token].logprob if completion.logprobs else None
        replies.write(
            json.dumps(
                {
                    "s": seconds,
                    "cached": out.num_cached_tokens,
                    "token": token,
                    "logprob": logprob,
                    "t0": t0,
                    "t1": t1,
                }
            )
            + "\n"
        )


class EngineFailed(RuntimeError):
    """The engine process exited before it was ready; ``reason`` is vLLM's error line."""

    def __init__(self, reason: str, log_tail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_tail = log_tail


class Engine:
    """An engine child process in its own process group (vLLM's engine core and workers join
    it), stopped by that group's id. vLLM can leave shared-memory segments behind when its
    start fails or a process is killed: the segments the group maps are noted while it runs and
    removed after it stopped if they are still there."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        max_model_len: int,
        kvcache_gib: int,
        kv_transfer: dict[str, Any] | None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "kvoffload.bench.vllm",
            "--engine",
            "--model",
            str(model),
            "--reply-fd",
            str(write_fd),
            "--max-model-len",
            str(max_model_len),
        ]
        if kv_transfer is not None:
            cmd += ["--kv-transfer", json.dumps(kv_transfer)]
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "KVOFFLOAD_ENDPOINT")
        }
        env.update(ENGINE_ENV, VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib), **(extra_env or {}))
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._shm: set[str] = set()
        started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=env,
            text=True,
            start_new_session=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        try:
            self._read(600.0)
        except EngineFailed:
            self.stop()
            raise
        self.start_s = time.monotonic() - started

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        ready: list = []
        while not ready and time.monotonic() < deadline:
            self._note_shm()
            ready, _, _ = select.select(
                [self._replies], [], [], min(1.0, max(0.0, deadline - time.monotonic()))
            )
        line = self._replies.readline() if ready else ""
        if not line:
            text = self.log_path.read_text(errors="replace")
            raise EngineFailed(_error_line(text), text[-8000:])
        return json.loads(line)

    def _send(self, cmd: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        return self._send({"op": "generate", "prompt": prompt})

    def reset_prefix_cache(self) -> None:
        if not self._send({"op": "reset_prefix_cache"})["ok"]:
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def _group(self) -> list[int]:
        """Pids of the processes still in the engine's process group."""
        pids = []
        for pid in psutil.pids():
            try:
                if os.getpgid(pid) == self.proc.pid:
                    pids.append(pid)
            except ProcessLookupError:
                continue
        return pids

    def _note_shm(self) -> None:
        for pid in self._group():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                fields = line.split(maxsplit=5)
                path = fields[5] if len(fields) == 6 else ""
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    name = path.removeprefix("/dev/shm/")
                    if not name.startswith("kvoffload-"):
                        self._shm.add(name)

    def stop(self) -> None:
        """Quit, give the group 30 s to exit by itself, kill what is left of it, remove the
        segments it left."""
        self._note_shm()
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        deadline = time.monotonic() + 30
        while self._group() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for name in sorted(self._shm):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                continue
            print(f"  removed /dev/shm/{name}, left by vLLM", flush=True)
        self._replies.close()
        self._log.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _error_line(log: str) -> str:
    """The root cause in an engine log: the first ``SomeError: message`` line (vLLM logs the
    worker's exception first, then the engine's wrappers of it)."""
    for line in log.splitlines():
        match = re.search(r"\b(\w*(?:Error|Exception)): (.+)$", line)
        if match:
            return f"{match.group(1)}: {match.group(2).strip()}"[:400]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1][-400:] if lines else "the engine exited without output"


# ---- kvoffload service ----------------------------------------------------------------------


class Service:
    """A kvoffload service (cpu and disk workers) in ``home``: host pool sized for
    ``pool_blocks`` blocks, disk tier for ``disk_blocks``; its children log to ``log_path``."""

    def __init__(self, home: Path, pool_blocks: int, disk_blocks: int, log_path: Path) -> None:
        import msgspec

        from kvoffload.config import load_config
        from kvoffload.runtime.supervisor import Supervisor

        cfg = load_config(
            None,
            {
                "KVOFFLOAD_SERVICE__RUNTIME_DIR": str(home / "run"),
                "KVOFFLOAD_SERVICE__LOG_LEVEL": "warning",
                "KVOFFLOAD_DISK__ROOT": str(home / "disk"),
            },
        )
        block_bytes = kv_block_bytes()
        self.cfg = msgspec.structs.replace(
            cfg,
            pool=msgspec.structs.replace(
                cfg.pool, block_bytes=block_bytes, num_slots=pool_blocks, unread_promotion_cap=1.0
            ),
            disk=msgspec.structs.replace(
                cfg.disk, capacity_bytes=disk_blocks * (block_bytes + 4096)
            ),
        )
        self.log_path = log_path
        self.supervisor = Supervisor(self.cfg, log_path=self.log_path)

    def __enter__(self) -> Service:
        from kvoffload.client import KVOffloadClient

        self.endpoint = self.supervisor.start().client_endpoint
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.client = KVOffloadClient(self.endpoint, timeout_s=30.0, name="bench")
                workers = self.client.status().workers
                if all(w in workers and workers[w].index_complete for w in ("cpu", "disk")):
                    return self
                self.client.close()
            except TimeoutError:
                pass
            time.sleep(0.1)
        self.supervisor.stop()
        raise TimeoutError("the kvoffload service did not start")

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.supervisor.stop()

    def tiering(self) -> TieringStatus:
        return self.client.status().tiering

    def wait_settled(
        self, ready_keys: int, disk_keys: int, timeout_s: float = 120.0
    ) -> TieringStatus:
        """Until the pool holds ``ready_keys`` ready keys (0: any), the disk tier indexes
        ``disk_keys`` keys and no store, tier job or cascade is left in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            t = self.tiering()
            ready = t.used_slots - t.writing_slots
            if (
                ready >= ready_keys
                and t.writing_slots == 0
                and t.jobs_in_flight == 0
                and t.cascade_backlog == 0
                and t.tiers["disk"].indexed_keys >= disk_keys
            ):
                return t
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvoffload did not settle: {msgspec.json.encode(t)[:2000]!r}")
            time.sleep(0.05)


# ---- measurement ----------------------------------------------------------------------------


def prompts_for(lengths: list[int], count: int) -> dict[int, list[tuple[list[int], ...]]]:
    """Per length, ``count`` triples (P + s0, P + s1, P + s2) with P random and new."""
    import numpy as np

    rng = np.random.default_rng(2026)
    out: dict[int, list[tuple[list[int], ...]]] = {}
    for length in lengths:
        triples = []
        for _ in range(count):
            prefix = rng.integers(3, VOCAB, size=length).tolist()
            triples.append(
                tuple(
                    prefix + rng.integers(3, VOCAB, size=SUFFIX_TOKENS).tolist() for _ in range(3)
                )
            )
        out[length] = triples
    return out


def warm_up(engine: Engine) -> None:
    """First calls pay one-time costs (allocations, first connector session)."""
    for seed in (1, 2):
        engine.generate([3 + (seed * k) % (VOCAB - 3) for k in range(300)])


def expect_cached(run: dict[str, Any], tokens: int, what: str, problems: list[str]) -> None:
    """Note (and print) a run whose cached tokens are not ``tokens``; the run stays a sample:
    its TTFT is what a user got."""
    if run["cached"] != tokens:
        problems.append(f"{what}: vLLM reports {run['cached']} cached tokens, expected {tokens}")
        print(f"  WARNING {problems[-1]}", flush=True)


def run_vllm(engine: Engine, prompts, runs: dict, problems: list[str]) -> None:
    warm_up(engine)
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, _ in triples:
            cold = engine.generate(cold_prompt)
            expect_cached(cold, 0, f"recompute {length}", problems)
            hit = engine.generate(hit_prompt)
            expect_cached(hit, length, f"resident {length}", problems)
            runs["recompute"][length].append(cold)
            runs["resident"][length].append(hit)


def run_kvoffload(
    engine: Engine, service: Service, prompts, runs: dict, problems: list[str]
) -> None:
    warm_up(engine)
    service.wait_settled(0, 0)
    stored = service.tiering().tiers["disk"].indexed_keys
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, resident_prompt in triples:
            cold = engine.generate(cold_prompt)
            expect_cached(cold, 0, f"kvoffload cold {length}", problems)
            stored += length // BLOCK_TOKENS
            service.wait_settled(length // BLOCK_TOKENS, stored)
            engine.reset_prefix_cache()
            hit = engine.generate(hit_prompt)
            expect_cached(hit, length, f"kvoffload pool {length}", problems)
            resident = engine.generate(resident_prompt)
            expect_cached(resident, length, f"resident with the connector {length}", problems)
            runs["kvoffload_cold"][length].append(cold)
            runs["kvoffload_pool"][length].append(hit)
            runs["kvoffload_resident"][length].append(resident)
    service.wait_settled(0, stored)
    for length, triples in prompts.items():
        for _, hit_prompt, _ in triples:
            service.client.reset_cache()
            engine.reset_prefix_cache()
            hit = engine.generate(hit_prompt)
            expect_cached(hit, length, f"kvoffload disk {length}", problems)
            runs["kvoffload_disk"][length].append(hit)


def run_native(engine: Engine, prompts, runs: dict, problems: list[str]) -> None:
    warm_up(engine)
    for length, triples in prompts.items():
        for cold_prompt, hit_prompt, _ in triples:
            engine.generate(cold_prompt)
            engine.reset_prefix_cache()
            hit = engine.generate(hit_prompt)
            expect_cached(hit, length, f"vllm native offload {length}", problems)
            runs["vllm_native"][length].append(hit)


def read_probe(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in directory.glob("probe-*.jsonl"):
        events.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(events, key=lambda e: e["t"])


BREAKDOWN_FIELDS = (
    ("first_lookup_ms", "request reaches the scheduler and its first lookup starts"),
    ("hit_known_ms", "the lookup answer that makes vLLM schedule the load is known"),
    ("load_submitted_ms", "the worker starts the step that copies the blocks"),
    (
        "load_worker_ms",
        "the worker's load: copy pool slots -> vLLM KV blocks, verify their checksums",
    ),
    ("load_reported_ms", "the scheduler learns the load finished"),
    ("done_ms", "generate() returns with the first token"),
    ("steps", "scheduler steps the request lived through"),
    ("match_ms", "time in the connector's get_num_new_matched_tokens (lookups answered at once)"),
    ("lookup_rtt_ms", "time in the step-end lookup batches (round trips to kvoffload)"),
    ("step_interval_ms", "mean time between two scheduler steps in the request's life"),
)


def _request_breakdown(events: list[dict[str, Any]], run: dict[str, Any]) -> dict[str, float]:
    """Milestones of one hit run, in ms from the ``generate`` call (``t0``)."""
    t0, t1 = run["t0"], run["t1"]
    window = [e for e in events if t0 <= e["t"] <= t1]

    def ms(t: float | None) -> float | None:
        return None if t is None else (t - t0) * 1e3

    matches = [e for e in window if e["ev"] == "match"]
    hit = next((e for e in matches if e["hit"]), None)
    transfers = [e for e in window if e["ev"] == "transfers" and e["loads"]]
    reported = next((e for e in window if e["ev"] == "output" and e["recving"]), None)
    steps = [e for e in window if e["ev"] == "step"]
    return {
        "first_lookup_ms": ms(matches[0]["t"]) if matches else None,
        "hit_known_ms": ms(hit["t"] + hit["d"]) if hit else None,
        "load_submitted_ms": ms(transfers[0]["t"]) if transfers else None,
        "load_worker_ms": sum(e["d"] for e in transfers) * 1e3,
        "load_reported_ms": ms(reported["t"]) if reported else None,
        "done_ms": ms(t1),
        "steps": len(steps),
        "match_ms": sum(e["d"] for e in matches) * 1e3,
        "lookup_rtt_ms": sum(e["d"] for e in window if e["ev"] == "schedule_end") * 1e3,
        "step_interval_ms": ((steps[-1]["t"] - steps[0]["t"]) / (len(steps) - 1) * 1e3)
        if len(steps) > 1
        else None,
    }


def breakdown(events: list[dict[str, Any]], runs: dict) -> dict[str, Any]:
    """Per mode (pool, disk, resident) and length: the median of each milestone over the prompts."""
    out: dict[str, Any] = {"fields": dict(BREAKDOWN_FIELDS)}
    for mode in ("kvoffload_pool", "kvoffload_disk", "kvoffload_resident"):
        out[mode] = {}
        for length, by_prompt in runs[mode].items():
            rows = [_request_breakdown(events, run) for run in by_prompt]
            out[mode][str(length)] = {
                name: statistics.median(v)
                if (v := [r[name] for r in rows if r[name] is not None])
                else None
                for name, _ in BREAKDOWN_FIELDS
            }
    return out


def print_breakdown(profile: dict[str, Any]) -> None:
    names = [name for name, _ in BREAKDOWN_FIELDS]
    print(
        "kvoffload hit TTFT breakdown (medians; ms since generate(); see kvoffload_breakdown.fields)"
    )
    print(f"{'mode':>9}{'prefix':>7}" + "".join(f"{n.removesuffix('_ms'):>18}" for n in names))
    for mode in ("kvoffload_pool", "kvoffload_disk", "kvoffload_resident"):
        for length, row in profile[mode].items():
            cells = "".join(
                f"{'-' if row[n] is None else format(row[n], '.1f'):>18}" for n in names
            )
            print(f"{mode.removeprefix('kvoffload_'):>9}{length:>7}{cells}")


def summarize(lengths: list[int], runs: dict, native_ran: bool) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        med = {
            mode: statistics.median(r["s"] for r in by_len[length])
            for mode, by_len in runs.items()
            if by_len[length]
        }
        reference = runs["resident"][length]
        hit_modes = ("kvoffload_pool", "kvoffload_disk", *(("vllm_native",) if native_ran else ()))
        same = all(
            run["token"] == ref["token"]
            for mode in hit_modes
            for run, ref in zip(runs[mode][length], reference, strict=True)
            if run["cached"] == ref["cached"] == length
        )
        row = {
            "prefix_tokens": length,
            "prefix_blocks": length // BLOCK_TOKENS,
            "prefix_bytes": length // BLOCK_TOKENS * kv_block_bytes(),
            **{f"{mode}_ttft_s": value for mode, value in med.items()},
            "samples_s": {
                mode: [r["s"] for r in by_len[length]]
                for mode, by_len in runs.items()
                if by_len[length]
            },
            "first_token_same_as_resident": same,
            "full_hits": {
                mode: sum(r["cached"] == length for r in runs[mode][length]) for mode in hit_modes
            },
            "pool_vs_resident": med["kvoffload_pool"] / med["resident"],
            "pool_vs_resident_same_engine": med["kvoffload_pool"] / med["kvoffload_resident"],
            "recompute_vs_pool": med["recompute"] / med["kvoffload_pool"],
            "disk_vs_recompute": med["kvoffload_disk"] / med["recompute"],
            "cold_vs_recompute": med["kvoffload_cold"] / med["recompute"],
        }
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    longest = max(rows, key=lambda r: r["prefix_tokens"])
    met = {
        "pool_within_1_5x_of_resident": all(
            r["pool_vs_resident"] <= POOL_VS_RESIDENT_MAX for r in rows
        ),
        "pool_5x_faster_than_recompute_at_longest": longest["recompute_vs_pool"]
        >= RECOMPUTE_VS_POOL_MIN,
        "disk_never_slower_than_recompute": all(
            r["disk_vs_recompute"] <= DISK_VS_RECOMPUTE_MAX for r in rows
        ),
        "same_first_token": all(r["first_token_same_as_resident"] for r in rows),
        "every_hit_run_hit": not problems,
    }
    return {"met": met, "all_met": all(met.values())}


def print_table(rows: list[dict[str, Any]], native: dict[str, Any]) -> None:
    def ms(row: dict[str, Any], mode: str) -> str:
        value = row.get(f"{mode}_ttft_s")
        return f"{value * 1e3:.0f}" if value is not None else "-"

    head = (
        f"{'prefix':>7}{'MiB':>5}{'recompute':>11}{'resident':>10}{'kvo cold':>10}{'kvo pool':>10}"
        f"{'kvo res':>9}{'kvo disk':>10}{'native':>8}{'pool/res':>10}{'(same eng)':>11}{'rec/pool':>10}"
        f"{'disk/rec':>10}  same token"
    )
    print("TTFT, ms (medians)")
    print(head)
    for r in rows:
        print(
            f"{r['prefix_tokens']:>7}{r['prefix_bytes'] / 2**20:>5.0f}{ms(r, 'recompute'):>11}"
            f"{ms(r, 'resident'):>10}{ms(r, 'kvoffload_cold'):>10}{ms(r, 'kvoffload_pool'):>10}"
            f"{ms(r, 'kvoffload_resident'):>9}{ms(r, 'kvoffload_disk'):>10}{ms(r, 'vllm_native'):>8}"
            f"{r['pool_vs_resident']:>10.2f}{r['pool_vs_resident_same_engine']:>11.2f}"
            f"{r['recompute_vs_pool']:>10.1f}{r['disk_vs_recompute']:>10.2f}"
            f"  {'yes' if r['first_token_same_as_resident'] else 'NO'}"
        )
    if native.get("skipped"):
        print(f"vllm native CPU offloading: skipped: {native['reason']}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    lengths = sorted(args.lengths)
    longest = max(lengths)
    max_model_len = longest + SUFFIX_TOKENS + BLOCK_TOKENS
    longest_blocks = longest // BLOCK_TOKENS
    total_blocks = args.prompts * sum(lengths) // BLOCK_TOKENS
    kvcache_gib = max(
        1, -(-(2 * (longest + SUFFIX_TOKENS) // BLOCK_TOKENS + 64) * kv_block_bytes() // 2**30)
    )
    prompts = prompts_for(lengths, args.prompts)
    modes = (
        "recompute",
        "resident",
        "kvoffload_cold",
        "kvoffload_pool",
        "kvoffload_resident",
        "kvoffload_disk",
        "vllm_native",
    )
    runs: dict[str, dict[int, list]] = {mode: {n: [] for n in lengths} for mode in modes}
    home = Path(tempfile.mkdtemp(prefix="kvo-bench-vllm-"))
    logs = Path(args.logs) if args.logs else home
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    engines: dict[str, Any] = {}
    native: dict[str, Any] = {}
    service_status: dict[str, Any] = {}
    profile: dict[str, Any] = {}
    problems: list[str] = []
    link_downs = 0

    def step(what: str) -> None:
        print(f"  {what} ({time.monotonic() - started:.0f} s)", flush=True)

    try:
        model = make_model(home / "model", max_model_len)
        step("model written")
        with Engine(model, logs / "engine-vllm.log", max_model_len, kvcache_gib, None) as engine:
            engines["vllm"] = {"start_s": engine.start_s}
            run_vllm(engine, prompts, runs, problems)
        step("vLLM without connector done")
        with Service(
            home, 2 * longest_blocks + 64, total_blocks + 2 * longest_blocks, logs / "service.log"
        ) as service:
            connector = {
                **KVOFFLOAD_CONNECTOR,
                "kv_connector_extra_config": {"endpoint": service.endpoint},
            }
            probe_env = None
            if args.profile:
                connector.update(
                    kv_connector="ProbeConnector",
                    kv_connector_module_path="kvoffload.bench.vllm_probe",
                )
                probe_dir = home / "probe"
                probe_dir.mkdir()
                probe_env = {"KVO_BENCH_PROBE_DIR": str(probe_dir)}
            with Engine(
                model,
                logs / "engine-kvoffload.log",
                max_model_len,
                kvcache_gib,
                connector,
                probe_env,
            ) as engine:
                engines["kvoffload"] = {
                    "start_s": engine.start_s,
                    "connector": connector["kv_connector"],
                }
                run_kvoffload(engine, service, prompts, runs, problems)
            link_downs = engine.log_path.read_text(errors="replace").count("kvoffload_link_down")
            if args.profile:
                profile = breakdown(read_probe(probe_dir), runs)
            service_status = msgspec.to_builtins(service.client.status())
        step("vLLM with kvoffload done")
        native_cfg = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": (longest_blocks + 64) * kv_block_bytes()
            },
        }
        if args.no_native:
            native = {"skipped": True, "reason": "--no-native"}
        else:
            try:
                with Engine(
                    model, logs / "engine-native.log", max_model_len, kvcache_gib, native_cfg
                ) as engine:
                    engines["vllm_native"] = {"start_s": engine.start_s}
                    run_native(engine, prompts, runs, problems)
                native = {"skipped": False}
            except EngineFailed as exc:
                native = {"skipped": True, "reason": exc.reason}
        step("vLLM native offloading " + ("skipped" if native["skipped"] else "done"))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    native_ran = not native["skipped"]
    rows = summarize(lengths, runs, native_ran)
    import torch
    import vllm

    tiering = service_status.get("tiering", {})
    return {
        "model": {
            **MODEL,
            "vocab": VOCAB,
            "dtype": "bfloat16",
            "block_tokens": BLOCK_TOKENS,
            "kv_block_bytes": kv_block_bytes(),
        },
        "vllm_version": vllm.__version__,
        "kvoffload_commit": _git_commit(),
        "torch_version": torch.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg(),
        },
        "prompts_per_length": args.prompts,
        "suffix_tokens": SUFFIX_TOKENS,
        "max_model_len": max_model_len,
        "vllm_cpu_kvcache_gib": kvcache_gib,
        "engines": engines,
        "vllm_native_offloading": native,
        "kvoffload_service": {
            "pool_slots": 2 * longest_blocks + 64,
            "per_tier": tiering.get("per_tier"),
        },
        "targets": {
            "pool_vs_resident_max": POOL_VS_RESIDENT_MAX,
            "recompute_vs_pool_min_at_longest": RECOMPUTE_VS_POOL_MIN,
            "disk_vs_recompute_max": DISK_VS_RECOMPUTE_MAX,
            **targets(rows, problems),
        },
        "results": rows,
        "problems": problems,
        "kvoffload_link_downs": link_downs,
        "kvoffload_breakdown": profile,
        "runs": {mode: {str(n): v for n, v in by_len.items()} for mode, by_len in runs.items()},
        "seconds": time.monotonic() - started,
    }


def _git_commit() -> str:
    """The checkout measured (``-dirty`` if the integration or this script have local changes)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kvoffload", "scripts"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument(
        "--prompts", type=int, default=5, help="prefixes per length (medians over them)"
    )
    parser.add_argument("--out", default="results/bench_vllm.json")
    parser.add_argument(
        "--logs", default="", help="keep the engine and service logs in this directory"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time the connector's calls inside vLLM (kvoffload/bench/vllm_probe.py) and "
        "break the kvoffload hit TTFT down",
    )
    parser.add_argument(
        "--no-native", action="store_true", help="do not try vLLM's own CPU offloading"
    )
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kv-transfer", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        engine_main(args)
        return 0
    if any(n % BLOCK_TOKENS for n in args.lengths):
        parser.error(f"prefix lengths must be multiples of {BLOCK_TOKENS}")
    from kvoffload.logs import configure_logging

    configure_logging("bench", "warning")
    report = bench(args)
    print_table(report["results"], report["vllm_native_offloading"])
    if report["kvoffload_breakdown"]:
        print_breakdown(report["kvoffload_breakdown"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for problem in report["problems"]:
        print(f"problem: {problem}")
    if report["kvoffload_link_downs"]:
        print(
            f"the connector lost the service {report['kvoffload_link_downs']} time(s) (kvoffload_link_down "
            "in the engine log): those requests were recomputed"
        )
    met = report["targets"]["met"]
    print(
        "targets: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in met.items())
    )
    print(f"JSON in {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
