"""The KV caches registered by clients, and the checks a handle passes before the cpu worker
is asked to attach it. The manager stats segments; it never maps them."""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from kvoffload.memory.kvcache import handle_problem, segment_problem
from kvoffload.memory.shmseg import stat_segment
from kvoffload.runtime.rundir import is_run_segment
from kvoffload.server.state import CPU_WORKER, ManagerState, RequestError
from kvoffload.wire import protocol as p
from kvoffload.wire.protocol import ErrorCode

log = structlog.get_logger()


class KVHandles:
    """Registered handles by id, each with the identity of the client that owns it."""

    def __init__(self, state: ManagerState) -> None:
        self.state = state
        self.by_id: dict[str, tuple[bytes, p.KVHandle]] = {}
        self.service_segments = _segment_ids([state.spec.pool_name, state.spec.slot_table_name])
        # what the last cpu worker said it can do; None before its first hello
        self.cpu_capabilities: frozenset[str] | None = None

    def register(self, identity: bytes, handle: p.KVHandle) -> None:
        """Check and record the handle, then ask a connected cpu worker to attach it."""
        owner = self.by_id.get(handle.handle_id)
        if owner is not None and owner[0] != identity:
            raise RequestError(
                ErrorCode.HANDLE_TAKEN, f"KV handle {handle.handle_id!r} belongs to another client"
            )
        if handle.kind not in tuple(p.HandleKind):
            raise RequestError(ErrorCode.BAD_REQUEST, f"unknown KV handle kind {handle.kind!r}")
        problem = handle_problem(handle, self.state.cfg.pool.block_bytes)
        if not problem and handle.kind == p.HandleKind.SHM:
            problem = self._shm_problem(handle)
        if problem:
            raise RequestError(ErrorCode.BAD_HANDLE, f"KV handle {handle.handle_id!r}: {problem}")
        if not self.cpu_serves(handle):
            raise RequestError(
                ErrorCode.HANDLE_UNSUPPORTED,
                f"KV handle {handle.handle_id!r}: no worker can serve {handle.kind} handles "
                "(the cpu worker has no CUDA device); register a shared-memory KV cache instead",
            )
        self.by_id[handle.handle_id] = (identity, handle)
        session = self.state.sessions.get(identity)
        if session is not None:
            session.handles.add(handle.handle_id)
        if self.state.registry.live(CPU_WORKER) is not None:
            self.state.send_worker(CPU_WORKER, p.AttachKV(handle))

    def owned(
        self, identity: bytes, handle_id: str, keys: list[bytes], blocks: list[int]
    ) -> p.KVHandle:
        """The client's handle, once the device blocks are checked against it."""
        owner_handle = self.by_id.get(handle_id)
        if owner_handle is None or owner_handle[0] != identity:
            raise RequestError(
                ErrorCode.UNKNOWN_HANDLE,
                f"KV handle {handle_id!r} is not registered by this client",
            )
        handle = owner_handle[1]
        if len(blocks) != len(keys):
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"{len(keys)} keys but {len(blocks)} device blocks"
            )
        for block in blocks:
            if not 0 <= block < handle.num_blocks:
                raise RequestError(
                    ErrorCode.BLOCK_OUT_OF_RANGE,
                    f"device block {block} outside 0..{handle.num_blocks - 1}",
                )
        return handle

    def cpu_serves(self, handle: p.KVHandle) -> bool:
        """False when the cpu worker said it cannot serve handles of this kind; True while no
        cpu worker has said anything yet (its hello decides then)."""
        return self.cpu_capabilities is None or handle.kind in self.cpu_capabilities

    def attach_all(self, capabilities: list[str]) -> None:
        """A cpu worker said hello: attach every handle it can serve, drop the others."""
        self.cpu_capabilities = frozenset(capabilities)
        for owner, handle in list(self.by_id.values()):
            if self.cpu_serves(handle):
                self.state.send_worker(CPU_WORKER, p.AttachKV(handle))
            else:
                self._drop(owner, handle.handle_id, "the cpu worker cannot serve it")

    def release(self, handle_ids: Iterable[str]) -> None:
        """Forget handles of a client that left, and detach them from the cpu worker."""
        for handle_id in handle_ids:
            self.by_id.pop(handle_id, None)
            if self.state.registry.live(CPU_WORKER) is not None:
                self.state.send_worker(CPU_WORKER, p.DetachKV(handle_id))

    def _drop(self, identity: bytes, handle_id: str, reason: str) -> None:
        self.by_id.pop(handle_id, None)
        session = self.state.sessions.get(identity)
        if session is not None:
            session.handles.discard(handle_id)
        log.error("kv_handle_dropped", handle_id=handle_id, reason=reason)

    def _shm_problem(self, handle: p.KVHandle) -> str:
        """Why the segment of an shm handle cannot be a KV cache: a segment of the service (by
        name, or by identity under another name), missing, or too small for its tensors. The
        segment is opened read-only and stat'ed, never mapped."""
        name = handle.shm_name
        if is_run_segment(name):
            return (
                f"{name} is a segment of the service (host pool, slot header table), not a KV cache"
            )
        try:
            st = stat_segment(name, "shm segment")
        except (OSError, ValueError) as exc:
            return str(exc)
        if (st.st_dev, st.st_ino) in self.service_segments:
            return f"{name} is another name of a segment of the service, not a KV cache"
        return segment_problem(handle, st.st_size)


def _segment_ids(names: list[str]) -> set[tuple[int, int]]:
    """(device, inode) of each named segment that exists."""
    ids = set()
    for name in filter(None, names):
        try:
            st = stat_segment(name, "service segment")
        except (OSError, ValueError) as exc:
            log.warning("service_segment_stat_failed", segment=name, error=str(exc))
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids
