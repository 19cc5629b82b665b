"""Prefix keys: stable across processes, chained, full blocks only, bound to the model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")  # kvoffload.engine imports torch

from kvoffload.engine.hashing import KEY_BYTES, block_keys  # noqa: E402

MODEL = b"model-a"
BT = 16


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def test_keys_are_the_same_in_another_process() -> None:
    prompt = tokens(100)
    code = (
        "import json, sys; from kvoffload.engine.hashing import block_keys; "
        "t = json.loads(sys.argv[1]); print(json.dumps([k.hex() for k in block_keys(t, 16, b'model-a')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(prompt)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(out.stdout) == [k.hex() for k in block_keys(prompt, BT, MODEL)]


def test_first_keys_follow_the_documented_chain() -> None:
    prompt = tokens(32)
    raw = np.asarray(prompt, dtype="<i4").tobytes()
    first = hashlib.blake2b(raw[:64] + MODEL, digest_size=32).digest()
    second = hashlib.blake2b(first + raw[64:] + MODEL, digest_size=32).digest()
    assert block_keys(prompt, BT, MODEL) == [first, second]


def test_only_full_blocks_get_keys() -> None:
    prompt = tokens(64)
    assert [len(block_keys(prompt[:n], BT, MODEL)) for n in (0, 15, 16, 31, 63, 64)] == [
        0,
        0,
        1,
        1,
        3,
        4,
    ]
    assert block_keys(prompt[:63], BT, MODEL) == block_keys(prompt, BT, MODEL)[:3]
    assert all(len(k) == KEY_BYTES for k in block_keys(prompt, BT, MODEL))


@pytest.mark.parametrize("position", [0, 15, 16, 40, 63])
def test_changing_one_token_changes_its_block_key_and_every_later_one(position: int) -> None:
    prompt = tokens(64)
    changed = list(prompt)
    changed[position] += 1
    before, after = block_keys(prompt, BT, MODEL), block_keys(changed, BT, MODEL)
    block = position // BT
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


def test_keys_depend_on_the_model_and_block_order() -> None:
    prompt = tokens(64)
    keys = block_keys(prompt, BT, MODEL)
    assert set(keys).isdisjoint(block_keys(prompt, BT, b"model-b"))
    swapped = prompt[16:32] + prompt[:16] + prompt[32:]
    assert block_keys(swapped, BT, MODEL)[1] != keys[1]
    assert len(set(keys)) == len(keys)


def test_token_ids_outside_int32_are_refused() -> None:
    with pytest.raises(ValueError):
        block_keys([2**31] * BT, BT, MODEL)
