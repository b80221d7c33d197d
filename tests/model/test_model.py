"""Behaviour of the model definition beyond parity: forward context, routing, meta construction."""
import pytest
import torch

from tests.conftest import TINY_FAMILIES
from unified.checkpoint import load_model
from unified.model.attention import SegmentAttention, causal_attention
from unified.model.config import MoEConfig, ModelConfig
from unified.model.forward_context import forward_context, get_forward_context
from unified.model.moe import Router
from unified.model.transformer import CausalLM


class RecordingContext:
    """Attends exactly like training attention but records which layers asked."""

    def __init__(self):
        self.layers = []

    def attend(self, layer, q, k, v, scale, sliding_window):
        self.layers.append(layer)
        return causal_attention(q, k, v, scale, sliding_window)


def test_attention_reads_the_forward_context(runtime, tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3")).model
    ids, positions = torch.randint(0, 160, (1, 10)), torch.arange(10)
    with torch.inference_mode():
        plain = model(ids, positions)
        ctx = RecordingContext()
        with forward_context(ctx):
            assert get_forward_context() is ctx
            via_context = model(ids, positions)
    assert get_forward_context() is None
    assert ctx.layers == [0, 1, 2]
    torch.testing.assert_close(via_context, plain)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "deepseek_v3"])
def test_segments_sharing_a_prefix_compute_what_each_sequence_alone_does(family, runtime, tiny_checkpoint):
    """One row: a prefix, then two continuations that each see the prefix and themselves (past a sliding
    window for mistral and qwen2), then padding; MLA (deepseek_v3) attends through the same context."""
    model = load_model(tiny_checkpoint(family)).model
    prefix, first, second = (torch.randint(0, 160, (n,)).tolist() for n in (5, 9, 7))
    ids = torch.tensor([prefix + first + second + [0, 0]])
    positions = torch.tensor([list(range(14)) + list(range(5, 12)) + [0, 0]])
    segments = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7 + [-1] * 2])
    with torch.no_grad(), forward_context(SegmentAttention(segments, positions)):
        packed = model(ids, positions)[0]
    with torch.no_grad():
        alone = [model(torch.tensor([prefix + rest]), torch.arange(5 + len(rest)))[0] for rest in (first, second)]
    torch.testing.assert_close(packed[:14], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[14:21], alone[1][5:], atol=1e-5, rtol=1e-5)
    assert packed[21:].isfinite().all()


def test_group_limited_routing_only_picks_from_best_groups():
    moe = MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=4, scoring="sigmoid", score_correction_bias=True,
                    num_groups=4, topk_groups=1, routed_scaling_factor=2.0)
    router = Router(hidden_size=8, moe=moe, dtype=torch.float32)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        router.score_bias.zero_()
    x = torch.full((1, 8), -5.0)
    x[0, 6], x[0, 7], x[0, 0] = 4.0, 3.0, 5.0  # best single expert is 0, but group 3 (experts 6, 7) sums higher
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(weights.sum(), torch.tensor(2.0))


def test_giant_layout_builds_on_meta_device(runtime):
    from unified.model.config import MLAConfig

    config = ModelConfig(family="deepseek_v3", vocab_size=163840, hidden_size=7168, num_layers=4, num_heads=64,
                         num_kv_heads=64, head_dim=192, intermediate_size=18432,
                         mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128),
                         moe=MoEConfig(num_experts=384, top_k=8, expert_intermediate_size=2048, scoring="sigmoid",
                                       score_correction_bias=True, shared_intermediate_size=2048, dense_layers=[0]))
    with torch.device("meta"):
        model = CausalLM(config, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    experts_per_layer = 384 * 3 * 7168 * 2048
    assert params > 3 * experts_per_layer
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_every_tensor_is_built_on_the_device_and_in_the_dtype_asked_for(family, runtime, tiny_checkpoint):
    """A tensor left on the host (computed RoPE frequencies) fails the first forward on an accelerator; a
    norm left in float32 turns a bf16 model's activations float32 (both were found on a GPU)."""
    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config

    config = model_config_from_hf(read_hf_config(tiny_checkpoint(family)))
    with torch.device("meta"):
        model = CausalLM(config, torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {name for name, t in tensors.items() if t.device.type != "meta"} == set()
    float32_by_design = {"score_bias", "inv_freq"}  # routing bias and RoPE frequencies stay float32, as in HF
    assert {name for name, t in tensors.items()
            if t.dtype != torch.bfloat16 and name.split(".")[-1] not in float32_by_design} == set()
