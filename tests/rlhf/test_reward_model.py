"""A reward model (HF *ForSequenceClassification, num_labels=1) loads into our model with its score head and
scores as `transformers` does; a folder that is not one fails with a message saying what to do."""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import build_tiny_hf_model
from unified.checkpoint import load_model
from unified.checkpoint.loader import hf_state_dict
from unified.errors import UserError
from unified.model.score_head import last_token_index
from unified.rlhf.reward_model import load_reward_model

PAD = 2  # SmolLM2's <|im_end|>: its pad token, and the token that closes every chat turn
FAMILIES = ("llama", "qwen2", "qwen3")  # qwen2: attention biases; qwen3: a tied config, q/k norms


def build_reward_checkpoint(path, family: str, tokenizer_from, num_labels: int = 1):
    model = build_tiny_hf_model(family, auto_class="AutoModelForSequenceClassification", vocab_size=49152,
                                num_labels=num_labels, pad_token_id=PAD)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="module")
def reward_checkpoint(tmp_path_factory, smollm2_checkpoint):
    """reward_checkpoint(family) -> a tiny random reward model with SmolLM2's tokenizer, made once."""
    made = {}

    def make(family: str):
        if family not in made:
            made[family] = build_reward_checkpoint(tmp_path_factory.mktemp(f"reward-{family}"), family,
                                                   smollm2_checkpoint)
        return made[family]

    return make


def reference_scores(path, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    reference = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    with torch.inference_mode():
        return reference(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_match_transformers_on_a_padded_batch(family, runtime, reward_checkpoint):
    path = reward_checkpoint(family)
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 49152, (n,), generator=generator) for n in (5, 17, 11)]
    rows[2][-1] = PAD  # a row whose own text ends in the pad token is scored at the token before it
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)  # [3, 17]
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    model = load_model(path, num_labels=1).model
    with torch.inference_mode():
        ours = model.scores(model(ids, torch.arange(ids.shape[1])), last_token_index(ids, lengths, PAD))
    expected = reference_scores(path, ids, mask)
    assert ours.shape == expected.shape == (3, 1)
    assert (ours - expected).abs().max().item() <= 1e-5, (ours, expected)


def test_export_writes_the_score_head_back(runtime, reward_checkpoint):
    path = reward_checkpoint("llama")
    exported = hf_state_dict(load_model(path, num_labels=1).model)
    saved = load_file(path / "model.safetensors")
    assert exported.keys() == saved.keys()
    assert torch.equal(exported["score.weight"], saved["score.weight"])


def test_reward_scores_chats_as_transformers_does(runtime, reward_checkpoint):
    from transformers import AutoTokenizer

    path = reward_checkpoint("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversation = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    prompts = ["What is 2 + 3?", "What is 2 + 3?", conversation]
    completions = ["5", "It is five, because two and three make five.", "Blue."]
    reward = load_reward_model(path, "cpu", torch.float32, batch_size=2)  # two batches, the first padded
    scores = reward(prompts, completions, answer=["5", "5", "blue"])
    assert len(scores) == 3 and all(type(s) is float for s in scores)
    chats = [[{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": completions[0]}],
             [{"role": "user", "content": prompts[1]}, {"role": "assistant", "content": completions[1]}],
             conversation + [{"role": "assistant", "content": completions[2]}]]
    for chat, score in zip(chats, scores):
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        assert text.endswith(f"<|im_start|>assistant\n{chat[-1]['content']}<|im_end|>\n")
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        assert score == pytest.approx(reference_scores(path, ids).item(), abs=1e-5)


def test_reward_without_a_chat_template_reads_prompt_and_completion_as_one_text(runtime, reward_checkpoint, tmp_path):
    shutil.copytree(reward_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink()
    from transformers import AutoTokenizer

    scores = load_reward_model(tmp_path, "cpu", torch.float32)(["Q: 2 + 3 = ?\nA:"], [" 5"])
    ids = torch.tensor([AutoTokenizer.from_pretrained(tmp_path)("Q: 2 + 3 = ?\nA: 5")["input_ids"]])
    assert scores == [pytest.approx(reference_scores(tmp_path, ids).item(), abs=1e-5)]


def test_a_causal_lm_is_not_a_reward_model(runtime, tiny_chat_checkpoint):
    with pytest.raises(UserError, match=r"LlamaForCausalLM, not a sequence classifier.*ForSequenceClassification"):
        load_reward_model(tiny_chat_checkpoint, "cpu", torch.float32)


def test_a_reward_model_needs_one_label(runtime, smollm2_checkpoint, tmp_path):
    build_reward_checkpoint(tmp_path, "llama", smollm2_checkpoint, num_labels=2)
    with pytest.raises(UserError, match=r"num_labels=2 \(config.json\), but num_labels=1 is needed"):
        load_reward_model(tmp_path, "cpu", torch.float32)


def test_a_reward_model_needs_its_tokenizer(runtime, reward_checkpoint, tmp_path):
    shutil.copytree(reward_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    with pytest.raises(UserError, match=r"has no tokenizer.*copy the tokenizer files"):
        load_reward_model(tmp_path, "cpu", torch.float32)


def test_a_reward_model_cannot_be_loaded_to_generate(runtime, reward_checkpoint):
    with pytest.raises(UserError, match=r"sequence classifier \(LlamaForSequenceClassification\).*no LM head"):
        load_model(reward_checkpoint("llama"))


def test_grpo_learns_from_a_reward_model(reward_checkpoint, tiny_chat_checkpoint, tmp_path):
    import json

    from tests.conftest import run_cli

    output = tmp_path / "out"
    result = run_cli("recipe=grpo", f"model={tiny_chat_checkpoint}", f"output={output}",
                     f"rlhf.reward_model={reward_checkpoint('llama')}", "steps=1", "rlhf.prompts_per_step=2",
                     "rlhf.max_tokens=8", "rlhf.eval_prompts=0", "train.wandb=disabled")
    assert result.returncode == 0, result.stderr[-3000:]
    step = json.loads((output / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["reward_std"] > 0  # a random reward model still tells completions apart
