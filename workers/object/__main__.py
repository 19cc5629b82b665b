"""``python -m workers.object --spec RUNSPEC_JSON [--hello-timeout S]``: the object tier worker.

Before it connects to the manager it checks the store (one LIST: endpoint reachable, credentials
accepted, bucket present). A check that fails for a reason the world may fix (``StoreNotReady``:
S3 unreachable, the bucket missing, the credentials refused) is tried again with the
supervisor's backoff (``supervisor.restart_backoff_initial_s``, doubling up to
``restart_backoff_max_s``), logged as ``object_store_unavailable`` with the reason at the first
try and then at most once a minute; meanwhile the tier is down (the service degraded) and it
joins once a check passes, with no restart of the service. Settings that can never work (no
endpoint, a malformed one) log ``object_store_unusable`` and exit with code 2 (the framework's
"refused" code). Then it runs ``ObjectBackend`` under ``workers.framework.run_worker``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence

import msgspec

from kvoffload.config import Config
from kvoffload.logs import configure_logging, get_logger
from kvoffload.runtime.runspec import EXIT_OK, EXIT_REFUSED, load_runspec
from workers.framework import run_worker
from workers.object.errors import ObjectStoreConfigError, StoreNotReady
from workers.object.worker import ObjectBackend

log = get_logger()

LOG_EVERY_S = 60.0
"""A store that stays unavailable is logged at most this often."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvoffload object tier worker")
    parser.add_argument(
        "--spec", required=True, help="run spec JSON file written by the supervisor"
    )
    parser.add_argument(
        "--hello-timeout", type=float, default=30.0, help="seconds to wait for the manager's ack"
    )
    args = parser.parse_args(argv)
    try:
        spec = load_runspec(args.spec)
        cfg = spec.load_config()
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        configure_logging(proc=ObjectBackend.name)
        log.error("runspec_invalid", path=args.spec, error=str(exc))
        return EXIT_REFUSED
    configure_logging(proc=ObjectBackend.name, level=cfg.service.log_level)
    obj = cfg.object
    backend = None
    try:
        if not obj.endpoint:
            raise ObjectStoreConfigError("object.endpoint is not set")
        backend = ObjectBackend(cfg)
        attempts = _until_ready(backend, cfg)
    except (ObjectStoreConfigError, ValueError) as exc:
        log.error("object_store_unusable", endpoint=obj.endpoint, bucket=obj.bucket, error=str(exc))
        if backend is not None:
            backend.close()
        return EXIT_REFUSED
    if attempts is None:  # stopped while the store was not ready
        backend.close()
        return EXIT_OK
    log.info(
        "object_store_ready",
        endpoint=obj.endpoint,
        bucket=obj.bucket,
        prefix=obj.prefix,
        attempts=attempts,
    )
    return run_worker(backend, spec, config=cfg, hello_timeout_s=args.hello_timeout)


def _until_ready(backend: ObjectBackend, cfg: Config) -> int | None:
    """Check the store until it is usable; the attempts it took, or None when SIGTERM or
    SIGINT came first."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    sup, obj = cfg.supervisor, cfg.object
    delay, attempts, logged_at = sup.restart_backoff_initial_s, 0, -LOG_EVERY_S
    try:
        while True:
            attempts += 1
            try:
                backend.check()
                return attempts
            except StoreNotReady as exc:
                now = time.monotonic()
                if now - logged_at >= LOG_EVERY_S:
                    logged_at = now
                    log.warning(
                        "object_store_unavailable",
                        endpoint=obj.endpoint,
                        bucket=obj.bucket,
                        error=str(exc),
                        attempts=attempts,
                        retry_in_s=delay,
                    )
            if stop.wait(delay):
                return None
            delay = min(delay * 2, sup.restart_backoff_max_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
