"""The wire: what crosses a channel and what its reply carries.

- ``protocol``: every message of the client and job channels (msgspec Structs on msgpack, one
  tagged union per channel, a protocol version, a size limit), their encoding and decoding;
- ``vocab``: the closed vocabularies (lookup results, miss reasons, job kinds, error codes);
- ``status``: the typed status of the manager and its workers;
- ``tenant_ids``: tenant names and the ids the service knows them by (the standard library
  only).

A leaf package: it imports nothing of kvoffload outside itself, so every layer may import it
and the tiering library imports ``vocab``, ``status`` and ``tenant_ids`` without the protocol.
"""
