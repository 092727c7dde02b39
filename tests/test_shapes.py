"""neuron_infer.shapes.known: a fast path is taken only where every shape a graph serves takes it."""
import torch

from neuron_infer.shapes import known


class _Rows(torch.nn.Module):
    def forward(self, x):  # x [R, 4]
        return x * 2 if known(x.shape[0] <= 8) else x + 1  # the two paths are distinguishable


def _export(lo, hi):
    rows = torch.export.Dim("rows", min=lo, max=hi)
    return torch.export.export(_Rows(), (torch.ones(3, 4),), dynamic_shapes=({0: rows},), strict=False)


def test_plain_bools_and_traced_shapes_are_themselves():
    assert known(True) and not known(False)
    assert known(3 <= 8) and not known(9 <= 8)


def test_a_range_inside_the_limit_takes_the_fast_path_a_range_across_it_does_not():
    x = torch.ones(3, 4)
    assert torch.equal(_export(2, 8).module()(x), x * 2)
    assert torch.equal(_export(2, 64).module()(x), x + 1)  # undecided: the path that serves any row count
    assert torch.equal(_export(2, 64).module()(torch.ones(40, 4)), torch.ones(40, 4) + 1)  # and no guard on 3
