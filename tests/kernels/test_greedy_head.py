"""The bfloat16 screen of greedy choices (unified/kernels/greedy_head.py) gives float32's argmax: on heads of
several shapes and chunkings, with ties broken to the first entry, and it hands back (None) what it cannot
decide; the model uses it, and only while the weight is the one screened."""
import pytest
import torch

from unified.kernels import greedy_head, pack_screen, screened_argmax

pytestmark = pytest.mark.skipif(not greedy_head.available(), reason="no native bfloat16 matmuls on this CPU")


def _argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).argmax(-1)


@pytest.mark.parametrize("vocab,hidden,rows,chunk", [(49152, 576, 64, None), (5000, 96, 9, 1024), (300, 32, 1, 64),
                                                      (1001, 64, 17, 100)])
def test_the_screen_gives_the_float32_argmax(vocab, hidden, rows, chunk):
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, hidden, generator=g) * torch.rand(vocab, 1, generator=g)  # rows of unequal norms
    x = torch.randn(rows, hidden, generator=g) * 3
    screen = pack_screen(weight, chunk)
    with torch.no_grad():
        assert screen.serves(x, weight)
        assert torch.equal(screened_argmax(x, weight, screen), _argmax(x, weight))
    assert screen.nbytes == greedy_head.bytes_for(vocab, hidden)


def test_near_ties_go_to_the_larger_logit_and_exact_ties_to_the_first_entry():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 64, generator=g)
    x = torch.randn(3, 64, generator=g)
    winner = _argmax(x, weight)
    for row, token in enumerate(winner.tolist()):  # a rival closer than bfloat16 can tell, and an exact copy
        weight[100 + row] = weight[token] * (1 - 2 ** -12)
        weight[4000 + row] = weight[token]
    screen = pack_screen(weight, 1024)
    with torch.no_grad():
        assert torch.equal(screened_argmax(x, weight, screen), _argmax(x, weight))


def test_what_the_screen_cannot_tell_is_handed_back():
    weight = torch.randn(greedy_head.MAX_CANDIDATES * 4, 64)
    screen = pack_screen(weight, 512)
    with torch.no_grad():
        assert screened_argmax(torch.full((2, 64), float("nan")), weight, screen) is None
        assert screened_argmax(torch.zeros(2, 64), weight, screen) is None  # every entry ties: all are candidates
        assert torch.equal(screened_argmax(torch.zeros(2, 64), weight[:500], pack_screen(weight[:500], 128)),
                           torch.zeros(2, dtype=torch.long))  # fewer ties than that: the first entry


def test_a_changed_weight_or_the_reference_backend_is_not_served():
    from unified.kernels import set_backend

    weight = torch.randn(512, 32)
    screen = pack_screen(weight, 128)
    x = torch.randn(2, 32)
    with torch.no_grad():
        set_backend("reference")
        try:
            assert not screen.serves(x, weight)
        finally:
            set_backend("auto")
        weight.add_(1)
        assert not screen.serves(x, weight)
    assert not screen.serves(x, weight.detach().clone())  # grad mode: the training path


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied head, and a head of its own
def test_the_model_s_greedy_tokens_take_the_screen(tiny_checkpoint, runtime, family, monkeypatch):
    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from unified.model.transformer import CausalLM

    config = model_config_from_hf(read_hf_config(tiny_checkpoint(family)))
    model = CausalLM(config, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.pack_weights()
    assert model.head_screen is not None
    used = []
    monkeypatch.setattr("unified.kernels.screened_argmax",
                        lambda *a: used.append(1) or greedy_head.screened_argmax(*a))
    hidden = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        assert torch.equal(model.greedy_tokens(hidden), model.logits(hidden).argmax(-1))
    assert used
