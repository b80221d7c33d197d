"""A decode step's trace specialised to its one batch size: the shape arithmetic it recorded, folded.

`torch.jit.trace` records every size the Python read (`x.shape`, `numel()`, the `//` and `*` on them, the lists
given to `view`) as ops that run again at each replay: a traced decoder layer ran ~170 interpreter ops around
its ~10 kernels. A trace of traced_steps.py serves one exact batch size, so every such size is a constant. This
pass inlines the module calls, replaces the sizes of tensors whose shapes the trace recorded, and of the
module's parameters (which keep their shapes, through sleep mode too), by constants, folds the integer
arithmetic and the integer lists built on them, drops `contiguous()` of tensors recorded contiguous, lowers
tuples and removes what has no use left.

It folds integers only. No tensor in the graph is evaluated, constants included: the step's buffers and the KV
cache are constants of the trace, and folding a read of them would freeze the values they hold now (why the
traces run unoptimised). The one kind of tensor it reads is the 0-dim integer literal that the tracer makes of
a Python number in arithmetic on a size (`x.shape[-1] // 2`), and only beside such a size.
"""
from __future__ import annotations

import math

import torch

_TensorType = torch._C.TensorType
_ARITHMETIC = {"aten::floor_divide": lambda a, b: a // b, "aten::floordiv": lambda a, b: a // b,
               "aten::mul": lambda a, b: a * b, "aten::add": lambda a, b: a + b, "aten::sub": lambda a, b: a - b}
_PASS_THROUGH = {"prim::NumToTensor", "aten::Int", "aten::ScalarImplicit"}


def specialize(trace: torch.jit.ScriptModule) -> None:
    """Specialises `trace`'s forward in place; run it before the trace's first call."""
    graph = trace.graph
    _inline(graph, trace)
    _Folder(graph, trace).fold()
    torch._C._jit_pass_lower_all_tuples(graph)
    torch._C._jit_pass_dce(graph)


def _inline(graph: torch._C.Graph, root: torch.jit.ScriptModule) -> None:
    """Replaces each call of a submodule's method by that method's graph, a level of calls at a time. torch's
    own inliner would insert the methods' pre-optimised graphs, whose constant pooling merges tensor constants
    that held equal values when traced (two buffers, or a buffer and a literal): one would be read for both."""
    while True:
        calls = [node for node in graph.nodes() if node.kind() == "prim::CallMethod"]
        if not calls:
            return
        modules = _attributes(graph, root)
        for node in calls:
            method = modules[node.inputsAt(0).unique()]._c._get_method(node.s("name"))
            with graph.insert_point_guard(node):
                outputs = graph.insertGraph(method.graph.copy(), list(node.inputs()))
            for old, new in zip(node.outputs(), outputs):
                old.replaceAllUsesWith(new)
            node.destroy()


def _attributes(graph: torch._C.Graph, root: torch.jit.ScriptModule) -> dict[int, object]:
    """What each `prim::GetAttr` of the graph reads (submodules, parameters, buffers), by the value it defines;
    the graph's `self` is `root`."""
    objects = {next(graph.inputs()).unique(): root}
    for node in graph.nodes():
        if node.kind() == "prim::GetAttr" and node.inputsAt(0).unique() in objects:
            objects[node.output().unique()] = getattr(objects[node.inputsAt(0).unique()], node.s("name"))
    return objects


def _sizes(value: torch._C.Value) -> list[int] | None:
    kind = value.type()
    if not isinstance(kind, _TensorType) or kind.sizes() is None or None in kind.sizes():
        return None
    return list(kind.sizes())


def _recorded_contiguous(value: torch._C.Value) -> bool:
    sizes, strides = _sizes(value), value.type().strides() if isinstance(value.type(), _TensorType) else None
    if sizes is None or strides is None or None in strides:
        return False
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _is_zero(literal) -> bool:
    return isinstance(literal, int) and literal == 0  # memory_format: torch.contiguous_format


class _Folder:
    def __init__(self, graph: torch._C.Graph, root: torch.jit.ScriptModule):
        self.graph = graph
        self.sizes: dict[int, int | list[int]] = {}  # values known from shapes (or built on them only)
        self.objects = _attributes(graph, root)

    def fold(self) -> None:
        constants, aliases = [], []
        for node in self.graph.nodes():
            kind, inputs = node.kind(), list(node.inputs())
            if kind == "aten::contiguous" and _recorded_contiguous(inputs[0]) and _is_zero(self._literal(inputs[1])):
                aliases.append(node)  # contiguous() of a contiguous tensor is that tensor
                continue
            value = self._evaluate(kind, inputs)
            if value is None:
                continue
            self.sizes[node.output().unique()] = value
            if not isinstance(node.output().type(), _TensorType):
                constants.append((node, value))
        for node, value in constants:
            with self.graph.insert_point_guard(node):
                node.output().replaceAllUsesWith(self.graph.insertConstant(value))
        for node in aliases:
            node.output().replaceAllUsesWith(node.inputsAt(0))

    def _evaluate(self, kind: str, inputs: list) -> int | list[int] | None:
        if kind in ("aten::size", "aten::numel", "aten::dim"):
            owner = self.objects.get(inputs[0].unique())
            sizes = list(owner.shape) if isinstance(owner, torch.Tensor) else _sizes(inputs[0])
            if sizes is None:
                return None
            if kind == "aten::numel":
                return math.prod(sizes)
            if kind == "aten::dim":
                return len(sizes)
            if len(inputs) == 1:
                return sizes
            dim = self._literal(inputs[1])
            return sizes[dim] if isinstance(dim, int) else None
        if kind in _PASS_THROUGH:
            return self.sizes.get(inputs[0].unique())
        if kind in _ARITHMETIC:
            if len(inputs) == 3 and self._literal(inputs[2]) != 1:  # tensor add/sub: alpha must be 1
                return None
            left, right = (self._operand(v) for v in inputs[:2])
            known = inputs[0].unique() in self.sizes or inputs[1].unique() in self.sizes
            if known and isinstance(left, int) and isinstance(right, int):
                return _ARITHMETIC[kind](left, right)
            return None
        if kind == "prim::ListConstruct":
            items = [self._operand(v) for v in inputs]
            return items if all(isinstance(item, int) for item in items) else None
        return None

    def _operand(self, value: torch._C.Value) -> int | None:
        """A size, an integer literal, or the 0-dim integer tensor the tracer makes of one."""
        known = self.sizes.get(value.unique())
        if isinstance(known, int):
            return known
        literal = self._literal(value)
        if isinstance(literal, torch.Tensor):
            integer = literal.dim() == 0 and not literal.is_floating_point() and not literal.is_complex()
            return int(literal.item()) if integer else None
        return literal if isinstance(literal, int) and not isinstance(literal, bool) else None

    @staticmethod
    def _literal(value: torch._C.Value):
        node = value.node()
        return value.toIValue() if node.kind() == "prim::Constant" else None
