"""What the supervisor hands each child process: endpoints, pool name and the effective config.

Written by the supervisor as a 0600 JSON file in the run directory; children load it with
``load_runspec``. The config inside is the validated config, so children never re-read TOML.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import msgspec

from kvoffload.config import Config

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
"""A child that exits with this code refused its configuration (bad credentials, missing bucket,
protocol mismatch): restarting it cannot help, so it stays down and its tier's jobs fail."""
EXIT_FATAL = 3
"""A child that cannot start for a reason that will not change by itself (its disk root locked
by another store, an incompatible layout, a missing module, a port in use): it writes the
reason to the file named by ``FATAL_REASON_ENV`` and exits; the supervisor stops the service
once a child failed to start so a few times in a row."""
FATAL_REASON_ENV = "KVOFFLOAD_FATAL_REASON_FILE"
"""Set by the supervisor for each child it restarts: where an ``EXIT_FATAL`` reason goes."""


class FatalStartError(Exception):
    """A start-up failure a restart cannot fix. The message is the reason for the operator:
    the setting, its value and the fix."""


def exit_fatal(reason: str) -> int:
    """Leave ``reason`` where the supervisor reads it (when it said where) and return
    ``EXIT_FATAL``, the exit code for it."""
    path = os.environ.get(FATAL_REASON_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(reason)
    return EXIT_FATAL


class RunSpec(msgspec.Struct, forbid_unknown_fields=True):
    run_id: str
    job_endpoint: str
    client_endpoint: str
    pool_name: str
    config: dict[str, Any]
    slot_table_name: str = ""
    """The slot header table's shm name; "" when ``pool.slot_headers`` is off."""

    def load_config(self) -> Config:
        """``config`` as a typed ``Config`` (msgspec.ValidationError if it does not fit)."""
        return msgspec.convert(self.config, Config)


def write_runspec(path: Path, spec: RunSpec) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(spec))
    os.replace(tmp, path)


def load_runspec(path: str | Path) -> RunSpec:
    """Read a run spec JSON file (OSError, msgspec.DecodeError or msgspec.ValidationError)."""
    return msgspec.json.decode(Path(path).read_bytes(), type=RunSpec)
