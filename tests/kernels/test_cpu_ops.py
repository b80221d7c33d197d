"""Building and loading the C++ CPU kernels (unified/kernels/cpu_ops.py)."""
import os
import resource
import time

import pytest
import torch

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


def test_the_caching_host_allocator_hands_large_blocks_out_again():
    """Blocks over glibc's 32 MiB heap limit come back without being unmapped and faulted in again; small
    tensors and the values written keep working as before; empty_host_cache frees what is cached."""
    if os.environ.get("UNIFIED_CPU_KERNELS") == "0":
        pytest.skip("UNIFIED_CPU_KERNELS=0")
    assert cpu_ops.cache_host_allocations()
    cpu_ops.empty_host_cache()
    first = torch.full((64, 151_936), 1.5)  # a [batch, vocabulary] logits tensor, 39 MB
    address = first.data_ptr()
    del first
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = torch.empty(64, 151_000).fill_(2.0)  # a little smaller: the same size class
    assert again.data_ptr() == address
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1000  # 9,500 pages if mapped afresh
    small = torch.arange(10.0)
    assert again.sum().item() == 2.0 * again.numel() and small.sum().item() == 45.0
    del again
    assert torch.ops.unified_cpu.host_cache_bytes() >= 64 * 151_000 * 4
    assert cpu_ops.empty_host_cache() >= 64 * 151_000 * 4
    assert torch.ops.unified_cpu.host_cache_bytes() == 0
