"""Loading from an HF folder does not keep the checkpoint's pages mapped beside the weights they were copied
into (unified/checkpoint/loader.py unmaps the files as it goes): a rank's resident memory rises by the weights,
not by twice them."""
import sys

import pytest

from unified.runtime.memory_report import resident_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs resets VmHWM")
def test_loading_smollm2_rises_by_its_weights_not_twice(runtime, smollm2_checkpoint):
    from unified.checkpoint import load_model

    before = resident_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    model = load_model(smollm2_checkpoint).model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rise = resident_bytes("VmHWM") - before
    # the weights, plus at most 64 MiB still mapped and one tensor read ahead (the 113 MB tied embedding)
    assert rise < weights * 1.4, (rise, weights)
