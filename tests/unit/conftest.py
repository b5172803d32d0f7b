"""Fixtures of gpufeed's unit tests only (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _loader_cpus_read_afresh():
    """sysinfo.process_loader_cpus reads the CPUs once per process: a test that patches the
    budget gets its own reading, and leaves none behind for the next test."""
    from gpufeed.system import sysinfo

    sysinfo._process_loader_cpus.cache_clear()
    yield
    sysinfo._process_loader_cpus.cache_clear()
