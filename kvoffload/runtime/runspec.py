"""What the supervisor hands each child process: endpoints, pool name and the effective config.

Written by the supervisor as a 0600 JSON file in the run directory; children load it with
``load_runspec``. The config inside is the validated config, so children never re-read TOML.
"""

from __future__ import annotations

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
