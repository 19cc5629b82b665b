"""Runs the disk benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.disk import main

if __name__ == "__main__":
    raise SystemExit(main())
