"""``nki.isa`` for the simulator: dst-first instructions, enums and version queries (NKI documentation)."""
from ...sim import runtime as _runtime
from .. import isa_constants as constants  # noqa: F401
from ..checks import NkiInstruction  # noqa: F401
from ..enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
from ..errors import SimulationError as NkiValidationError  # noqa: F401
from ..isa_data import dma_copy, dma_transpose, iota, memset, tensor_copy  # noqa: F401
from ..isa_extra import (  # noqa: F401
    bn_aggr,
    bn_stats,
    dma_compute,
    max8,
    nc_find_index8,
    nc_match_replace8,
    nc_stream_shuffle,
    tensor_copy_predicated,
    tensor_partition_reduce,
)
from ..isa_gather import local_gather, nc_n_gather, nonzero_with_count, tensor_tensor_scan  # noqa: F401
from ..isa_lnc import core_barrier, sendrecv  # noqa: F401
from ..isa_mx import nc_matmul_mx, quantize_mx  # noqa: F401
from ..isa_registers import (  # noqa: F401
    VirtualRegister,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from ..isa_scalar import activate2, activation, activation_reduce  # noqa: F401
from ..isa_select import affine_select, range_select, select_reduce  # noqa: F401
from ..isa_tensor import nc_matmul, nc_transpose  # noqa: F401
from ..isa_vector import (  # noqa: F401
    exponential,
    reciprocal,
    scalar_tensor_tensor,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
)
from ..nki_scalar import NkiScalar, scalar_load, scalar_store  # noqa: F401

tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version():
    """The target generation (``nisa.nc_version.gen2/3/4``) from NEURON_PLATFORM_TARGET_OVERRIDE."""
    ctx = _runtime.active()
    if ctx is not None:
        return nc_version(ctx.gen)
    from ..target import target_from_env
    return nc_version(target_from_env().gen)


_DOCUMENTED_NOT_SIMULATED = frozenset({
    "scalar_load", "scalar_store", "tensor_scalar_cumulative", "rng", "rand2", "rand_set_state",
    "rand_get_state", "set_rng_seed", "dropout", "sequence_bounds", "topk", "get_nc_sub_version",
})


def __getattr__(name):
    if name in _DOCUMENTED_NOT_SIMULATED:
        raise NotImplementedError(f"nisa.{name} is documented (NKI documentation) but not implemented by the "
                                  f"neuron-infer NKI simulator; see nki_kernels/sim/FIDELITY.md §10")
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
