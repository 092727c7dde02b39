"""Capacity planner behind `neuron-infer plan`: per-rank memory, fit check and roofline lower bounds.

For a model config, a build (tp degree, quantization, batch, max length, buckets) and an instance type
(neuron_infer.capacity.presets), one rank = one logical NeuronCore (LNC physical cores sharing their HBM):

    weight bytes / rank  from the ShardPlan (padding and KV replication included): decoder linear weights at the
                         quantized width (int8/fp8/w8a8: 1 byte + one fp32 scale per output channel; mxfp8 8.25
                         bits, mxfp4 4.25 bits incl. the 8-bit scale per 32 values; none: the dtype), everything
                         else (embedding, lm_head, norms, biases) in the dtype
    KV cache / rank      2 x layers x local KV heads x head_dim x bytes x batch x length (allocated at max_length)
    fits                 weights + KV cache + reserve <= HBM per logical core; reserve = `reserve_fraction`
                         (default 10 %) of that HBM for the runtime, NEFF I/O, scratchpad and activations
    TTFT bound (compute) prefill FLOPs of a context bucket on one rank / peak FLOP/s of one core (or the weight
                         stream time if larger): 2 x linear params x tokens + causal attention 2 x T^2 x D per head
    TPOT bound (memory)  bytes one decode step reads on one rank (weights except the embedding table, plus the KV
                         cache of the bucket) / HBM bandwidth of one core (or compute time if larger)

The bounds ignore collectives, kernel launch and host overhead, so measured times are always above them; the
ratio measured / bound is the efficiency of the system that was measured. Peak compute uses the fastest rate
the quantization could use (fp8/w8a8: FP8 rate, MX on Trn3: MX rate, else BF16), so it stays a lower bound.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from neuron_infer.capacity.presets import Instance, get_instance
from neuron_infer.config import DTYPES, QUANT_SCHEMES, ModelConfig, auto_buckets
from neuron_infer.errors import ConfigError
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.shard import rank_param_counts

_DTYPE_BYTES = {"bf16": 2, "fp32": 4}
_QUANT_BITS = {"int8": 8.0, "fp8": 8.0, "w8a8": 8.0, "mxfp8": 8.25, "mxfp4": 4.25}
_SCALE_BYTES = 4  # one fp32 scale per output channel (per-channel symmetric int8/fp8)


@dataclass(frozen=True)
class CapacityPlan:
    """The result of `plan_capacity`; `to_dict()` is the `--json` output."""

    model: str
    instance: str
    tp: int
    lnc: int
    quant: str
    dtype: str
    batch_size: int
    max_length: int
    logical_cores: int
    shard_plan: str
    hbm_bytes_per_core: int
    reserve_bytes: int
    weight_bytes_per_rank: int
    weight_bytes_by_dtype: tuple[tuple[str, int], ...]
    kv_cache_bytes_per_rank: int
    kv_cache_bytes_by_bucket: tuple[tuple[int, int], ...]
    hbm_used_bytes_per_rank: int
    headroom_bytes: int
    fits: bool
    peak_flops_per_core: float
    hbm_bytes_per_s_per_core: float
    ttft_lower_bound_s: float
    ttft_lower_bound_s_by_bucket: tuple[tuple[int, float], ...]
    tpot_lower_bound_s: float
    tpot_lower_bound_s_by_bucket: tuple[tuple[int, float], ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("weight_bytes_by_dtype", "kv_cache_bytes_by_bucket", "ttft_lower_bound_s_by_bucket",
                  "tpot_lower_bound_s_by_bucket"):
            d[k] = {str(a): b for a, b in d[k]}
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class _RankWork:
    """Per-rank sizes the bounds need."""

    linear_params: int  # decoder q/k/v/o/gate/up/down weights
    lm_head_params: int  # lm_head rows x hidden (the embedding shard when tied)
    weight_bytes: int
    streamed_weight_bytes: int  # read by every decode step (all but an untied embedding table)
    by_dtype: tuple[tuple[str, int], ...]
    kv_bytes_per_token: int  # per sequence, all layers, this rank


def plan_capacity(cfg: ModelConfig, instance: str | Instance, tp: int, quant: str = "none", max_length: int = 4096,
                  batch_size: int = 1, lnc: int | None = None, context_buckets: tuple[int, ...] | None = None, *,
                  model_name: str = "", dtype: str = "bf16", kv_cache_dtype: str = "auto",
                  tokengen_buckets: tuple[int, ...] | None = None, reserve_fraction: float = 0.10) -> CapacityPlan:
    """Plan `cfg` at `tp` ranks on `instance`; raises ConfigError with the fix for impossible requests."""
    inst = get_instance(instance) if isinstance(instance, str) else instance
    lnc = inst.default_lnc if lnc is None else lnc
    _validate(inst, tp, quant, dtype, kv_cache_dtype, max_length, batch_size, lnc, reserve_fraction)
    plan = ShardPlan.build(cfg, tp)
    ctx = tuple(context_buckets) if context_buckets else auto_buckets(min(128, max_length), max_length)
    tkg = tuple(tokengen_buckets) if tokengen_buckets else auto_buckets(min(128, max_length), max_length)
    for name, buckets in (("context", ctx), ("token-generation", tkg)):
        if max(buckets) > max_length or min(buckets) < 1:
            raise ConfigError(f"{name} buckets {list(buckets)} must lie in 1..max_length={max_length}")
    work = _rank_work(cfg, plan, quant, dtype, kv_cache_dtype)
    chip = inst.chip
    hbm = chip.hbm_bytes // chip.cores * lnc
    bw = chip.hbm_bytes_per_s / chip.cores * lnc
    peak = _peak_flops(inst, quant) / chip.cores * lnc
    reserve = int(hbm * reserve_fraction)
    kv_alloc = work.kv_bytes_per_token * batch_size * max_length
    used = work.weight_bytes + kv_alloc
    q_dim = plan.local_num_heads * cfg.head_dim

    def ttft(t: int) -> float:
        flops = batch_size * (2 * work.linear_params * t + 2 * cfg.num_layers * t * t * q_dim
                              + 2 * work.lm_head_params)
        read = work.streamed_weight_bytes + work.kv_bytes_per_token * batch_size * t
        return max(flops / peak, read / bw)

    def tpot(s: int) -> float:
        flops = batch_size * (2 * (work.linear_params + work.lm_head_params) + 4 * cfg.num_layers * s * q_dim)
        read = work.streamed_weight_bytes + work.kv_bytes_per_token * batch_size * s
        return max(flops / peak, read / bw)

    return CapacityPlan(
        model=model_name or "custom", instance=inst.name, tp=tp, lnc=lnc, quant=quant, dtype=dtype,
        batch_size=batch_size, max_length=max_length, logical_cores=inst.logical_cores(lnc),
        shard_plan=plan.summary(), hbm_bytes_per_core=hbm, reserve_bytes=reserve,
        weight_bytes_per_rank=work.weight_bytes, weight_bytes_by_dtype=work.by_dtype,
        kv_cache_bytes_per_rank=kv_alloc,
        kv_cache_bytes_by_bucket=tuple((b, work.kv_bytes_per_token * batch_size * b) for b in tkg),
        hbm_used_bytes_per_rank=used, headroom_bytes=hbm - reserve - used, fits=used + reserve <= hbm,
        peak_flops_per_core=peak, hbm_bytes_per_s_per_core=bw,
        ttft_lower_bound_s=ttft(max(ctx)), ttft_lower_bound_s_by_bucket=tuple((b, ttft(b)) for b in ctx),
        tpot_lower_bound_s=tpot(max(tkg)), tpot_lower_bound_s_by_bucket=tuple((b, tpot(b)) for b in tkg),
        notes=_notes(inst, plan, quant, lnc),
    )


def _rank_work(cfg: ModelConfig, plan: ShardPlan, quant: str, dtype: str, kv_cache_dtype: str) -> _RankWork:
    hid, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    q, kv, inter = plan.local_num_heads * d, plan.local_num_kv_heads * d, plan.intermediate_size // plan.tp
    linear = layers * (2 * hid * q + 2 * hid * kv + 3 * hid * inter)
    out_channels = layers * (q + 2 * kv + hid + 2 * inter + hid)
    counts = rank_param_counts(cfg, plan)
    other = sum(counts.values()) - linear  # embedding, lm_head, norms, biases: kept in the dtype
    wbytes = _DTYPE_BYTES[dtype]
    if quant == "none":
        by_dtype = ((dtype, (linear + other) * wbytes),)
    else:
        by_dtype = ((quant, int(linear * _QUANT_BITS[quant] / 8)), (dtype, other * wbytes))
        if quant in ("int8", "fp8", "w8a8"):
            by_dtype += (("scales_fp32", out_channels * _SCALE_BYTES),)
    total = sum(b for _, b in by_dtype)
    table = 0 if cfg.tie_word_embeddings else counts["embedding"] * wbytes  # lookups read only `batch` rows
    kv_bytes = 1 if kv_cache_dtype == "fp8" else wbytes
    return _RankWork(
        linear_params=linear, lm_head_params=plan.local_vocab_size * hid, weight_bytes=total,
        streamed_weight_bytes=total - table, by_dtype=by_dtype,
        kv_bytes_per_token=2 * layers * plan.local_num_kv_heads * d * kv_bytes,
    )


def _peak_flops(inst: Instance, quant: str) -> float:
    chip = inst.chip
    if quant in ("mxfp8", "mxfp4") and chip.mx_flops:
        return chip.mx_flops
    if quant in ("fp8", "w8a8"):
        return chip.fp8_flops
    return chip.bf16_flops


def _validate(inst: Instance, tp: int, quant: str, dtype: str, kv_cache_dtype: str, max_length: int,
              batch_size: int, lnc: int, reserve_fraction: float) -> None:
    if lnc not in inst.lnc_options:
        raise ConfigError(f"--lnc {lnc} is not available on {inst.name} (options: {list(inst.lnc_options)}); "
                          "logical NeuronCores of 2 exist on trn2/trn3 only")
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > inst.logical_cores(lnc):
        raise ConfigError(
            f"--tp-degree {tp} needs {tp} NeuronCores but {inst.name} has {inst.logical_cores(lnc)} logical cores "
            f"at LNC={lnc}; use --tp-degree <= {inst.logical_cores(lnc)} or a larger instance"
        )
    if quant not in QUANT_SCHEMES:
        raise ConfigError(f"--quant {quant!r} is unknown; choose one of {', '.join(QUANT_SCHEMES)}")
    if dtype not in DTYPES or kv_cache_dtype not in ("auto", "fp8"):
        raise ConfigError(f"dtype {dtype!r} / kv cache dtype {kv_cache_dtype!r}: choose {DTYPES} / auto|fp8")
    if max_length < 1 or batch_size < 1:
        raise ConfigError(f"--max-length {max_length} and --batch-size {batch_size} must be >= 1")
    if not 0.0 <= reserve_fraction < 1.0:
        raise ConfigError(f"reserve fraction {reserve_fraction} must be in [0, 1)")


def _notes(inst: Instance, plan: ShardPlan, quant: str, lnc: int) -> tuple[str, ...]:
    notes = []
    if plan.padded_num_heads != plan.num_heads:
        notes.append(f"{plan.padded_num_heads - plan.num_heads} padded query heads cost compute and q/o weights")
    if plan.kv_replication > 1:
        notes.append(f"KV heads are replicated x{plan.kv_replication:g}: weights and cache of k/v grow accordingly")
    if plan.tp < inst.logical_cores(lnc):
        notes.append(f"{inst.logical_cores(lnc) - plan.tp} of {inst.logical_cores(lnc)} cores stay idle "
                     "(room for data-parallel replicas)")
    if quant in ("mxfp8", "mxfp4") and not inst.chip.mx_flops:
        notes.append(f"{inst.chip.name} has no MX matmul: weights stored as {quant} are dequantized for BF16 compute")
    if inst.name == "trn3":
        notes.append("trn3 assumed to be a 16-chip Trn3 Gen1 UltraServer server (see presets.py)")
    return tuple(notes)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def render_capacity_text(p: CapacityPlan) -> str:
    """The human-readable `neuron-infer plan` output."""
    dtypes = ", ".join(f"{k} {_gib(v)}" for k, v in p.weight_bytes_by_dtype)
    lines = [
        (f"{p.model} on {p.instance}: tp {p.tp}, LNC {p.lnc} ({p.logical_cores} logical cores), quant {p.quant}, "
         f"{p.dtype}, batch {p.batch_size}, max length {p.max_length}"),
        f"  shard plan        {p.shard_plan}",
        f"  HBM per core      {_gib(p.hbm_bytes_per_core)} (reserve {_gib(p.reserve_bytes)})",
        f"  weights / rank    {_gib(p.weight_bytes_per_rank)}  ({dtypes})",
        f"  KV cache / rank   {_gib(p.kv_cache_bytes_per_rank)} (batch {p.batch_size} x {p.max_length} tokens)",
        f"  used / headroom   {_gib(p.hbm_used_bytes_per_rank)} / {_gib(p.headroom_bytes)}  -> "
        + ("FITS" if p.fits else "DOES NOT FIT"),
        f"  peak per core     {p.peak_flops_per_core / 1e12:.1f} TFLOP/s, {p.hbm_bytes_per_s_per_core / 1e9:.0f} GB/s",
        "  context bucket    TTFT lower bound",
    ]
    lines += [f"  {b:>14}    {_ms(t)}" for b, t in p.ttft_lower_bound_s_by_bucket]
    lines.append("  tokengen bucket   KV read / rank   TPOT lower bound")
    kv = dict(p.kv_cache_bytes_by_bucket)
    lines += [f"  {b:>15}   {_gib(kv[b]):>14}   {_ms(t)}" for b, t in p.tpot_lower_bound_s_by_bucket]
    lines += [f"  note: {n}" for n in p.notes]
    lines.append("  (bounds ignore collectives and overheads: real latencies are higher)")
    return "\n".join(lines)


def tp_candidates(logical_cores: int) -> tuple[int, ...]:
    """TP degrees `plan` tries when none is given: powers of two up to the core count, and the count itself."""
    out, tp = [], 1
    while tp <= logical_cores:
        out.append(tp)
        tp *= 2
    if out[-1] != logical_cores:
        out.append(logical_cores)
    return tuple(out)


def smallest_fitting_plan(cfg: ModelConfig, instance: str | Instance, quant: str = "none", max_length: int = 4096,
                          batch_size: int = 1, lnc: int | None = None, **kwargs: Any) -> CapacityPlan:
    """The plan at the smallest TP degree of `tp_candidates` that fits; ConfigError (with the fix) if none does."""
    inst = get_instance(instance) if isinstance(instance, str) else instance
    lnc_n = inst.default_lnc if lnc is None else lnc
    _validate(inst, 1, quant, kwargs.get("dtype", "bf16"), kwargs.get("kv_cache_dtype", "auto"), max_length,
              batch_size, lnc_n, kwargs.get("reserve_fraction", 0.10))
    tried = tp_candidates(inst.logical_cores(lnc_n))
    last = None
    for tp in tried:
        last = plan_capacity(cfg, inst, tp, quant, max_length, batch_size, lnc_n, **kwargs)
        if last.fits:
            chosen = f"tp {tp} chosen: the smallest of {list(tried)} that fits (pass --tp-degree to choose)"
            return dataclasses.replace(last, notes=(chosen, *last.notes))
    assert last is not None
    raise ConfigError(
        f"{last.model} does not fit on {inst.name} at any TP degree {list(tried)}: at tp {last.tp} a rank needs "
        f"{_gib(last.hbm_used_bytes_per_rank + last.reserve_bytes)} of {_gib(last.hbm_bytes_per_core)}; use "
        "--quant (e.g. fp8 or int8), a smaller --max-length / --batch-size, or a larger instance"
    )
