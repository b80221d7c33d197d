"""Sampling options, logprobs and request validation through the real engine on a tiny model."""
import pytest
import torch

from tests.engine.conftest import assert_no_block_leaks, generate_all, make_engine
from unified.engine.sampler import _filter
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
