"""nki.collectives over a simulated group of ranks (nki.simulator.simulate_ranks), on the examples the NKI 0.6 API
reference gives for each collective, plus the rendezvous rules: matched by order per program, mismatches and
missing peers are errors, a plain launch is one rank."""
from __future__ import annotations

import ml_dtypes
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest
from nki.collectives import ReplicaGroup
from nki.simulator import simulate_ranks

from nki_kernels.sim import SimulationError

from .conftest import hbm_out, run, sbuf_in


def _staged(x, shape=None):
    """Copy an input into a fresh shared_hbm tensor (collectives work on internal tensors)."""
    t = nl.ndarray(shape or x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    if shape is None:
        nisa.dma_copy(dst=t, src=x)
    return t


def _all_reduce(x, group, op):
    src, dst = _staged(x), _staged(x, x.shape)
    ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=group, op=op)
    return dst


def _all_gather(x, group, n, dim):
    src = _staged(x)
    shape = tuple(s * n if i == dim else s for i, s in enumerate(x.shape))
    dst = _staged(x, shape)
    ncc.all_gather(srcs=[src], dsts=[dst], replica_group=group, collective_dim=dim)
    return dst


def _all_gather_sbuf(x, group, n):
    src = sbuf_in(x)
    dst = nl.ndarray((x.shape[0], x.shape[1] * n), dtype=x.dtype, buffer=nl.sbuf)
    ncc.all_gather(srcs=[src], dsts=[dst], replica_group=group, collective_dim=1)
    return hbm_out(dst)


def _reduce_scatter(x, group, n):
    src, dst = _staged(x), _staged(x, (x.shape[0] // n, x.shape[1]))
    ncc.reduce_scatter(srcs=[src], dsts=[dst], replica_group=group, collective_dim=0, op=nl.add)
    return dst


def _all_to_all(x, group):
    src, dst = _staged(x), _staged(x, x.shape)
    ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=group, collective_dim=0)
    return dst


def _ranks(kernel, xs, lnc=None, **kwargs):
    return simulate_ranks(kernel, [dict(x=x, **kwargs) for x in xs], lnc=lnc, target="trn2")


def test_all_reduce_sums_over_the_ranks_reference_example():
    """Reference example: replica_group [[0, 1]], both ranks [[1,2,3],[4,5,6]] -> [[2,4,6],[8,10,12]]."""
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    out = _ranks(_all_reduce, [x, x], group=ReplicaGroup([[0, 1]]), op=nl.add)
    for o in out:
        np.testing.assert_array_equal(o, 2 * x)


def test_all_reduce_max_and_sub_groups_reduce_separately():
    xs = [np.full((2, 4), r, np.float32) for r in range(4)]
    out = _ranks(_all_reduce, xs, group=ReplicaGroup([[0, 2], [1, 3]]), op=nl.maximum)
    assert [float(o[0, 0]) for o in out] == [2, 3, 2, 3]


def test_all_reduce_rejects_an_op_outside_add_min_max():
    x = np.ones((2, 2), np.float32)
    with pytest.raises(SimulationError, match="op must be one of"):
        _ranks(_all_reduce, [x, x], group=ReplicaGroup([[0, 1]]), op=nl.multiply)


@pytest.mark.parametrize("lnc", [None, 2])
def test_all_gather_concatenates_in_group_order(lnc):
    """Reference example: rank0 [[1,2,3],[4,5,6]], rank1 [[7,8,9],[10,11,12]] -> both get all four rows."""
    xs = [np.arange(6, dtype=np.float32).reshape(2, 3) + 1, np.arange(6, dtype=np.float32).reshape(2, 3) + 7]
    out = _ranks(_all_gather, xs, lnc=lnc, group=ReplicaGroup([[0, 1]]), n=2, dim=0)
    for o in out:
        np.testing.assert_array_equal(o, np.arange(12, dtype=np.float32).reshape(4, 3) + 1)
    rev = _ranks(_all_gather, xs, group=ReplicaGroup([[1, 0]]), n=2, dim=0)
    np.testing.assert_array_equal(rev[0][:2], xs[1])


def test_all_gather_on_sbuf_along_the_free_dim_keeps_bf16_bits():
    xs = [np.random.default_rng(r).standard_normal((4, 8)).astype(ml_dtypes.bfloat16) for r in range(3)]
    out = _ranks(_all_gather_sbuf, xs, group=ReplicaGroup([[0, 1, 2]]), n=3)
    np.testing.assert_array_equal(out[2], np.concatenate(xs, axis=1))


def test_all_gather_on_hbm_supports_only_dim_0():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(SimulationError, match="collective_dim must be 0 for HBM"):
        _ranks(_all_gather, [x, x], group=ReplicaGroup([[0, 1]]), n=2, dim=1)


def test_reduce_scatter_reference_example():
    """Reference example: both ranks [[1],[2],[3],[4]] (as rows) -> rank0 [[2],[4]], rank1 [[6],[8]]."""
    x = np.repeat(np.arange(1, 5, dtype=np.float32)[:, None], 3, axis=1)
    out = _ranks(_reduce_scatter, [x, x], group=ReplicaGroup([[0, 1]]), n=2)
    np.testing.assert_array_equal(out[0][:, 0], [2, 4])
    np.testing.assert_array_equal(out[1][:, 0], [6, 8])


def test_all_to_all_reference_example():
    """Reference example: rank0 rows a0, a1; rank1 rows b0, b1 -> rank0 [a0, b0], rank1 [a1, b1]."""
    a = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    b = np.array([[7, 8, 9], [10, 11, 12]], np.float32)
    out = _ranks(_all_to_all, [a, b], group=ReplicaGroup([[0, 1]]))
    np.testing.assert_array_equal(out[0], [[1, 2, 3], [7, 8, 9]])
    np.testing.assert_array_equal(out[1], [[4, 5, 6], [10, 11, 12]])


def _rank_slice(x):
    """Reference example for rank_id: select slice rank_id of a [ranks, H, W] input with scalar_offset."""
    _, h, w = x.shape
    out = nl.ndarray((h, w), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x.ap(pattern=[[w, h], [1, w]], scalar_offset=ncc.rank_id(), indirect_dim=0))
    return out


def test_rank_id_selects_each_ranks_slice_and_is_0_in_a_plain_launch():
    x = np.arange(24, dtype=np.float32).reshape(3, 2, 4)
    out = _ranks(_rank_slice, [x, x, x])
    for r in range(3):
        np.testing.assert_array_equal(out[r], x[r])
    np.testing.assert_array_equal(run(_rank_slice, x, target="trn2"), x[0])


def test_rank_id_is_a_register_not_a_python_int():
    def kernel(x):
        return ncc.rank_id() + 1
    with pytest.raises(TypeError):
        _ranks(kernel, [np.zeros((1, 1), np.float32)] * 2)


def _ring(x, group, steps, channels):
    """Ring all-gather: at step i write the block of the rank whose data is here (current_processing_rank_id) to
    its slot, then pass the block on with collective_permute_implicit; one copy of the data per channel."""
    h, w = x.shape
    n = len(group.groups[0])
    out = nl.ndarray((channels, n, h, w), dtype=x.dtype, buffer=nl.shared_hbm)
    bufs = [[_staged(x) for _ in range(channels)], [_staged(x, x.shape) for _ in range(channels)]]
    for i in range(steps):
        cur, nxt = bufs[i % 2], bufs[(i + 1) % 2]
        for c in range(channels):
            who = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=i, replica_group=group,
                                                                             channel_id=c)
            view = out.ap(pattern=[[w, h], [1, w]], offset=c * n * h * w, scalar_offset=who, indirect_dim=1)
            nisa.dma_copy(dst=view, src=cur[c])
        if i + 1 < steps:
            ncc.collective_permute_implicit(srcs_by_channel=[[t] for t in cur], dsts_by_channel=[[t] for t in nxt],
                                            replica_group=group, channel_ids=list(range(channels)))
    return out


@pytest.mark.parametrize("channels", [1, 2])
def test_implicit_permute_and_processing_rank_id_gather_the_ring(channels):
    xs = [(np.full((2, 3), 10 * r) + np.arange(3)).astype(np.float32) for r in range(4)]
    out = _ranks(_ring, xs, group=ReplicaGroup([[0, 1, 2, 3]]), steps=4, channels=channels)
    for o in out:
        for c in range(channels):
            np.testing.assert_array_equal(o[c], np.stack(xs))


def test_one_permute_step_delivers_the_predecessors_data():
    xs = [np.full((1, 2), r, np.float32) for r in range(3)]

    def kernel(x):
        src, dst = _staged(x), _staged(x, x.shape)
        ncc.collective_permute_implicit(srcs_by_channel=[[src]], dsts_by_channel=[[dst]],
                                        replica_group=ReplicaGroup([[2, 0, 1]]))
        return dst
    out = simulate_ranks(kernel, [{"x": x} for x in xs])
    assert [float(o[0, 0]) for o in out] == [2, 0, 1]   # ring 2 -> 0 -> 1 -> 2


def test_implicit_permute_reduce_sends_the_combined_sources():
    def kernel(x):
        a, b, dst = _staged(x), _staged(x), _staged(x, x.shape)
        ncc.collective_permute_implicit_reduce(srcs0_by_channel=[[a]], srcs1_by_channel=[[b]],
                                               dsts_by_channel=[[dst]], replica_group=ReplicaGroup([[0, 1]]),
                                               op=nl.add)
        return dst
    out = simulate_ranks(kernel, [{"x": np.full((2, 2), r + 1, np.float32)} for r in range(2)])
    assert float(out[0][0, 0]) == 4 and float(out[1][0, 0]) == 2


def test_explicit_permute_follows_the_pairs_and_leaves_non_targets():
    def kernel(x):
        src, dst = _staged(x), _staged(x)   # dst starts as this rank's own data
        ncc.collective_permute(srcs=[src], dsts=[dst], source_target_pairs=[(0, 1), (1, 2)])
        return dst
    out = simulate_ranks(kernel, [{"x": np.full((1, 2), r + 5, np.float32)} for r in range(3)])
    assert [float(o[0, 0]) for o in out] == [5, 5, 6]


def _v_kernel(x, meta, group, flavour):
    dst = nl.ndarray((8,), dtype=x.dtype, buffer=nl.shared_hbm)
    src, m = _staged(x), _staged(meta)
    getattr(ncc, flavour)(srcs=[src], dsts=[dst], replica_group=group, metadata_tensor=m)
    return dst, m


def test_all_gather_v_broadcasts_a_chunk_into_equal_slots_and_reports_counts():
    xs = [np.arange(6, dtype=np.float32) + 10 * r for r in range(2)]
    metas = [np.array([[2, 2], [1, 1], [0, 0]], np.uint32), np.array([[3, 3], [0, 0], [0, 0]], np.uint32)]
    out = simulate_ranks(_v_kernel, [{"x": x, "meta": m, "group": ReplicaGroup([[0, 1]]), "flavour": "all_gather_v"}
                                     for x, m in zip(xs, metas)])
    for dst, meta in out:
        np.testing.assert_array_equal(dst[:2], [1, 2])            # rank 0's src[1:3] in slot 0
        np.testing.assert_array_equal(dst[4:7], [10, 11, 12])     # rank 1's src[0:3] in slot 1
        np.testing.assert_array_equal(meta[2], [2, 3])


def test_all_to_all_v_sends_each_destination_its_own_chunk():
    xs = [np.arange(6, dtype=np.float32) + 10 * r for r in range(2)]
    metas = [np.array([[1, 2], [0, 3], [0, 0]], np.uint32), np.array([[3, 1], [0, 5], [0, 0]], np.uint32)]
    out = simulate_ranks(_v_kernel, [{"x": x, "meta": m, "group": ReplicaGroup([[0, 1]]), "flavour": "all_to_all_v"}
                                     for x, m in zip(xs, metas)])
    np.testing.assert_array_equal(out[0][0][:1], [0])
    np.testing.assert_array_equal(out[0][0][4:7], [10, 11, 12])
    np.testing.assert_array_equal(out[1][0][:2], [3, 4])
    np.testing.assert_array_equal(out[1][0][4:5], [15])
    np.testing.assert_array_equal(out[1][1][2], [2, 1])


def test_mismatched_collectives_across_ranks_are_an_error():
    def kernel(x):
        src = _staged(x)
        if ncc.rank_id().value == 0:
            ncc.all_reduce(srcs=[src], dsts=[_staged(x, x.shape)], replica_group=ReplicaGroup([[0, 1]]), op=nl.add)
        else:
            ncc.all_gather(srcs=[src], dsts=[_staged(x, (4, 2))], replica_group=ReplicaGroup([[0, 1]]),
                           collective_dim=0)
        return src
    with pytest.raises(SimulationError, match="does not match across ranks"):
        simulate_ranks(kernel, [{"x": np.ones((2, 2), np.float32)}] * 2)


def test_a_rank_that_skips_the_collective_is_reported_not_a_hang():
    def kernel(x):
        src = _staged(x)
        if ncc.rank_id().value == 0:
            ncc.all_reduce(srcs=[src], dsts=[_staged(x, x.shape)], replica_group=ReplicaGroup([[0, 1]]), op=nl.add)
        return src
    with pytest.raises(SimulationError, match="returned without the matching collective"):
        simulate_ranks(kernel, [{"x": np.ones((2, 2), np.float32)}] * 2)


def test_a_group_beyond_a_single_rank_launch_points_to_simulate_ranks():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(SimulationError, match="simulate_ranks"):
        run(_all_reduce, x, group=ReplicaGroup([[0, 1]]), op=nl.add, target="trn2")
    np.testing.assert_array_equal(run(_all_reduce, x, group=ReplicaGroup([[0]]), op=nl.add, target="trn2"), x)


def test_replica_group_rejects_overlapping_sub_groups():
    with pytest.raises(SimulationError, match="must not overlap"):
        ReplicaGroup([[0, 1], [1, 2]])
