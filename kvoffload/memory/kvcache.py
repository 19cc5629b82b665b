"""Engine-side KV caches the cpu worker can reach, and the ``KVHandle`` that describes them.

Layout contract (shared with ``workers.cpu``): a KV cache is a list of block-major tensors, each
``num_blocks`` rows of ``row_bytes[j]`` bytes. A device block's bytes in a pool slot are the
concatenation, in tensor order, of each tensor's row for that block, so ``sum(row_bytes)`` must
equal the pool's ``block_bytes``.

- ``SharedKVCache``: a CPU KV cache in one POSIX shared-memory segment (engines without a GPU,
  tests, the demo). The creator ``create``s and ``unlink``s it; the cpu worker ``attach``es.
- ``cuda_kv_handle``: a handle for CUDA KV tensors, shared through CUDA IPC. The engine must
  keep those tensors alive until the worker has been told ``DetachKV``.

torch is imported only by the functions that need it.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvoffload.logs import get_logger
from kvoffload.memory.blockformat import PAGE_BYTES
from kvoffload.memory.shmseg import OwnedSegment, attach_segment, close_mapping, create_segment
from kvoffload.wire.protocol import CudaIpcFields, HandleKind, KVHandle, TensorSpec

if TYPE_CHECKING:
    import torch

log = get_logger()

MAX_KV_BLOCKS = 1 << 24
"""The most device blocks one handle may have."""
MAX_HANDLE_ID_CHARS = 256
_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
"""Element sizes of the torch dtypes a cuda_ipc tensor may have, by name (without torch)."""


def _align_up(value: int, to: int = PAGE_BYTES) -> int:
    return (value + to - 1) // to * to


def unique_kv_name() -> str:
    """A fresh segment name ``/kvoffload-kv-<random>``."""
    return f"/kvoffload-kv-{secrets.token_hex(8)}"


def handle_problem(handle: KVHandle, block_bytes: int) -> str:
    """What is wrong with ``handle``'s own fields for a pool of ``block_bytes`` blocks, in
    words ("" when nothing is): its id, kind, block count, tensors' rows and offsets, and for
    ``cuda_ipc`` the IPC fields of each tensor. Reads no memory; ``segment_problem`` checks an
    ``shm`` handle against its segment's size."""
    if not handle.handle_id or len(handle.handle_id) > MAX_HANDLE_ID_CHARS:
        return (
            f"handle_id must be 1 to {MAX_HANDLE_ID_CHARS} characters, got {len(handle.handle_id)}"
        )
    if handle.kind not in tuple(HandleKind):
        return (
            f"unknown handle kind {handle.kind!r}; expected one of {[k.value for k in HandleKind]}"
        )
    if handle.num_blocks <= 0:
        return f"num_blocks must be > 0, got {handle.num_blocks}"
    if handle.num_blocks > MAX_KV_BLOCKS:
        return f"num_blocks must be <= {MAX_KV_BLOCKS}, got {handle.num_blocks}"
    if not handle.tensors:
        return "a handle needs at least one tensor"
    for j, tensor in enumerate(handle.tensors):
        if tensor.row_bytes <= 0:
            return f"tensor {j}: row_bytes must be > 0, got {tensor.row_bytes}"
        if tensor.offset < 0:
            return f"tensor {j}: offset must be >= 0, got {tensor.offset}"
    rows = sum(t.row_bytes for t in handle.tensors)
    if rows != block_bytes:
        return (
            f"the tensors' row_bytes sum to {rows}; they must sum to the pool's block_bytes "
            f"{block_bytes}"
        )
    if handle.kind == HandleKind.SHM:
        if not handle.shm_name:
            return "an shm handle needs shm_name"
        if any(t.ipc is not None for t in handle.tensors):
            return "an shm handle's tensors carry no ipc fields"
        return ""
    for j, tensor in enumerate(handle.tensors):
        problem = _ipc_problem(tensor.ipc, handle.num_blocks, tensor.row_bytes)
        if problem:
            return f"tensor {j}: {problem}"
    return ""


def segment_problem(handle: KVHandle, segment_bytes: int) -> str:
    """ "" when every tensor of the shm ``handle`` lies inside its ``segment_bytes``-byte
    segment, else which one does not."""
    for j, t in enumerate(handle.tensors):
        end = t.offset + handle.num_blocks * t.row_bytes
        if end > segment_bytes:
            return (
                f"tensor {j} (offset {t.offset} + {handle.num_blocks} blocks x {t.row_bytes} "
                f"bytes) ends at byte {end}, outside the {segment_bytes}-byte segment "
                f"{handle.shm_name}"
            )
    return ""


def _ipc_problem(ipc: CudaIpcFields | None, num_blocks: int, row_bytes: int) -> str:
    """What is wrong with one tensor's CUDA IPC fields ("" when they describe a contiguous
    tensor of ``num_blocks`` rows of ``row_bytes`` inside its shared storage). Their types
    were checked by decoding."""
    if ipc is None:
        return "a cuda_ipc tensor needs its ipc fields"
    size, stride = ipc.size, ipc.stride
    if len(size) != len(stride) or any(d < 0 for d in size):
        return "ipc size and stride must be of the same length, sizes >= 0"
    itemsize = _DTYPE_BYTES.get(ipc.dtype.removeprefix("torch."))
    if itemsize is None:
        return f"unknown dtype {ipc.dtype!r}"
    ints = (
        "tensor_offset",
        "device",
        "storage_size_bytes",
        "storage_offset_bytes",
        "ref_counter_offset",
    )
    if any(getattr(ipc, f) < 0 for f in ints):
        return f"ipc fields {list(ints)} must be >= 0"
    if not ipc.handle or not ipc.ref_counter_handle:
        return "ipc handles must not be empty"
    if not size or size[0] != num_blocks:
        return f"its size {size} does not have {num_blocks} blocks first"
    elements = 1
    for dim in size[1:]:
        elements *= dim
    if elements * itemsize != row_bytes:
        return f"its rows are {elements * itemsize} bytes, the handle says {row_bytes}"
    step = 1
    for dim, dim_stride in zip(reversed(size), reversed(stride), strict=True):
        if dim != 1 and dim_stride != step:
            return f"it is not contiguous (stride {stride} for size {size})"
        step *= dim
    end = (ipc.tensor_offset + num_blocks * elements) * itemsize
    if end > ipc.storage_size_bytes:
        return f"it ends at byte {end}, past its {ipc.storage_size_bytes}-byte storage"
    return ""


def layout(num_blocks: int, row_bytes: Sequence[int]) -> tuple[list[int], int]:
    """Page-aligned byte offsets of the tensors laid out one after another, and the total size."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if not row_bytes or any(rb <= 0 for rb in row_bytes):
        raise ValueError(
            f"row_bytes must be a non-empty list of positive sizes, got {list(row_bytes)}"
        )
    offsets = []
    end = 0
    for rb in row_bytes:
        offsets.append(end)
        end = _align_up(end + num_blocks * rb)
    return offsets, end


def _reserve_pages(fd: int, mapping: mmap.mmap) -> None:
    """Reserve the segment's pages now, so a full /dev/shm fails here with ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, len(mapping))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise


class SharedKVCache(OwnedSegment):
    """A KV cache in one shm segment. ``tensors[j]`` is a writable zero-copy uint8 array of
    shape ``(num_blocks, row_bytes[j])``. Build it with ``create`` or ``attach``."""

    what = "KV cache segment"

    def __init__(
        self,
        name: str,
        num_blocks: int,
        row_bytes: Sequence[int],
        offsets: Sequence[int],
        mapping: mmap.mmap,
        creator: bool,
    ) -> None:
        self._name = name
        self._num_blocks = num_blocks
        self._row_bytes = tuple(row_bytes)
        self._offsets = tuple(offsets)
        self._mmap: mmap.mmap | None = mapping
        self._creator = creator
        self._unlinked = False
        # np.frombuffer keeps the mapping exported while a view lives (np.ndarray(buffer=...)
        # would not, and mmap.close() would then unmap under it).
        self.tensors: list[np.ndarray] = [
            np.frombuffer(mapping, dtype=np.uint8, count=num_blocks * rb, offset=off).reshape(
                num_blocks, rb
            )
            for rb, off in zip(self._row_bytes, self._offsets, strict=True)
        ]

    @classmethod
    def create(cls, name: str | None, num_blocks: int, row_bytes: Sequence[int]) -> SharedKVCache:
        """Create and map a new zeroed segment, mode 0600 (``name`` None: ``unique_kv_name()``;
        FileExistsError if it exists). Its pages are reserved up front (ENOSPC raises here)."""
        offsets, size = layout(num_blocks, row_bytes)
        name = name if name is not None else unique_kv_name()
        mapping = create_segment(name, size, "KV cache segment", _reserve_pages)
        log.debug("kv_cache_created", segment=name, blocks=num_blocks, bytes=size)
        return cls(name, num_blocks, row_bytes, offsets, mapping, creator=True)

    @classmethod
    def attach(cls, handle: KVHandle) -> SharedKVCache:
        """Map the segment of an ``shm`` handle. FileNotFoundError if it is gone; ValueError if
        the handle is not ``shm`` or a tensor lies outside the segment."""
        if handle.kind != HandleKind.SHM:
            raise ValueError(
                f"handle {handle.handle_id} is {handle.kind!r}, not {HandleKind.SHM.value!r}"
            )
        problem = handle_problem(handle, sum(t.row_bytes for t in handle.tensors))
        if problem:
            raise ValueError(f"handle {handle.handle_id}: {problem}")

        def check_size(size: int) -> None:
            problem = segment_problem(handle, size)
            if problem:
                raise ValueError(f"handle {handle.handle_id}: {problem}")

        mapping = attach_segment(handle.shm_name, "KV cache segment", check_size, populate=True)
        return cls(
            handle.shm_name,
            handle.num_blocks,
            [t.row_bytes for t in handle.tensors],
            [t.offset for t in handle.tensors],
            mapping,
            creator=False,
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def row_bytes(self) -> tuple[int, ...]:
        return self._row_bytes

    @property
    def offsets(self) -> tuple[int, ...]:
        return self._offsets

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in a pool slot: the sum of the row sizes."""
        return sum(self._row_bytes)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def block(self, block_id: int) -> bytes:
        """A copy of one block's bytes in pool order (the rows concatenated)."""
        return b"".join(t[block_id].tobytes() for t in self.tensors)

    def handle(self, handle_id: str) -> KVHandle:
        """The ``shm`` handle to send in ``RegisterKV`` / ``AttachKV``."""
        return KVHandle(
            handle_id=handle_id,
            kind=HandleKind.SHM,
            num_blocks=self._num_blocks,
            tensors=[
                TensorSpec(row_bytes=rb, offset=off)
                for rb, off in zip(self._row_bytes, self._offsets, strict=True)
            ],
            shm_name=self._name,
        )

    def torch_views(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Zero-copy torch tensors over ``tensors``, shape ``(num_blocks, row_bytes // itemsize)``
        of ``dtype`` (default uint8). They keep the mapping exported, so drop them before
        ``close`` (a ``torch.frombuffer`` view would not, and could outlive the mapping)."""
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        views = []
        for j, array in enumerate(self.tensors):
            if array.shape[1] % itemsize:
                raise ValueError(
                    f"row_bytes[{j}]={array.shape[1]} is not a multiple of {dtype}'s size"
                )
            views.append(torch.from_numpy(array).view(dtype))
        return views

    def close(self) -> None:
        """Unmap. Idempotent. If views handed out are still alive the unmap is left to the
        garbage collector (logged as ``shm_close_deferred``)."""
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        self.tensors = []
        close_mapping(mapping, "KV cache segment", self._name)


# ---- CUDA IPC --------------------------------------------------------------------------------


def cuda_ipc_fields(tensor: torch.Tensor) -> CudaIpcFields:
    """torch's CUDA IPC sharing fields of ``tensor`` (``rebuild_cuda_ipc_tensor`` is the
    inverse)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (
        _tensor_cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcFields(
        size=list(size),
        stride=list(stride),
        tensor_offset=int(tensor_offset),
        dtype=str(dtype),
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required),
    )


def rebuild_cuda_ipc_tensor(ipc: CudaIpcFields) -> torch.Tensor:
    """Open a tensor shared by ``cuda_ipc_fields`` (in another process than the producer).
    ValueError for an unknown dtype."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, ipc.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {ipc.dtype!r}")
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(ipc.size),
        tuple(ipc.stride),
        ipc.tensor_offset,
        torch.storage.TypedStorage,
        dtype,
        ipc.device,
        ipc.handle,
        ipc.storage_size_bytes,
        ipc.storage_offset_bytes,
        False,
        ipc.ref_counter_handle,
        ipc.ref_counter_offset,
        ipc.event_handle,
        ipc.event_sync_required,
    )


def cuda_kv_handle(handle_id: str, tensors: Sequence[torch.Tensor]) -> KVHandle:
    """A ``cuda_ipc`` handle for block-major CUDA KV tensors (first dim = blocks, same for all).
    Each tensor's row is ``tensor[0]``; tensors must be contiguous (ValueError otherwise)."""
    if not tensors:
        raise ValueError("no tensors")
    num_blocks = int(tensors[0].shape[0])
    specs = []
    for j, t in enumerate(tensors):
        if not t.is_cuda:
            raise ValueError(f"tensor {j} is on {t.device}, not a CUDA device")
        if not t.is_contiguous():
            raise ValueError(f"tensor {j} is not contiguous")
        if t.dim() < 1 or int(t.shape[0]) != num_blocks:
            raise ValueError(
                f"tensor {j} has shape {tuple(t.shape)}, expected {num_blocks} blocks first"
            )
        row_bytes = t[0].numel() * t.element_size()
        specs.append(TensorSpec(row_bytes=row_bytes, ipc=cuda_ipc_fields(t)))
    return KVHandle(
        handle_id=handle_id, kind=HandleKind.CUDA_IPC, num_blocks=num_blocks, tensors=specs
    )
