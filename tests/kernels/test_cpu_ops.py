"""Building and loading the C++ CPU kernels (unified/kernels/cpu_ops.py)."""
import os
import time

import pytest

from unified.kernels import cpu_ops


@pytest.fixture
def fresh_availability():
    cpu_ops.available.cache_clear()
    yield
    cpu_ops.available.cache_clear()


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one(fresh_availability):
    if os.environ.get("UNIFIED_CPU_KERNELS") == "0":
        pytest.skip("UNIFIED_CPU_KERNELS=0")
    assert cpu_ops.available()
    lock = cpu_ops.build_directory() / "lock"
    lock.touch()
    old = time.time() - cpu_ops.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    cpu_ops.available.cache_clear()
    assert cpu_ops.available()  # would wait on the lock forever
    assert not lock.exists()


def test_the_kernels_can_be_switched_off(fresh_availability, monkeypatch):
    monkeypatch.setenv("UNIFIED_CPU_KERNELS", "0")
    assert not cpu_ops.available()
