"""Process-level fixtures live in tests/service_process.py (registered in tests/conftest.py)."""

from tests.service_process import Service, shm_segments, start_service  # noqa: F401
