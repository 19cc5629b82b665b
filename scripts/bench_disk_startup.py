"""Runs the disk startup benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.disk_startup import main

if __name__ == "__main__":
    raise SystemExit(main())
