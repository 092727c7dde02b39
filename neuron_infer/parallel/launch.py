"""CPU rank launcher and the collectives the model needs.

`run_ranks(worker_fn, tp, args)` runs `worker_fn(ctx, *args)` on `tp` ranks joined by torch.distributed (gloo):

- On one host (default) it spawns `tp` processes (multiprocessing "spawn"); the parent hosts the rendezvous store
  on 127.0.0.1 (an OS-chosen free port, so concurrent runs never collide). Each rank starts its own session
  (process group) so the parent can kill it together with anything it started.
- Under torchrun-style multi-host rendezvous (MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE all set) it spawns
  nothing: this process joins that group as rank RANK and runs `worker_fn` itself.

`RankProcesses(worker_fn, tp, args)` keeps the spawned ranks alive instead: `worker_fn` sets each rank up once
(e.g. loads its shard) and returns a handler; every `call(request)` runs the handler on every rank. It is the same
spawn, monitor and stop code as `run_ranks`, which is a one-shot `RankProcesses`.

Rank 0 talks to the parent: its return value is the result of `run_ranks`, and `ctx.emit(obj)` streams objects
to the parent's `on_emit` callback (e.g. tokens as they are sampled). Other ranks' return values are dropped.

Failure handling (spawn mode): the parent watches a result queue and the processes. A rank that raises (its
traceback is sent back), dies (e.g. SIGKILL; seen through its exit code), hangs (no result `timeout_s` after all
ranks joined the group) or never joins (`start_timeout_s`)
makes `run_ranks` raise `RankFailure` naming that rank; every rank process is then killed and reaped, so no
orphans remain. Ranks that only failed because a peer vanished under them (a collective saw the connection
close) are reported as secondary. To name a hung rank, each rank counts the collectives it has entered in
shared memory: at the deadline the rank(s) furthest behind are the ones that stopped making progress.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from neuron_infer.cpu_threads import usable_cpus
from neuron_infer.cpu_threads import use as use_threads
from neuron_infer.errors import ConfigError, NeuronInferError

# Oversubscription limit: more than this many ranks per CPU core makes every collective a context-switch storm.
MAX_RANKS_PER_CPU = 4
# Resident memory of one rank process before it loads weights (python + torch + gloo), measured ~220 MiB here.
RANK_PROCESS_OVERHEAD_BYTES = 300 * 2**20
_TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_GRACE_S = 1.0  # after a first failure, wait this long for the other ranks' reports before stopping all
_SECONDARY_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                      "timed out", "Socket Timeout", "recvValue", "ECONNRESET", "Connection refused")


class RankFailure(NeuronInferError):
    """A tensor-parallel run failed; the message names the rank(s) and their error."""


@dataclass(frozen=True)
class RankContext:
    """What a worker function receives: its rank, the world size and (rank 0) a channel to the parent."""

    rank: int
    world_size: int
    _emit: Callable[[Any], None] | None = field(default=None, repr=False)

    def emit(self, obj: Any) -> None:
        """Rank 0: send `obj` to the parent's `on_emit` now. Other ranks: ignored (so workers need no branch)."""
        if self.rank == 0 and self._emit is not None:
            self._emit(obj)


# --------------------------------------------------------------------------------------------------------------
# collectives (identity when not distributed or world size 1)

_PROGRESS: Any = None  # shared int array: collectives entered, per rank (spawn mode only)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _enter() -> None:
    if _PROGRESS is not None:
        _PROGRESS[dist.get_rank()] += 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over all ranks (row-parallel layers, vocab-parallel embedding). Half precision is reduced in
    fp32 and cast back, so the sum is as accurate as the fp32 one and identical on every rank."""
    if _world() == 1:
        return t
    _enter()
    work = t.float() if t.dtype in (torch.bfloat16, torch.float16) else t.contiguous().clone()
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.to(t.dtype)


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `t` along the last dim in rank order (vocab-parallel logits): [..., n*world]."""
    world = _world()
    if world == 1:
        return t
    _enter()
    src = t.contiguous()
    parts = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(parts, src)
    return torch.cat(parts, dim=-1)  # [..., n * world]


def broadcast_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank (sampled tokens, so all ranks feed the same next input)."""
    if _world() == 1:
        return t
    _enter()
    out = t.contiguous().clone()
    dist.broadcast(out, src=0)
    return out


def broadcast_object_from_rank0(obj: Any) -> Any:
    """Rank 0's picklable `obj` on every rank (requests, stop decisions)."""
    if _world() == 1:
        return obj
    _enter()
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------------------------------
# capacity checks


def check_cpu_ranks(tp: int, weight_bytes_per_rank: int = 0, cpu_count: int | None = None,
                    available_bytes: int | None = None) -> None:
    """Reject a degree this machine cannot run before any process starts (CPU oversubscription, host RAM)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp degree {tp!r} must be an integer >= 1")
    cpus = cpu_count or os.cpu_count() or 1
    if tp > MAX_RANKS_PER_CPU * cpus:
        raise ConfigError(
            f"tp degree {tp} needs {tp} rank processes but this machine has {cpus} CPU core(s); on CPU use "
            f"--tp-degree <= {MAX_RANKS_PER_CPU * cpus} (tensor parallelism on CPU shares the same cores)"
        )
    if available_bytes is None:
        available_bytes = psutil.virtual_memory().available
    need = tp * (RANK_PROCESS_OVERHEAD_BYTES + weight_bytes_per_rank)
    if need > available_bytes:
        raise ConfigError(
            f"tp degree {tp} needs about {need / 2**30:.1f} GiB of host RAM ({tp} processes x "
            f"({RANK_PROCESS_OVERHEAD_BYTES / 2**20:.0f} MiB + {weight_bytes_per_rank / 2**20:.0f} MiB weights)) "
            f"but {available_bytes / 2**30:.1f} GiB is available; lower --tp-degree or quantize the model"
        )


def torchrun_env_present() -> bool:
    """True when torchrun-style rendezvous variables are all set (then `run_ranks` joins that group)."""
    return all(os.environ.get(v) for v in _TORCHRUN_VARS)


# --------------------------------------------------------------------------------------------------------------
# running ranks


def run_ranks(worker_fn: Callable[..., Any], tp: int, args: tuple = (), *, timeout_s: float = 600.0,
              on_emit: Callable[[Any], None] | None = None, weight_bytes_per_rank: int = 0,
              start_timeout_s: float = 180.0) -> Any:
    """Run `worker_fn(ctx, *args)` on `tp` ranks; return rank 0's return value (see the module docstring).

    `worker_fn` must be a module-level function and `args` picklable (spawned processes import them).
    `start_timeout_s` bounds process start-up and the rendezvous (importing torch takes seconds per process on a
    loaded machine); `timeout_s` then bounds `worker_fn` itself: a rank without a result by then is hung.
    Raises ConfigError (bad degree, before any process starts) or RankFailure (a rank failed; all stopped).
    """
    if torchrun_env_present():
        return _run_in_env_group(worker_fn, tp, args, timeout_s, on_emit)
    check_cpu_ranks(tp, weight_bytes_per_rank)
    if tp == 1:  # nothing to coordinate: run in this process, collectives are identity
        return worker_fn(RankContext(0, 1, on_emit), *args)
    ranks = RankProcesses(worker_fn, tp, args, timeout_s=timeout_s, start_timeout_s=start_timeout_s, serve=False)
    try:
        return ranks.wait(on_emit)
    finally:
        ranks.close()


class RankProcesses:
    """`tp` spawned rank processes joined by gloo (spawn mode of `run_ranks`, or a long-lived group).

    serve=False: each rank runs `worker_fn(ctx, *args)` once; `wait()` returns rank 0's value.
    serve=True: each rank runs `worker_fn(ctx, *args)` once to set up (e.g. load its shard), which returns a
    handler; the constructor waits for that set-up. Every `call(request)` then runs `handler(request)` on every
    rank (each rank receives the request through its own inbox) and returns rank 0's value. Idle ranks wait on
    their inbox, not in a collective, so a group may stay idle for any time.

    Any failure (a rank raised, died, hung or never joined) raises RankFailure naming the rank and stops every
    process; the group then refuses further calls. `close()` stops every process (SIGKILL to each rank's process
    group) and reaps them; ranks also exit by themselves within 0.5 s of this process's death.
    """

    def __init__(self, worker_fn: Callable[..., Any], tp: int, args: tuple = (), *, timeout_s: float,
                 start_timeout_s: float, serve: bool = True):
        self.tp, self.timeout_s = tp, timeout_s
        self._store = dist.TCPStore("127.0.0.1", 0, tp + 1, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=start_timeout_s + timeout_s))
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(tp)] if serve else [None] * tp
        progress = ctx.Array("q", tp, lock=False)
        self.procs = [
            ctx.Process(target=_rank_entry, name=f"neuron-infer-rank{r}", daemon=True,
                        args=(r, tp, self._store.port, worker_fn, args, self._results, progress,
                              start_timeout_s + timeout_s, os.getpid(), self._inboxes[r]))
            for r in range(tp)
        ]
        self._monitor = _Monitor(self.procs, self._results, progress, timeout_s, start_timeout_s)
        self.stopped: str | None = None  # why the group no longer runs requests (None while it does)
        try:
            for p in self.procs:
                p.start()
            if serve:
                self.wait(None)  # every rank set up
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def call(self, request: Any, on_emit: Callable[[Any], None] | None = None) -> Any:
        """Run the handler on every rank with `request` (picklable); rank 0's return value."""
        if self.stopped is not None:
            raise RankFailure(f"the {self.tp} rank processes are no longer running ({self.stopped}); "
                              "load the model again")
        for box in self._inboxes:
            box.put(request)
        return self.wait(on_emit)

    def wait(self, on_emit: Callable[[Any], None] | None) -> Any:
        """Collect one result from every rank (set-up, one call, or the one-shot run)."""
        try:
            return self._monitor.wait(on_emit)
        except RankFailure as e:
            lines = str(e).splitlines()
            self.close(f"stopped after a failure: {lines[1] if len(lines) > 1 else e}")
            raise
        except BaseException:  # e.g. KeyboardInterrupt mid-call: the ranks are in an unknown state
            self.close("stopped after an interrupted call")
            raise

    def close(self, why: str = "closed") -> None:
        """Stop and reap every rank process (idempotent)."""
        if self.stopped is None:
            self.stopped = why
        _stop(self.procs)
        for q in (self._results, *filter(None, self._inboxes)):
            q.cancel_join_thread()
            q.close()
        self._store = None  # the rendezvous store's server thread ends with it


def rank_threads(tp: int) -> int:
    """Threads per rank when `tp` ranks share the CPUs this process may use (more would oversubscribe: every
    OpenMP barrier of every rank then waits for descheduled threads)."""
    return max(1, usable_cpus() // tp)


def rank_cpu_groups(cpus: list[int], ranks: int) -> list[list[int]]:
    """`cpus` split into `ranks` contiguous, non-empty groups (with more ranks than CPUs, neighbouring ranks share
    one)."""
    if ranks < 1 or not cpus:
        raise ConfigError(f"cannot split {len(cpus)} CPUs over {ranks} ranks; need >= 1 of each")
    cpus, n = sorted(cpus), len(cpus)
    return [cpus[r * n // ranks:(r + 1) * n // ranks] or [cpus[r * n // ranks]] for r in range(ranks)]


def _rank_entry(rank: int, tp: int, port: int, worker_fn: Callable[..., Any], args: tuple, results: Any,
                progress: Any, timeout_s: float, parent_pid: int, inbox: Any = None) -> None:
    """Body of one spawned rank process: run `worker_fn` once, or (with an inbox) serve requests until told to
    stop (None) or killed."""
    global _PROGRESS
    os.setsid()  # own process group: the parent kills it (and anything it starts) with one killpg
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    _PROGRESS = progress
    use_threads("auto", cap=rank_threads(tp))  # its share, fewer while other processes keep CPUs busy
    try:
        # the parent stops us at timeout_s; the gloo timeout only needs to be longer than that
        store = dist.TCPStore("127.0.0.1", port, tp + 1, is_master=False, timeout=timedelta(seconds=timeout_s + 60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=tp,
                                timeout=timedelta(seconds=timeout_s + 60))
        results.put(("ready", rank, None))
        emit = (lambda obj: results.put(("emit", 0, _pack(obj)))) if rank == 0 else None
        value = worker_fn(RankContext(rank, tp, emit), *args)
        if inbox is None:
            results.put(("result", rank, _pack(value if rank == 0 else None)))
            return
        results.put(("result", rank, _pack(None)))  # set up
        while (request := inbox.get()) is not None:
            out = value(request)
            results.put(("result", rank, _pack(out if rank == 0 else None)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent, named by rank
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        results.close()
        results.join_thread()  # flush our messages before the process exits


def _pack(obj: Any) -> bytes:
    """Plain pickle: tensors are copied into the bytes. (torch's multiprocessing pickler would instead pass shared
    memory by file descriptor, which breaks once the rank process has exited.)"""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _exit_with_parent(parent_pid: int) -> None:
    """Ranks never outlive the launcher, even if it is SIGKILLed and cannot stop them."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def _stop(procs: list[Any]) -> None:
    """Kill every still-running rank (its whole process group) and reap all of them."""
    for p in procs:
        if p.pid is None:
            continue
        if p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group leader, or already gone
                p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)


class _Monitor:
    """Parent side: collect results, notice errors, deaths and hangs, and describe them."""

    def __init__(self, procs: list[Any], results: Any, progress: Any, timeout_s: float, start_timeout_s: float):
        self.procs, self.results, self.progress = procs, results, progress
        self.on_emit: Callable[[Any], None] | None = None
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.ready: set[int] = set()
        self.finished: set[int] = set()
        self.errors: dict[int, str] = {}
        self.deaths: dict[int, int] = {}
        self.value: Any = None

    def wait(self, on_emit: Callable[[Any], None] | None) -> Any:
        """One result from every rank (rank 0's value), or RankFailure."""
        self.on_emit, self.finished, self.value = on_emit, set(), None
        running = len(self.ready) == len(self.procs)
        deadline = time.monotonic() + (self.timeout_s if running else self.start_timeout_s)
        first_failure: float | None = None
        while True:
            self._drain(0.05)
            self._check_exits()
            if len(self.finished) == len(self.procs):
                return self.value
            now = time.monotonic()
            if not running and len(self.ready) == len(self.procs):
                running, deadline = True, now + self.timeout_s
            if (self.errors or self.deaths) and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure > _GRACE_S:
                raise RankFailure(self._describe(timed_out=False))
            if now > deadline:
                raise RankFailure(self._describe(timed_out=True))

    def _drain(self, wait_s: float) -> None:
        try:
            msg = self.results.get(timeout=wait_s)
        except queue_mod.Empty:
            return
        while True:
            kind, rank, payload = msg
            if kind == "emit":
                if self.on_emit is not None:
                    self.on_emit(pickle.loads(payload))
            elif kind == "ready":
                self.ready.add(rank)
            elif kind == "result":
                self.finished.add(rank)
                self.value = pickle.loads(payload) if rank == 0 else self.value
            else:
                self.errors[rank] = payload
            try:
                msg = self.results.get_nowait()
            except queue_mod.Empty:
                return

    def _check_exits(self) -> None:
        for rank, p in enumerate(self.procs):
            code = p.exitcode
            if code is None or rank in self.errors or rank in self.finished or rank in self.deaths:
                continue  # exit code 0 without a result is a death too (e.g. os._exit(0) inside the worker)
            self._drain(0.2)  # a report sent just before exiting may still be in the pipe
            if rank not in self.errors and rank not in self.finished:
                self.deaths[rank] = code

    def _describe(self, timed_out: bool) -> str:
        secondary = {r for r, tb in self.errors.items() if any(m in tb for m in _SECONDARY_MARKERS)}
        primary = sorted((set(self.errors) - secondary) | set(self.deaths))
        silent = [r for r in range(len(self.procs)) if r not in self.finished | set(self.errors) | set(self.deaths)]
        lines = []
        for r in primary:
            if r in self.deaths:
                lines.append(f"rank {r} died: {_exit_text(self.deaths[r])} (no Python error was reported)")
            else:
                lines.append(f"rank {r} raised {self.errors[r].strip()}")
        unjoined = [r for r in silent if r not in self.ready]
        if timed_out and unjoined:
            lines.append(f"rank(s) {_ranks(unjoined)} did not join the process group within start_timeout_s="
                         f"{self.start_timeout_s:g} s (slow start-up or a blocked port?)")
        elif timed_out and silent:
            entered = {r: int(self.progress[r]) for r in silent}
            behind = [r for r in silent if entered[r] == min(entered.values())]
            waiting = [r for r in silent if r not in behind]
            lines.append(
                f"rank{'s' if len(behind) > 1 else ''} {_ranks(behind)} hung: no result within timeout_s="
                f"{self.timeout_s:g} s (entered {min(entered.values())} collective(s)"
                + (f"; rank(s) {_ranks(waiting)} were waiting for it in a later collective)" if waiting else ")"))
        if not primary and not (timed_out and silent):
            lines.extend(f"rank {r} raised {self.errors[r].strip()}" for r in sorted(secondary))
        elif secondary:
            lines.append(f"rank(s) {_ranks(sorted(secondary))} then failed in a collective because a peer was gone")
        return (f"tensor-parallel run over {len(self.procs)} ranks failed:\n" + "\n".join(lines)
                + f"\nall {len(self.procs)} rank processes were stopped.")


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _run_in_env_group(worker_fn: Callable[..., Any], tp: int, args: tuple, timeout_s: float,
                      on_emit: Callable[[Any], None] | None) -> Any:
    """torchrun-style: join the group described by MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE as rank RANK."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != tp:
        raise ConfigError(f"WORLD_SIZE={world} (from the environment) differs from --tp-degree {tp}; "
                          "launch as many ranks as the tp degree (torchrun --nnodes x --nproc-per-node)")
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    try:
        return worker_fn(RankContext(rank, world, on_emit if rank == 0 else None), *args)
    finally:
        if owns_group:
            dist.destroy_process_group()
