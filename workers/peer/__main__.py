"""``python -m workers.peer --spec RUNSPEC_JSON [--hello-timeout S]``: run the peer tier worker
(``PeerBackend`` under the common worker loop). Exit codes as in ``workers.framework``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.framework import worker_main
from workers.peer.worker import PeerBackend


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(lambda cfg, spec: PeerBackend(cfg, spec.client_endpoint), argv)


if __name__ == "__main__":
    sys.exit(main())
