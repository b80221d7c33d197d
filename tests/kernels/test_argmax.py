"""kernels.argmax_rows (greedy choice) against torch's max(-1).indices."""
import torch

from unified import kernels


def test_matches_torch_on_ties_nans_infinities_and_ragged_widths():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 15, 16, 17, 1000, 151_936):
        logits = torch.randn(7, vocab, generator=g)
        logits[1] = 0.0  # all tied: the first index
        logits[2] = float("-inf")
        logits[3, vocab // 2] = float("inf")
        logits[4, vocab - 1] = float("nan")  # the reference's rule: the NaN's index
        logits[5, (vocab - 1) // 3:] = logits[5].max() + 1  # tied maxima from a third of the row on
        torch.testing.assert_close(kernels.argmax_rows(logits), kernels.argmax_rows_reference(logits), rtol=0,
                                   atol=0)
    assert kernels.argmax_rows(torch.randn(0, 5)).shape == (0,)
