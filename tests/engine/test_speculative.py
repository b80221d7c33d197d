"""Speculative decoding (n-gram prompt lookup): exact verification, the rejection rule, no leaks."""
from __future__ import annotations

import json
import math
import random
import re
import shutil

import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.engine.conftest import assert_no_block_leaks, generate_all, make_engine, reference_logits
from unified.checkpoint import load_model
from unified.config.schema import EngineConfig, SpeculativeConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.sampling_params import SamplingParams
from unified.engine.sequence import Sequence
from unified.engine.speculative import NgramDrafter, NgramIndex, Speculator, ngram_proposal
from unified.errors import UserError

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def _repetitive_prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (with an edit), so the lookup finds n-grams, of mixed lengths."""
    g = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(count):
        phrase = torch.randint(0, vocab, (5 + i % 4,), generator=g).tolist()
        prompts.append(phrase * (2 + i % 3) + phrase[:2] + [int(torch.randint(0, vocab, (1,), generator=g))])
    return prompts


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    assert ngram_proposal([1, 2, 3, 9, 1, 2, 3, 7, 3], 1, 3, 2) == [7, 3]  # [3] alone: its latest earlier match
    assert ngram_proposal([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 1, 3, 3) == [9, 5, 2]  # [1, 2, 3] beats [2, 3]
    assert ngram_proposal([4, 5, 6, 4, 5], 2, 3, 4) == [6, 4, 5]
    assert ngram_proposal([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_proposal([7, 7], 1, 3, 0) == [] and ngram_proposal([7], 1, 3, 4) == []


def test_the_ngram_index_proposes_what_a_scan_of_the_whole_sequence_finds():
    """The drafter's index, extended as tokens are appended (one or several per step), gives `ngram_proposal`'s
    answer at every length; handed other tokens than it indexed, it starts over."""
    rng = random.Random(0)
    for _ in range(60):
        low = rng.randint(1, 3)
        high, vocab = rng.randint(low, 5), rng.choice([2, 3, 50])
        index, ids = NgramIndex(low, high), []
        for _ in range(rng.randint(1, 60)):
            ids += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 3]))]
            room = rng.randint(0, 5)
            assert index.proposal(ids, room) == ngram_proposal(ids, low, high, room)
    index = NgramIndex(1, 3)
    assert index.proposal([1, 2, 3, 1, 2], 2) == [3, 1]
    assert index.proposal([5, 2, 3, 5, 2], 2) == [3, 5]  # same length, other tokens
    assert index.proposal([4, 4], 3) == [4]  # shorter


@pytest.mark.parametrize("family,kv", [("llama", "auto"), ("qwen3", "auto"), ("deepseek_v3", "auto"), ("llama", "int8")])
def test_greedy_output_is_the_non_speculative_output_with_preemption_and_n(family, kv, tiny_models):
    """Mixed prompt lengths, n = 2, a cache small enough to preempt (int8 KV too): the same tokens, drafts
    accepted, no leak."""
    loaded = tiny_models(family)
    prompts = _repetitive_prompts(loaded.config.vocab_size, 6)
    params = [SamplingParams(temperature=0, max_tokens=24 + 4 * (i % 3), ignore_eos=True, n=1 + i % 2)
              for i in range(len(prompts))]
    plain = generate_all(make_engine(loaded, num_blocks=40, kv_cache_dtype=kv), prompts, params)
    engine = make_engine(loaded, num_blocks=40, kv_cache_dtype=kv, speculative=NGRAM)
    spec = generate_all(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]
    assert engine.scheduler.num_preemptions > 0
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens and stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]
    assert_no_block_leaks(engine)


def test_the_verification_rows_are_the_single_token_decoding_logits(tiny_models, monkeypatch):
    """In fp32 each draft position's logits equal those of decoding that token alone (within 1e-5)."""
    loaded = tiny_models("llama")
    prompt = _repetitive_prompts(loaded.config.vocab_size, 1)[0]
    continuation = generate_all(make_engine(loaded), [prompt],
                                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    seen = []
    verify = Speculator.verify

    def recording(self, seq, draft, rows, greedy_tokens):
        seen.append((list(seq.token_ids), list(draft), rows.clone()))
        return verify(self, seq, draft, rows, greedy_tokens)

    monkeypatch.setattr(Speculator, "verify", recording)
    # the proposal is what greedy decoding gives next, so every draft is kept and every row is checked
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, wanted: [
        continuation[len(seq.token_ids) - len(prompt):][:room] for seq, room in wanted])
    engine = make_engine(loaded, speculative=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)  # logits, not argmax ids
    out = generate_all(engine, [prompt], params)[0].outputs[0]
    assert out.token_ids == continuation and seen and all(len(d) > 1 for _, d, _ in seen[:-1])
    for tokens, draft, rows in seen:
        want = reference_logits(loaded.model, prompt, tokens[len(prompt):] + draft + [0])[-len(draft) - 1:]
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
    plain = generate_all(make_engine(loaded), [prompt], params)[0].outputs[0]  # logprobs are the target's
    assert [e.token_id for e in out.logprobs] == out.token_ids and len(out.logprobs) == 16
    for got, want in zip(out.logprobs, plain.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5) and [t for t, _ in got.top] == [t for t, _ in want.top]
    assert engine.speculator.stats.mean_acceptance_length > 3


def _chi_square_bound(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: dict, expected: dict) -> tuple[float, int]:
    """Statistic and degrees of freedom over the cells expected at least 5 times (the rest pooled)."""
    stat, cells, rest_seen, rest_expected = 0.0, 0, 0, 0.0
    for cell, e in expected.items():
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            cells += 1
        else:
            rest_seen, rest_expected = rest_seen + counts.get(cell, 0), rest_expected + e
    if rest_expected > 0:
        stat += (rest_seen - rest_expected) ** 2 / rest_expected
        cells += 1
    return stat, cells - 1


def test_the_rejection_rule_keeps_the_targets_distribution():
    """Two draft tokens over a 6-token vocabulary, 6,000 draws with fixed seeds: the (first, second) token
    pairs follow p1(a) p2(b | a) (p2 is the second row when the first draft was kept, else unused)."""
    rows = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0],
                         [0.3, 1.2, 0.1, -0.4, 0.5, 0.0],
                         [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    draft = [3, 1]
    speculator = Speculator(NGRAM, 1000, NgramDrafter(NGRAM))
    counts: dict = {}
    draws = 6000
    for seed in range(draws):
        seq = Sequence("r", 0, [0], SamplingParams(temperature=1.0, max_tokens=4), seed=seed)
        tokens, _ = speculator.verify(seq, draft, rows, None)
        # the second token exists only when the first is the kept draft: pool it with the first otherwise
        cell = (tokens[0], tokens[1] if tokens[0] == draft[0] else None)
        counts[cell] = counts.get(cell, 0) + 1
    p1, p2 = rows[0].softmax(-1), rows[1].softmax(-1)
    expected = {(a, None): draws * float(p1[a]) for a in range(6) if a != draft[0]}
    expected.update({(draft[0], b): draws * float(p1[draft[0]] * p2[b]) for b in range(6)})
    stat, df = _chi_square(counts, expected)
    assert stat < _chi_square_bound(df), (stat, df, counts)


def test_a_seeded_request_samples_the_same_tokens_whatever_the_batch_and_with_or_without_drafts(tiny_models):
    """A small token budget trims drafts differently as the batch changes (here its order): each sampled token
    still takes one number from its sequence's generator, so the output is the plain sampler's. (The tiny
    model's logits are flat: a low temperature lets its sampled output repeat itself, which drafts need.)"""
    loaded = tiny_models("llama")
    prompts = _repetitive_prompts(loaded.config.vocab_size, 6)
    params = [SamplingParams(temperature=0.02, max_tokens=16, ignore_eos=True, n=2, seed=100 + i)
              for i in range(len(prompts))]
    engine = make_engine(loaded, max_num_batched_tokens=16, speculative=NGRAM)
    tokens = lambda outputs: [[c.token_ids for c in o.outputs] for o in outputs]  # noqa: E731
    forward = tokens(generate_all(engine, prompts, params))
    backward = tokens(generate_all(engine, prompts[::-1], params[::-1]))[::-1]
    assert engine.speculator.stats.num_accepted_tokens > 0
    plain = tokens(generate_all(make_engine(loaded, max_num_batched_tokens=16), prompts, params))
    assert forward == backward == plain


def test_sampled_output_follows_the_target_model_on_a_small_vocabulary(tmp_path, runtime):
    """A model of 8 tokens, temperature 1, 3,000 samples of 3 tokens, the second one drafted (the first comes
    from the prompt's step; the target's own token always follows a draft): the first two follow the model's
    own p(a) p(b | a)."""
    path = tmp_path / "tiny8"
    build_tiny_hf_model("llama", seed=3, vocab_size=8).save_pretrained(path)
    loaded = load_model(path)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2]  # every token has an earlier successor: always a draft
    engine = make_engine(loaded, num_blocks=512, max_num_seqs=64, speculative=NGRAM)
    draws = 3000
    out = generate_all(engine, [prompt], SamplingParams(n=draws, temperature=1.0, max_tokens=3, ignore_eos=True,
                                                        seed=11))[0]
    assert engine.speculator.stats.num_drafts >= draws and engine.speculator.stats.num_accepted_tokens > 0
    counts: dict = {}
    for completion in out.outputs:
        cell = tuple(completion.token_ids[:2])
        counts[cell] = counts.get(cell, 0) + 1
    p1 = reference_logits(loaded.model, prompt, [0])[0].softmax(-1)
    expected = {}
    for a in range(8):
        p2 = reference_logits(loaded.model, prompt + [a], [0])[0].softmax(-1)
        expected.update({(a, b): draws * float(p1[a] * p2[b]) for b in range(8)})
    stat, df = _chi_square(counts, expected)
    assert stat < _chi_square_bound(df), (stat, df)
    assert_no_block_leaks(engine)


def test_speculation_settings_that_cannot_run_are_refused_clearly(tiny_models):
    loaded = tiny_models("llama")
    for spec, words in ((SpeculativeConfig(method="mtp"), "no multi-token prediction layer"),
                        (SpeculativeConfig(method="draft"), "needs engine.speculative.draft_model"),
                        (SpeculativeConfig(method="medusa"), "unknown"),
                        (SpeculativeConfig(method="ngram", num_tokens=0), "at least 1"),
                        (SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "min <= max")):
        with pytest.raises(UserError, match=words):
            make_engine(loaded, speculative=spec)


def test_smollm2_repeating_a_paragraph_gives_the_same_greedy_text_in_fewer_steps(runtime, smollm2_checkpoint):
    """An input-grounded request (repeat a given paragraph) on SmolLM2: identical greedy tokens, and most drafts
    kept, so far fewer steps than tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    loaded = load_model(smollm2_checkpoint)
    paragraph = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
                 "the members agreed to fund the reading room, the children's corner and the archive.")
    prompt = f"Repeat the following paragraph exactly.\n\n{paragraph}\n\nRepeated paragraph:\n\n{paragraph[:40]}"
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = generate_all(make_engine(loaded, tokenizer, block_size=16), [prompt], params)[0].outputs[0]
    engine = make_engine(loaded, tokenizer, block_size=16, speculative=SpeculativeConfig(method="ngram"))
    steps = 0
    request = engine.add_request(prompt, params)
    done = []
    while engine.has_unfinished():
        done += engine.step()
        steps += 1
    spec = done[0].outputs[0]
    assert done[0].request_id == request and spec.token_ids == plain.token_ids and spec.text == plain.text
    assert engine.speculator.stats.mean_acceptance_length > 2 and steps < 20
    assert_no_block_leaks(engine)


def test_the_counters_reach_metrics():
    from unified.engine.outputs import EngineStats
    from unified.engine.speculative import SpecDecodeStats
    from unified.serve.metrics import ServerMetrics

    metrics, spec = ServerMetrics(), SpecDecodeStats()
    stats = EngineStats(0, 0, 0, 8, 0.0, 0.0, 0, spec=spec)
    spec.record(4, 2)
    metrics.engine_step(stats, 3, 0.01, {})
    spec.record(4, 4)
    metrics.engine_step(stats, 5, 0.01, {})
    text = metrics.render().decode()
    for line in ("unified_spec_decode_num_drafts_total 2.0", "unified_spec_decode_num_draft_tokens_total 8.0",
                 "unified_spec_decode_num_accepted_tokens_total 6.0",
                 'unified_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0',
                 'unified_spec_decode_num_accepted_tokens_per_pos_total{position="3"} 1.0'):
        assert line in text
    assert spec.mean_acceptance_length == 4.0


def test_the_batch_recipe_takes_the_setting_from_the_command_line(tmp_path, tiny_chat_checkpoint):
    import json

    from tests.conftest import run_cli

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "one two three one two three one two", "max_tokens": 40,
                                  "temperature": 0, "ignore_eos": True}) + "\n")
    texts = []
    for extra in ((), ("engine.speculative.method=ngram", "engine.speculative.num_tokens=3",
                       "engine.speculative.prompt_lookup_min=1")):
        target = tmp_path / f"out{len(extra)}.jsonl"
        result = run_cli("recipe=batch", f"model={tiny_chat_checkpoint}", f"input={source}", f"output={target}",
                         "device=cpu", "engine.num_blocks=64", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        texts.append(json.loads(target.read_text())["text"])
    log = result.stdout + result.stderr
    assert "speculative decoding: ngram, up to 3 draft tokens per step" in log
    assert int(re.search(r"speculative decoding: (\d+) drafts, mean acceptance length", log).group(1)) > 0
    assert texts[0] == texts[1]



def _truncated(source, target, layers: int):
    """A draft for `source`: its first `layers` layers, same embedding, head and tokenizer."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        path.unlink()
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            index = re.search(r"\.layers\.(\d+)\.", name)
            if index is None or int(index.group(1)) < layers:
                tensors[name] = tensor
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):  # one entry per layer
        config["layer_types"] = config["layer_types"][:layers]
    (target / "config.json").write_text(json.dumps(config))
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    return target


def test_a_draft_model_keeps_the_greedy_output_with_preemption_and_n(tiny_checkpoint, runtime, tmp_path):
    """The target itself as its draft (every draft kept: 5 tokens a step) and a layer-truncated draft (some
    kept): the non-speculative tokens, no leak in either engine."""
    path = tiny_checkpoint("qwen3")
    target = load_model(path)
    prompts = _repetitive_prompts(target.config.vocab_size, 5)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=1 + i % 2) for i in range(5)]
    plain = generate_all(make_engine(target, num_blocks=40), prompts, params)
    for draft_path, least in ((path, 4.5), (_truncated(path, tmp_path / "draft", 1), 1.0)):
        spec = SpeculativeConfig(method="draft", num_tokens=4, draft_model=str(draft_path))
        engine = LLMEngine(target.model, None, EngineConfig(num_blocks=40, block_size=4, speculative=spec),
                           torch.device("cpu"), torch.float32, None, draft_model=load_model(draft_path).model)
        got = generate_all(engine, prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in plain]
        assert engine.scheduler.num_preemptions > 0
        assert engine.speculator.stats.mean_acceptance_length >= least, draft_path
        assert_no_block_leaks(engine)
        drafter = engine.speculator.drafter.engine
        assert not drafter.has_unfinished() and all(b.ref_count == 0 for b in drafter.blocks.blocks)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_checkpoint, runtime, tmp_path):
    build_tiny_hf_model("llama", vocab_size=200).save_pretrained(tmp_path / "other")
    spec = SpeculativeConfig(method="draft", draft_model=str(tmp_path / "other"))
    with pytest.raises(UserError, match="vocabulary"):
        LLMEngine(load_model(tiny_checkpoint("llama")).model, None, EngineConfig(num_blocks=16, speculative=spec),
                  torch.device("cpu"), torch.float32, None, draft_model=load_model(tmp_path / "other").model)


def test_smollm2_with_a_layer_truncated_draft_gives_the_same_greedy_text(runtime, smollm2_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    loaded = load_model(smollm2_checkpoint)
    prompt = "List the days of the week: Monday, Tuesday, Wednesday,"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = generate_all(make_engine(loaded, tokenizer, block_size=16), [prompt], params)[0].outputs[0]
    draft = _truncated(smollm2_checkpoint, tmp_path / "draft", 10)
    spec = SpeculativeConfig(method="draft", num_tokens=3, draft_model=str(draft))
    engine = LLMEngine(loaded.model, tokenizer, EngineConfig(num_blocks=64, block_size=16, speculative=spec),
                       torch.device("cpu"), torch.float32, None, draft_model=load_model(draft).model)
    got = generate_all(engine, [prompt], params)[0].outputs[0]
    assert got.token_ids == plain.token_ids and got.text == plain.text
    assert engine.speculator.stats.num_drafts > 0
    assert_no_block_leaks(engine)


def test_the_python_api_refuses_speculation_settings_it_cannot_run_naming_them(runtime, tiny_chat_checkpoint,
                                                                                tmp_path):
    from unified.engine import LLM

    model = str(tiny_chat_checkpoint)
    for speculative, words in (({"method": "ngram", "num_tokens": 2.5}, "engine option speculative.num_tokens"),
                               ({"method": "ngram", "lookup_max": 3}, "engine option speculative.lookup_max"),
                               ("ngram", "speculative='ngram': give a dict"),
                               ({"method": "draft", "draft_model": str(tmp_path / "none")},
                                "engine.speculative.draft_model=.* is neither a checkpoint folder")):
        with pytest.raises(UserError, match=words):
            LLM(model, device="cpu", num_blocks=16, speculative=speculative)
    # the same vocabulary size, other ids: its proposals would mean other tokens to the target
    shutil.copytree(tiny_chat_checkpoint, tmp_path / "other_ids")
    tokenizer = json.loads((tmp_path / "other_ids" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[1000:1002]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "other_ids" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(UserError, match="its tokenizer is not the target model's"):
        LLM(model, device="cpu", num_blocks=16,
            speculative={"method": "draft", "draft_model": str(tmp_path / "other_ids")})
