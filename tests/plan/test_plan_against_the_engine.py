"""The plan's counts against what the engine, the model and the quantized-checkpoint writer really allocate."""
from __future__ import annotations

import pytest
import torch

from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
from unified.checkpoint.quantized import quantize_tensor
from unified.engine.kv_cache import KVCache
from unified.model.transformer import CausalLM
from unified.plan.hardware import load_hardware
from unified.plan.inventory import PROJECTION, RankTensor, Stage, rank_tensors
from unified.plan.planner import setting_for
from unified.plan.rank_memory import serve_breakdowns
from unified.plan.weight_bytes import engine_copy_bytes, packed_rows_multiple, stored_bytes, weight_bytes
from unified.runtime.layout import Layout


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_kv_cache_bytes_are_the_engine_s(tiny_checkpoint, run_config, family, kv_dtype):
    config = model_config_from_hf(read_hf_config(tiny_checkpoint(family)))
    cfg = run_config("engine.num_blocks=7", f"engine.kv_cache_dtype={kv_dtype}")
    s = setting_for(cfg, load_hardware("cpu"), context=64)
    ranks, blocks = serve_breakdowns(config, Layout(), kv_dtype, s)
    cache = KVCache(config, blocks, s.engine.block_size, torch.float32, torch.device("cpu"), kv_dtype)
    held = sum(t.numel() * t.element_size() for layer in cache.values + cache.scales if layer for t in layer
               if t is not None)
    held += sum(c.numel() * c.element_size() for c in cache.key_centres if c is not None)
    assert ranks[0]["kv_cache"] == held


@pytest.mark.parametrize("method,shape", [  # compressed-tensors stores 2-D matrices of whole groups
    ("fp8", (256, 384)), ("fp8", (200, 130)), ("fp8", (3, 256, 384)), ("int8", (256, 384)), ("int8", (200, 128)),
    ("int4", (256, 384)), ("int4", (200, 128))])
def test_quantized_weight_bytes_are_what_the_writer_stores(method, shape):
    tensor = torch.randn(shape)
    stored = quantize_tensor("w.weight", tensor, method)
    values, scales = stored_bytes(RankTensor("w.weight", shape, PROJECTION), method, 128)
    assert values + scales == sum(t.numel() * t.element_size() for t in stored.values())


def test_weights_are_the_model_s_parameters(tiny_checkpoint, runtime):
    config = model_config_from_hf(read_hf_config(tiny_checkpoint("qwen2_moe")))
    model = CausalLM(config, torch.float32)
    held = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    assert weight_bytes(rank_tensors(config, Stage(Layout())), 4)["weights"] == held


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # tied head, and a head of its own
@pytest.mark.parametrize("quantization,head", [(None, False), ("int8", False), ("int8", True), ("int4", True)])
def test_engine_copies_are_what_pack_weights_makes(tiny_checkpoint, runtime, family, quantization, head):
    from unified.kernels.linear import head_chunk_size

    config = model_config_from_hf(read_hf_config(tiny_checkpoint(family)))
    model = CausalLM(config, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.weight_quantization, model.quantize_head = quantization, head
    model.pack_weights()
    made = model.unpack_weights()
    tensors = rank_tensors(config, Stage(Layout()))
    tied = next(t.shape for t in tensors if t.name == "embed.weight") if config.tie_word_embeddings else None
    assert made == engine_copy_bytes(tensors, True, True, quantization, head, tied, head_chunk_size(),
                                     packed_rows_multiple())


def test_an_mtp_drafter_s_layer_and_cache_layer_are_counted(tmp_path, run_config, runtime):
    from tests.conftest import build_mtp_checkpoint
    from unified.checkpoint.mtp import load_mtp_layer
    from unified.engine.speculative import cache_layers

    path = build_mtp_checkpoint(tmp_path / "mtp")
    config = model_config_from_hf(read_hf_config(path))
    cfg = run_config("engine.num_blocks=7", "engine.speculative.method=mtp", "engine.speculative.num_tokens=2")
    s = setting_for(cfg, load_hardware("cpu"), context=64)
    ranks, blocks = serve_breakdowns(config, Layout(), "auto", s)
    layer = load_mtp_layer(path, torch.device("cpu"), torch.float32)
    assert ranks[0]["mtp_layer"] == sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    layers = [*range(config.num_layers), *cache_layers(s.engine.speculative, config)]
    cache = KVCache(config, blocks, s.engine.block_size, torch.float32, torch.device("cpu"), "auto", layers=layers)
    assert ranks[0]["kv_cache"] == sum(t.numel() * t.element_size() for layer in cache.values for t in layer)
