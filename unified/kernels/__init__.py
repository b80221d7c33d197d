"""Custom ops. Model and engine code call these functions, never an implementation directly.

Each op has a plain-PyTorch reference (any device, the ground truth in tests) and, where one exists,
a faster path chosen by the input's device and dtype (registry.py: C++ on CPU, Triton on accelerators; the
sources are in the repository's kernels/ folder). Each is also a `torch.ops.unified` custom op (ops.py), which
traced code calls.
"""
from unified.kernels.activation import gated_activation, gated_activation_reference
from unified.kernels.argmax import (argmax_merge_, argmax_merge_reference, argmax_rows, argmax_rows_reference,
                                    topk_merge_, topk_merge_reference)
from unified.kernels.cpu_ops import training_path
from unified.kernels.kv_quant import dequantize_kv, packed_dim, quantize_kv, scale_layout
from unified.kernels.linear import (QUANTIZATIONS, PackedHead, PackedWeight, dequantize, head_argmax, head_logits,
                                     linear, pack_head, pack_weight, quantize, rescore_top,
                                     serves_quantized, takes_inference_path)
from unified.kernels.moe import experts as moe_experts, route_topk
from unified.kernels.paged_attention import (AttentionPlan, paged_attention, paged_decode, plan_paged_attention,
                                             write_kv)
from unified.kernels.registry import set_backend
from unified.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from unified.kernels.rotary import apply_rotary, norm_rope_, norm_rope_applies
from unified.kernels import ops  # noqa: E402,F401 (registers torch.ops.unified.*)

__all__ = ["add_rms_norm", "apply_rotary", "argmax_merge_", "argmax_merge_reference", "argmax_rows",
           "argmax_rows_reference", "AttentionPlan", "dequantize", "dequantize_kv", "gated_activation",
           "gated_activation_reference", "head_argmax", "head_logits", "linear", "moe_experts", "norm_rope_",
           "norm_rope_applies", "pack_head", "pack_weight", "packed_dim", "PackedHead", "PackedWeight",
           "paged_attention", "QUANTIZATIONS", "paged_decode", "plan_paged_attention", "quantize", "quantize_kv",
           "rescore_top", "rms_norm", "rms_norm_reference", "route_topk", "scale_layout", "serves_quantized",
           "set_backend", "takes_inference_path", "topk_merge_", "topk_merge_reference", "training_path",
           "write_kv"]
