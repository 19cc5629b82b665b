"""``python -m workers.object --spec RUNSPEC_JSON [--hello-timeout S]``: the object tier worker.

Before it connects to the manager it checks the store (one LIST: endpoint reachable, credentials
accepted, bucket present). If that fails it logs ``object_store_unusable`` with the reason and
exits with code 2 (the framework's "refused" code); otherwise it runs ``ObjectBackend`` under
``workers.framework.run_worker``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from kvoffload.logs import configure_logging, get_logger
from kvoffload.runtime.runspec import EXIT_REFUSED, load_runspec
from workers.framework import run_worker
from workers.object.errors import ObjectStoreConfigError
from workers.object.worker import ObjectBackend

log = get_logger()


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
        backend.check()
    except (ObjectStoreConfigError, ValueError) as exc:
        log.error("object_store_unusable", endpoint=obj.endpoint, bucket=obj.bucket, error=str(exc))
        if backend is not None:
            backend.close()
        return EXIT_REFUSED
    log.info("object_store_ready", endpoint=obj.endpoint, bucket=obj.bucket, prefix=obj.prefix)
    return run_worker(backend, spec, config=cfg, hello_timeout_s=args.hello_timeout)


if __name__ == "__main__":
    sys.exit(main())
