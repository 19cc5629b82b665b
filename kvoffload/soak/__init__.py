"""Soak runs and fault injection against a real kvoffload service.

- ``blocks``: block contents derived from keys, so every load is verifiable;
- ``engine``: the synthetic engine process;
- ``clients``: the runner's handles on its engine processes;
- ``injector``: the seeded fault schedule and its player;
- ``invariants``: what must hold during and after a run;
- ``runner``: ``kvoffload soak`` (``run_soak``);
- ``probe``: a small verifying engine for fault and security tests.

The service under test, the local S3 server and the small helpers come from
``kvoffload.testing``.
"""
