"""Live SBUF / PSUM allocation accounting against the target's capacity (NKI documentation)."""
from __future__ import annotations

import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from nki_kernels.sim import CapacityError, SimulationError, SimulatorWarning

from .conftest import run


def test_sbuf_allocation_over_capacity_names_the_allocation():
    def kernel():
        nl.ndarray((128, 50_000), nl.float32, buffer=nl.sbuf, name="huge_tile")   # 200,000 B per partition

    with pytest.raises(CapacityError, match=r"SBUF allocation 'huge_tile' .* needs 200000 B per partition.*180224"):
        run(kernel, target="trn1")
    run(kernel, target="trn3")   # 245,752 B per partition on gen4


def test_sbuf_live_allocations_add_up_and_are_listed():
    def kernel():
        a = nl.ndarray((128, 25_000), nl.float32, buffer=nl.sbuf, name="a_keep")
        b = nl.ndarray((128, 25_000), nl.float32, buffer=nl.sbuf, name="b_keep")
        nl.ndarray((128, 4_000), nl.float32, buffer=nl.sbuf)   # 216,000 B > 212,984 on trn2
        assert a.shape == b.shape   # a and b stay referenced (live) past the third allocation

    # over-subscription of reachable tiles is reported, not refused: the compiler allocates by liveness
    with pytest.warns(SimulatorWarning, match=r"sbuf@test_memory.py:\d+.*live allocations: a_keep=100000B, b_keep=100000B"):
        run(kernel, target="trn2")


def test_loop_body_tiles_are_freed_when_unreachable():
    seen = []

    def kernel(x_hbm):
        for i in nl.affine_range(40):
            t = nl.ndarray((128, 20_000), nl.float32, buffer=nl.sbuf)   # 80,000 B: 40 live copies could never fit
            nisa.dma_copy(dst=t[:, 0:4], src=x_hbm)
            seen.append(i)

    run(kernel, np.zeros((128, 4), np.float32), target="trn1")
    assert len(seen) == 40


def test_tiles_kept_in_a_list_stay_live():
    def kernel():
        keep = []
        for _ in nl.affine_range(40):
            keep.append(nl.ndarray((128, 20_000), nl.float32, buffer=nl.sbuf))

    with pytest.warns(SimulatorWarning, match="SBUF allocation"):
        run(kernel, target="trn1")


def test_psum_has_eight_banks_of_2kib():
    def kernel(n_tiles, cols):
        keep = [nl.ndarray((128, cols), nl.float32, buffer=nl.psum, name=f"acc{i}") for i in range(n_tiles)]
        assert len(keep) == n_tiles   # all tiles stay referenced (live) until the kernel returns

    run(lambda: kernel(8, 512))
    with pytest.warns(SimulatorWarning, match=r"PSUM allocation 'acc8' .*\(1 bank\(s\) of 2048 B\)"):
        run(lambda: kernel(9, 512))
    with pytest.warns(SimulatorWarning, match="PSUM allocation 'acc4'"):
        run(lambda: kernel(5, 513))    # 2052 B -> 2 banks each
    with pytest.raises(CapacityError, match="PSUM allocation 'whole'"):   # more than all 8 banks at once
        run(lambda: nl.ndarray((128, 4097), nl.float32, buffer=nl.psum, name="whole") and None)


def test_psum_address_must_be_bank_aligned():
    with pytest.raises(SimulationError, match="must start at a bank boundary"):
        run(lambda: nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 1024)))

    def aligned():
        nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 4096))

    run(aligned)


def test_each_lnc_program_has_its_own_on_chip_memory():
    def kernel():
        nl.ndarray((128, 40_000), nl.float32, buffer=nl.sbuf, name=f"core{nl.program_id(0)}")   # 160,000 B

    run(kernel, lnc=2, target="trn2")
