"""The public surface: ``kvoffload`` names what users import, each name is the object of its
home module, and importing the package alone loads nothing else."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvoffload


def test_every_public_name_is_its_home_modules_object():
    for name in kvoffload.__all__:
        value = getattr(kvoffload, name)
        home = kvoffload._HOMES.get(name)
        if home is not None:
            assert value is getattr(importlib.import_module(home), name), name
    assert set(kvoffload._HOMES) <= set(kvoffload.__all__)


def test_the_vllm_connector_path_names_the_connector():
    module = importlib.import_module(kvoffload.VLLM_CONNECTOR_MODULE)
    assert getattr(module, kvoffload.VLLM_CONNECTOR).__name__ == kvoffload.VLLM_CONNECTOR


def test_an_unknown_name_is_an_attribute_error():
    try:
        kvoffload.KVOffloadManager  # noqa: B018
    except AttributeError as exc:
        assert "KVOffloadManager" in str(exc)
    else:
        raise AssertionError("an internal name was served as public")


def test_importing_the_package_loads_nothing_else():
    code = (
        "import sys, kvoffload; "
        "print(sorted(m for m in sys.modules if m.startswith('kvoffload.') or m in "
        "('zmq', 'torch', 'msgspec', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
