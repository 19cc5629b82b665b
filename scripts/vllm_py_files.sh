#!/usr/bin/env bash
# scripts/vllm_py_files.sh VERSION DIR: the Python files of vLLM VERSION's wheel (vllm/*.py, no
# dependencies, no compiled code) in DIR/vllm, for the tests that check the integration against
# that version's own classes (tests/integrations/vllm/test_vllm_versions.py, which finds DIR in
# KVOFFLOAD_VLLM033_DIR for 0.33.0). Does nothing when DIR already holds them.
set -euo pipefail
version=$1
dir=$2
cd "$(dirname "$0")/.."
if [ -f "$dir/vllm/__init__.py" ]; then
    exit 0
fi
python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --no-deps --only-binary=:all: "vllm==$version" -d "$tmp"
mkdir -p "$(dirname "$dir")"
rm -rf "$dir.partial"
"$python" - "$tmp" "$dir.partial" <<'PY'
import pathlib
import sys
import zipfile

(wheel,) = pathlib.Path(sys.argv[1]).glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    archive.extractall(sys.argv[2], names)
print(f"{len(names)} files of {wheel.name} in {sys.argv[2]}")
PY
rm -rf "$dir"
mv "$dir.partial" "$dir"
