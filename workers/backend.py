"""The interface between the common worker loop (``workers.framework``) and one tier's medium.

A backend moves bytes between host-pool slots and its medium; the framework owns the socket,
the job threads, validation, fault settings and the one-result-per-job rule. Threading:
``run_job`` runs on the framework's job threads (several at once); every other method runs on
the worker's main thread.

Resource contract (a result is never early, docs/design/tiering.md): ``run_job`` returns a
``BackendOutcome`` whose ``release`` drops everything that could still touch the pool (or the
engine's KV cache) for that job. The framework calls ``release`` on the main thread and publishes
the job's ``JobDone`` only after it returned; if it raises, the job stays tracked and ``release`` is
called again later, so it must be safe to call again after a failure. ``cleanup`` is secondary
best-effort work run once after a successful release; its failures are only logged and never hold
back the result.

Per-worker settings (job threads, CPU affinity) come from the backend, which reads its own
config section; so does the use of slot headers (``use_slot_headers``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload.memory.pool import HostPool
from kvoffload.wire.protocol import Job, JobKind, KVHandle
from kvoffload.wire.status import MediumStats
from workers.faults import FaultInjector

if TYPE_CHECKING:
    from kvoffload.config import Config
    from workers.slotheaders import SlotHeaders

SLOT_KINDS = frozenset(JobKind) - {JobKind.PROBE, JobKind.DELETE}
"""Kinds whose ``Job.slots`` are co-indexed with ``Job.keys``."""
DEVICE_KINDS = frozenset({JobKind.DEVICE_STORE, JobKind.DEVICE_LOAD})
"""Kinds whose ``Job.device_blocks`` are co-indexed with ``Job.keys`` and need ``handle_id``."""
URGENT_KINDS = frozenset({JobKind.DEVICE_LOAD, JobKind.PROMOTION, JobKind.PROBE, JobKind.VERIFY})
"""Kinds on the engine's critical path: run before stores and cascades when both are queued."""
INDEX_BATCH_KEYS = 4096
"""The most keys one ``IndexUpdate`` carries (a start-up index goes in batches of this size)."""


@dataclass
class BackendOutcome:
    """What one job did.

    ``ok_keys``: the keys that succeeded, in job order (all of them means success).
    ``absent_keys``: failed keys the medium confirmed it does not hold (probe: not found;
    promote: not stored, or corrupt and removed); other failed keys failed transiently.
    ``full_keys``: failed cascade keys the medium had no room for.
    ``removed``: a ``delete`` job: the blocks the medium removed (a tenant purge's included).
    ``nbytes``: bytes moved. ``error``: a short summary of the failures (details are logged by
    the backend). ``release``: None when nothing is held; else must succeed before the result is
    published (retried while it raises). ``cleanup``: None or best-effort work after release.
    """

    ok_keys: list[bytes]
    nbytes: int = 0
    error: str = ""
    absent_keys: list[bytes] = field(default_factory=list)
    full_keys: list[bytes] = field(default_factory=list)
    removed: int = 0
    release: Callable[[], None] | None = None
    cleanup: Callable[[], None] | None = None


class AttachRefused(ValueError):
    """An ``AttachKV`` handle that this worker cannot use (wrong geometry, unreachable memory)."""


@runtime_checkable
class Backend(Protocol):
    """One tier's medium, driven by ``workers.framework.run_worker``.

    ``name`` is the worker's identity on the job channel ("cpu", "disk", "object"); ``medium``
    is reported in the hello; ``capabilities`` lists the job kinds it runs (jobs of other kinds
    are refused by the framework) plus optional feature tags. ``degraded`` is reported in every
    heartbeat.
    """

    name: str
    medium: str

    @property
    def capabilities(self) -> Sequence[str]: ...

    @property
    def degraded(self) -> bool: ...

    def job_threads(self, cfg: Config) -> int:
        """How many jobs the framework runs at once for this backend (from its config section)."""

    def cpu_affinity(self, cfg: Config) -> tuple[int, ...]:
        """Cores the worker process is pinned to (empty: not pinned), from its config section."""

    def use_slot_headers(self, headers: SlotHeaders) -> None:
        """Called before ``start`` when slot headers are on. A backend that writes pool slots
        stamps each slot it completely wrote before reporting its key as succeeded; one that
        writes none ignores it."""

    def start(self, pool: HostPool, faults: FaultInjector) -> None:
        """Open the medium; called once before the hello. ``faults`` stays the same object for
        the worker's life (``Control(faults)`` updates it in place). Raising aborts the worker."""

    def initial_index(self) -> Iterable[list[bytes]]:
        """Batches of the keys the medium holds now (any batch size; the framework
        re-batches). Empty for a backend without an index. Called after the first ack, and
        again on the main thread when a restarted manager asks for a new hello."""

    def run_job(self, job: Job) -> BackendOutcome:
        """Run one validated job (blocking, on a job thread, or on the main thread when
        ``runs_inline``). Per-key failures are reported in the outcome, never raised; an
        exception fails the whole job and is logged."""

    def runs_inline(self, job: Job) -> bool:
        """Whether ``job`` (validated, urgent) is short enough to run on the worker's main
        thread the moment it arrives, ahead of the queue: one block from a local medium. The
        framework runs it there only when it arrived alone and no other urgent job is in
        flight (``workers.jobs``). It saves the hand-off to a job thread (a wake-up of another
        thread, 100-150 µs of a cold one-block load on a 2-vCPU machine) and holds the main
        loop for as long as it runs."""

    def touch(self, keys: list[bytes]) -> None:
        """Mark ``keys`` recently used (eviction order); unknown keys are ignored."""

    def take_index_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(added, removed) keys since the previous call, e.g. evictions; both empty when none."""

    def attach_kv(self, handle: KVHandle) -> None:
        """Make an engine's KV cache reachable (cpu worker); raise AttachRefused if unusable.
        Other backends ignore it."""

    def detach_kv(self, handle_id: str) -> None:
        """Forget a KV cache; jobs still using it keep it mapped until their release."""

    def stats(self) -> MediumStats:
        """This backend's counters for the heartbeat (a snapshot the caller may keep)."""

    def close(self) -> None:
        """Release the medium; called once after the last job was released."""


class NoIndexBackend:
    """Defaults for a backend whose medium keeps no key index and reaches no engine KV cache:
    no keys at start-up, touches ignored, no index changes, KV handles ignored, every job on a
    job thread."""

    def initial_index(self) -> Iterable[list[bytes]]:
        return ()

    def touch(self, keys: list[bytes]) -> None:
        return None

    def take_index_changes(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def attach_kv(self, handle: KVHandle) -> None:
        return None

    def detach_kv(self, handle_id: str) -> None:
        return None

    def runs_inline(self, job: Job) -> bool:
        return False
