"""One rank's view of the model: its local layout (heads, MLP and vocabulary slices) and its op table."""
from __future__ import annotations

from neuron_infer.model.llama import LocalLayout
from neuron_infer.model.op_tables import get_ops
from neuron_infer.model.ops import Ops
from neuron_infer.parallel.launch import all_gather_last_dim, all_reduce_sum
from neuron_infer.parallel.plan import RankShard


def tp_ops(kernels: str) -> Ops:
    """The op table of a CPU rank: the build's kernels plus the gloo collectives (identity outside a process group)."""
    return get_ops(kernels).with_collectives(all_reduce_sum, all_gather_last_dim)


def rank_layout(shard: RankShard) -> LocalLayout:
    return LocalLayout(**shard.local_layout_fields())
