"""`unified recipe=quantize`: int8 / int4 / fp8 copies of a checkpoint that load as the weights they encode."""
from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests.conftest import run_cli
from unified.checkpoint import load_model
from unified.checkpoint.quantized import _unpack_int32, pack_int32
from unified.config.schema import RunConfig
from unified.errors import UserError
from unified.jobs import quantize


def _cfg(model, output, method, lm_head=False):
    cfg = OmegaConf.structured(RunConfig(job="quantize", model=str(model), output=str(output)))
    cfg.engine.quantization, cfg.engine.quantize_lm_head = method, lm_head
    return cfg


def _logits(loaded, ids):
    with torch.inference_mode():
        return loaded.model.logits(loaded.model(ids, torch.arange(ids.shape[1])))


def test_int4_packing_is_compressed_tensors_layout():
    """Eight values per int32, lowest bits first, each offset by 8 (checked against compressed-tensors 0.20's
    own packer when this was written)."""
    values = torch.tensor([[1, -2, 3, 0, 0, 0, 0, -8, 7, 7, 7, 7, 7, 7, 7, 7]], dtype=torch.int8)
    word = 9 | 6 << 4 | 11 << 8 | 8 << 12 | 8 << 16 | 8 << 20 | 8 << 24 | 0 << 28
    assert pack_int32(values, 4).tolist() == [[word, -1]]  # 0xFFFFFFFF: eight 15s
    assert torch.equal(_unpack_int32(pack_int32(values, 4), 4, (1, 16), "x"), values)


def test_the_recipe_writes_int8_that_loads_as_the_engines_int8(runtime, tiny_checkpoint, tmp_path):
    """The int8 checkpoint (compressed-tensors, channel-wise) computes what the engine's own int8 copies do."""
    source = tiny_checkpoint("llama")
    result = run_cli("recipe=quantize", f"model={source}", f"output={tmp_path / 'int8'}", "engine.quantization=int8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "quantized 21 of" in result.stdout  # 3 layers x 7 projections; the head stays
    config = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized" and config["ignore"] == ["lm_head"]
    # more positions than the decode kernel takes (it reads x as int16): both sides read x as it is, and only
    # the weights could differ
    ids = torch.randint(0, 160, (1, 24), generator=torch.Generator().manual_seed(0))
    served = load_model(source)
    served.model.weight_quantization = "int8"
    served.model.pack_weights()
    torch.testing.assert_close(_logits(load_model(tmp_path / "int8"), ids), _logits(served, ids), rtol=1e-5,
                               atol=1e-5)


def test_an_int4_checkpoint_is_served_as_its_own_int4_values(runtime, tiny_checkpoint, tmp_path):
    """engine.quantization=int4 on a compressed-tensors int4 checkpoint: the copies the kernels read hold the
    stored values and scales (as loaded they were dequantized), so the logits are the checkpoint's."""
    quantize.run(_cfg(tiny_checkpoint("llama"), tmp_path / "int4", "int4", lm_head=False))
    # more positions than the decode kernel takes (it reads x as int16): both sides read x as it is, and only
    # the weights could differ
    ids = torch.randint(0, 160, (1, 24), generator=torch.Generator().manual_seed(0))
    served = load_model(tmp_path / "int4")
    assert served.model.int4_group == json.loads((tmp_path / "int4" / "config.json").read_text())[
        "quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    served.model.weight_quantization = "int4"
    served.model.pack_weights()
    stored = load_file(tmp_path / "int4" / "model.safetensors")
    copy = served.model.layers["0"].mlp.down_proj.packed
    assert copy.layout == "int4"
    assert torch.equal(copy.tensor.view(torch.int32), stored["model.layers.0.mlp.down_proj.weight_packed"])
    assert torch.equal(copy.scale, stored["model.layers.0.mlp.down_proj.weight_scale"].float())
    torch.testing.assert_close(_logits(served, ids), _logits(load_model(tmp_path / "int4"), ids), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("method,family", [("int4", "llama"), ("fp8", "qwen3_moe"), ("fp8", "deepseek_v3")])
def test_int4_and_fp8_copies_stay_close_to_the_source(runtime, tiny_checkpoint, tmp_path, method, family):
    source = tiny_checkpoint(family)
    quantize.run(_cfg(source, tmp_path / method, method, lm_head=True))
    ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(0))
    got, want = _logits(load_model(tmp_path / method), ids), _logits(load_model(source), ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > (0.99 if method == "fp8" else 0.95)


def test_the_recipe_refuses_what_it_cannot_do(runtime, tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama")
    with pytest.raises(UserError, match="needs engine.quantization=int8|int4|fp8"):
        quantize.run(_cfg(source, tmp_path / "a", None))
    with pytest.raises(UserError, match="needs output="):
        quantize.run(_cfg(source, "", "int8"))
    quantize.run(_cfg(source, tmp_path / "b", "fp8"))
    with pytest.raises(UserError, match="already quantized"):
        quantize.run(_cfg(tmp_path / "b", tmp_path / "c", "int8"))
    with pytest.raises(UserError, match="not empty"):
        quantize.run(_cfg(source, tmp_path / "b", "int8"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        quantize.run(_cfg(source, tmp_path / "file", "int8"))


def test_mixtral_experts_are_quantized_and_a_tied_head_is_left_out_of_the_config(runtime, tiny_checkpoint, tmp_path):
    quantize.run(_cfg(tiny_checkpoint("mixtral"), tmp_path / "mixtral", "int8"))
    stored = load_file(tmp_path / "mixtral" / "model.safetensors")
    experts = [n for n in stored if ".experts." in n and n.endswith(".weight")]
    assert experts and all(stored[n].dtype == torch.int8 and f"{n}_scale" in stored for n in experts)
    assert stored["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # the router stays
    # qwen3's head is tied to the embeddings, which are not quantized: the config must not claim the head is
    quantize.run(_cfg(tiny_checkpoint("qwen3"), tmp_path / "qwen3", "int4", lm_head=True))
    config = json.loads((tmp_path / "qwen3" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["lm_head"] and config["config_groups"]["group_0"]["format"] == "pack-quantized"


def test_int4_of_a_model_with_an_odd_input_width_is_refused_naming_the_layer(runtime, tiny_checkpoint):
    loaded = load_model(tiny_checkpoint("llama"))
    model = loaded.model
    model.layers["1"].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 95))
    model.weight_quantization = "int4"
    with pytest.raises(UserError, match=r"layers.1.mlp.down_proj has 95 inputs; serve this model with "
                                        r"engine.quantization=int8"):
        model.pack_weights()


def test_check_parity_of_a_quantized_checkpoint_needs_no_quantization_library(runtime, tiny_checkpoint, tmp_path):
    """transformers' side runs on the weights our reader dequantizes, with its own name mapping (Qwen3-MoE's
    experts are fused in transformers' model), so both sides hold the same weights."""
    quantize.run(_cfg(tiny_checkpoint("qwen3_moe"), tmp_path / "int4", "int4"))
    result = run_cli("recipe=check_parity", f"model={tmp_path / 'int4'}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "PASSED" in result.stdout


def test_check_parity_reports_the_int8_model_against_its_source(tiny_checkpoint):
    result = run_cli("recipe=check_parity", f"model={tiny_checkpoint('qwen3')}", "engine.quantization=int8",
                     "check.min_cosine=0.99", "check.max_abs_diff=1.0")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "served as int8" in result.stdout and "PASSED" in result.stdout
