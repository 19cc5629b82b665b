"""Runs the cpu worker benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.cpu_worker import main

if __name__ == "__main__":
    raise SystemExit(main())
