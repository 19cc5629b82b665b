"""Runs the object benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.object import main

if __name__ == "__main__":
    raise SystemExit(main())
