"""Shared fixtures: a one-process CPU runtime and tiny random-weight HF checkpoints of every family.

The cache that holds the converted built-in model lives in this session's temp folder, so every run
starts cold; CLI tests run in subprocesses that inherit it through UNIFIED_CACHE_DIR.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

_session_cache = tempfile.mkdtemp(prefix="unified-test-cache-")
atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)
os.environ["UNIFIED_CACHE_DIR"] = _session_cache
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter, which must be chosen before triton is first
# imported (its own library functions are decorated then); tests pick the backend (kernels.registry).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent

_COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

# Every family the model implements natively, with the features that distinguish it switched on.
TINY_FAMILIES = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False, **_MOE),
    "qwen3_moe": dict(num_experts=4, norm_topk_prob=True, **_MOE),
    "deepseek_v3": dict(n_routed_experts=8, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=12, num_key_value_heads=4, first_k_dense_replace=1, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5, rope_parameters=_YARN, **_MOE),
}


def build_tiny_hf_model(family: str, seed: int = 0, auto_class: str = "AutoModelForCausalLM", **config_overrides):
    """`auto_class` picks the head (e.g. AutoModelForSequenceClassification); `config_overrides` change the config."""
    import transformers
    from transformers import AutoConfig

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**_COMMON, **TINY_FAMILIES[family], **config_overrides})
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # HF initialises norms to ones and biases to zero; random values make a wrong mapping visible.
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "layernorm.weight")):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif name.endswith((".bias", "e_score_correction_bias")):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    return model


def build_mtp_checkpoint(path: Path, layers: int = 2, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A tiny DeepSeek-V3 of `layers` layers with one MTP layer stored after them, as DeepSeek-V3 ships it
    (the block of a model one layer deeper, its own norms and projection, copies of embedding and head);
    with `tokenizer_from`'s tokenizer (and vocabulary size) if given."""
    from safetensors.torch import load_file, save_file

    vocab = {"vocab_size": 49152} if tokenizer_from else {}
    model = build_tiny_hf_model("deepseek_v3", seed=seed, num_hidden_layers=layers + 1, **vocab)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_from else ():
        shutil.copy(tokenizer_from / name, path / name)
    tensors = load_file(path / "model.safetensors")
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{layers}."
    tensors |= {f"{prefix}enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
                f"{prefix}hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
                f"{prefix}eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
                f"{prefix}shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
                f"{prefix}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"{prefix}shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config |= {"num_hidden_layers": layers, "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def runtime():
    from unified.runtime import Layout, init_distributed, select_accelerator

    accelerator = select_accelerator("cpu")
    init_distributed(accelerator, Layout())
    return accelerator


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(family) -> folder with config.json + model.safetensors, made once per session."""
    return _saved_once(tmp_path_factory, "tiny", build_tiny_hf_model)


def _saved_once(tmp_path_factory, prefix: str, build):
    """family -> a folder holding `build(family).save_pretrained(...)`, made the first time it is asked for."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"{prefix}-{family}")
            build(family).save_pretrained(path)
            made[family] = path
        return made[family]

    return make


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    from unified.checkpoint.builtin import resolve_model

    return resolve_model("smollm2")


def build_tiny_chat_checkpoint(path: Path, tokenizer_from: Path, seed: int = 0, hidden_size: int = 64,
                               init_std: float = 0.5, max_positions: int = 1024) -> Path:
    """A 2-layer random Llama with `tokenizer_from`'s tokenizer and chat template: fast, but chats.

    By default its weights are drawn wide (std 0.5) so logits are spread and greedy choices have clear margins."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=init_std, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory, smollm2_checkpoint):
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny-chat"), smollm2_checkpoint)


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `python -m unified ARGS` from a scratch folder and checks it left that folder empty."""
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-m", "unified", *args], cwd=cwd, capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert not os.listdir(cwd), f"the run cluttered its working directory: {os.listdir(cwd)}"
    return result


@pytest.fixture(scope="session")
def tiny_vl_checkpoint(tmp_path_factory):
    """tiny_vl_checkpoint(family) -> folder of a tiny random vision-language model (tests/vision_fixtures.py)."""
    from tests.vision_fixtures import build_tiny_vl_model

    return _saved_once(tmp_path_factory, "tiny-vl", build_tiny_vl_model)


@pytest.fixture(scope="session")
def tiny_vl_chat_checkpoint(tmp_path_factory, smollm2_checkpoint):
    """A tiny random LLaVA with SmolLM2's tokenizer and chat template, `<image>` its image token."""
    from tests.vision_fixtures import build_tiny_vl_chat_checkpoint

    return build_tiny_vl_chat_checkpoint(tmp_path_factory.mktemp("tiny-vl-chat"), smollm2_checkpoint)
