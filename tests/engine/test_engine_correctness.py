"""The engine against the plain forward pass, by teacher forcing: same tokens in, same logits out."""
import pytest
import torch

from tests.engine.conftest import assert_no_block_leaks, make_engine, reference_logits, run_teacher_forced

FAMILIES = ["llama", "mistral", "qwen3_moe", "deepseek_v3"]  # GQA, sliding window, MoE, MLA


def _workload(seed: int, lengths=(5, 17, 33, 64), new_tokens=6, vocab=160):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    continuations = [torch.randint(0, vocab, (new_tokens,), generator=g).tolist() for _ in lengths]
    return prompts, continuations


def _check(engine, model, prompts, continuations):
    for got, prompt, cont in zip(run_teacher_forced(engine, prompts, continuations), prompts, continuations):
        torch.testing.assert_close(got, reference_logits(model, prompt, cont), rtol=0, atol=1e-4)
    assert_no_block_leaks(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_mixed_lengths_match_plain_forward(family, chunked, tiny_models):
    loaded = tiny_models(family)
    engine = make_engine(loaded, chunked_prefill=chunked, max_num_batched_tokens=24 if chunked else 128,
                         prefix_caching=False)
    _check(engine, loaded.model, *_workload(0))


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_preemption_under_a_tiny_cache(family, tiny_models):
    loaded = tiny_models(family)
    engine = make_engine(loaded, num_blocks=26, max_num_batched_tokens=64, prefix_caching=False)
    _check(engine, loaded.model, *_workload(1, lengths=(30, 31, 29, 28), new_tokens=10))
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["mistral", "deepseek_v3"])
def test_prefix_cache_hits_give_the_same_logits(family, tiny_models):
    loaded = tiny_models(family)
    engine = make_engine(loaded, max_num_batched_tokens=64)
    shared = torch.randint(0, 160, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts, continuations = _workload(4, lengths=(3, 9, 14))
    prompts = [shared + p for p in prompts]
    _check(engine, loaded.model, prompts[:1], continuations[:1])
    _check(engine, loaded.model, prompts[1:], continuations[1:])
    assert engine.blocks.hit_tokens >= 2 * 40


def _count_computed_tokens(engine) -> list[int]:
    """A list that collects the tokens each scheduled sequence computes, step by step."""
    computed, schedule = [], engine.scheduler.schedule

    def counting_schedule():
        batch = schedule()
        computed.extend(item.num_new_tokens for item in batch)
        return batch

    engine.scheduler.schedule = counting_schedule
    return computed


@pytest.mark.parametrize("chunk", [64, 16], ids=["whole-prompt", "chunked"])
def test_requests_arriving_together_compute_a_shared_prefix_once(chunk, tiny_models):
    """Requests behind one system prompt, all queued at once: the first computes it, the others hold back
    until its blocks are cached, then compute their own tails only; the logits stay the plain forward's."""
    loaded = tiny_models("llama")
    engine = make_engine(loaded, max_num_batched_tokens=chunk)
    shared = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts, continuations = _workload(6, lengths=(3, 6, 2, 7))
    prompts = [shared + p for p in prompts]
    computed = _count_computed_tokens(engine)
    _check(engine, loaded.model, prompts, continuations)
    prompt_tokens = sum(len(p) for p in prompts) + sum(len(c) - 1 for c in continuations)
    assert engine.blocks.hit_tokens == 3 * 40  # the shared prompt's 10 blocks of 4, for every request but the first
    assert sum(computed) == prompt_tokens - 3 * 40


def test_n_samples_of_a_prompt_share_its_computation(tiny_models):
    from unified.engine.sampling_params import SamplingParams

    engine = make_engine(tiny_models("llama"), max_num_batched_tokens=256)
    computed = _count_computed_tokens(engine)
    engine.add_request(list(range(1, 31)), SamplingParams(n=4, max_tokens=3, ignore_eos=True, seed=0))
    (output,) = [o for _ in range(8) for o in engine.step()]
    assert [len(c.token_ids) for c in output.outputs] == [3, 3, 3, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # each sample its own draw
    # the first computes the 30-token prompt; the three others its last, partial block (2 tokens) only
    assert sum(computed) == 30 + 3 * 2 + 4 * 2
    assert_no_block_leaks(engine)


def test_aborted_and_finished_requests_free_every_block(tiny_models):
    from unified.engine.sampling_params import SamplingParams

    engine = make_engine(tiny_models("llama"), max_num_batched_tokens=16)
    keep = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    dropped = engine.add_request(list(range(2, 40)), SamplingParams(max_tokens=50, ignore_eos=True, n=2))
    engine.step()
    engine.step()
    engine.abort(dropped)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [o.request_id for o in finished] == [keep]
    assert_no_block_leaks(engine)
