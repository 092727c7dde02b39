"""GEMV calls that read the same input become one call: one parallel region and one pass over the activations.

    before:  y_q = gemv(view(h), [w_q]);  y_k = gemv(view(h), [w_k]);  y_v = gemv(view(h), [w_v])
    after:   y = gemv(view(h), [w_q, w_k, w_v])                        [R, N_q + N_k + N_v]
             y_q, y_k, y_v = y[:, :N_q], y[:, N_q:N_q + N_k], y[:, N_q + N_k:]     views, no copy

In a Llama layer this merges q/k/v and gate/up, so a decode step runs 4 GEMV calls per layer instead of 7 (each call
is an OpenMP parallel region ending in a barrier; the w8a8 kernel also quantizes the activations once per call). The
result is bit-identical: each output column is computed by the same code from the same inputs, whichever call it
belongs to (the kernels' columns do not depend on their neighbours).

Two calls read the same input when their x arguments are the same node seen through the same reshapes and copies
(view, reshape, contiguous) with the same shape: every linear does its own `x.reshape(rows, K).contiguous()`.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from neuron_infer.backends.cpu import kernels as cpu_gemv

aten = torch.ops.aten
_SAME_VALUES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                aten.alias.default}


def _source(node: fx.Node) -> fx.Node:
    """The node whose value `node` is, seen through reshapes and copies."""
    while node.op == "call_function" and node.target in _SAME_VALUES:
        node = node.args[0]
    return node


def _tensor_args(call: fx.Node) -> list[fx.Node]:
    """Every node a GEMV call reads: x and each weight (and scale)."""
    return [call.args[0], *(n for lst in call.args[1:] for n in lst)]


def group_gemvs(gm: fx.GraphModule) -> int:
    """Merge the GEMV calls (cpu_gemv.OPS) of one kind that read the same input, at most cpu_gemv.MAX_GROUP per
    call, in graph order. A call joins a group only if every tensor it reads exists where the group's first call
    stands (the merged call takes that place). Returns the number of calls removed."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    kinds = set(cpu_gemv.OPS.values())
    by_input: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in kinds:
            x = node.args[0]
            shape = tuple(str(d) for d in x.meta["val"].shape)  # a dynamic dim by its symbol (SymInts do not hash)
            by_input[(node.target, _source(x), shape)].append(node)
    removed = 0
    for calls in by_input.values():
        while len(calls) > 1:
            first = calls[0]
            group = [first] + [c for c in calls[1:] if all(order[a] < order[first] for a in _tensor_args(c)[1:])]
            group = group[:cpu_gemv.MAX_GROUP]
            if len(group) > 1:
                _merge(graph, group)
                removed += len(group) - 1
            calls = [c for c in calls if c not in group]
    if removed:
        graph.lint()
        gm.recompile()
    return removed


def _merge(graph: fx.Graph, group: list[fx.Node]) -> None:
    """Replace `group` (calls of one op on one input) by one call and a column slice per call."""
    first = group[0]
    lists = [[n for call in group for n in call.args[i]] for i in range(1, len(first.args))]
    with graph.inserting_before(first):
        merged = graph.call_function(first.target, (first.args[0], *lists))
        merged.meta.update({k: v for k, v in first.meta.items() if k not in ("val", "tensor_meta")})
        merged.meta["val"] = torch.cat([call.meta["val"] for call in group], -1)  # fake tensors: shapes only
        start = 0
        for call in group:
            width = call.meta["val"].shape[-1]
            piece = graph.call_function(aten.slice.Tensor, (merged, 1, start, start + width))
            piece.meta["val"] = merged.meta["val"][:, start:start + width]
            start += width
            call.replace_all_uses_with(piece)
    for call in group:
        x = call.args[0]
        graph.erase_node(call)
        while x.op == "call_function" and x.target in _SAME_VALUES and not x.users:  # its now unused reshapes
            source = x.args[0]
            graph.erase_node(x)
            x = source
