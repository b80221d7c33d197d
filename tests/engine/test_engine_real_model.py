"""The engine on the real SmolLM2 weights: greedy agreement with the plain forward, stop strings, chat."""
import pytest
import torch

from tests.engine.conftest import assert_no_block_leaks, generate_all, make_engine
from unified.checkpoint import load_model
from unified.chat import chat_prompt
from unified.engine.llm import eos_ids
from unified.engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]
MARGIN = 1e-3  # top-2 logit gaps below this could flip with thread counts and shapes


@pytest.fixture(scope="module")
def smollm2(runtime, smollm2_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    return load_model(smollm2_checkpoint), tokenizer, eos_ids(tokenizer, smollm2_checkpoint)


@torch.inference_mode()
def test_greedy_tokens_match_the_plain_forward(smollm2):
    loaded, tokenizer, eos = smollm2
    model = loaded.model
    prompts = [chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    engine = make_engine(loaded, tokenizer, eos, num_blocks=64, block_size=16, max_num_batched_tokens=48)
    outputs = generate_all(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    compared = 0
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt + output.outputs[0].token_ids])
        logits = model.logits(model(ids, torch.arange(ids.shape[1])))[0, len(prompt) - 1:-1]
        top2 = logits.topk(2, dim=-1)
        for step, token in enumerate(output.outputs[0].token_ids):
            if top2.values[step, 0] - top2.values[step, 1] < MARGIN:
                break  # past a near-tie the two paths may legitimately diverge
            assert token == top2.indices[step, 0].item()
            compared += 1
    assert compared >= 40
    assert_no_block_leaks(engine)


def test_stop_strings_end_the_text_before_the_stop(smollm2):
    loaded, tokenizer, eos = smollm2
    engine = make_engine(loaded, tokenizer, eos, num_blocks=32, block_size=16)
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    full = generate_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert "Paris" in full.text and full.finish_reason == "stop"  # stopped by <|im_end|>
    cut = generate_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=20, stop=["Paris"]))[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index("Paris")]
    assert_no_block_leaks(engine)
