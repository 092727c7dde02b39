"""``nki.language`` for the simulator: dtypes, buffers, operators, allocation and convenience wrappers (§4)."""
from ...sim import alu as _alu
from ...sim import runtime as _runtime
from ..dtypes import (  # noqa: F401
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from ..language_ops import (  # noqa: F401
    NKIObject,
    affine_range,
    copy,
    device_print,
    ds,
    empty_like,
    fori_loop,
    full,
    load,
    matmul,
    max,
    mean,
    min,
    ndarray,
    no_reorder,
    num_programs,
    ones,
    program_id,
    program_ndim,
    sequential_range,
    shared_constant,
    shared_identity_matrix,
    static_range,
    store,
    sum,
    transpose,
    zeros,
    zeros_like,
)
from ..isa_registers import dynamic_range, while_loop  # noqa: F401
from ..language_ops import broadcast_to, rand, random_seed  # noqa: F401
from ..memory import MemoryRegion, hbm, private_hbm, psum, sbuf, shared_hbm  # noqa: F401
from ..tensor import NkiTensor  # noqa: F401

# nl.add, nl.exp, nl.maximum, nl.greater_equal, nl.bitwise_and, ... (only the names the real API has)
globals().update({k: v for k, v in _alu.OPS.items() if k not in _alu.SIMULATOR_ONLY})


def is_hbm(buffer):
    return buffer.kind == "hbm"


def is_sbuf(buffer):
    return buffer.kind == "sbuf"


def is_psum(buffer):
    return buffer.kind == "psum"


def is_on_chip(buffer):
    return buffer.on_chip


class _TileSize:
    """``nl.tile_size`` constants (§2.3); SBUF figures follow the target generation."""

    pmax = 128
    psum_fmax = psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_num_banks = 8
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = sbuf_min_align = 4

    @property
    def sbuf_fmax_bytes(self):
        ctx = _runtime.active()
        if ctx is None:
            from ..target import target_from_env
            return target_from_env().sbuf_bytes_per_partition
        return ctx.target.sbuf_bytes_per_partition

    total_available_sbuf_size = sbuf_fmax_bytes

    @property
    def sbuf_fmax(self):
        return self.sbuf_fmax_bytes // 4

    @property
    def sbuf_size_bytes(self):
        return self.sbuf_fmax_bytes * 128


tile_size = _TileSize()


_DOCUMENTED_NOT_SIMULATED = frozenset({
    "alloc_tiles", "alloc_blocks", "tiles", "blocks", "softmax",
    "rms_norm", "gather_flattened", "dropout", "load_transpose2d", "where", "var", "prod",
    "all", "expand_dims",
})


def __getattr__(name):
    if name in _DOCUMENTED_NOT_SIMULATED:
        raise NotImplementedError(f"nl.{name} is documented (NKI documentation) but not implemented by the "
                                  f"neuron-infer NKI simulator; see nki_kernels/sim/FIDELITY.md §10")
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")
