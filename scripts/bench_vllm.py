"""Runs the vllm benchmark; same as `kvoffload bench`'s suite, kept as a script."""

from kvoffload.bench.vllm import main

if __name__ == "__main__":
    raise SystemExit(main())
