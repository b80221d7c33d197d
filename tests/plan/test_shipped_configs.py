"""Configuration-only built-in models: read without weights, refused where weights are needed."""
from __future__ import annotations

import pytest

from unified.checkpoint.builtin import resolve_model
from unified.checkpoint.shipped import config_only_names, model_config_of
from unified.errors import UserError
from unified.plan.inventory import Stage, rank_tensors
from unified.runtime.layout import Layout


def _parameters(config) -> int:
    return sum(t.numel for t in rank_tensors(config, Stage(Layout())) if not t.buffer)


def test_shipped_names():
    assert config_only_names() == ["deepseek-v3", "kimi-k2", "unified-3t-vl"]


@pytest.mark.parametrize("name,heads,experts,dense,vocab,low,high", [
    ("deepseek-v3", 128, 256, 3, 129280, 650e9, 672e9),  # 671B counts the MTP layer (~14B), which we do not build
    ("kimi-k2", 64, 384, 1, 163840, 1.02e12, 1.04e12),
    ("unified-3t-vl", 64, 1152, 1, 163840, 2.9e12, 3.1e12),
])
def test_configs_read_without_weights(name, heads, experts, dense, vocab, low, high):
    config = model_config_of(name)
    mla, moe = config.mla, config.moe
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (61, 7168, 18432)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (config.num_heads, moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (heads, experts, 8, 2048)
    assert moe.shared_intermediate_size == 2048 and moe.dense_layers == list(range(dense))
    assert config.vocab_size == vocab
    assert low < _parameters(config) < high
    assert (config.vision is not None) == (name == "unified-3t-vl")


def test_kimi_k2_count_matches_the_released_checkpoint():
    config = model_config_of("kimi-k2")
    score_biases = sum(t.numel for t in rank_tensors(config, Stage(Layout())) if t.name.endswith("score_bias"))
    # the released safetensors' parameter count (its e_score_correction_bias tensors are buffers here)
    assert _parameters(config) + score_biases == 1_026_408_232_448


def test_the_3t_model_has_a_million_token_context():
    assert model_config_of("unified-3t-vl").max_position_embeddings == 1 << 20


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "unified-3t-vl"])
def test_loading_weights_of_a_configuration_is_refused(name):
    with pytest.raises(UserError, match="configuration without weights"):
        resolve_model(name)


def test_unknown_names_list_the_configurations():
    with pytest.raises(UserError, match="deepseek-v3, kimi-k2, unified-3t-vl"):
        resolve_model("no-such-model")
