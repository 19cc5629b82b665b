"""Harnesses shared by the tests, the soak (``kvoffload.soak``) and the benchmarks
(``kvoffload.bench``).

- ``service``: a real kvoffload service in a temp directory (``ServiceHarness``: an in-process
  supervisor or ``kvoffload serve``), its config sections, log events and leftovers;
- ``s3server``: a local SeaweedFS S3 server (``S3Server``);
- ``vllm_engine``: a vLLM engine in its own process group (``VllmEngineProcess``) and the tiny
  random-weight models it serves (vLLM is imported only in the engine's process);
- ``metrics``: scraping the manager's Prometheus endpoint;
- ``helpers``: test keys, polling until a condition holds, a free TCP port, the checkout root.

Only tests, ``kvoffload.soak`` and ``kvoffload.bench`` import this package. The service, the
workers, the client, the engine integrations and the CLI's startup path never do (the CLI
reaches it only through the soak and the benchmarks, which it imports lazily).
"""
