"""``nki.collectives`` on a simulated group of ranks (NKI 0.6 API reference, ``nki.collectives``).

Model. ``nki.simulator.simulate_ranks(kernel, [kwargs_rank0, kwargs_rank1, ...], lnc=...)`` launches the kernel
once per rank, every rank (and, under LNC2, each of its two programs) in its own thread; each rank has its own HBM
and on-chip memory. A collective is a rendezvous: the participants are the ranks of the caller's sub-group of the
``ReplicaGroup`` (the list that contains ``rank_id()``), program p of each rank meeting program p of the others,
and calls are matched by order (the n-th collective of a program with the n-th of its peers). Each participant
posts a copy of its sources, waits until every peer has posted, checks that they all issued the same collective,
and writes its own destinations. Rank order inside a sub-group is the order of its list: ``all_gather``
concatenates in that order and the ring of the ``collective_permute_implicit*`` family sends position i's data to
position i + 1 (every channel uses the same ring). Reductions are done in fp32 in rank order and cast on write.
A plain ``nki.simulate`` launch is a group of one rank (rank 0).

``rank_id`` and ``collective_permute_implicit_current_processing_rank_id`` return a ``VirtualRegister`` (the
reference: "a scalar register"), usable as a ``scalar_offset`` or in register instructions, not in Python
arithmetic. Restrictions the reference states are checked (memory spaces, collective_dim, one tensor per list
where it says so, consecutive channel ids); ``priority`` and ``name`` are accepted and ignored.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from . import checks as C
from . import dtypes as D
from . import runtime
from .errors import SimulationError
from .isa_registers import VirtualRegister
from .language_ops import NKIObject
from .registers import reducer

_REDUCE_OPS = ("add", "minimum", "maximum")
_MAX_CHANNELS = 4


@dataclass
class World:
    """The ranks of one ``simulate_ranks`` run and their collective mailboxes (guarded by ``cond``)."""

    size: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    posts: dict = field(default_factory=dict)     # (program, seq, group) -> {rank: (op, payload)}
    reads: dict = field(default_factory=dict)     # same key -> number of participants done with it
    finished: set = field(default_factory=set)    # (rank, program) that returned
    failed: bool = False


class ReplicaGroup(NKIObject):
    """Sub-groups of ranks that take part in a collective: ``ReplicaGroup([[0, 1, 2, 3]])``; sub-groups must not
    overlap (the reference)."""

    def __init__(self, groups=None, **kwargs):
        super().__init__(**kwargs)
        if groups is None:
            raise SimulationError("ReplicaGroup needs a list of rank lists, e.g. ReplicaGroup([[0, 1]])")
        self.groups = tuple(tuple(int(r) for r in g) for g in groups)
        seen = [r for g in self.groups for r in g]
        if not self.groups or any(not g for g in self.groups) or len(seen) != len(set(seen)):
            raise SimulationError(f"ReplicaGroup sub-groups must be non-empty and must not overlap, got {groups!r}")

    def _group_of(self, rank: int, op: str) -> tuple[int, ...]:
        for g in self.groups:
            if rank in g:
                return g
        raise SimulationError(f"{op}: rank {rank} is in no sub-group of {self.groups}")

    def __repr__(self) -> str:
        return f"ReplicaGroup({[list(g) for g in self.groups]})"


# ---------------------------------------------------------------- rendezvous


def _group(replica_group, op: str) -> tuple[int, ...]:
    if not isinstance(replica_group, ReplicaGroup):
        raise SimulationError(f"{op} replica_group must be an nki.collectives.ReplicaGroup, got "
                              f"{type(replica_group).__name__}")
    ctx = runtime.current()
    group = replica_group._group_of(ctx.rank, op)
    size = ctx.world.size if ctx.world is not None else 1
    if any(not 0 <= r < size for r in group):
        raise SimulationError(f"{op}: sub-group {list(group)} names ranks outside this run of {size} rank(s); run "
                              f"the kernel once per rank with nki.simulator.simulate_ranks")
    return group


def _exchange(op: str, group: tuple[int, ...], payload) -> dict:
    """Post ``payload`` for this rank and return {rank: payload} of every rank of ``group`` (same program id)."""
    ctx = runtime.current()
    if len(group) == 1:
        return {ctx.rank: payload}
    world, me, pid = ctx.world, ctx.rank, ctx.program_id
    seq = ctx.sync_seq.get(("collective",), 0)
    ctx.sync_seq[("collective",)] = seq + 1
    key = (pid, seq, group)
    with world.cond:
        world.posts.setdefault(key, {})[me] = (op, payload)
        world.cond.notify_all()
        while True:
            posted = world.posts[key]
            if len(posted) == len(group):
                break
            if world.failed:
                raise runtime.PeerFailed(f"rank {me}: {op} #{seq}: another rank failed")
            gone = [r for r in group if r not in posted and (r, pid) in world.finished]
            if gone:
                raise SimulationError(f"rank {me}: {op} #{seq}: rank {gone[0]} returned without the matching "
                                      f"collective (every rank of {list(group)} must issue the same sequence)")
            world.cond.wait(timeout=1.0)
        ops = {r: posted[r][0] for r in group}
        if len(set(ops.values())) > 1:
            raise SimulationError(f"rank {me}: collective #{seq} does not match across ranks: {ops}")
        got = {r: posted[r][1] for r in group}
        world.reads[key] = world.reads.get(key, 0) + 1
        if world.reads[key] == len(group):
            del world.posts[key], world.reads[key]
    return got


# ---------------------------------------------------------------- checks and data


def _tensors(ts, op: str, role: str, one: bool = False) -> list:
    if not isinstance(ts, (list, tuple)) or not ts:
        raise SimulationError(f"{op} {role} must be a non-empty list of tensors")
    if one and len(ts) != 1:
        raise SimulationError(f"{op} {role} must contain exactly one tensor (coalesced collectives are not "
                              f"supported here), got {len(ts)}")
    return [C.tensor(t, op, role) for t in ts]


def _spaces(op: str, srcs, dsts, allowed=("hbm", "sbuf"), coalesced: bool = True) -> str:
    """The memory space of a collective's tensors (``coalesced``: srcs are one coalesced list, not channels)."""
    kinds = {t.kind for t in srcs + dsts}
    if not kinds <= set(allowed):
        raise SimulationError(f"{op} tensors must be in {' or '.join(a.upper() for a in allowed)}, got "
                              f"{sorted(k.upper() for k in kinds)}")
    if len(kinds) > 1:
        raise SimulationError(f"{op}: all tensors must be on HBM or all on SBUF, not mixed")
    kind = kinds.pop()
    if kind == "sbuf" and coalesced and len(srcs) > 1:
        raise SimulationError(f"{op}: coalesced collectives (several tensors) need HBM tensors")
    return kind


def _pairs(op: str, srcs, dsts) -> None:
    if len(srcs) != len(dsts):
        raise SimulationError(f"{op}: {len(srcs)} srcs but {len(dsts)} dsts")
    for s, d in zip(srcs, dsts):
        if s.dtype != d.dtype:
            raise SimulationError(f"{op}: src {s.dtype} and dst {d.dtype} must have the same dtype")
        C.writable(d, op)


def _read(ts) -> list:
    return [t.read().copy() for t in ts] if C.executing() else [None] * len(ts)


def _emit(op: str, srcs, dsts) -> C.NkiInstruction:
    nbytes = sum(t.size * t.np_dtype.itemsize for t in dsts)
    return C.emit("dma", op, srcs[0], dsts[0], dma_bytes=nbytes)


def _reduce(op_obj, arrays, dtype) -> np.ndarray:
    fn = {"add": np.add, "minimum": np.minimum, "maximum": np.maximum}[op_obj]
    acc = D.to_f32(arrays[0], dtype)
    for a in arrays[1:]:
        acc = fn(acc, D.to_f32(a, dtype))
    return acc


def _dim(op: str, t, dim, allowed: tuple[int, ...]) -> int:
    if dim not in allowed:
        what = "SBUF" if t.kind == "sbuf" else "HBM"
        raise SimulationError(f"{op} collective_dim must be {' or '.join(map(str, allowed))} for {what} tensors, "
                              f"got {dim!r}")
    if t.kind == "sbuf" and t.ndim != 2:
        raise SimulationError(f"{op}: SBUF collectives operate on 2-D tensors, got {t.shape}")
    return dim


def _scaled(shape, dim, n) -> tuple:
    return tuple(s * n if i == dim else s for i, s in enumerate(shape))


# ---------------------------------------------------------------- dense collectives


def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None):
    """dst_i = op over the sub-group's ranks of src_i (``nl.add``, ``nl.minimum`` or ``nl.maximum``)."""
    what = "all_reduce"
    srcs, dsts = _tensors(srcs, what, "srcs"), _tensors(dsts, what, "dsts")
    _spaces(what, srcs, dsts)
    _pairs(what, srcs, dsts)
    red = reducer(op, f"{what} op", _REDUCE_OPS)
    for s, d in zip(srcs, dsts):
        if s.shape != d.shape:
            raise SimulationError(f"{what}: src {s.shape} and dst {d.shape} must have the same shape")
    group = _group(replica_group, what)
    got = _exchange(what, group, _read(srcs))
    if C.executing():
        for i, d in enumerate(dsts):
            C.write(d, _reduce(red, [got[r][i] for r in group], d.dtype))
    return _emit(what, srcs, dsts)


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """dst_i = concatenation of the sub-group's src_i along ``collective_dim``, in sub-group order."""
    what = "all_gather"
    srcs, dsts = _tensors(srcs, what, "srcs"), _tensors(dsts, what, "dsts")
    kind = _spaces(what, srcs, dsts)
    _pairs(what, srcs, dsts)
    group = _group(replica_group, what)
    for s, d in zip(srcs, dsts):
        dim = _dim(what, s, collective_dim, (0, 1) if kind == "sbuf" else (0,))
        if _scaled(s.shape, dim, len(group)) != d.shape:
            raise SimulationError(f"{what}: dst shape {d.shape} must be src shape {s.shape} with dim {dim} "
                                  f"times {len(group)} ranks")
    got = _exchange(what, group, _read(srcs))
    if C.executing():
        for i, d in enumerate(dsts):
            C.store(d, np.concatenate([got[r][i] for r in group], axis=collective_dim))
    return _emit(what, srcs, dsts)


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None):
    """Reduce src_i over the sub-group, split it along dim 0 into one chunk per rank; rank at position p keeps
    chunk p."""
    what = "reduce_scatter"
    srcs, dsts = _tensors(srcs, what, "srcs"), _tensors(dsts, what, "dsts")
    _spaces(what, srcs, dsts)
    _pairs(what, srcs, dsts)
    red = reducer(op, f"{what} op", _REDUCE_OPS)
    group = _group(replica_group, what)
    for s, d in zip(srcs, dsts):
        _dim(what, s, collective_dim, (0,))
        if _scaled(d.shape, 0, len(group)) != s.shape:
            raise SimulationError(f"{what}: src shape {s.shape} must be dst shape {d.shape} with dim 0 times "
                                  f"{len(group)} ranks")
    got = _exchange(what, group, _read(srcs))
    if C.executing():
        pos = group.index(runtime.current().rank)
        for i, d in enumerate(dsts):
            total = _reduce(red, [got[r][i] for r in group], d.dtype)
            C.write(d, np.split(total, len(group), axis=0)[pos])
    return _emit(what, srcs, dsts)


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None):
    """Split src_i along dim 0 into one chunk per rank; rank at position p receives chunk p of every rank,
    concatenated in sub-group order. HBM tensors only."""
    what = "all_to_all"
    srcs, dsts = _tensors(srcs, what, "srcs"), _tensors(dsts, what, "dsts")
    _spaces(what, srcs, dsts, ("hbm",))
    _pairs(what, srcs, dsts)
    group = _group(replica_group, what)
    for s, d in zip(srcs, dsts):
        _dim(what, s, collective_dim, (0,))
        if s.shape != d.shape or s.shape[0] % len(group):
            raise SimulationError(f"{what}: src and dst must have the same shape with dim 0 divisible by "
                                  f"{len(group)} ranks, got {s.shape} and {d.shape}")
    got = _exchange(what, group, _read(srcs))
    if C.executing():
        pos = group.index(runtime.current().rank)
        for i, d in enumerate(dsts):
            C.store(d, np.concatenate([np.split(got[r][i], len(group), axis=0)[pos] for r in group], axis=0))
    return _emit(what, srcs, dsts)


# ---------------------------------------------------------------- variable-size collectives


def _metadata(t, n: int, has_rdispls: bool, op: str):
    t = C.tensor(t, op, "metadata_tensor")
    rows = 4 if has_rdispls else 3
    want = (rows, n) if t.kind == "hbm" else (1, rows, n)
    if t.dtype != D.uint32 or t.shape != want:
        raise SimulationError(f"{op} metadata_tensor must be uint32 of shape {want} on {t.kind.upper()}, got "
                              f"{t.shape} {D.dtype_name(t.dtype)}")
    return t


def _flat_v(op, srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls, per_dest: bool):
    srcs, dsts = _tensors(srcs, op, "srcs", one=True), _tensors(dsts, op, "dsts", one=True)
    _spaces(op, srcs, dsts, ("hbm",))
    _pairs(op, srcs, dsts)
    group = _group(replica_group, op)
    n = len(group)
    meta = _metadata(metadata_tensor, n, has_rdispls, op)
    ctx = runtime.current()
    pos = group.index(ctx.rank)
    table = meta.read().reshape(-1, n).astype(np.int64) if ctx.execute else None
    src, dst = srcs[0], dsts[0]
    chunks = None
    if ctx.execute:
        flat = src.read().reshape(-1)
        counts, displs = table[0], table[1]
        if not per_dest:
            counts, displs = np.repeat(counts[0], n), np.repeat(displs[0], n)
        if np.any(displs + counts > flat.size):
            raise SimulationError(f"{op}: rank {ctx.rank} sends past the end of its src ({flat.size} elements)")
        chunks = [flat[displs[j]:displs[j] + counts[j]].copy() for j in range(n)]
    got = _exchange(op, group, chunks)
    if ctx.execute:
        out = dst.read().reshape(-1).copy()
        slot = dst.size // n
        received = []
        for j, r in enumerate(group):
            piece = got[r][pos]
            start = int(table[3][j]) if has_rdispls else slot * j
            if start + piece.size > (dst.size if has_rdispls else slot * (j + 1)):
                raise SimulationError(f"{op}: {piece.size} elements from rank {r} do not fit dst at {start}")
            out[start:start + piece.size] = piece
            received.append(piece.size)
        C.store(dst, out.reshape(dst.shape))
        if not recv_counts_known:
            table[2] = received
            C.store(meta, table.astype(np.uint32).reshape(meta.shape))
    return _emit(op, srcs, dsts)


def all_gather_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    """Each rank broadcasts ``src[send_displ : send_displ + send_count]`` (metadata rows 0/1, first column) to the
    sub-group; the chunk of the rank at position j lands in slot j of ``dst`` (``dst.size / ranks`` elements).
    Row 2 receives the per-rank counts unless ``recv_counts_known``. ``has_rdispls=True`` is not supported (as the
    reference states)."""
    if has_rdispls:
        raise SimulationError("all_gather_v(has_rdispls=True) is not supported")
    return _flat_v("all_gather_v", srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
                   per_dest=False)


def all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None):
    """Rank at position p sends ``src[send_displs[j] : send_displs[j] + send_counts[j]]`` to the rank at position
    j (metadata rows 0/1); chunks land at ``recv_displs`` (row 3) or in equal slots of ``dst``; row 2 receives the
    counts unless ``recv_counts_known``."""
    return _flat_v("all_to_all_v", srcs, dsts, replica_group, metadata_tensor, recv_counts_known, has_rdispls,
                   per_dest=True)


# ---------------------------------------------------------------- permutes


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None):
    """For every (source, target) pair the target's dst receives the source's src; the participants are the ranks
    named in the pairs. HBM tensors, one per list."""
    what = "collective_permute"
    srcs, dsts = _tensors(srcs, what, "srcs", one=True), _tensors(dsts, what, "dsts", one=True)
    _spaces(what, srcs, dsts, ("hbm",))
    _pairs(what, srcs, dsts)
    pairs = [(int(a), int(b)) for a, b in source_target_pairs]
    if len({b for _, b in pairs}) != len(pairs):
        raise SimulationError(f"{what}: a rank can receive from one source only, got {pairs}")
    me = runtime.current().rank
    group = tuple(sorted({r for p in pairs for r in p}))
    if me not in group:
        raise SimulationError(f"{what}: rank {me} is in none of the source_target_pairs {pairs}")
    _group(ReplicaGroup([group]), what)
    if srcs[0].shape != dsts[0].shape:
        raise SimulationError(f"{what}: src {srcs[0].shape} and dst {dsts[0].shape} must have the same shape")
    got = _exchange(what, group, _read(srcs))
    source = next((a for a, b in pairs if b == me), None)
    if C.executing() and source is not None:
        C.store(dsts[0], got[source][0])
    return _emit(what, srcs, dsts)


def _channels(op: str, lists, role: str, channel_ids) -> list:
    if not isinstance(lists, (list, tuple)) or len(lists) != len(channel_ids):
        raise SimulationError(f"{op} {role} must hold one tensor list per channel ({len(channel_ids)} channels)")
    return [_tensors(ts, op, role, one=True)[0] for ts in lists]


def _channel_ids(op: str, channel_ids) -> list[int]:
    ids = [int(c) for c in channel_ids]
    if ids != list(range(len(ids))) or not 1 <= len(ids) <= _MAX_CHANNELS:
        raise SimulationError(f"{op} channel_ids must be consecutive integers from 0 (at most {_MAX_CHANNELS}), "
                              f"got {channel_ids!r}")
    return ids


def _ring_permute(op, srcs, dsts, replica_group, combine):
    _pairs(op, srcs, dsts)
    _spaces(op, srcs, dsts, coalesced=False)
    for s, d in zip(srcs, dsts):
        if s.shape != d.shape:
            raise SimulationError(f"{op}: src {s.shape} and dst {d.shape} of a channel must have the same shape")
    group = _group(replica_group, op)
    got = _exchange(op, group, combine())
    if C.executing():
        pos = group.index(runtime.current().rank)
        prev = group[(pos - 1) % len(group)]
        for c, d in enumerate(dsts):
            C.store(d, got[prev][c])
    return _emit(op, srcs, dsts)


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=[0], priority=None,  # noqa: B006 - the real default
                                name=None):
    """Ring permute: on every channel each rank sends its src to its successor in the sub-group and receives its
    predecessor's src into its dst."""
    what = "collective_permute_implicit"
    ids = _channel_ids(what, channel_ids)
    srcs = _channels(what, srcs_by_channel, "srcs_by_channel", ids)
    dsts = _channels(what, dsts_by_channel, "dsts_by_channel", ids)
    return _ring_permute(what, srcs, dsts, replica_group, lambda: _read(srcs))


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op,
                                       channel_ids=[0], priority=None, name=None):  # noqa: B006 - the real default
    """Ring permute of ``op(srcs0[c], srcs1[c])`` (computed in fp32, cast to the dst dtype) to the successor."""
    what = "collective_permute_implicit_reduce"
    ids = _channel_ids(what, channel_ids)
    red = reducer(op, f"{what} op", _REDUCE_OPS)
    srcs0 = _channels(what, srcs0_by_channel, "srcs0_by_channel", ids)
    srcs1 = _channels(what, srcs1_by_channel, "srcs1_by_channel", ids)
    dsts = _channels(what, dsts_by_channel, "dsts_by_channel", ids)
    for a, b in zip(srcs0, srcs1):
        if a.shape != b.shape:
            raise SimulationError(f"{what}: srcs0 {a.shape} and srcs1 {b.shape} must have the same shape")

    def combined():
        if not C.executing():
            return [None] * len(dsts)
        return [C.cast_for(d, _reduce(red, [a.read(), b.read()], a.dtype)) for a, b, d in zip(srcs0, srcs1, dsts)]

    _spaces(what, srcs1, dsts, coalesced=False)
    return _ring_permute(what, srcs0, dsts, replica_group, combined)


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """The rank whose data a ring step ``iteration_id`` processes: this rank at 0, then its predecessors (the data
    each ``collective_permute_implicit`` brings one step further round the ring), as a register."""
    what = "collective_permute_implicit_current_processing_rank_id"
    if not 0 <= int(channel_id) < _MAX_CHANNELS:
        raise SimulationError(f"{what} channel_id must be in [0, {_MAX_CHANNELS}), got {channel_id!r}")
    group = _group(replica_group, what)
    pos = group.index(runtime.current().rank)
    return VirtualRegister(group[(pos - int(iteration_id)) % len(group)])


def rank_id(name=None):
    """This rank's id in the run (0 for a plain single-rank launch), as a register."""
    return VirtualRegister(runtime.current().rank)
