"""``Landed`` notices from a tier worker's job threads to the clients that wait for them.

A promotion with a ``LandingTarget`` tells its client of each key the moment its slot is
complete, straight from the job thread that landed it, so the client does not wait for the
manager to hear of it and answer (docs/design/cold-loads.md). The notices go through the
client's landing pipe (``kvoffload.wire.landing_pipe``), whose writing ends the job threads
share. A write never blocks: a notice the pipe cannot take (a client gone, or far behind) is
dropped and counted; such a client stops waiting at its deadline and asks the manager, which
learns of every key from the job's progress and result in any case.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.logs import get_logger
from kvoffload.wire.landing_pipe import LandingWriters, landing_frames
from kvoffload.wire.protocol import Landed, LandingTarget

log = get_logger()


class LandingNotifier:
    def __init__(self) -> None:
        self._writers = LandingWriters()
        self.sent = 0
        self.dropped = 0

    def landed(
        self,
        target: LandingTarget,
        keys: Sequence[bytes],
        slots: Sequence[int],
        checksums: Sequence[list[int]],
        final: bool = False,
    ) -> None:
        """Tell ``target`` that ``keys`` landed in ``slots`` with these digests; ``final``:
        they were the job's last, none failed."""
        self._send(
            target,
            Landed(target.ticket, list(keys), list(slots), list(checksums), final=final),
        )

    def over(self, target: LandingTarget, failed: Sequence[bytes]) -> None:
        """Tell ``target`` that its job is over and which of its keys failed."""
        self._send(target, Landed(target.ticket, failed=list(failed), final=True))

    def _send(self, target: LandingTarget, notice: Landed) -> None:
        try:
            frames = landing_frames(notice)
        except ValueError as exc:
            self.dropped += 1
            log.error("landing_notice_too_large", ticket=target.ticket, error=str(exc))
            return
        reason = self._writers.write(target.endpoint, frames)
        if reason:
            self.dropped += 1
            log.warning(
                "landing_notice_dropped",
                endpoint=target.endpoint,
                ticket=target.ticket,
                reason=reason,
            )
            return
        self.sent += 1

    def close(self) -> None:
        """Close the clients' pipes (the job threads have stopped)."""
        self._writers.close()
