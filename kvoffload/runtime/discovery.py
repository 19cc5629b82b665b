"""Finding the client endpoint of a running kvoffload service.

Order: an explicit endpoint, then ``KVOFFLOAD_ENDPOINT``, then ``service.client_endpoint`` of
the configuration, then the newest live run in the configuration's runtime directory
(``<runtime_dir>/<run_id>-client.sock``).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvoffload.config import Config, load_config, resolve_runtime_dir
from kvoffload.runtime.rundir import live_runs

ENDPOINT_ENV = "KVOFFLOAD_ENDPOINT"


class NoServiceFound(LookupError):
    """No endpoint was given and no live local run was found (the message says where)."""


def find_endpoint(explicit: str | None = None, cfg: Config | None = None) -> str:
    """The client endpoint to connect to; NoServiceFound if there is none to be found."""
    if explicit:
        return explicit
    from_env = os.environ.get(ENDPOINT_ENV, "")
    if from_env:
        return from_env
    cfg = cfg if cfg is not None else load_config(None)
    if cfg.service.client_endpoint:
        return cfg.service.client_endpoint
    base = resolve_runtime_dir(cfg)
    runs = live_runs(base)
    if not runs:
        raise NoServiceFound(
            f"no running kvoffload service found in {base}; start one with `kvoffload serve` "
            f"or set {ENDPOINT_ENV}"
        )
    newest = max(runs, key=lambda r: r.started_at)
    return f"ipc://{Path(base) / (newest.run_id + '-client.sock')}"
