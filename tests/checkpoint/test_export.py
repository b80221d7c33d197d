"""Export -> transformers load gives back exactly the tensors we imported, for every family."""
import json

import pytest
import torch

from tests.conftest import TINY_FAMILIES
from unified.checkpoint import export_hf, load_model
from unified.checkpoint.safetensors_io import INDEX


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_export_reimport_is_bit_identical(family, runtime, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_checkpoint(family)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    export_hf(load_model(source), tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert reloaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(reloaded[name], tensor), name
    ours_again = dict(load_model(tmp_path).model.named_parameters())
    for name, tensor in load_model(source).model.named_parameters():
        assert torch.equal(ours_again[name], tensor), name


def test_export_writes_sharded_index_that_loads(runtime, tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("qwen3_moe")
    export_hf(load_model(source), tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / INDEX).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    ids, positions = torch.randint(0, 160, (1, 12)), torch.arange(12)
    a, b = load_model(source).model, load_model(tmp_path).model
    with torch.inference_mode():
        assert torch.equal(a.logits(a(ids, positions)), b.logits(b(ids, positions)))


def test_tensor_parallel_rank_reads_only_its_slice(runtime, tiny_checkpoint):
    from unified.checkpoint.hf_names import parameter_map
    from unified.checkpoint.loader import Shard, assemble
    from unified.checkpoint.safetensors_io import SafetensorsCheckpoint

    path = tiny_checkpoint("llama")
    ckpt = SafetensorsCheckpoint(path)
    config = load_model(path).config
    params = {p.ours: p for p in parameter_map(config)}
    gate_up = params["layers.0.mlp.gate_up_proj.weight"]
    down = params["layers.0.mlp.down_proj.weight"]
    gate, up = (ckpt.get(n) for n in gate_up.rows[0])
    for rank in range(2):
        expected = torch.cat((gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]), 0)  # [gate_r | up_r]
        assert torch.equal(assemble(ckpt, gate_up, Shard(rank, 2)), expected)
        assert torch.equal(assemble(ckpt, down, Shard(rank, 2)), ckpt.get(down.rows[0][0]).chunk(2, 1)[rank])
