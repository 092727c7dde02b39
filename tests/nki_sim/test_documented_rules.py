"""Rules relaxed to what the NKI 0.6 API reference documents (each case is valid NKI code the docs allow)."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import SimulationError, SimulatorWarning

from .conftest import hbm_out, run, sbuf_in


def test_kernel_inputs_are_shared_hbm_and_compare_equal_to_hbm():
    """The SDK's MXFP deep-dive kernels assert ``input.buffer == nl.hbm``; inputs are also shared by both cores."""
    seen = {}

    def kernel(x_hbm):
        seen.update(hbm=x_hbm.buffer == nl.hbm, shared=x_hbm.buffer == nl.shared_hbm, sbuf=x_hbm.buffer == nl.sbuf,
                    private_vs_shared=nl.hbm == nl.shared_hbm, is_hbm=nl.is_hbm(x_hbm.buffer))
        return x_hbm

    run(kernel, np.zeros((2, 2), np.float32))
    assert seen == {"hbm": True, "shared": True, "sbuf": False, "private_vs_shared": False, "is_hbm": True}


def test_dge_mode_accepts_the_documented_integers(rng):
    x = rng.standard_normal((4, 4)).astype(np.float32)

    def kernel(x_hbm, mode):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x_hbm, dge_mode=mode)
        return hbm_out(t)

    for mode in (0, 1, 2, 3):   # unknown, swdge, hwdge, none
        np.testing.assert_array_equal(run(kernel, x, mode), x)

    def cast_with_hwdge(x_hbm):   # 2 is hwdge: equal dtypes required
        nisa.dma_copy(dst=nl.ndarray((4, 4), nl.bfloat16, buffer=nl.sbuf), src=x_hbm, dge_mode=2)

    with pytest.raises(SimulationError, match="hwdge needs equal dtypes"):
        run(cast_with_hwdge, x)
    assert nisa.dge_mode(2) is nisa.dge_mode.hwdge and nisa.dge_mode.unknown.value == 0


@pytest.mark.parametrize("target,expect", [("trn1", (False, False)), ("trn2", (True, False)), ("trn3", (True, True))])
def test_nc_version_values_are_ordered(target, expect):
    got = {}

    def kernel():
        v = nisa.get_nc_version()
        got["v"] = (v >= nisa.nc_version.gen3, v > nisa.nc_version.gen3)

    run(kernel, target=target)
    assert got["v"] == expect
    assert sorted([nisa.nc_version.gen4, nisa.nc_version.gen2]) == [nisa.nc_version.gen2, nisa.nc_version.gen4]


def test_nkiobject_keyword_constructor_and_dataclasses():
    cfg = nl.NKIObject(tile=128, name="x")
    assert (cfg.tile, cfg.name) == (128, "x")

    @dataclasses.dataclass
    class Params(nl.NKIObject):
        n: int
        scale: float = 1.0

    assert Params(4).n == 4 and Params(4, 0.5).scale == 0.5

    @dataclasses.dataclass
    class Section(nl.NKIObject):   # attributes without annotations are not dataclass fields
        index = None
        offset = None

    sec = Section(index=3, offset=256)
    assert (sec.index, sec.offset) == (3, 256) and Section().index is None
    with pytest.raises(TypeError):
        Section(undeclared=1)

    part = Params(scale=2.0)             # keywords only: a field left out stays unset, as NKIObject(**kw) does
    assert part.scale == 2.0 and not hasattr(part, "n")
    with pytest.raises(TypeError):
        Params(scale=2.0, undeclared=1)


def test_nc_stream_shuffle_broadcasts_one_partition_to_a_quadrant(rng):
    x = rng.standard_normal((1, 6)).astype(np.float32)

    def kernel(x_hbm):
        src = sbuf_in(x_hbm)
        dst = nl.ndarray((32, 6), nl.float32, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=[0] * 32)
        return hbm_out(dst)

    np.testing.assert_array_equal(run(kernel, x), np.repeat(x, 32, axis=0))


def test_dma_transpose_4d_default_axes_are_3_1_2_0(rng):
    x = rng.standard_normal((2, 3, 4, 5)).astype(ml_dtypes.bfloat16)

    def kernel(x_hbm):
        t = nl.ndarray((5, 3, 4, 2), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x_hbm)
        out = nl.ndarray((5, 3, 4, 2), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(run(kernel, x, target="trn2"), np.transpose(x, (3, 1, 2, 0)))


def test_empty_ds_slices_are_legal_and_move_nothing(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)

    def kernel(x_hbm):
        t = nl.zeros((4, 8), nl.float32, buffer=nl.sbuf)
        empty = x_hbm[:, nl.ds(8, 0)]
        assert empty.shape == (4, 0) and empty.size == 0
        nisa.dma_copy(dst=t[:, nl.ds(3, 0)], src=x_hbm[:, nl.ds(5, 0)])
        return hbm_out(t)

    np.testing.assert_array_equal(run(kernel, x), np.zeros_like(x))


def test_access_pattern_bounds_are_checked_when_read_not_when_built():
    def kernel():
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        beyond = t.ap([[8, 4], [1, 9]])    # reaches element 32 of 32: fine while unused
        assert beyond.shape == (4, 9)
        nisa.tensor_copy(dst=nl.ndarray((4, 9), nl.float32, buffer=nl.sbuf), src=beyond)

    with pytest.raises(SimulationError, match="outside tensor"):
        run(kernel)


def test_tiles_placed_with_address_are_not_charged_as_new_capacity():
    usable = 245_752 // 4   # fp32 elements per partition on trn3

    def placed():
        arena = nl.ndarray((128, usable), nl.float32, buffer=nl.sbuf, name="arena")
        tiles = [nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, address=(0, k * 4096)) for k in range(4)]
        return arena, tiles   # everything stays live

    run(lambda: placed() and None)

    def unplaced():
        arena = nl.ndarray((128, usable), nl.float32, buffer=nl.sbuf, name="arena")
        extra = nl.ndarray((128, 1024), nl.float32, buffer=nl.sbuf, name="extra")
        return arena, extra

    with pytest.warns(SimulatorWarning, match="extra"):
        run(lambda: unplaced() and None)


def test_shared_constant_from_an_npy_path(tmp_path, rng):
    c = rng.standard_normal((3, 5)).astype(np.float32)
    path = tmp_path / "table.npy"
    np.save(path, c)

    def kernel():
        return nl.shared_constant(str(path))

    np.testing.assert_array_equal(run(kernel), c)
    with pytest.raises(SimulationError, match=".npy"):
        run(lambda: nl.shared_constant(str(tmp_path / "table.txt")))


def test_dma_transpose_of_4_byte_data_without_hwdge(rng):
    """Only the hardware-DGE lowering is documented to need 2-byte dtypes."""
    x = rng.integers(-100, 100, size=(8, 16)).astype(np.int32)

    def kernel(x_hbm, mode):
        t = nl.ndarray((16, 8), nl.int32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=x_hbm, dge_mode=mode)
        return hbm_out(t)

    np.testing.assert_array_equal(run(kernel, x, nisa.dge_mode.unknown, target="trn2"), x.T)
    with pytest.raises(SimulationError, match="2-byte ones with dge_mode=hwdge"):
        run(kernel, x, nisa.dge_mode.hwdge, target="trn2")


def test_vector_offset_gathers_and_scatters_rows_with_oob_skip(rng):
    """``.ap(pattern, vector_offset=idx)``: row i starts at ``idx[i] * row_size`` (row size from the tensor's shape)."""
    table = rng.standard_normal((10, 6)).astype(np.float32)
    rows = np.array([[7], [2], [2], [99]], np.int32)   # 99 is out of range

    def kernel(t_hbm, r_hbm, skip):
        idx = sbuf_in(r_hbm)
        got = nl.zeros((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=got, src=t_hbm.ap([[6, 4], [1, 6]], vector_offset=idx, indirect_dim=0),
                      oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error)
        out = nl.zeros((10, 6), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out.ap([[6, 4], [1, 6]], vector_offset=idx, indirect_dim=0), src=got,
                      oob_mode=nisa.oob_mode.skip)
        return hbm_out(got), out

    got, out = run(kernel, table, rows, True)
    np.testing.assert_array_equal(got, np.stack([table[7], table[2], table[2], np.zeros(6, np.float32)]))
    ref = np.zeros_like(table)
    ref[7], ref[2] = table[7], table[2]
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(SimulationError, match="outside the tensor"):
        run(kernel, table, rows, False)


def test_scalar_offset_past_the_end_is_skipped_with_oob_skip(rng):
    """oob_mode.skip also covers a pattern moved out of range by a runtime scalar_offset: nothing is written."""
    src = rng.standard_normal((2, 4)).astype(np.float32)

    def kernel(s_hbm, offset, skip):
        tile = sbuf_in(s_hbm)
        off = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=off, value=offset)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=nl.zeros((4, 4), nl.float32, buffer=nl.sbuf))
        nisa.dma_copy(dst=out.ap([[4, 2], [1, 4]], offset=0, scalar_offset=off, indirect_dim=0), src=tile,
                      oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error)
        return out

    ref = np.zeros((4, 4), np.float32)
    ref[1:3] = src
    np.testing.assert_array_equal(run(kernel, src, 1, True), ref)
    np.testing.assert_array_equal(run(kernel, src, -1000, True), np.zeros((4, 4), np.float32))
    with pytest.raises(SimulationError, match="outside tensor"):
        run(kernel, src, -1000, False)


def test_scalar_offset_scales_by_the_rows_of_the_tensor_ap_is_called_on():
    """API reference (NkiTensor.ap): indirect_dim names a dimension of ``self.shape`` whose stride scales the scalar
    offset. A flat [rows*8] table reshaped to [rows, 8] and read with scalar_offset=r at indirect_dim=0 gives row r."""
    table = np.arange(48, dtype=np.float32)

    def kernel(flat, row):
        idx = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=idx, value=row)
        rows = flat.reshape((6, 8))
        tile = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=rows.ap([[8, 1], [1, 8]], offset=0, scalar_offset=idx, indirect_dim=0))
        return hbm_out(tile)

    np.testing.assert_array_equal(run(kernel, table, 4), table[32:40].reshape(1, 8))
