"""The engine's connection to the kvoffload service, built so the engine never shares its fate.

Every call is bounded by ``call_timeout_s``. A call that times out, or finds the manager gone
or restarted, marks the link down: the client is abandoned (its session's pins are released
when that manager answers again), ``generation`` moves on, and a background thread reconnects
with capped backoff. While the link is down ``call`` raises ``ServiceDown`` at once, without
touching the network, so a dead, hung or restarting service costs the engine one timeout and
then nothing. Errors the service answers on purpose (``no_space``, ``unknown_request``...)
are ``KVOffloadError`` and do not take the link down.

Not thread-safe: one thread (the scheduler's) calls it; the reconnect thread only hands over a
freshly connected client under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import zmq

from kvoffload.client import KVOffloadClient, KVOffloadError
from kvoffload.integrations.vllm import integration_logger
from kvoffload.wire.protocol import Connected, ErrorCode

log = integration_logger(__name__)

T = TypeVar("T")

# Error codes that mean "this session is gone", not "this call was wrong".
_SESSION_LOST = frozenset({ErrorCode.NOT_CONNECTED, ErrorCode.UNAVAILABLE, ErrorCode.DRAINING})


class ServiceDown(Exception):
    """The service cannot be reached now; the caller treats it as a miss or a dropped store."""


class ServiceLink:
    def __init__(
        self,
        resolve_endpoint: Callable[[], str],
        *,
        name: str,
        call_timeout_s: float,
        connect_timeout_s: float,
        max_backoff_s: float,
        on_connect: Callable[[Connected], None] | None = None,
        landing: bool = False,
    ) -> None:
        """``resolve_endpoint`` is asked again before every connection attempt (a restarted
        service may listen elsewhere; LookupError: none found). ``on_connect`` runs in the
        calling thread for each new session before it is used (it may raise to refuse the
        service, e.g. on a geometry mismatch). ``landing``: its clients take ``Landed``
        notices (``KVOffloadClient``'s ``landing``)."""
        self._resolve_endpoint = resolve_endpoint
        self._landing = landing
        self.endpoint = ""
        self.name = name
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self._on_connect = on_connect
        self.generation = 0
        self.info: Connected | None = None
        self.outages = 0
        self._client: KVOffloadClient | None = None
        self._lock = threading.Lock()
        self._handover: KVOffloadClient | None = None
        self._reconnector: threading.Thread | None = None
        self._closed = threading.Event()

    # ---- state ----------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._client is not None

    def ready(self) -> bool:
        """Whether a call can be tried now (takes over a client the reconnect thread made)."""
        if self._client is None:
            self._take_handover()
        return self._client is not None

    def connect_now(self) -> bool:
        """One bounded connection attempt in the calling thread (start-up); on failure the
        background thread keeps trying. True if connected."""
        try:
            self._adopt(self._new_client())
        except (TimeoutError, LookupError, zmq.ZMQError, KVOffloadError) as exc:
            log.warning("kvoffload_unreachable endpoint=%s error=%s", self.endpoint, exc)
            self._start_reconnect()
            return False
        return True

    def _new_client(self) -> KVOffloadClient:
        self.endpoint = self._resolve_endpoint()
        return KVOffloadClient(
            self.endpoint,
            timeout_s=self.connect_timeout_s,
            name=self.name,
            landing=self._landing,
        )

    def _adopt(self, client: KVOffloadClient) -> None:
        if self._on_connect is not None:
            try:
                self._on_connect(client.info)
            except BaseException:
                client.abandon(linger_ms=0)
                raise
        client.timeout_s = self.call_timeout_s
        self._client = client
        self.info = client.info
        self.generation += 1
        log.info(
            "kvoffload_connected endpoint=%s client_id=%s generation=%d",
            self.endpoint,
            client.info.client_id,
            self.generation,
        )

    def _take_handover(self) -> None:
        with self._lock:
            client, self._handover = self._handover, None
        if client is None:
            return
        try:
            self._adopt(client)
        except Exception as exc:  # noqa: BLE001 - nothing may raise into vLLM
            log.error("kvoffload_service_refused endpoint=%s error=%s", self.endpoint, exc)
            self._start_reconnect()

    # ---- calls ----------------------------------------------------------------------------

    def call(self, fn: Callable[[KVOffloadClient], T]) -> T:
        """Run one client call. ServiceDown if the link is (or just went) down;
        KVOffloadError for a typed error the service answered. Errors the service answered
        to calls sent without waiting (``wait=False``), read meanwhile, are logged."""
        if self._client is None:
            self._take_handover()
            if self._client is None:
                raise ServiceDown(f"kvoffload at {self.endpoint} is unreachable")
        client = self._client
        try:
            return fn(client)
        except KVOffloadError as exc:
            if exc.code in _SESSION_LOST:
                self._lost(f"{exc.code}: {exc.message}")
                raise ServiceDown(str(exc)) from None
            raise
        except (TimeoutError, zmq.ZMQError) as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            raise ServiceDown(str(exc)) from None
        except Exception as exc:
            # A reply this client cannot use (another protocol version, a bug): start over
            # with a new session rather than let it reach the engine.
            log.exception("kvoffload_call_failed endpoint=%s", self.endpoint)
            self._lost(f"{type(exc).__name__}: {exc}")
            raise ServiceDown(str(exc)) from None
        finally:
            while client.deferred_errors:
                deferred = client.deferred_errors.popleft()
                log.warning(
                    "kvoffload_unawaited_call_failed endpoint=%s code=%s error=%s",
                    self.endpoint,
                    deferred.code,
                    deferred.message,
                )

    def _lost(self, why: str) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.abandon()
        self.outages += 1
        log.warning(
            "kvoffload_link_down endpoint=%s generation=%d error=%s",
            self.endpoint,
            self.generation,
            why,
        )
        self._start_reconnect()

    # ---- reconnecting ---------------------------------------------------------------------

    def _start_reconnect(self) -> None:
        if self._closed.is_set():
            return
        if self._reconnector is not None and self._reconnector.is_alive():
            return
        self._reconnector = threading.Thread(
            target=self._reconnect_loop, name="kvoffload-reconnect", daemon=True
        )
        self._reconnector.start()

    def _reconnect_loop(self) -> None:
        delay = min(0.05, self.max_backoff_s)
        while not self._closed.wait(delay):
            try:
                client = self._new_client()
            except (TimeoutError, LookupError, zmq.ZMQError, KVOffloadError):
                delay = min(delay * 2, self.max_backoff_s)
                continue
            with self._lock:
                stale, self._handover = self._handover, client
            if stale is not None:
                stale.abandon(linger_ms=0)
            return

    def close(self) -> None:
        """Stop reconnecting and leave the service (best effort, bounded)."""
        self._closed.set()
        if self._reconnector is not None:
            self._reconnector.join(timeout=self.connect_timeout_s + 1.0)
        with self._lock:
            handover, self._handover = self._handover, None
        for client in (self._client, handover):
            if client is not None:
                client.abandon()
        self._client = None
