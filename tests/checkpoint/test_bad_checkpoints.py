"""Bad checkpoints fail with a message that names the file and the tensor, never a bare traceback."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_cli
from unified.checkpoint import CheckpointError, load_model
from unified.errors import UserError


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_pickled_weights_are_refused(llama_copy):
    torch.save(load_file(llama_copy / "model.safetensors"), llama_copy / "pytorch_model.bin")
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"pickled weights \(pytorch_model.bin\).*safetensors"):
        load_model(llama_copy)


def test_truncated_file_names_the_file(runtime, llama_copy):
    path = llama_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors.*truncated or corrupt"):
        load_model(llama_copy)


def test_garbage_header_names_the_file(runtime, llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(llama_copy)


def test_missing_tensor_is_named(runtime, llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing.*model.safetensors"):
        load_model(llama_copy)


def test_shape_mismatch_names_tensor_and_file(runtime, llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["intermediate_size"] = 80
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"shape mismatch: model.layers.0.mlp.gate_proj.weight \(96, 64\) in model.safetensors"):
        load_model(llama_copy)


def test_missing_shard_listed_in_index(runtime, llama_copy):
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(llama_copy)


def test_unsupported_architecture_is_named(runtime, llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="model_type 'gpt2' is not implemented natively"):
        load_model(llama_copy)


def test_cli_reports_bad_checkpoint_without_traceback(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"truncated")
    result = run_cli("recipe=check_parity", f"model={llama_copy}", "device=cpu")
    assert result.returncode == 2
    assert "error:" in result.stderr and "model.safetensors" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
