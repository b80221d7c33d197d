"""A trace specialised to its batch size (unified/engine/trace_specialization.py): its shape arithmetic is folded
into constants, and every tensor it reads, captured constants included, is still read at each replay."""
from __future__ import annotations

import collections
import warnings

import torch

from tests.engine.conftest import make_engine
from tests.engine.test_traced_steps import _generate
from unified.engine.trace_specialization import specialize

SHAPE_OPS = {"aten::size", "aten::numel", "prim::NumToTensor", "aten::Int", "aten::floor_divide", "prim::CallMethod"}


def _kinds(trace) -> collections.Counter:
    return collections.Counter(node.kind() for node in trace.graph.nodes())


def _trace(module, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, inputs, check_trace=False)


class _Inner(torch.nn.Module):
    def __init__(self, table: torch.Tensor, step: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)
        self.table, self.step = table, step  # plain attributes: the tracer holds them as constants

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = (x.reshape(rows, x.shape[-1]).contiguous() @ self.weight.T).view(x.shape[0], x.shape[1], self.weight.shape[0])
        half = y.shape[-1] // 2
        return y[..., :half] * self.table + y[..., half:] * self.step


class _Outer(torch.nn.Module):
    def __init__(self, table, step):
        super().__init__()
        self.inner = _Inner(table, step)

    def forward(self, x):
        return self.inner(x) + 1


def test_shape_arithmetic_is_folded_and_captured_tensors_stay_live():
    table, step = torch.ones(3), torch.tensor(2)
    module, x = _Outer(table, step), torch.randn(2, 5, 4)
    trace = _trace(module, x)
    inlined = trace.inlined_graph
    torch._C._jit_pass_inline(inlined)
    before = collections.Counter(node.kind() for node in inlined.nodes())
    specialize(trace)
    after = _kinds(trace)
    assert before["aten::floor_divide"] == 2 and before["aten::size"] and not any(after[k] for k in SHAPE_OPS)
    with torch.no_grad(), torch.jit.optimized_execution(False):  # as the engine runs them
        torch.testing.assert_close(trace(x), module(x))
        table.mul_(3)  # the captured constants change in place, as the engine's buffers and cache do
        step.fill_(-1)  # a 0-dim integer tensor, as the literals beside sizes are
        module.inner.weight.add_(1)
        torch.testing.assert_close(trace(x), module(x))


def test_the_engines_traces_hold_no_shape_arithmetic_and_no_conversions(tiny_models):
    """Nor, in the layers, a dtype conversion (of the context lengths every layer's attention reads) or a
    contiguous() of a weight: ops that would run in every replay for nothing."""
    engine = make_engine(tiny_models("qwen3"), block_size=16, max_num_seqs=4)
    engine.runner.graphs.record_after = 1
    _generate(engine, max_tokens=4)
    traces = engine.runner.graphs.traces
    assert traces and not engine.runner.graphs.eager_sizes
    for trace in traces.values():
        kinds = _kinds(trace)
        assert not any(kinds[k] for k in SHAPE_OPS), {k: kinds[k] for k in SHAPE_OPS}
        in_layers = [n for n in trace.graph.nodes() if ".layers." in n.scopeName()]
        assert not [n for n in in_layers if n.kind() == "aten::to"]
        assert not [n for n in in_layers
                    if n.kind() == "aten::contiguous" and n.inputsAt(0).node().kind() == "prim::GetAttr"]
