import resource
import sys

import pytest
import torch

from unified.runtime.host_memory import retain_freed_host_memory


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_activations_are_reused_without_page_faults():
    if not retain_freed_host_memory():
        pytest.skip("the C library is not glibc")
    size = 24 << 20  # a 24 MiB activation, as a prefill step allocates and frees dozens of
    for _ in range(3):  # the first rounds may grow the heap
        torch.ones(size // 4)
    before = _minor_faults()
    for _ in range(10):
        torch.ones(size // 4)
    pages = 10 * size // resource.getpagesize()
    assert _minor_faults() - before < pages // 20  # without the tuning every round faults all of them in
