"""Our model against `transformers` on the same weights: every family, every layer, fp32 and bf16."""
import pytest
import torch

from tests.conftest import TINY_FAMILIES
from unified.checkpoint import load_model
from unified.jobs.parity import compare, reference_model


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_model_matches_transformers(family, runtime, tiny_checkpoint):
    path = tiny_checkpoint(family)
    ours = load_model(path)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    report = compare(ours.model, reference_model(path), ids)
    assert len(report.layer_cosine) == ours.config.num_layers
    assert min(report.layer_cosine.values()) >= 0.99999, report.table()
    assert report.logits_cosine >= 0.99999, report.table()
    assert report.logits_max_abs_diff <= 1e-4, report.table()


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_model_matches_transformers_in_bf16(family, runtime, tiny_checkpoint):
    path = tiny_checkpoint(family)
    ours = load_model(path, dtype=torch.bfloat16)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    report = compare(ours.model, reference_model(path, torch.bfloat16), ids)
    assert report.logits_cosine >= 0.9999, report.table()
    assert min(report.layer_cosine.values()) >= 0.9999, report.table()


def test_smollm2_real_weights_match_transformers(runtime, smollm2_checkpoint):
    ours = load_model(smollm2_checkpoint)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    ids = torch.tensor([tokenizer("The capital of France is Paris. The largest planet is Jupiter, and")["input_ids"]])
    report = compare(ours.model, reference_model(smollm2_checkpoint), ids)
    assert report.logits_cosine >= 0.99999, report.table()
    assert report.logits_max_abs_diff <= 1e-3, report.table()
    assert min(report.layer_cosine.values()) >= 0.99999, report.table()


def test_kimi_k2_model_type_loads_as_deepseek_v3(runtime, tiny_checkpoint, tmp_path):
    import json
    import shutil

    source = tiny_checkpoint("deepseek_v3")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16)
    with torch.inference_mode():
        kimi = load_model(tmp_path).model
        deepseek = load_model(source).model
        torch.testing.assert_close(kimi.logits(kimi(ids, positions)), deepseek.logits(deepseek(ids, positions)),
                                   rtol=0, atol=0)
