"""Keys whose landing a client awaits: the promotions a ``Lookup`` with ``landing`` started.

The tier worker tells the client of each key as it lands (``Landed`` on the landing channel);
the manager learns of it from the job's progress or result, and only then may it pin the slot
for the client. Until then the slot is being written: nothing evicts or reuses it. This table
holds, per promotion job, who waits for which key in which slot, so that the manager can:

- on landing (``landed``, ``over``): pin the key for the client, as a pinned lookup would have
  (``ManagerState.settle_landings``);
- on a client's ``CompleteLoad`` that comes first (it copied the block already, or gave up
  waiting): mark the wait ``released``: its landing then pins and releases at once, so the
  block is counted read and its unread-promotion pin goes;
- on a request's finish or a client's departure: forget its waits.

Single-threaded: only the manager's poll loop touches it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class LandingWait:
    """One client's wait for one key of a promotion job, landing in ``slot``."""

    identity: bytes
    scoped: str
    key: bytes
    slot: int
    job_id: int
    released: bool = False


class Landings:
    def __init__(self) -> None:
        self._by_job: dict[int, dict[bytes, LandingWait]] = {}
        self._by_client: dict[bytes, dict[bytes, list[LandingWait]]] = {}

    def __len__(self) -> int:
        return sum(len(waits) for waits in self._by_job.values())

    def expect(
        self, job_id: int, identity: bytes, scoped: str, keys: list[bytes], slots: list[int]
    ) -> None:
        """The client ``identity`` waits for ``keys`` of the job, landing in ``slots``."""
        by_key = self._by_job.setdefault(job_id, {})
        mine = self._by_client.setdefault(identity, {})
        for key, slot in zip(keys, slots, strict=True):
            wait = LandingWait(identity, scoped, key, slot, job_id)
            by_key[key] = wait
            mine.setdefault(key, []).append(wait)

    def waiting_slot(self, job_id: int, key: bytes) -> int:
        """The slot a wait of the job for ``key`` expects; -1 when none waits (any more)."""
        wait = self._by_job.get(job_id, {}).get(key)
        return -1 if wait is None else wait.slot

    def landed(self, job_id: int, keys: list[bytes]) -> list[LandingWait]:
        """The waits for ``keys`` of the job, which are over (removed)."""
        by_key = self._by_job.get(job_id)
        if not by_key:
            return []
        out = [wait for key in keys if (wait := by_key.pop(key, None)) is not None]
        if not by_key:
            del self._by_job[job_id]
        for wait in out:
            self._forget(wait)
        return out

    def over(self, job_id: int) -> list[LandingWait]:
        """Every wait left for the job, whose result came (removed)."""
        by_key = self._by_job.pop(job_id, None)
        if not by_key:
            return []
        for wait in by_key.values():
            self._forget(wait)
        return list(by_key.values())

    def has_waits(self, identity: bytes) -> bool:
        """Whether the client has any wait (open or released) not forgotten yet."""
        return identity in self._by_client

    def open_count(self, identity: bytes, scoped: str, key: bytes) -> int:
        """The client's waits for ``key`` for its request ``scoped`` not released yet."""
        waits = self._by_client.get(identity, {}).get(key, ())
        return sum(w.scoped == scoped and not w.released for w in waits)

    def release(self, identity: bytes, scoped: str, keys: list[bytes]) -> None:
        """A ``CompleteLoad`` of the client: for each of ``keys`` (``open_count`` of them
        each at most), one of its open waits for its request ``scoped`` is marked released."""
        mine = self._by_client.get(identity, {})
        for key in keys:
            wait = next(
                (w for w in mine.get(key, ()) if w.scoped == scoped and not w.released), None
            )
            if wait is not None:
                wait.released = True

    def drop_request(self, identity: bytes, scoped: str) -> None:
        """The request finished: its waits are forgotten (what lands is not pinned for it)."""
        mine = self._by_client.get(identity)
        if not mine:
            return
        for waits in list(mine.values()):
            for wait in [w for w in waits if w.scoped == scoped]:
                self._drop(wait)

    def drop_client(self, identity: bytes) -> None:
        """The client left: every wait of it is forgotten."""
        for waits in list(self._by_client.get(identity, {}).values()):
            for wait in list(waits):
                self._drop(wait)

    def _drop(self, wait: LandingWait) -> None:
        by_key = self._by_job.get(wait.job_id)
        if by_key is not None and by_key.get(wait.key) is wait:
            del by_key[wait.key]
            if not by_key:
                del self._by_job[wait.job_id]
        self._forget(wait)

    def _forget(self, wait: LandingWait) -> None:
        mine = self._by_client.get(wait.identity)
        if mine is None:
            return
        waits = mine.get(wait.key)
        if waits is not None:
            waits[:] = [w for w in waits if w is not wait]
            if not waits:
                del mine[wait.key]
        if not mine:
            del self._by_client[wait.identity]
