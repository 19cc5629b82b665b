#!/usr/bin/env bash
# scripts/gpu_wheels.sh DIR: download into DIR the wheels `kvoffload bench gpu` needs that a bare
# CUDA image (Python 3.12 with torch, no network) may lack, for CPython 3.12 on manylinux x86_64:
# pyzmq, msgspec, posix-ipc, structlog and numpy (torch does not require numpy), plus xxhash,
# psutil and prometheus-client in case the image lacks them too. No dependencies are pulled:
# these have none. About 17 MiB. On the GPU machine (see docs/benchmarks.md):
#   pip install --no-index --find-links DIR pyzmq msgspec posix-ipc structlog numpy xxhash psutil prometheus-client
#   python -m kvoffload.cli bench gpu
set -euo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
dir=$1
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
mkdir -p "$dir"
"$python" -m pip download --quiet --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$dir" \
    "pyzmq>=25" "msgspec>=0.18" "posix-ipc>=1.1" "structlog>=24" "numpy>=1.24" \
    "xxhash>=3.4" "psutil>=5.9" "prometheus-client>=0.20"
ls -l "$dir"
