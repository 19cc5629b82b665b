"""``python -m kvoffload.server --spec RUNSPEC``: run the manager (started by the supervisor)."""

import argparse
import sys

from kvoffload.logs import configure_logging, get_logger
from kvoffload.runtime.runspec import FatalStartError, exit_fatal, load_runspec
from kvoffload.server.loop import serve

log = get_logger()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvoffload-manager")
    parser.add_argument("--spec", required=True, help="run spec JSON written by the supervisor")
    args = parser.parse_args(argv)
    spec = load_runspec(args.spec)
    cfg = spec.load_config()
    configure_logging("manager", cfg.service.log_level)
    try:
        serve(spec)
    except FatalStartError as exc:
        log.error("manager_cannot_start", reason=str(exc))
        return exit_fatal(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
