"""Kernel launch: ``nki.jit``, ``nki.simulate``, ``nki.simulator.simulate_kernel`` (NKI documentation).

Arguments: NumPy arrays and torch tensors become ``shared_hbm`` tensors that share memory with the caller where
possible (so in-place writes are visible); results come back as NumPy arrays, or torch tensors if any argument
was a torch tensor. torch is imported only when a torch tensor is passed. LNC2 runs the body twice (program 0
and program 1, in two threads) over the same HBM storages; ``simulate_ranks`` runs one launch per rank of a
collective group, all concurrently.
"""
from __future__ import annotations

import os
import shlex
import threading
from dataclasses import dataclass

from . import runtime
from .api_version import api_version
from .args import ArgConverter
from .errors import SimulationError
from .target import parse_target, precise_fp_from_env, target_from_env
from .tensor import NkiTensor


@dataclass(frozen=True)
class ShapeSpec:
    """A shape/dtype placeholder argument: no data is allocated (for ``execute=False`` cost-only runs)."""

    shape: tuple
    dtype: object


class Kernel:
    """Result of ``nki.jit(fn)``: callable (runs on the simulator on this machine) and ``kernel[lnc]``."""

    def __init__(self, fn, lnc=None, options=None):
        self.fn, self.lnc, self.options = fn, lnc, dict(options or {})
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __getitem__(self, lnc) -> Kernel:
        if isinstance(lnc, tuple):
            raise SimulationError("kernel[d0, d1, ...] SPMD grids are legacy NKI; the new API takes kernel[lnc] "
                                  "with lnc 1 or 2 (loop over batch/heads inside the kernel)")
        if lnc not in (1, 2):
            raise SimulationError(f"kernel[lnc]: lnc must be 1 or 2, got {lnc!r}")
        return Kernel(self.fn, lnc, self.options)

    def __call__(self, *args, **kwargs):
        if runtime.active() is not None:   # called from inside a running kernel: a sub-kernel is inlined (§1.3)
            return self.fn(*args, **kwargs)
        return simulate_kernel(self.fn, args, kwargs, lnc=self.lnc)

    def __repr__(self) -> str:
        return f"nki.jit({self.__name__}){'' if self.lnc is None else f'[{self.lnc}]'}"


def jit(fn=None, **kwargs):
    """``@nki.jit`` / ``nki.jit(fn, **opts)``. ``platform_target=`` is an error since 0.3; ``mode`` is ignored."""
    if "platform_target" in kwargs:
        raise SimulationError("nki.jit(platform_target=...) is not supported; set NEURON_PLATFORM_TARGET_OVERRIDE")
    if fn is None:
        return lambda f: jit(f, **kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, None, kwargs)


def simulate(kernel):
    """``nki.simulate(kernel)(*args)`` / ``nki.simulate(kernel[2])(*args)``: run on the CPU simulator."""
    fn, lnc = _unwrap(kernel)
    return lambda *args, **kwargs: simulate_kernel(fn, args, kwargs, lnc=lnc)


def _unwrap(kernel):
    if isinstance(kernel, Kernel):
        return kernel.fn, kernel.lnc
    if callable(kernel):
        return kernel, None
    raise SimulationError(f"expected a kernel function or nki.jit object, got {type(kernel).__name__}")


def _default_lnc():
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    return None if not value else int(value)


def compiler_lnc() -> int | None:
    """The LNC degree given to neuronx-cc in NEURON_CC_FLAGS (``--lnc`` / ``--logical-nc-config``), if any."""
    flags = shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
    for i, flag in enumerate(flags):
        name, _, value = flag.partition("=")
        if name in ("--lnc", "--logical-nc-config"):
            value = value or (flags[i + 1] if i + 1 < len(flags) else "")
            if value not in ("1", "2"):
                raise SimulationError(f"NEURON_CC_FLAGS {name}={value!r}: the LNC degree is 1 or 2")
            return int(value)
    return None


def check_lnc(fn, kernel_lnc) -> None:
    """NKI 0.7: a kernel whose LNC degree differs from neuronx-cc's is rejected (NCC_EVRF066). The kernel's degree
    is its ``kernel[lnc]`` grid, else NEURON_LOGICAL_NC_CONFIG, else 1; the compiler's is NEURON_CC_FLAGS' --lnc
    (checked only when given: the simulator has no graph compile). The 0.6 rules leave this unchecked."""
    compiler = compiler_lnc()
    if compiler is None or api_version() == "0.6":
        return
    kernel = kernel_lnc or 1
    if kernel != compiler:
        raise SimulationError(f"NCC_EVRF066: NKI kernel {getattr(fn, '__name__', 'kernel')!r} is configured with "
                              f"LNC={kernel}, but neuronx-cc is using LNC={compiler}; set NEURON_LOGICAL_NC_CONFIG "
                              f"and --lnc to the same degree")


def simulate_kernel(func, args=(), kwargs=None, lnc=None, recorder=None, execute=True, target=None):
    """Run ``func(*args, **kwargs)`` as an NKI kernel on the CPU and return its outputs.

    lnc: None (no grid: program_ndim() == 0) or 1/2 (``kernel[lnc]``). recorder: receives one InstrEvent per
    instruction. execute=False validates and records without doing the NumPy math (outputs are then None).
    target: "trn1" | "trn2" | "trn3" (default: NEURON_PLATFORM_TARGET_OVERRIDE, else trn3).
    """
    launch = _Launch(func, args, kwargs, lnc, recorder, execute, target)
    return launch.finish(_run_programs(launch.fn, [launch]))


def simulate_ranks(func, rank_kwargs, lnc=None, target=None):
    """Run ``func`` once per rank of a simulated collective group, all ranks concurrently, and return the list of
    per-rank outputs. ``rank_kwargs[r]`` holds rank r's keyword arguments; ``nki.collectives`` calls exchange data
    between the ranks (nki_kernels/sim/collectives.py describes the model)."""
    from .collectives import World
    world = World(len(rank_kwargs))
    launches = [_Launch(func, (), kw, lnc, None, True, target, rank=r, world=world)
                for r, kw in enumerate(rank_kwargs)]
    results = _run_programs(launches[0].fn, launches)
    n = len(results) // len(launches)
    return [launch.finish(results[i * n:(i + 1) * n]) for i, launch in enumerate(launches)]


class _Launch:
    """One rank's launch: its arguments as HBM tensors and one run context per program instance."""

    def __init__(self, func, args, kwargs, lnc, recorder, execute, target, rank=0, world=None):
        self.fn, bracket = _unwrap(func)
        lnc = lnc if lnc is not None else (bracket if bracket is not None else _default_lnc())
        tgt = parse_target(target) if target else target_from_env()
        if lnc not in (None, 1, 2):
            raise SimulationError(f"lnc must be 1 or 2, got {lnc!r}")
        if lnc == 2 and tgt.gen < 3:
            raise SimulationError("LNC2 needs trn2/trn3 (gen3+); trn1 NeuronCores run kernel[1] only")
        check_lnc(self.fn, lnc)
        precise = precise_fp_from_env()
        self.execute = execute
        self.conv = ArgConverter(precise=precise, execute=execute)
        shared = runtime.Shared()
        self.args, self.kwargs = self.conv.wrap(tuple(args), dict(kwargs or {}), shared, ShapeSpec)
        self.contexts = [runtime.RunContext(target=tgt, recorder=recorder, execute=execute, precise_fp=precise,
                                            program_id=pid, num_programs=lnc or 1,
                                            program_ndim=0 if lnc is None else 1, shared=shared, rank=rank,
                                            world=world) for pid in range(lnc or 1)]

    def finish(self, results):
        for result in results:
            _check_outputs(result)
        self.conv.write_back()
        return self.conv.unwrap(results[0]) if self.execute else None


def _run_one(fn, args, kwargs, ctx):
    shared, world = ctx.shared, ctx.world
    try:
        with runtime.kernel_context(ctx):
            return fn(*args, **kwargs)
    except BaseException:
        for sync in (shared, world):
            if sync is not None:
                with sync.cond:
                    sync.failed = True
                    sync.cond.notify_all()
        raise
    finally:
        with shared.cond:
            shared.finished.add(ctx.program_id)
            shared.cond.notify_all()
        if world is not None:
            with world.cond:
                world.finished.add((ctx.rank, ctx.program_id))
                world.cond.notify_all()


def _run_programs(fn, launches):
    """Program instances run concurrently (one thread each for LNC2 or several ranks) so sendrecv, core_barrier
    and collectives can meet. Results in launch order, then program order."""
    jobs = [(launch, ctx) for launch in launches for ctx in launch.contexts]
    if len(jobs) == 1:
        launch, ctx = jobs[0]
        return [_run_one(fn, launch.args, launch.kwargs, ctx)]
    results, errors = [None] * len(jobs), [None] * len(jobs)

    def worker(i):
        launch, ctx = jobs[i]
        try:
            results[i] = _run_one(fn, launch.args, launch.kwargs, ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), name=f"nki-rank{ctx.rank}-program{ctx.program_id}")
               for i, (_, ctx) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, runtime.PeerFailed)), None)
    if first is not None or any(errors):
        raise first if first is not None else next(e for e in errors if e is not None)
    return results


def _check_outputs(result) -> None:
    items = result if isinstance(result, (tuple, list)) else (result,)
    for r in items:
        if isinstance(r, (tuple, list)):
            _check_outputs(r)
        elif isinstance(r, NkiTensor) and r.buffer.name != "shared_hbm":
            raise SimulationError(f"kernel output {r.name!r} is in {r.buffer!r}; kernel outputs must be allocated "
                                  f"with buffer=nl.shared_hbm")
