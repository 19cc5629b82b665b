"""SharedKVCache: layout, handle, attach from a handle, zero-copy views, lifecycle."""

from __future__ import annotations

import os
import stat

import numpy as np
import posix_ipc
import pytest

from kvoffload.testing.helpers import skip_without_extra

skip_without_extra("engine")

import torch  # noqa: E402

from kvoffload.memory.kvcache import (  # noqa: E402
    SharedKVCache,
    handle_problem,
    layout,
    segment_problem,
    unique_kv_name,
)
from kvoffload.wire.protocol import (  # noqa: E402
    AttachKV,
    CudaIpcFields,
    HandleKind,
    KVHandle,
    TensorSpec,
    decode_manager_message,
    encode,
)


@pytest.fixture
def kv():
    cache = SharedKVCache.create(None, 8, [1000, 5000])
    yield cache
    cache.close()
    cache.unlink()


def test_layout_is_page_aligned_and_back_to_back():
    offsets, size = layout(3, [100, 4096, 10])
    assert offsets == [0, 4096, 4096 + 3 * 4096]
    assert size == 4096 + 3 * 4096 + 4096
    with pytest.raises(ValueError):
        layout(0, [10])
    with pytest.raises(ValueError):
        layout(2, [10, 0])


def test_create_segment_mode_name_and_views(kv):
    assert kv.name.startswith("/kvoffload-kv-") and kv.name != unique_kv_name()
    mode = stat.S_IMODE(os.stat(f"/dev/shm{kv.name}").st_mode)
    assert mode == 0o600
    assert [t.shape for t in kv.tensors] == [(8, 1000), (8, 5000)]
    assert all(t.dtype == np.uint8 and not t.any() for t in kv.tensors)
    assert kv.block_bytes == 6000
    assert kv.offsets == (0, 8192)


def test_handle_fields_and_wire_round_trip(kv):
    handle = kv.handle("engine-0")
    assert handle == KVHandle(
        handle_id="engine-0",
        kind=HandleKind.SHM,
        num_blocks=8,
        tensors=[TensorSpec(row_bytes=1000, offset=0), TensorSpec(row_bytes=5000, offset=8192)],
        shm_name=kv.name,
    )
    assert decode_manager_message(encode(AttachKV(handle=handle))).handle == handle


def test_attach_sees_the_creators_bytes_and_writes_back(kv):
    rng = np.random.default_rng(1)
    for t in kv.tensors:
        t[:] = rng.integers(0, 256, t.shape, dtype=np.uint8)
    other = SharedKVCache.attach(kv.handle("h"))
    try:
        assert all(np.array_equal(a, b) for a, b in zip(kv.tensors, other.tensors, strict=True))
        assert other.block(3) == kv.tensors[0][3].tobytes() + kv.tensors[1][3].tobytes()
        other.tensors[1][7, :4] = [1, 2, 3, 4]
        assert list(kv.tensors[1][7, :4]) == [1, 2, 3, 4]
        with pytest.raises(PermissionError):
            other.unlink()
    finally:
        other.close()


def test_attach_rejects_bad_handles(kv):
    good = kv.handle("h")
    with pytest.raises(ValueError):
        SharedKVCache.attach(
            KVHandle(handle_id="h", kind="cuda_ipc", num_blocks=8, tensors=good.tensors)
        )
    too_far = KVHandle(
        handle_id="h",
        kind=HandleKind.SHM,
        num_blocks=8,
        tensors=[TensorSpec(row_bytes=5000, offset=16384)],
        shm_name=kv.name,
    )
    with pytest.raises(ValueError, match="outside"):
        SharedKVCache.attach(too_far)
    gone = KVHandle(
        handle_id="h",
        kind=HandleKind.SHM,
        num_blocks=8,
        tensors=good.tensors,
        shm_name=unique_kv_name(),
    )
    with pytest.raises(FileNotFoundError):
        SharedKVCache.attach(gone)


def test_torch_views_are_zero_copy_and_typed(kv):
    u8, f16 = kv.torch_views(), kv.torch_views(torch.float16)
    assert u8[0].shape == (8, 1000) and f16[1].shape == (8, 2500) and f16[1].dtype == torch.float16
    assert u8[1].data_ptr() == kv.tensors[1].ctypes.data
    f16[0][2, 0] = 1.5
    assert kv.tensors[0][2, :2].tobytes() == np.array([1.5], dtype=np.float16).tobytes()
    del u8, f16
    with SharedKVCache.create(None, 2, [6]) as odd, pytest.raises(ValueError):
        odd.torch_views(torch.float32)


def test_close_with_live_views_is_deferred_and_unlink_removes_the_name():
    cache = SharedKVCache.create(None, 2, [4096])
    path = f"/dev/shm{cache.name}"
    view = cache.torch_views()[0]
    cache.close()  # deferred: the view keeps the mapping exported
    view[0, 0] = 7  # still mapped, so this is safe
    assert cache.closed
    del view
    with cache:
        pass
    assert not os.path.exists(path)
    with pytest.raises(FileExistsError):
        name = unique_kv_name()
        first = SharedKVCache.create(name, 1, [4096])
        try:
            SharedKVCache.create(name, 1, [4096])
        finally:
            first.close()
            first.unlink()
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name)


def cuda_fields(size, stride, dtype="torch.float16", **over):
    fields = {
        "size": size,
        "stride": stride,
        "tensor_offset": 0,
        "dtype": dtype,
        "device": 0,
        "handle": b"h" * 64,
        "storage_size_bytes": 16 * 8 * 4096 * 2,
        "storage_offset_bytes": 0,
        "ref_counter_handle": b"r" * 16,
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
    }
    return CudaIpcFields(**{**fields, **over})


def test_handle_problem_names_what_is_wrong(kv):
    good = kv.handle("h")
    assert handle_problem(good, 6000) == ""
    assert segment_problem(good, 8 * 4096 + 8 * 5000) == ""
    assert "outside the 40000-byte segment" in segment_problem(good, 40000)
    row = 8 * 4096 * 2

    def cuda(fields, row_bytes=row, blocks=16):
        return handle_problem(
            KVHandle("g", "cuda_ipc", blocks, [TensorSpec(row_bytes=row_bytes, ipc=fields)]),
            row_bytes,
        )

    assert cuda(cuda_fields([16, 8, 4096], [32768, 4096, 1])) == ""
    assert cuda(cuda_fields([16, 1, 4096], [4096, 1, 1]), row_bytes=8192) == "", (
        "size-1 dims may have any stride"
    )
    assert "not contiguous" in cuda(cuda_fields([16, 8, 4096], [4096, 65536, 1]))
    assert "does not have 16 blocks first" in cuda(cuda_fields([8, 8, 4096], [32768, 4096, 1]))
    assert "rows are 131072 bytes, the handle says 65536" in cuda(
        cuda_fields([16, 8, 4096], [32768, 4096, 1], "torch.float32")
    )
    assert "unknown dtype" in cuda(cuda_fields([16, 8, 4096], [32768, 4096, 1], "torch.nope"))
    assert "past its" in cuda(cuda_fields([16, 8, 4096], [32768, 4096, 1], tensor_offset=1))
    assert "must not be empty" in cuda(cuda_fields([16, 8, 4096], [32768, 4096, 1], handle=b""))
    assert "needs its ipc fields" in cuda(None)
    assert (
        handle_problem(KVHandle("h", "shm", 8, good.tensors, ""), 6000)
        == "an shm handle needs shm_name"
    )
    assert handle_problem(KVHandle("h", "rdma", 8, good.tensors, kv.name), 6000).startswith(
        "unknown handle kind"
    )
