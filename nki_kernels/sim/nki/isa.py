"""``nki.isa`` for the simulator: dst-first instructions, enums and version queries (nki-reference.md §5)."""
from ...sim import runtime as _runtime
from ..checks import NkiInstruction  # noqa: F401
from ..enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
from ..isa_data import dma_copy, dma_transpose, iota, memset, tensor_copy  # noqa: F401
from ..isa_mx import nc_matmul_mx, quantize_mx  # noqa: F401
from ..isa_scalar import activation, activation_reduce  # noqa: F401
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

tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version():
    """The target generation (``nisa.nc_version.gen2/3/4``) from NEURON_PLATFORM_TARGET_OVERRIDE."""
    ctx = _runtime.active()
    if ctx is not None:
        return nc_version(ctx.gen)
    from ..target import target_from_env
    return nc_version(target_from_env().gen)
