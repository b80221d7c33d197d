"""LoRA on the shared model against peft on the transformers model of the same checkpoint, merged against
unmerged (plain forward and the engine), and under tensor parallel 2 against one rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, build_tiny_hf_model
from unified.checkpoint import hf_state_dict, load_model
from unified.config.schema import LoraConfig
from unified.errors import UserError
from unified.checkpoint.lora import apply_lora, load_adapter, lora_summary, merge_lora, save_adapter

MLA_ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
IDS = torch.randint(0, 160, (2, 20), generator=torch.Generator().manual_seed(1))


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(ids.shape[1]))).float()


def _randomize(params, seed: int = 1) -> None:
    """Fresh B is zero; random A and B make every adapter change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _adapted(family: str, tiny_checkpoint, targets=None, **options):
    loaded = load_model(tiny_checkpoint(family))
    cfg = LoraConfig(rank=4, alpha=8, targets=targets, **options) if targets else LoraConfig(rank=4, alpha=8, **options)
    params = apply_lora(loaded.model, cfg)
    _randomize(params)
    return loaded, params


def test_fresh_adapters_change_nothing_and_leave_only_themselves_trainable(runtime, tiny_checkpoint):
    loaded = load_model(tiny_checkpoint("llama"))
    before, names = _logits(loaded.model), set(hf_state_dict(loaded.model))
    params = apply_lora(loaded.model, LoraConfig(rank=4, alpha=8))
    torch.testing.assert_close(_logits(loaded.model), before, rtol=0, atol=0)
    assert {id(p) for p in loaded.model.parameters() if p.requires_grad} == {id(p) for p in params}
    # 3 layers x (q, k, v, o, gate, up, down), r=4: A is [4, in features], B is [out features, 4]
    assert len(params) == 3 * 7 * 2
    inputs, outputs = 6 * 64 + 96, 64 + 32 + 32 + 64 + 96 + 96 + 64
    assert sum(p.numel() for p in params) == 3 * 4 * (inputs + outputs)
    assert set(hf_state_dict(loaded.model)) == names  # base names untouched: loader and exporter still apply
    assert lora_summary(loaded.model).startswith(f"LoRA: {sum(p.numel() for p in params):,} trainable parameters")


@pytest.mark.parametrize("family,targets", [
    ("llama", None),
    ("llama", ["q_proj", "v_proj", "up_proj"]),  # fused layers with untargeted parts
    ("qwen3", None),  # qk-norm, tied embeddings
    ("qwen2_moe", None),  # qkv bias, a shared expert's MLP
    ("deepseek_v3", MLA_ATTENTION),  # MLA; peft maps this model's MLP names onto its routed experts
])
def test_saved_adapter_gives_peft_the_same_logits(family, targets, runtime, tiny_checkpoint, tmp_path):
    from peft import PeftModel

    loaded, _ = _adapted(family, tiny_checkpoint, targets)
    save_adapter(loaded.model, tmp_path, base_model=str(loaded.path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 4, 8, "none")
    reference = PeftModel.from_pretrained(build_tiny_hf_model(family), tmp_path).eval()
    with torch.no_grad():
        theirs = reference(IDS).logits
    ours = _logits(loaded.model)
    assert _cosine(ours, theirs) >= 0.99999
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert _cosine(ours, build_tiny_hf_model(family)(IDS).logits.detach()) < 0.999  # the adapter does something


def test_gradients_match_peft(runtime, tiny_checkpoint, tmp_path):
    from peft import PeftModel

    loaded, _ = _adapted("llama", tiny_checkpoint)
    save_adapter(loaded.model, tmp_path)
    reference = PeftModel.from_pretrained(build_tiny_hf_model("llama"), tmp_path, is_trainable=True)
    (reference(IDS).logits ** 2).mean().backward()
    model = loaded.model
    (model.logits(model(IDS, torch.arange(IDS.shape[1]))) ** 2).mean().backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in reference.named_parameters() if p.requires_grad}
    checked = 0
    for name, (module, part) in {"layers.1.attn.qkv_proj": ("self_attn", "k_proj"),
                                 "layers.2.mlp.gate_up_proj": ("mlp", "up_proj"),
                                 "layers.0.mlp.down_proj": ("mlp", "down_proj")}.items():
        adapter = model.get_submodule(name).lora
        layer = name.split(".")[1]
        for kind, ours in (("A", adapter.A[part]), ("B", adapter.B[part])):
            peft_name = f"base_model.model.model.layers.{layer}.{module}.{part}.lora_{kind}.weight"
            torch.testing.assert_close(ours.grad, theirs[peft_name], rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked == 6
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora." not in n)


@pytest.mark.parametrize("family,targets", [("llama", None), ("deepseek_v3", MLA_ATTENTION)])
def test_peft_saved_adapter_loads_into_ours(family, targets, runtime, tiny_checkpoint, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = targets or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    reference = get_peft_model(build_tiny_hf_model(family), PeftLoraConfig(r=8, lora_alpha=4, target_modules=targets))
    _randomize([p for p in reference.parameters() if p.requires_grad], seed=2)
    reference.save_pretrained(tmp_path)
    loaded = load_model(tiny_checkpoint(family))
    params = load_adapter(loaded.model, tmp_path)
    assert all(p.requires_grad for p in params) and len(params) == 2 * 3 * len(targets)
    with torch.no_grad():
        theirs = reference.eval()(IDS).logits
    ours = _logits(loaded.model)
    assert _cosine(ours, theirs) >= 0.99999
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_adapter_on_some_layers_round_trips_through_ours(runtime, tiny_checkpoint, tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    reference = get_peft_model(build_tiny_hf_model("llama"),
                               PeftLoraConfig(r=4, target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]))
    _randomize([p for p in reference.parameters() if p.requires_grad], seed=3)
    reference.save_pretrained(tmp_path / "peft")
    loaded = load_model(tiny_checkpoint("llama"))
    assert len(load_adapter(loaded.model, tmp_path / "peft")) == 2 * 2 * 2
    save_adapter(loaded.model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["exclude_modules"] == ["model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    again = PeftModel.from_pretrained(build_tiny_hf_model("llama"), tmp_path / "ours").eval()
    with torch.no_grad():
        assert _cosine(again(IDS).logits, reference.eval()(IDS).logits) >= 0.99999
        assert _cosine(_logits(loaded.model), reference(IDS).logits) >= 0.99999


def test_our_adapter_round_trips(runtime, tiny_checkpoint, tmp_path):
    loaded, _ = _adapted("deepseek_v3", tiny_checkpoint)  # every target: MLA, dense and shared-expert MLPs
    save_adapter(loaded.model, tmp_path)
    again = load_model(tiny_checkpoint("deepseek_v3"))
    load_adapter(again.model, tmp_path)
    torch.testing.assert_close(_logits(again.model), _logits(loaded.model), rtol=0, atol=0)


def test_adapter_matrices_stream_into_another_models_adapters(runtime, tiny_checkpoint):
    """What an RLHF sync sends to rollout ranks: each whole matrix under peft's name, written into place."""
    from unified.checkpoint.lora import adapter_tensors, write_adapter_tensor

    loaded, _ = _adapted("deepseek_v3", tiny_checkpoint)
    again = load_model(tiny_checkpoint("deepseek_v3"))
    apply_lora(again.model, LoraConfig(rank=4, alpha=8))
    sent = dict(adapter_tensors(loaded.model))
    assert sent and all(write_adapter_tensor(again.model, name, tensor) for name, tensor in sent.items())
    assert not write_adapter_tensor(again.model, "base_model.model.no.such_proj.lora_A.weight", next(iter(sent.values())))
    torch.testing.assert_close(_logits(again.model), _logits(loaded.model), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_merged_weights_give_the_unmerged_logits(family, runtime, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from unified.checkpoint import export_hf

    loaded, _ = _adapted(family, tiny_checkpoint)
    unmerged = _logits(loaded.model)
    assert merge_lora(loaded.model) > 0
    assert not any(".lora." in n for n in loaded.model.state_dict())
    assert not any("lora" in m._modules for m in loaded.model.modules())  # `self.lora` is a plain attribute again
    torch.testing.assert_close(_logits(loaded.model), unmerged, rtol=0, atol=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(export_hf(loaded, tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert _cosine(exported(IDS).logits, unmerged) >= 0.99999


@pytest.mark.parametrize("family,targets", [
    ("llama", None),
    ("deepseek_v3", None),  # kv_b_proj's adapter folded into the latent-space attention of the cache
])
def test_engine_serves_unmerged_adapters_like_merged_weights(family, targets, runtime, tiny_checkpoint):
    from tests.engine.conftest import generate_all, make_engine, reference_logits, run_teacher_forced
    from unified.engine.sampling_params import SamplingParams

    loaded, _ = _adapted(family, tiny_checkpoint, targets)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 23, 40)]
    continuations = [torch.randint(0, 160, (6,), generator=g).tolist() for _ in prompts]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    unmerged = make_engine(loaded, prefix_caching=False)  # its packed copies fold the adapters in
    unmerged_logits = run_teacher_forced(unmerged, prompts, continuations)
    unmerged_tokens = [o.outputs[0].token_ids for o in generate_all(unmerged, prompts, greedy)]
    for got, prompt, cont in zip(unmerged_logits, prompts, continuations):
        torch.testing.assert_close(got, reference_logits(loaded.model, prompt, cont), rtol=0, atol=1e-4)

    merge_lora(loaded.model)
    merged = make_engine(loaded, prefix_caching=False)
    for got, want in zip(run_teacher_forced(merged, prompts, continuations), unmerged_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert [o.outputs[0].token_ids for o in generate_all(merged, prompts, greedy)] == unmerged_tokens


def test_packed_copies_fold_the_adapter_in_only_while_it_is_current(runtime, tiny_checkpoint):
    from unified.checkpoint.lora import adapters_disabled

    loaded, params = _adapted("llama", tiny_checkpoint)
    model = loaded.model
    with torch.no_grad():
        adapted = _logits(model)  # no packed copies yet: base and adapter computed apart
        with adapters_disabled(model):
            base = _logits(model)
    model.pack_weights()
    layer = model.layers["0"].mlp.down_proj
    assert layer.packed.adapter is not None
    calls = []
    layer.lora.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, layer.weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight + layer.lora.delta_weight())
                                   , atol=1e-5, rtol=1e-5)
        assert not calls, "the folded copy ran the adapter a second time"
        torch.testing.assert_close(_logits(model), adapted, atol=1e-5, rtol=1e-5)
        with adapters_disabled(model):  # the copy holds the adapter: the base alone must not read it
            torch.testing.assert_close(_logits(model), base, atol=1e-5, rtol=1e-5)
        for p in params:
            p.mul_(2)  # an in-place update, as an optimizer makes: every folded copy is stale now
        changed = _logits(model)
    model.pack_weights()
    with torch.no_grad():
        torch.testing.assert_close(_logits(model), changed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, adapted, atol=1e-3)


def test_resumed_adapter_trains_only_itself(runtime, tiny_checkpoint, tmp_path):
    loaded, _ = _adapted("qwen3", tiny_checkpoint, dropout=0.1)
    save_adapter(loaded.model, tmp_path)
    model = load_model(tiny_checkpoint("qwen3")).model
    params = load_adapter(model, tmp_path)
    model.train()
    (model.logits(model(IDS, torch.arange(IDS.shape[1]))) ** 2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert model.layers["0"].attn.qkv_proj.lora.p == 0.1


@pytest.mark.parametrize("change,message", [
    (dict(rank=0), "rank of at least 1"),
    (dict(rank=4, targets=["q_proj", "w1"]), "w1"),
    (dict(rank=4, targets=["q_b_proj"]), "names no projection"),
    (dict(rank=4, dropout=1.0), "dropout"),
])
def test_bad_configs_are_refused(change, message, runtime, tiny_checkpoint):
    loaded = load_model(tiny_checkpoint("llama"))
    with pytest.raises(UserError, match=message):
        apply_lora(loaded.model, LoraConfig(**change))


def test_routed_experts_and_second_adapters_are_refused(runtime, tiny_checkpoint, tmp_path):
    loaded = load_model(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(UserError, match="routed MoE experts"):
        apply_lora(loaded.model, LoraConfig(rank=4, experts=True))
    apply_lora(loaded.model, LoraConfig(rank=4))
    with pytest.raises(UserError, match="already has LoRA adapters"):
        apply_lora(loaded.model, LoraConfig(rank=4))
    with pytest.raises(UserError, match="no adapter_config.json"):
        load_adapter(load_model(tiny_checkpoint("qwen3_moe")).model, tmp_path)


def test_unsupported_peft_adapters_are_refused(runtime, tiny_checkpoint, tmp_path):
    loaded, _ = _adapted("llama", tiny_checkpoint)
    save_adapter(loaded.model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UserError, match="use_dora"):
        load_adapter(load_model(tiny_checkpoint("llama")).model, tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="has no linear for"):
        load_adapter(load_model(tiny_checkpoint("deepseek_v3")).model, tmp_path)


def _tensor_parallel_worker(checkpoint: str, adapter: str, out: str) -> None:
    """Under torchrun with 2 ranks: the adapter's logits and gradients, the adapter saved again, and the
    merged logits, at tensor parallel 2."""
    from unified.runtime import Layout, init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"), Layout(tensor=2))
    model = load_model(checkpoint).model
    load_adapter(model, adapter)
    _hidden_loss(model).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    unmerged = _logits(model)
    save_adapter(model, Path(out) / "saved-at-tp2")
    merge_lora(model)
    torch.save({"logits": unmerged, "grads": grads, "merged": _logits(model)},
               Path(out) / f"rank{torch.distributed.get_rank()}.pt")


def _hidden_loss(model) -> torch.Tensor:
    """On the final hidden states, which every tensor-parallel rank holds whole (the logits' gather has no backward)."""
    return (model(IDS, torch.arange(IDS.shape[1])) ** 2).mean()


def test_tensor_parallel_adapters_match_one_rank(runtime, tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    from tests.serve.conftest import free_port

    loaded, _ = _adapted("qwen3", tiny_checkpoint)
    save_adapter(loaded.model, tmp_path / "adapter")
    model = load_model(tiny_checkpoint("qwen3")).model
    load_adapter(model, tmp_path / "adapter")
    _hidden_loss(model).backward()
    logits = _logits(model)
    result = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                             str(free_port()), __file__, str(tiny_checkpoint("qwen3")), str(tmp_path / "adapter"),
                             str(tmp_path)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["merged"], logits, rtol=0, atol=1e-5)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            local, full = got["grads"][name], param.grad
            split = [d for d in range(full.dim()) if local.shape[d] != full.shape[d]]  # B of column, A of row linears
            want = full.chunk(2, dim=split[0])[rank] if split else full
            torch.testing.assert_close(local, want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} on rank {rank}: {m}")
    assert {len([d for d in range(p.dim()) if ranks[0]["grads"][n].shape[d] != p.shape[d]])
            for n, p in model.named_parameters() if p.requires_grad} == {0, 1}  # both split and replicated ones
    want, got = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("adapter", "saved-at-tp2"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


if __name__ == "__main__":
    _tensor_parallel_worker(*sys.argv[1:])
