"""Host pool: real POSIX shared memory, two processes, zero-copy views, CUDA registration."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from kvoffload.memory.pool import HostPool, PoolMismatch
from kvoffload.testing.helpers import REPO_ROOT


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CUDA = _cuda_available()

BLOCK = 4096 * 4
SLOTS = 8


def _shm_leftovers(token: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if token in n]


@pytest.fixture
def pool_name() -> Iterator[str]:
    """A unique segment name; fails the test if the segment outlives it."""
    token = secrets.token_hex(6)
    name = f"/kvoffload-test-{token}-pool"
    yield name
    leftovers = _shm_leftovers(token)
    for leftover in leftovers:
        os.unlink(f"/dev/shm/{leftover}")
    assert not leftovers, f"test left shared memory behind: {leftovers}"


@pytest.fixture
def pool(pool_name: str) -> Iterator[HostPool]:
    created = HostPool.create(pool_name, SLOTS, BLOCK)
    try:
        yield created
    finally:
        created.close()
        created.unlink()


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_create_geometry_and_mode(pool: HostPool, pool_name: str) -> None:
    assert (pool.name, pool.num_slots, pool.block_bytes) == (pool_name, SLOTS, BLOCK)
    assert pool.size == SLOTS * BLOCK
    st = os.stat(f"/dev/shm{pool_name}")
    assert st.st_size == SLOTS * BLOCK
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert pool.address() % 4096 == 0
    assert pool.as_numpy().shape == (SLOTS, BLOCK)
    assert pool.as_numpy().dtype == np.uint8


def test_create_refuses_existing_name(pool: HostPool, pool_name: str) -> None:
    with pytest.raises(FileExistsError, match=pool_name):
        HostPool.create(pool_name, SLOTS, BLOCK)


def test_bytes_cross_processes(pool: HostPool, pool_name: str) -> None:
    payload = np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8)
    pool.slot(5)[:] = payload.tobytes()
    result = _run_python(
        f"""
        import hashlib
        from kvoffload.memory.pool import HostPool
        pool = HostPool.attach({pool_name!r}, {SLOTS}, {BLOCK})
        print(hashlib.sha256(pool.slot(5)).hexdigest())
        pool.slot_array(6)[:] = 0xAB
        pool.close()
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hashlib.sha256(payload.tobytes()).hexdigest()
    assert bytes(pool.slot(6)) == b"\xab" * BLOCK
    assert not pool.as_numpy()[[0, 1, 2, 3, 4, 7]].any()


def test_slot_views_are_zero_copy_and_writable(pool: HostPool) -> None:
    view = pool.slot(2)
    arr = pool.slot_array(2)
    assert len(view) == BLOCK and not view.readonly
    view[10] = 42
    assert arr[10] == 42
    assert pool.as_numpy()[2, 10] == 42
    arr[11] = 43
    assert view[11] == 43
    assert arr.ctypes.data == pool.address() + 2 * BLOCK
    assert np.shares_memory(arr, pool.as_numpy())


def test_torch_view_is_zero_copy(pool: HostPool) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(pool.slot_array(3))
    assert tensor.data_ptr() == pool.address() + 3 * BLOCK
    tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert bytes(pool.slot(3)[:4]) == b"\x01\x02\x03\x04"
    tensor.view(torch.int32)[100] = -1
    assert bytes(pool.slot(3)[400:404]) == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("slot", [-1, SLOTS, SLOTS + 100])
def test_slot_bounds(pool: HostPool, slot: int) -> None:
    with pytest.raises(IndexError, match=rf"slot {slot} out of range \[0, {SLOTS}\)"):
        pool.slot(slot)
    with pytest.raises(IndexError, match=f"slot {slot}"):
        pool.slot_array(slot)


@pytest.mark.parametrize("block_bytes", [0, -4096, 4095, 4096 + 1, 1000])
def test_block_bytes_must_be_page_multiple(pool_name: str, block_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"block_bytes .*got {block_bytes}"):
        HostPool.create(pool_name, SLOTS, block_bytes)


def test_num_slots_and_name_validation(pool_name: str) -> None:
    with pytest.raises(ValueError, match="num_slots"):
        HostPool.create(pool_name, 0, BLOCK)
    with pytest.raises(ValueError, match="pool name"):
        HostPool.create(pool_name.lstrip("/"), SLOTS, BLOCK)


def test_attach_size_mismatch(pool: HostPool, pool_name: str) -> None:
    with pytest.raises(PoolMismatch, match=f"{SLOTS * BLOCK} bytes"):
        HostPool.attach(pool_name, SLOTS + 1, BLOCK)
    with pytest.raises(PoolMismatch):
        HostPool.attach(pool_name, SLOTS, BLOCK * 2)
    attached = HostPool.attach(pool_name, SLOTS, BLOCK)
    attached.close()


def test_attach_missing(pool_name: str) -> None:
    with pytest.raises(FileNotFoundError, match=pool_name):
        HostPool.attach(pool_name, SLOTS, BLOCK)


def test_close_and_unlink_are_idempotent(pool_name: str) -> None:
    pool = HostPool.create(pool_name, SLOTS, BLOCK, prefault=False)
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError, match="closed"):
        pool.slot(0)
    assert os.path.exists(f"/dev/shm{pool_name}")
    pool.unlink()
    pool.unlink()
    assert not os.path.exists(f"/dev/shm{pool_name}")


def test_attached_pool_cannot_unlink(pool: HostPool, pool_name: str) -> None:
    attached = HostPool.attach(pool_name, SLOTS, BLOCK)
    try:
        with pytest.raises(PermissionError):
            attached.unlink()
        assert os.path.exists(f"/dev/shm{pool_name}")
    finally:
        attached.close()


def test_close_with_live_view_is_deferred(pool_name: str) -> None:
    pool = HostPool.create(pool_name, SLOTS, BLOCK)
    view = pool.slot(1)
    pool.close()
    assert pool.closed
    view[0] = 9  # the mapping stays valid while the view lives
    assert view[0] == 9
    pool.unlink()
    del view


def test_context_manager_closes_and_unlinks(pool_name: str) -> None:
    with HostPool.create(pool_name, SLOTS, BLOCK) as pool:
        pool.slot(0)[0] = 1
    assert pool.closed
    assert not os.path.exists(f"/dev/shm{pool_name}")


def test_importing_pool_does_not_import_torch() -> None:
    result = _run_python(
        """
        import sys
        import kvoffload.memory.pool, kvoffload.memory.cuda_host
        assert "torch" not in sys.modules, "torch imported"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(CUDA, reason="a CUDA device is present")
def test_register_cuda_without_cuda_is_false(pool: HostPool) -> None:
    assert pool.register_cuda() is False
    assert pool.cuda_registered is False


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_register_cuda_and_copy_from_gpu(pool_name: str) -> None:
    import torch

    pool = HostPool.create(pool_name, SLOTS, BLOCK)
    try:
        assert pool.register_cuda() is True
        host = torch.from_numpy(pool.slot_array(4))
        assert host.is_pinned()
        source = (
            torch.arange(BLOCK, device="cuda", dtype=torch.int64).remainder(251).to(torch.uint8)
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
        stream.synchronize()
        expected = (np.arange(BLOCK) % 251).astype(np.uint8)
        assert np.array_equal(pool.slot_array(4), expected)
        del host
    finally:
        pool.close()
        pool.unlink()
    assert not pool.cuda_registered
