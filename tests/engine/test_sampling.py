"""Sampling options, logprobs and request validation through the real engine on a tiny model."""
import math

import pytest
import torch

from tests.engine.conftest import assert_no_block_leaks, generate_all, make_engine
from unified.engine.sampler import _filter, sample
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.engine.sequence import Sequence

PROMPT = list(range(3, 19))


@pytest.fixture
def engine(tiny_models):
    return make_engine(tiny_models("llama"), max_num_batched_tokens=64)


def test_same_seed_same_output_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    alone = generate_all(engine, [PROMPT], params)[0].outputs[0].token_ids
    crowd = generate_all(engine, [list(range(40, 70)), PROMPT, list(range(5, 9))], params)[1].outputs[0].token_ids
    assert alone == crowd
    other_seed = generate_all(engine, [PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=8, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    assert_no_block_leaks(engine)


def test_n_samples_differ_and_all_finish(engine):
    out = generate_all(engine, [PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)


def test_raw_logprobs_match_a_full_forward(engine, tiny_models):
    model = tiny_models("llama").model
    out = generate_all(engine, [PROMPT], SamplingParams(temperature=0.8, max_tokens=6, seed=3, logprobs=5,
                                                     ignore_eos=True))[0].outputs[0]
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.inference_mode():
        full = model.logits(model(ids, torch.arange(ids.shape[1])))[0].float().log_softmax(-1)
    for k, entry in enumerate(out.logprobs):
        row = full[len(PROMPT) - 1 + k]
        assert entry.token_id == out.token_ids[k]
        assert abs(entry.logprob - row[entry.token_id].item()) <= 1e-4
        top = row.topk(5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist())) <= 1e-4


def test_prompt_logprobs_match_a_full_forward_across_chunks_and_a_cached_prefix(engine, tiny_models):
    """A 150-token prompt prefills in chunks of 64; a second request with the same prompt would find it in
    the prefix cache, but its prompt logprobs need every prompt row computed."""
    model = tiny_models("llama").model
    prompt = [(7 * i) % 150 + 3 for i in range(150)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1, prompt_logprobs=3, ignore_eos=True)
    first, second = (generate_all(engine, [prompt], params)[0] for _ in range(2))
    with torch.inference_mode():
        full = model.logits(model(torch.tensor([prompt]), torch.arange(len(prompt))))[0].float().log_softmax(-1)
    for out in (first, second):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = full[position - 1]
            assert entry.token_id == prompt[position]
            assert abs(entry.logprob - row[prompt[position]].item()) <= 1e-4
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
            assert entry.rank == 1 + int((row > row[prompt[position]]).sum())
    assert generate_all(engine, [prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    assert_no_block_leaks(engine)


def test_processed_logprobs_reflect_temperature(engine):
    raw = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0].outputs[0]
    hot = generate_all(engine, [PROMPT], SamplingParams(temperature=0.5, max_tokens=1, logprobs=0, seed=0,
                                                     logprobs_mode="processed", top_k=1))[0].outputs[0]
    assert hot.token_ids[0] == raw.token_ids[0]  # top_k=1 keeps only the greedy token
    assert hot.logprobs[0].logprob == pytest.approx(0.0, abs=1e-6)
    assert raw.logprobs[0].logprob < 0


def test_stop_token_and_max_tokens(engine):
    greedy = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    stopped = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == greedy.token_ids[:first + 1]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8


def test_penalties_discourage_repeats(engine):
    plain = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    penalised = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                           frequency_penalty=2.0, presence_penalty=2.0))[0]
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(penalised.outputs[0].token_ids) < repeats(plain.outputs[0].token_ids)
    repetition = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                            repetition_penalty=5.0))[0]
    assert not set(repetition.outputs[0].token_ids) & set(PROMPT) or \
        repeats(repetition.outputs[0].token_ids) < repeats(plain.outputs[0].token_ids)


def test_top_p_and_min_p_filters():
    seq = Sequence("r", 0, [1], SamplingParams(temperature=1.0, top_p=0.7), seed=0)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = _filter(logits, seq).isfinite().tolist()
    assert kept == [True, True, False, False]
    seq.params = SamplingParams(temperature=1.0, min_p=0.4)
    assert _filter(logits, seq).isfinite().tolist() == [True, True, False, False]


@pytest.mark.parametrize("prompt, params, message", [
    (list(range(600)), SamplingParams(), "600 tokens but the model.s context is 256"),
    ([], SamplingParams(), "prompt is empty"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    ([1, 99999], SamplingParams(), "token ids must be in"),
])
def test_bad_requests_fail_alone(engine, prompt, params, message):
    ok = engine.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [ok]
    assert_no_block_leaks(engine)


def test_unknown_sampling_option_is_named():
    with pytest.raises(InvalidRequest, match="unknown sampling option.*beam_width"):
        SamplingParams.from_dict({"beam_width": 4})


EXTREMES = [dict(temperature=1e-300), dict(temperature=1e-38), dict(temperature=1e-6), dict(temperature=2.0),
            dict(temperature=1e300),
            dict(top_p=1e-300), dict(repetition_penalty=1e-40), dict(repetition_penalty=10.0), dict(min_p=1.0),
            dict(top_k=1), dict(top_k=10 ** 9), dict(presence_penalty=2.0, frequency_penalty=2.0),
            dict(presence_penalty=-2.0, frequency_penalty=-2.0)]
GREEDY_ALIKE = [dict(temperature=1e-300), dict(temperature=1e-38), dict(temperature=1e-6), dict(top_p=1e-300),
                dict(top_k=1), dict(min_p=1.0)]


def _finite_or_minus_inf(value: float) -> bool:
    return math.isfinite(value) or value == float("-inf")


def test_extreme_options_sample_valid_tokens_beside_normal_requests(engine):
    normal = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    alone = generate_all(engine, [PROMPT], normal)[0].outputs[0].token_ids
    greedy = generate_all(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    extreme = [SamplingParams(max_tokens=8, seed=k, ignore_eos=True, logprobs=3,
                              logprobs_mode="processed" if k % 2 else "raw", **options)
               for k, options in enumerate(EXTREMES)]
    outputs = generate_all(engine, [PROMPT] * (len(extreme) + 1), [normal] + extreme)
    assert outputs[0].outputs[0].token_ids == alone
    for options, out in zip(EXTREMES, outputs[1:]):
        completion = out.outputs[0]
        assert out.error is None and completion.finish_reason == "length", options
        assert len(completion.token_ids) == 8 and all(0 <= t < 160 for t in completion.token_ids), options
        for entry in completion.logprobs:
            assert all(_finite_or_minus_inf(lp) for lp in [entry.logprob] + [v for _, v in entry.top]), options
        if options in GREEDY_ALIKE:
            assert completion.token_ids == greedy.outputs[0].token_ids, options
    assert_no_block_leaks(engine)


def test_non_finite_logits_are_never_drawn():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 1.0, 2.0, nan, 0.0, 0.0],
                           [0.0, inf, -1.0, inf, 0.0, 0.0],
                           [-inf] * 6,
                           [nan] * 6])
    for options in [dict(temperature=1.0), dict(temperature=0.5, top_p=0.5, min_p=0.1, top_k=3),
                    dict(temperature=0.0, repetition_penalty=1.5)]:
        for mode in ("raw", "processed"):
            params = SamplingParams(logprobs=2, logprobs_mode=mode, **options)
            seqs = [Sequence(str(i), 0, [4, 5], params, seed=i) for i in range(len(logits))]
            tokens, entries = sample(logits, seqs)
            assert tokens[0] in (1, 2, 4, 5) and tokens[1] in (1, 3), (options, tokens)
            assert all(isinstance(t, int) and 0 <= t < 6 for t in tokens), (options, tokens)
            for entry in entries:
                values = [entry.logprob] + [v for _, v in entry.top]
                assert all(_finite_or_minus_inf(v) for v in values), (options, mode)


def test_one_copy_to_the_host_chooses_as_the_cpu_path_does():
    """The accelerators' path (everything the host needs in one copy) gives the CPU path's tokens and rows."""
    from unified.engine.sampler import _choose_plain

    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    logits[3, 7] = float("nan")
    for temperatures in ([0.0, 0.7, 1.0, 0.0, 1.3], [0.9] * 5, [0.0] * 5):
        def seqs():
            return [Sequence(str(i), 0, [4, 5], SamplingParams(temperature=t), seed=i)
                    for i, t in enumerate(temperatures)]
        want, want_rows = _choose_plain(logits.clone(), seqs(), one_copy=False)
        got, got_rows = _choose_plain(logits.clone(), seqs(), one_copy=True)
        assert got == want and got[3] is None
        for i in range(5):
            if got[i] is not None:
                torch.testing.assert_close(got_rows[i], want_rows[i])


def test_non_finite_temperature_is_refused():
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=float("inf")).validate()


@pytest.mark.parametrize("stop_ids", [[2 ** 70], [-3], [10 ** 12], [160]])
def test_stop_token_ids_outside_the_vocabulary_are_refused(engine, stop_ids):
    with pytest.raises(InvalidRequest, match=r"stop_token_ids must be token ids in \[0, 160\)"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2, stop_token_ids=stop_ids))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("mixed", [False, True], ids=["all-sampled", "with-greedy-rows"])
def test_draws_follow_the_softmax_across_vocabulary_chunks(mixed):
    """The batched two-level draw (chunk sums, then one chunk's cumulative sum) against the softmax: a
    chi-square test over a vocabulary of three chunks, one of them without mass; no draw lands on -inf."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows, rounds, temperature = 2500, 64, 40, 0.8
    logits = torch.randn(vocab, generator=generator) * 2
    logits[1024:2048] = float("-inf")
    logits[2490:] = float("-inf")
    seqs = [Sequence("r", i, [1], SamplingParams(temperature=temperature, seed=i), seed=i) for i in range(rows)]
    if mixed:
        seqs[0] = Sequence("g", 0, [1], SamplingParams(temperature=0), seed=0)
    counts = torch.zeros(vocab)
    for _ in range(rounds):
        tokens, _ = sample(logits.expand(rows, vocab).clone(), seqs)
        assert not mixed or tokens[0] == int(logits.argmax())
        counts += torch.bincount(torch.tensor(tokens[1:] if mixed else tokens), minlength=vocab)
    expected = torch.softmax(logits / temperature, -1) * counts.sum()
    assert counts[expected == 0].sum() == 0
    common = expected >= 5  # the chi-square approximation needs >= 5 expected per cell; pool the rest
    observed = torch.cat([counts[common], counts[~common].sum().view(1)])
    wanted = torch.cat([expected[common], expected[~common].sum().view(1)])
    chi_square = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(wanted) - 1
    assert chi_square < dof + 4 * math.sqrt(2 * dof), (chi_square, dof)
