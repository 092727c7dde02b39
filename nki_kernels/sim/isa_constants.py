"""``nki.isa.constants``: the ISA enumerations (also exported by ``nki.isa``), as nki-library imports them."""
from .enums import dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401
