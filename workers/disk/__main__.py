"""``python -m workers.disk --spec RUNSPEC_JSON [--hello-timeout S]``: run the disk tier worker
(``DiskBackend`` under the common worker loop). Exit codes as in ``workers.framework``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.disk.worker import DiskBackend
from workers.framework import worker_main


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(lambda cfg, _spec: DiskBackend(cfg), argv)


if __name__ == "__main__":
    sys.exit(main())
