"""Per-client state held by the manager: identity, lease, owned requests, pins, finished jobs,
its tenants and its place in the tiers' events.

Request ids are namespaced per client (``<client_id>/<req_id>``) so two engines never share a
request. A client may only release pins it took itself.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvoffload.server.events import EventReader
from kvoffload.wire.protocol import DeviceJobFinished


@dataclass(slots=True)
class PendingPoll:
    rid: int
    deadline: float


@dataclass(slots=True)
class ClientSession:
    identity: bytes
    client_id: str
    name: str
    last_seen: float
    requests: set[str] = field(default_factory=set)
    pinned: dict[bytes, int] = field(default_factory=dict)
    """Pins this client holds, per key (a key looked up pinned twice holds two)."""
    open_stores: dict[str, list[list[bytes]]] = field(default_factory=dict)
    events: deque[DeviceJobFinished] = field(default_factory=deque)
    pending_poll: PendingPoll | None = None
    handles: set[str] = field(default_factory=set)
    device_jobs: set[int] = field(default_factory=set)
    tenants: set[str] = field(default_factory=set)
    """The tenants this client named in its requests: it takes their blocks' events."""
    event_reader: EventReader = field(default_factory=EventReader)
    landing_endpoint: str = ""
    """Where this client takes ``Landed`` notices ("" for none)."""
    landing_lost: dict[str, set[bytes]] = field(default_factory=dict)
    """Per request, keys this client waited for whose promotion did not land them: its
    release of one is accepted without effect (a ``Landed`` notice may have raced the
    failure). Forgotten when the request finishes."""

    def scoped(self, req_id: str) -> str:
        return f"{self.client_id}/{req_id}"

    def add_pins(self, keys: list[bytes]) -> None:
        pinned = self.pinned
        for key in keys:
            pinned[key] = pinned.get(key, 0) + 1

    def owns_pins(self, keys: list[bytes]) -> bool:
        pinned = self.pinned
        if len(set(keys)) == len(keys):
            return all(key in pinned for key in keys)
        return all(pinned.get(k, 0) >= n for k, n in Counter(keys).items())

    def drop_pins(self, keys: list[bytes]) -> None:
        """Release one pin per key (of ``owns_pins`` keys)."""
        pinned = self.pinned
        for key in keys:
            left = pinned.get(key, 0) - 1
            if left > 0:
                pinned[key] = left
            else:
                pinned.pop(key, None)

    def all_pins(self) -> list[bytes]:
        """Every pin held, a key once per pin."""
        return [key for key, count in self.pinned.items() for _ in range(count)]

    def add_open_store(self, scoped_req: str, keys: list[bytes]) -> None:
        self.open_stores.setdefault(scoped_req, []).append(list(keys))

    def close_open_store(self, scoped_req: str, keys: list[bytes]) -> bool:
        """Forget a prepared store matching these keys; False if this client has none."""
        stores = self.open_stores.get(scoped_req, [])
        wanted = set(keys)
        for i, prepared in enumerate(stores):
            if set(prepared) == wanted:
                del stores[i]
                if not stores:
                    del self.open_stores[scoped_req]
                return True
        return False
