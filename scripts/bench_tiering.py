"""Runs the tiering benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.tiering import main

if __name__ == "__main__":
    raise SystemExit(main())
