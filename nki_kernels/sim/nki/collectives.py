"""``nki.collectives`` for the simulator: the real module's public names, simulated over a group of ranks launched
with ``nki.simulator.simulate_ranks`` (model and rules: nki_kernels/sim/collectives.py)."""
from ..collectives import (  # noqa: F401
    ReplicaGroup,
    all_gather,
    all_gather_v,
    all_reduce,
    all_to_all,
    all_to_all_v,
    collective_permute,
    collective_permute_implicit,
    collective_permute_implicit_current_processing_rank_id,
    collective_permute_implicit_reduce,
    rank_id,
    reduce_scatter,
)
