"""``python -m kvoffload.server --spec RUNSPEC``: run the manager (started by the supervisor)."""

import argparse
import sys

from kvoffload.logs import configure_logging
from kvoffload.runtime.runspec import load_runspec
from kvoffload.server.loop import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoffload-manager")
    parser.add_argument("--spec", required=True, help="run spec JSON written by the supervisor")
    args = parser.parse_args(argv)
    spec = load_runspec(args.spec)
    cfg = spec.load_config()
    configure_logging("manager", cfg.service.log_level)
    serve(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
