"""The soak runner's side of its synthetic engines: spawn, kill mid-request, respawn, stop.

Every engine is a child process of this one (``python -m kvoffload.soak.engine``) and is
signalled only through its own ``Popen``. KV cache segments are named
``/kvoffload-soak-<token>-<engine>-kv-<generation>``; a killed engine cannot unlink its own,
so ``EnginePool`` does it right after the kill (as an engine's orchestrator would).
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import posix_ipc

from kvoffload.testing.service import shm_names_containing


def unlink_segments(prefix: str) -> list[str]:
    """Unlink every /dev/shm segment whose name contains ``prefix`` (its leading "/" aside);
    the names unlinked."""
    names = shm_names_containing(prefix.lstrip("/"))
    for name in names:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)
    return names


class EngineProcess:
    """One running engine started by this process."""

    def __init__(self, proc: subprocess.Popen, name: str, report: Path, shm_prefix: str) -> None:
        self.proc = proc
        self.name = name
        self.report = report
        self.shm_prefix = shm_prefix
        self.killed = False
        self.terminated = False

    @classmethod
    def spawn(
        cls, endpoint: str, name: str, seed: int, workdir: Path, shm_prefix: str, extra: list[str]
    ) -> EngineProcess:
        report = workdir / f"{name}.jsonl"
        log_file = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it; closed after Popen
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvoffload.soak.engine",
                    "--endpoint",
                    endpoint,
                    "--name",
                    name,
                    "--seed",
                    str(seed),
                    "--report",
                    str(report),
                    "--shm-prefix",
                    shm_prefix,
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        finally:
            log_file.close()
        return cls(proc, name, report, shm_prefix)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (no clean-up of any kind) and reap."""
        if self.alive():
            self.proc.kill()
            self.killed = True
        self.proc.wait()

    def terminate(self, timeout_s: float) -> bool:
        """SIGTERM and wait; False (then SIGKILL) if it did not exit in time."""
        self.terminated = True
        if self.alive():
            self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.kill()
            return False

    def unlink_segments(self) -> list[str]:
        """Remove this engine's KV cache segments still in /dev/shm; their names."""
        return unlink_segments(self.shm_prefix)


class EnginePool:
    """The engines of one run (thread-safe). ``crashed`` lists engines that exited without
    being killed or terminated by the pool; they are replaced."""

    def __init__(
        self,
        endpoint: str,
        workdir: Path,
        seed: int,
        count: int,
        token: str,
        extra: Sequence[str] = (),
    ) -> None:
        self.endpoint = endpoint
        self.workdir = workdir
        self.token = token
        self.extra = list(extra)
        self._count = count
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._next = 0
        self.live: list[EngineProcess] = []
        self.gone: list[EngineProcess] = []
        self.crashed: list[tuple[str, int]] = []
        self.reclaimed_segments: list[str] = []
        self.kills = 0

    @property
    def prefix(self) -> str:
        return f"/kvoffload-soak-{self.token}-"

    def _spawn(self) -> EngineProcess:
        name = f"e{self._next}"
        self._next += 1
        engine = EngineProcess.spawn(
            self.endpoint,
            name,
            self._rng.randrange(1 << 30),
            self.workdir,
            f"{self.prefix}{name}-kv",
            self.extra,
        )
        self.live.append(engine)
        return engine

    def start(self) -> None:
        with self._lock:
            for _ in range(self._count):
                self._spawn()

    def kill_one(self, rng: random.Random) -> str | None:
        """SIGKILL a random live engine mid-request, reclaim its segments, start a new one."""
        with self._lock:
            if not self.live:
                return None
            engine = rng.choice(self.live)
            engine.kill()
            self.kills += 1
            self._retire(engine)
            self.reclaimed_segments += engine.unlink_segments()
            self._spawn()
            return f"{engine.name}:{engine.pid}"

    def _retire(self, engine: EngineProcess) -> None:
        self.live.remove(engine)
        self.gone.append(engine)

    def replace_crashed(self) -> list[tuple[str, int]]:
        """Engines that exited on their own since the last call (name, exit code); replaced."""
        found = []
        with self._lock:
            for engine in [e for e in self.live if not e.alive()]:
                self._retire(engine)
                found.append((engine.name, engine.proc.returncode))
                self.reclaimed_segments += engine.unlink_segments()
                self._spawn()
        self.crashed += found
        return found

    def stop_all(self, timeout_s: float = 30.0) -> list[str]:
        """SIGTERM every engine; names of those that did not exit in time (then killed)."""
        with self._lock:
            engines, self.live = self.live, []
            for engine in engines:
                if engine.alive():
                    engine.proc.terminate()
            hung = [e.name for e in engines if not e.terminate(timeout_s)]
            self.gone += engines
        return hung

    @property
    def replaced(self) -> int:
        """Engines killed by the pool or crashed (each was replaced)."""
        return self.kills + len(self.crashed)

    def reports(self) -> list[Path]:
        with self._lock:
            return [e.report for e in self.gone + self.live]

    def unlink_leftover_segments(self) -> list[str]:
        """Remove any KV segment of this run's engines still in /dev/shm; their names."""
        return unlink_segments(self.prefix)
