"""Per-client state held by the manager: identity, lease, owned requests, pins, event queue.

Request ids are namespaced per client (``<client_id>/<req_id>``) so two engines never share a
request. A client may only release pins it took itself.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvoffload.protocol import DeviceJobFinished


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
    pinned: Counter[bytes] = field(default_factory=Counter)
    open_stores: dict[str, list[list[bytes]]] = field(default_factory=dict)
    events: deque[DeviceJobFinished] = field(default_factory=deque)
    pending_poll: PendingPoll | None = None
    handles: set[str] = field(default_factory=set)
    device_jobs: set[int] = field(default_factory=set)

    def scoped(self, req_id: str) -> str:
        return f"{self.client_id}/{req_id}"

    def add_pins(self, keys: list[bytes]) -> None:
        self.pinned.update(keys)

    def owns_pins(self, keys: list[bytes]) -> bool:
        need = Counter(keys)
        return all(self.pinned[k] >= n for k, n in need.items())

    def drop_pins(self, keys: list[bytes]) -> None:
        self.pinned.subtract(keys)
        for key in set(keys):
            if self.pinned[key] <= 0:
                del self.pinned[key]

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
