"""NKI cost model: an ESTIMATE of kernel runtime from the simulator's instruction stream.

``CostModel(generation)`` is a ``Recorder``: the interpreter calls ``record(InstrEvent)`` once per executed
instruction and the model adds that instruction's estimated time to its engine (Tensor, Vector, Scalar, GpSimd,
DMA) with the published rules of the public NKI documentation §9 (see ``cost_rules.py`` and the constants table in
``cost_constants.py``). ``report()`` returns a ``CostReport``:

* per-engine busy time, instruction counts, DMA bytes (and the part touching HBM), matmul FLOPs;
* ``lower_bound_s`` = perfect overlap of the engines = max(engine busy) — the headline estimate;
* ``upper_bound_s`` = fully serialised = sum of engine busy + the whole fixed latency of every DMA;
* the implied fraction of Tensor Engine peak (for the matmul modes used; at both bounds) and of per-core HBM and
  DMA bandwidth (at the lower bound), and which engine bounds the kernel.

Nothing here was measured on hardware. Engines are modelled as independent in-order pipelines with no dependency
stalls, PSUM/SBUF port contention or DMA queue limits, so a real kernel should land between the two bounds (the
two published Trn1 GEMM measurements do: tests/nki_sim/test_cost_calibration.py).

Usage::

    print(cost_kernel(kernel, (ShapeSpec((4096, 8192), nl.bfloat16), ...), generation="trn1"))  # cost-only run
    # or attach a model to any run:
    model = CostModel("trn1")
    with nki_kernels.sim.recording(model):     # or simulate_kernel(..., recorder=model)
        kernel(a, b)
    print(model.report())
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from . import cost_constants as C
from . import cost_rules as R

ESTIMATE_LABEL = "ESTIMATE from published figures (NKI documentation); not measured on hardware"


@dataclass(frozen=True)
class OpStat:
    """Aggregated cost of one (engine, op) pair."""

    engine: str
    op: str
    count: int
    busy_s: float
    generic_rule: bool  # True when no op-specific §9 rule matched and the generic max(MIN_II, N) was used


@dataclass(frozen=True)
class CostReport:
    """Estimated cost of one simulated run (see module docstring for the definitions).

    Times are per NeuronCore (the busiest core for LNC2); counts, bytes and FLOPs are totals over all cores.
    """

    generation: str
    cores: int                     # physical cores the run used (2 for an LNC2 launch)
    engine_busy_s: dict[str, float]
    engine_instructions: dict[str, int]
    ops: tuple[OpStat, ...]
    dma_bytes: int
    hbm_bytes: int
    dma_transfers: int
    flops: float
    tensor_peak_time_s: float      # sum over matmuls of FLOPs / peak FLOP/s of that matmul's mode
    matmul_mode: str               # "bf16" | "fp32" | "double_row" | "mx" | "mixed" | "none"
    lower_bound_s: float
    upper_bound_s: float
    bound_engine: str
    tensor_peak_fraction: float    # at the lower bound (perfect overlap) — the headline figure
    tensor_peak_fraction_serial: float
    hbm_bw_fraction: float         # HBM bytes / lower bound / per-core HBM share
    dma_bw_fraction: float         # all DMA bytes / lower bound / per-core practical DMA peak
    label: str = field(default=ESTIMATE_LABEL)

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict (ops as a list of dicts)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "ops"}
        out["engine_busy_s"] = dict(self.engine_busy_s)
        out["engine_instructions"] = dict(self.engine_instructions)
        out["ops"] = [_op_dict(o) for o in self.ops]
        return out

    def __str__(self) -> str:
        return format_report(self)


def _op_dict(o: OpStat) -> dict:
    return {"engine": o.engine, "op": o.op, "count": o.count, "busy_s": o.busy_s, "generic_rule": o.generic_rule}


def _fmt_s(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} us"


def format_report(r: CostReport) -> str:
    """Readable table of a report."""
    cores = f", {r.cores} cores (per-core busiest shown)" if r.cores > 1 else ""
    lines = [f"NKI cost estimate — {r.generation}{cores} — {r.label}",
             f"{'engine':<8} {'instr':>9} {'busy':>12} {'share of lower bound':>22}"]
    for eng in C.ENGINES:
        busy = r.engine_busy_s[eng]
        share = busy / r.lower_bound_s if r.lower_bound_s > 0 else 0.0
        lines.append(f"{eng:<8} {r.engine_instructions[eng]:>9} {_fmt_s(busy):>12} {share:>21.1%}")
    lines += [
        f"lower bound (perfect overlap): {_fmt_s(r.lower_bound_s)}  — bound by {r.bound_engine}",
        f"upper bound (serialised):      {_fmt_s(r.upper_bound_s)}",
        (f"matmul FLOPs: {r.flops:.4g} ({r.matmul_mode}); Tensor Engine peak fraction: "
         f"{r.tensor_peak_fraction:.1%} (serialised: {r.tensor_peak_fraction_serial:.1%})"),
        (f"DMA: {r.dma_transfers} transfers, {r.dma_bytes / 2**20:.2f} MiB ({r.hbm_bytes / 2**20:.2f} MiB HBM side); "
         f"HBM BW fraction {r.hbm_bw_fraction:.1%}, DMA BW fraction {r.dma_bw_fraction:.1%}"),
    ]
    generic = [f"{o.engine}.{o.op}" for o in r.ops if o.generic_rule]
    if generic:
        lines.append("generic max(MIN_II, N) rule used for: " + ", ".join(sorted(generic)))
    return "\n".join(lines)


def _run_context():
    """The simulator's current run context (program id, target), or None outside a kernel run."""
    try:
        from . import runtime
    except ImportError:  # the cost model also works on plain event lists
        return None
    return runtime.active()


class CostModel:
    """Recorder that accumulates estimated per-engine time per NeuronCore.

    ``generation``: trn1|trn2|trn3 or gen2|gen3|gen4; ``None`` takes it from the simulated run's target (and
    raises if events arrive outside a run). With LNC2 each program instance is one physical core: busy times are
    kept per core and the bounds are taken over the cores, which run in parallel.
    """

    def __init__(self, generation: str | None = "gen2") -> None:
        self.generation = None if generation is None else C.resolve_generation(generation)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._busy: dict[int, dict[str, float]] = {}
        self._serial_extra: dict[int, float] = {}
        self._count = dict.fromkeys(C.ENGINES, 0)
        self._ops: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, False])
        self._dma_bytes = 0
        self._hbm_bytes = 0
        self._flops = 0.0
        self._peak_time = 0.0
        self._modes: set[str] = set()

    def _resolve(self, ctx) -> C.GenerationConstants:
        run_gen = f"gen{ctx.target.gen}" if ctx is not None else None
        if self.generation is None:
            if run_gen is None:
                raise ValueError("CostModel(generation=None) can only record inside a simulated run; "
                                 "pass generation='trn1'|'trn2'|'trn3' to cost a plain event list")
            self.generation = run_gen
        elif run_gen is not None and run_gen != self.generation:
            raise ValueError(f"CostModel is for {self.generation} but the kernel runs on target {run_gen}; "
                             f"set NEURON_PLATFORM_TARGET_OVERRIDE or build CostModel({run_gen!r})")
        return C.GEN[self.generation]

    def record(self, ev) -> None:
        """Add one instruction event (``nki_kernels.sim.events.InstrEvent``)."""
        ctx = _run_context()
        core = ctx.program_id if ctx is not None else 0
        with self._lock:
            g = self._resolve(ctx)
            seconds, generic = self._cost(ev, g, core)
            busy = self._busy.setdefault(core, dict.fromkeys(C.ENGINES, 0.0))
            busy[ev.engine] += seconds
            self._count[ev.engine] += 1
            slot = self._ops[(ev.engine, ev.op)]
            slot[0] += 1
            slot[1] += seconds
            slot[2] = slot[2] or generic

    def _cost(self, ev, g: C.GenerationConstants, core: int) -> tuple[float, bool]:
        if ev.engine == "tensor":
            cycles = R.tensor_cycles(ev)          # validates the event first
            if ev.op in ("nc_matmul", "nc_matmul_mx") and not ev.is_transpose:
                self._add_flops(ev, g)          # a transpose-mode matmul moves data: no matmul FLOPs
            return cycles / g.tensor_hz, False
        if ev.engine == "vector":
            cycles, known = R.vector_like_cycles(ev, g)
            return cycles / g.vector_hz, not known
        if ev.engine == "gpsimd":
            cycles, known = R.vector_like_cycles(ev, g, perf_modes=False)
            return cycles / g.gpsimd_hz, not known
        if ev.engine == "scalar":
            cycles, known = R.scalar_cycles(ev, g)
            return cycles / g.scalar_hz, not known
        if ev.engine == "dma":
            occupancy, serial = R.dma_seconds(ev, g)
            self._serial_extra[core] = self._serial_extra.get(core, 0.0) + serial - occupancy
            self._dma_bytes += ev.dma_bytes
            self._hbm_bytes += ev.dma_bytes * ((ev.src_buffer == "hbm") + (ev.dst_buffer == "hbm"))
            return occupancy, False
        raise ValueError(f"cost model: unknown engine {ev.engine!r} in {ev}; expected one of {C.ENGINES}")

    def _add_flops(self, ev, g: C.GenerationConstants) -> None:
        k, m, n = ev.matmul_kmn
        mode = R.matmul_mode(ev)
        flops = 2.0 * k * m * n
        self._flops += flops
        self._peak_time += flops / R.peak_flops_for(mode, g, self.generation)
        self._modes.add(mode)

    def report(self) -> CostReport:
        """Summarise everything recorded so far (per-engine busy = the busiest core's, for LNC2)."""
        with self._lock:
            return self._report()

    def _report(self) -> CostReport:
        gen = self.generation or "gen2"
        g = C.GEN[gen]
        cores = max(1, len(self._busy))
        per_core = list(self._busy.items()) or [(0, dict.fromkeys(C.ENGINES, 0.0))]
        busy = {e: max(b[e] for _, b in per_core) for e in C.ENGINES}
        lower = max(busy.values())
        upper = max(sum(b.values()) + self._serial_extra.get(c, 0.0) for c, b in per_core)
        bound = max(C.ENGINES, key=lambda e: busy[e]) if lower > 0 else "none"
        mode = "none" if not self._modes else (next(iter(self._modes)) if len(self._modes) == 1 else "mixed")
        ops = tuple(OpStat(e, o, int(v[0]), float(v[1]), bool(v[2])) for (e, o), v in sorted(self._ops.items()))

        def frac(work_s: float, elapsed: float) -> float:  # work in core-seconds at peak, over all cores
            return work_s / (elapsed * cores) if elapsed > 0 else 0.0

        return CostReport(
            generation=gen, cores=cores, engine_busy_s=busy, engine_instructions=dict(self._count),
            ops=ops, dma_bytes=self._dma_bytes, hbm_bytes=self._hbm_bytes, dma_transfers=self._count["dma"],
            flops=self._flops, tensor_peak_time_s=self._peak_time, matmul_mode=mode,
            lower_bound_s=lower, upper_bound_s=upper, bound_engine=bound,
            tensor_peak_fraction=frac(self._peak_time, lower),
            tensor_peak_fraction_serial=frac(self._peak_time, upper),
            hbm_bw_fraction=frac(self._hbm_bytes / g.hbm_bytes_per_s, lower),
            dma_bw_fraction=frac(self._dma_bytes / g.dma_bytes_per_s, lower),
        )


def estimate(events, generation: str = "gen2") -> CostReport:
    """Cost report of an iterable of ``InstrEvent`` (e.g. ``ListRecorder().events``)."""
    model = CostModel(generation)
    for ev in events:
        model.record(ev)
    return model.report()


def cost_kernel(kernel, args, kwargs=None, generation: str = "trn3", lnc: int | None = None) -> CostReport:
    """Cost report of one kernel launch in the simulator's cost-only mode (validation + events, no NumPy math).

    ``args`` may be arrays or ``nki.simulator.ShapeSpec(shape, dtype)`` placeholders (nothing is allocated), so
    realistic per-core shapes cost seconds, not minutes. The run targets ``generation``.
    """
    from .launch import simulate_kernel

    model = CostModel(generation)
    simulate_kernel(kernel, tuple(args), dict(kwargs or {}), lnc=lnc, recorder=model, execute=False,
                    target=generation)
    return model.report()
