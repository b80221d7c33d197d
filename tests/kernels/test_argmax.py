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


def test_chunk_by_chunk_merging_gives_the_whole_rows_first_maximum():
    """argmax_merge_ over a row's vocabulary chunks, in order, ends where argmax over the whole row does
    (ties across chunks, NaNs, all -inf); the C++ kernel and its reference agree on every chunk's state."""
    g = torch.Generator().manual_seed(1)
    for vocab, chunk in ((1000, 256), (151_936, 16_384), (40, 16)):
        logits = torch.randn(8, vocab, generator=g)
        logits[1] = 0.0
        logits[2] = float("-inf")
        logits[3, vocab - 3] = float("inf")
        logits[4, vocab // 2] = float("nan")
        logits[4, vocab - 1] = float("nan")
        logits[5, 3] = logits[5, vocab - 2] = logits[5].max() + 1  # a tie across chunks: the first wins
        logits[6, chunk - 1] = logits[6, chunk] = logits[6].max() + 1  # a tie at a chunk's edge
        states = []
        for merge in (kernels.argmax_merge_, kernels.argmax_merge_reference):
            best, index = torch.full((8,), float("-inf")), torch.zeros(8, dtype=torch.long)
            for start in range(0, vocab, chunk):
                merge(logits[:, start:start + chunk].contiguous(), start, best, index)
                states.append((best.clone(), index.clone()))
            assert index.tolist() == kernels.argmax_rows_reference(logits).tolist()
        half = len(states) // 2
        for (b1, i1), (b2, i2) in zip(states[:half], states[half:]):
            torch.testing.assert_close(b1, b2, rtol=0, atol=0, equal_nan=True)
            assert i1.tolist() == i2.tolist()


def test_chunk_by_chunk_top_k_keeps_the_first_of_equal_logits():
    """topk_merge_ over a row's vocabulary chunks, in order, keeps what a stable descending sort of the whole row
    puts first (ties within and across chunks, at a chunk's edge, -inf, a NaN, k above a chunk's width); the C++ kernel
    and its reference agree on every chunk's state."""
    g = torch.Generator().manual_seed(2)
    for vocab, chunk, k in ((1000, 256, 9), (151_936, 16_384, 9), (40, 16, 3), (40, 16, 24), (20, 7, 1)):
        logits = torch.randn(6, vocab, generator=g)
        logits[1] = 0.0  # all tied: the first k tokens
        logits[2, 3] = logits[2, vocab - 2] = logits[2].max() + 1  # a tie across chunks
        logits[3, chunk - 1] = logits[3, chunk] = logits[3].max() + 1  # a tie at a chunk's edge
        logits[4, : vocab // 4] = float("-inf")  # fewer than the row's finite logits: -inf never enters
        logits[5] = torch.randint(0, 4, (vocab,), generator=g).float()  # many ties
        logits[0, vocab // 3] = float("nan")  # never kept
        want = torch.where(logits.isnan(), float("-inf"), logits).sort(dim=-1, descending=True, stable=True)
        states = []
        for merge in (kernels.topk_merge_, kernels.topk_merge_reference):
            values, tokens = torch.full((6, k), float("-inf")), torch.zeros(6, k, dtype=torch.long)
            for start in range(0, vocab, chunk):
                merge(logits[:, start:start + chunk].contiguous(), start, values, tokens)
                states.append((values.clone(), tokens.clone()))
            assert torch.equal(values, want.values[:, :k]) and tokens.tolist() == want.indices[:, :k].tolist()
        half = len(states) // 2
        for (v1, t1), (v2, t2) in zip(states[:half], states[half:]):
            assert torch.equal(v1, v2) and t1.tolist() == t2.tolist()
