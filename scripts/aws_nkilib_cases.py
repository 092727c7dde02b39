"""nki-library cases for scripts/run_aws_nki_kernels.py: each runs one kernel of a user's nki-library checkout
(``src/nkilib_src`` on sys.path) on small inputs shaped like the library's own fast tests and compares it with the
torch reference the library publishes next to the kernel (``*_torch.py``). No nki-library code is copied here."""
from __future__ import annotations

import enum
import importlib
import inspect
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
from aws_nki_cases import Case, simulate, target

BF16 = ml_dtypes.bfloat16


def _to_torch(value):
    """numpy -> torch as the library's reference wrapper does: bf16/fp8 -> fp32, uint32 -> int32."""
    import torch
    if not isinstance(value, np.ndarray):
        return value
    if "bfloat16" in str(value.dtype) or "float8" in str(value.dtype) or value.dtype == np.float16:
        value = value.astype(np.float32)
    elif value.dtype == np.uint32:
        value = value.astype(np.int32)
    return torch.from_numpy(np.ascontiguousarray(value))


def _to_numpy(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().float().numpy() if value.is_floating_point() else value.detach().numpy()
    return np.asarray(value)


def check_max(got, ref, rtol, atol, what=""):
    """nki-library's own acceptance rule: |got - ref| <= atol + rtol * max|ref| (its comparator's "max" mode)."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        if got.size != ref.size:
            raise AssertionError(f"mismatch {what}: shape {got.shape} vs reference {ref.shape}")
        got = got.reshape(ref.shape)
    scale = np.nanmax(np.abs(ref)) if ref.size else 0.0
    err = np.abs(got - ref)
    if not np.all((err <= atol + rtol * scale) | (np.isnan(got) & np.isnan(ref))):
        raise AssertionError(f"mismatch {what}: max abs error {np.nanmax(err):.3g} > {atol} + {rtol} * {scale:.3g}")


def reference(fn: Callable, inputs: dict) -> list:
    """Call a torch reference with the inputs it names; its outputs in their order (dict values or one tensor)."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    result = fn(**{k: _to_torch(v) for k, v in inputs.items() if takes_all or k in params})
    if isinstance(result, dict):
        return [_to_numpy(v) for v in result.values()]
    if isinstance(result, (tuple, list)):
        return [_to_numpy(v) for v in result]
    return [_to_numpy(result)]


def _harness_module(name: str, **attrs) -> None:
    """Register module ``name`` of nki-library's test harness (and its missing parents) holding just ``attrs``."""
    import sys
    import types
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        full = ".".join(parts[:i])
        if full not in sys.modules:
            mod = types.ModuleType(full)
            mod.__path__ = []
            sys.modules[full] = mod
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)
    for key, value in attrs.items():
        setattr(sys.modules[name], key, value)


def _harness_norms() -> None:
    """Two library references (qkv_tkg, moe_cte) import the norm table of nki-library's test harness, whose other
    dependencies (neuron_dtypes, scipy) are not needed here: register a module with just that table, built from
    the library's own norm references."""
    import sys
    name = "test.integration.nkilib.utils.test_kernel_common"
    if name in sys.modules:
        return
    common = importlib.import_module("nkilib.core.utils.common_types")
    rms = importlib.import_module("nkilib.core.subkernels.rmsnorm_torch").rms_norm_torch_ref
    layer = importlib.import_module("nkilib.core.subkernels.layernorm_torch").layer_norm_torch_ref
    norm = common.NormType
    table = {norm.NO_NORM: lambda *x, **_: x[0], norm.RMS_NORM: rms, norm.LAYER_NORM: layer,
             norm.RMS_NORM_SKIP_GAMMA: rms}
    _harness_module(name, norm_name2func_torch=table)


class BlockwiseVariant(enum.Enum):
    """The blockwise-matmul variant names moe_cte's torch reference compares its ``bwmm_func`` against (it imports
    them from nki-library's test harness, registered here with just this enum)."""

    SHARD_ON_BLOCK = enum.auto()
    SHARD_ON_INTERMEDIATE = enum.auto()
    SHARD_ON_INTERMEDIATE_HW = enum.auto()
    SHARD_ON_INTERMEDIATE_DROPPING = enum.auto()


def _absent_neuron_dtypes() -> None:
    """nki-library's MX torch helpers import ``neuron_dtypes`` (not a public package) at module level; the non-MX
    references that import them never call it. Register a module whose every attribute access raises, so those
    references import and any MX use fails loudly instead of silently."""
    import sys
    import types
    try:
        importlib.import_module("neuron_dtypes")
        return
    except ImportError:
        pass

    class Absent(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise ImportError(f"neuron_dtypes.{name} is needed here and neuron_dtypes is not installed")

    sys.modules["neuron_dtypes"] = Absent("neuron_dtypes")


def lib(name: str, kernel: str, ref: str | Callable, make_inputs: Callable, rtol: float, atol: float, *,
        lnc: int = 2, platform: str = "trn2", outputs: slice | None = None, ref_names: dict | None = None,
        mutated: tuple[str, ...] = (), same_kernel_as: str = "") -> Case:
    """kernel / ref: "module.path:function" under nkilib (ref may instead be a function of the inputs returning the
    expected outputs, for kernels whose library test states its reference inline). make_inputs(rng) -> kernel
    keyword arguments; ref_names renames them for the reference. outputs selects which of the kernel's returned
    tensors (and the reference's, in the same order) are compared; a kernel that writes into its arguments instead
    of returning names them in mutated (the simulator writes them back like the SDK's simulator). same_kernel_as
    names the case whose kernel this one runs again (another LNC, layout or shape): it counts as that kernel."""
    def run(root, load, rng):
        kmod, kfn = kernel.split(":")
        _absent_neuron_dtypes()
        _harness_norms()
        kernel_fn = getattr(importlib.import_module("nkilib." + kmod), kfn)
        inputs = make_inputs(rng)
        with target(platform):
            got = simulate(kernel_fn, lnc=lnc, **inputs)
        got = [inputs[n] for n in mutated] if mutated else list(got) if isinstance(got, (tuple, list)) else [got]
        if callable(ref):
            want = ref(inputs)
        else:
            rmod, rfn = ref.split(":")
            ref_fn = getattr(importlib.import_module("nkilib." + rmod), rfn)
            if not inspect.isfunction(ref_fn):   # an LNC-subscriptable reference: ref[lnc](...)
                ref_fn = ref_fn[lnc]
            want = reference(ref_fn, {(ref_names or {}).get(k, k): v for k, v in inputs.items()})
        sel = outputs or slice(None)
        got, want = got[sel], want[sel]
        if len(got) != len(want):
            raise AssertionError(f"mismatch: kernel returned {len(got)} outputs, reference {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            check_max(g, w, rtol, atol, f"output {i}")
    return Case("nki-library/" + name, "nki-library", run, "nki-library/" + same_kernel_as if same_kernel_as else "")


def ranks(name: str, kernel: str, make_inputs: Callable, golden: Callable, rtol: float, atol: float, *,
          lnc: int, platform: str = "trn2") -> Case:
    """A collective kernel run once per rank of a simulated group (``nki.simulator.simulate_ranks``).
    make_inputs(rng) -> one kwargs dict per rank; golden(inputs) -> each rank's expected output, the result the
    library's own test states for it."""
    def run(root, load, rng):
        from nki.simulator import simulate_ranks
        kmod, kfn = kernel.split(":")
        kernel_fn = getattr(importlib.import_module("nkilib." + kmod), kfn)
        inputs = make_inputs(rng)
        with target(platform):
            got = simulate_ranks(kernel_fn, inputs, lnc=lnc)
        want = golden(inputs)
        if len(got) != len(want):
            raise AssertionError(f"mismatch: {len(got)} ranks returned, {len(want)} expected")
        for r, (g, w) in enumerate(zip(got, want)):
            check_max(g, w, rtol, atol, f"rank {r}")
    return Case("nki-library/" + name, "nki-library", run)


def _replica_group(n):
    return importlib.import_module("nki.collectives").ReplicaGroup([list(range(n))])


def _sb2sb_inputs(rng, m, k, tp):
    """Each rank holds a different [m, k] bf16 block (the library test's layout)."""
    group = _replica_group(tp)
    return [{"inp": _randn(rng, (m, k), BF16), "replica_groups": group, "tp_degree": tp} for _ in range(tp)]


def _sb2sb_golden(inputs):
    """Every rank ends with the blocks of all ranks concatenated along k, in rank order."""
    gathered = np.concatenate([kw["inp"] for kw in inputs], axis=1)
    return [gathered] * len(inputs)


def _fg_inputs(rng, m, k, tp, n=None):
    """Rank r holds rows [r*m, (r+1)*m) of a global lhs (and, with n, columns [r*n/tp, (r+1)*n/tp) of rhs)."""
    lhs = _randn(rng, (m * tp, k), BF16)
    rhs = _randn(rng, (k, n), BF16) if n else None
    out = []
    for r in range(tp):
        kw = {"lhs": lhs[r * m:(r + 1) * m], "tp_degree": tp, "num_groups": 1, "force_hbm_cc": False}
        if n:
            kw["rhs"] = rhs[:, r * (n // tp):(r + 1) * (n // tp)]
        out.append(kw)
    return out


def _fg_allgather_golden(inputs):
    """Every rank ends with the full global lhs."""
    return [np.concatenate([kw["lhs"] for kw in inputs], axis=0)] * len(inputs)


def _fgcc_golden(inputs):
    """Rank r ends with its column shard of lhs_global @ rhs_global (fp32 product cast to the input dtype)."""
    lhs = np.concatenate([kw["lhs"] for kw in inputs], axis=0).astype(np.float32)
    return [(lhs @ kw["rhs"].astype(np.float32)).astype(BF16) for kw in inputs]


def _attention_tkg_case(root, load, rng):
    """attention_tkg is a sub-kernel: it takes an SBUF allocator and its output tensors from the caller. A small
    jit wrapper of our own allocates them (flat KV cache in HBM, outputs in shared HBM, mask generated in-kernel from
    position ids, RoPE fused) and the result is compared with the library's attention_tkg_torch_ref at the
    tolerances of its test (rtol 1e-2, atol 1e-5)."""
    import nki
    import nki.language as nl
    mod = importlib.import_module("nkilib.core.attention.attention_tkg")
    alloc = importlib.import_module("nkilib.core.utils.allocator")
    logging = importlib.import_module("nkilib.core.utils.logging")
    ref = importlib.import_module("nkilib.core.attention.attention_tkg_torch").attention_tkg_torch_ref
    lnc, bs, heads, s_act, s_prior, full, d = 2, 4, 2, 7, 256, 16384, 128
    cfg = mod.AttnTKGConfig(bs, heads, s_act, s_prior, full, d, 0, use_pos_id=True, fuse_rope=True)
    out_shape, k_out_shape = (bs, heads, d, s_act), (bs, 1, d, s_act)

    @nki.jit
    def wrapper(q, k_active, v_active, k_prior, v_prior, mask, inv_freqs, rope_pos_ids):
        sbm = alloc.SbufManager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, logging.Logger("SBM"))
        sbm.open_scope()
        out = nl.ndarray(out_shape, dtype=q.dtype, buffer=nl.shared_hbm)
        k_out = nl.ndarray(k_out_shape, dtype=q.dtype, buffer=nl.shared_hbm)
        result = mod.attention_tkg(q, k_active, v_active, k_prior, v_prior, mask, out, cfg, sbm, inv_freqs,
                                   rope_pos_ids, None, None, None, k_out)
        sbm.close_scope()
        return result

    def u(*shape):
        return rng.random(shape).astype(BF16)
    pos = rng.integers(0, s_prior - s_act, (bs, 1))
    causal = np.tril(np.ones((s_act, s_act), np.uint8))            # [query, key]
    inputs = {"q": u(bs, heads, s_act, d), "k_active": u(bs, 1, s_act, d), "v_active": u(bs, 1, s_act, d),
              "k_prior": u(bs, 1, d, full), "v_prior": u(bs, 1, full, d),
              "mask": np.ascontiguousarray(np.broadcast_to(causal.T[:, None, None, :], (s_act, bs, heads, s_act))),
              "inv_freqs": rng.random((d // 2, 1)).astype(np.float32),
              "rope_pos_ids": np.broadcast_to(pos, (bs, s_act)).astype(np.float32)}
    with target("trn2"):
        got = simulate(wrapper, lnc=lnc, **inputs)
    import torch
    want = ref[lnc](**{k: _to_torch(v) for k, v in inputs.items()}, out=torch.zeros(out_shape),
                    cfg=cfg, sbm=None, start_pos_ids=None, sink=None, active_blocks_table=None,
                    k_out=torch.zeros(k_out_shape), DBG_TENSORS=None)
    for i, (g, w) in enumerate(zip(got, want)):
        check_max(g, _to_numpy(w), 1e-2, 1e-5, f"output {i}")


def _moe_blocks(rng, t, e, b, top_k, blocks_multiple, skip_token):
    """Blockwise MoE routing as the kernels take it: each token picks top_k distinct experts; expert x owns
    ceil(tokens_x / b) consecutive blocks of b token slots (the last expert also the padding blocks, so that
    n = ceil((t*top_k - (e-1)) / b) + e - 1, rounded up to ``blocks_multiple``); token_position_to_id[slot] is the
    token in that slot, empty slots hold -1 (skip_token) or t (the zero padding token)."""
    mask = np.zeros((t, e), np.float32)
    for tok in range(t):
        mask[tok, rng.choice(e, top_k, replace=False)] = 1
    n = math.ceil((t * top_k - (e - 1)) / b) + e - 1
    n = blocks_multiple * math.ceil(n / blocks_multiple)
    per_expert = np.ceil(mask.sum(0) / b).astype(np.int64)
    per_expert[-1] += n - per_expert.sum()
    slots = np.full(n * b, -1 if skip_token else t, np.int32)
    start = np.concatenate([[0], np.cumsum(per_expert)[:-1]]) * b
    for x in range(e):
        toks = np.nonzero(mask[:, x])[0]
        slots[start[x]:start[x] + toks.size] = toks
    return mask, slots, np.repeat(np.arange(e), per_expert).astype(np.int32)


def _moe_cte_case(kernel: str, variant: str, t, h, i, e, b, top_k, skip_token, act, clamps=(None,) * 4,
                  spec: str = ""):
    """One blockwise-matmul kernel of moe_cte (bias on, POST_SCALE affinities, bf16) at LNC2 against the library's
    moe_cte_torch_ref, at its test's tolerances (rtol 2e-2, atol 1e-5). spec: call the unified ``moe_cte`` entry
    with ``MoECTESpec(implementation=spec)`` instead of the variant's own kernel."""
    def run(root, load, rng):
        import torch
        types = importlib.import_module("nkilib.core.utils.common_types")
        utils = importlib.import_module("nkilib.core.moe.moe_cte.moe_cte_utils")
        kmod, kfn = kernel.split(":")
        kernel_fn = getattr(importlib.import_module("nkilib." + kmod), kfn)
        _harness_module("test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common", BWMMFunc=BlockwiseVariant)
        ref = importlib.import_module("nkilib.core.moe.moe_cte.moe_cte_torch").moe_cte_torch_ref
        block_parallel = variant == "SHARD_ON_BLOCK"
        mask, slots, block_to_expert = _moe_blocks(rng, t, e, b, top_k, 2 if block_parallel else 1, skip_token)
        rows = t if skip_token else t + 1
        hidden = np.zeros((rows, h), BF16)
        hidden[:t] = rng.random((t, h))
        aff = np.zeros((rows, e), np.float32)
        aff[:t] = rng.random((t, e)) * mask
        inputs = {"hidden_states": hidden, "expert_affinities_masked": aff.astype(BF16).reshape(-1, 1),
                  "gate_up_proj_weight": rng.uniform(-0.1, 0.1, (e, h, 2, i)).astype(BF16),
                  "down_proj_weight": rng.uniform(-0.1, 0.1, (e, math.ceil(i / 16) * 16, h)).astype(BF16),
                  "token_position_to_id": slots, "block_to_expert": block_to_expert, "block_size": b,
                  "gate_and_up_proj_bias": rng.uniform(-1, 1, (e, 2, i)).astype(BF16),
                  "down_proj_bias": rng.uniform(-1.6, 1.4, (e, h)).astype(BF16),
                  "activation_function": getattr(types.ActFnType, act),
                  "skip_dma": utils.SkipMode(skip_token, False), "compute_dtype": BF16,
                  "is_tensor_update_accumulating": top_k != 1,
                  "expert_affinities_scaling_mode": types.ExpertAffinityScaleMode.POST_SCALE}
        if variant == "SHARD_ON_INTERMEDIATE_HW":   # [N+1]: 1 for each block that holds tokens, then 0s
            used = int(np.ceil(mask.sum(0) / b).sum())
            inputs["conditions"] = (np.arange(block_to_expert.size + 1) < used).astype(np.int32)
        for name, value in zip(("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit",
                                "up_clamp_lower_limit"), clamps):
            if value is not None:
                inputs[name] = value
        kernel_args = dict(inputs)
        if spec:
            cte = importlib.import_module("nkilib.core.moe.moe_cte")
            kernel_args["spec"] = cte.MoECTESpec(implementation=getattr(cte.MoECTEImplementation, spec))
        with target("trn2"):
            got = simulate(kernel_fn, lnc=2, **kernel_args)
        ref_in = {k: _to_torch(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}
        want = ref(**ref_in, bwmm_func=getattr(BlockwiseVariant, variant), lnc_degree=2, top_k=top_k)["output"]
        got = got[0] if isinstance(got, (tuple, list)) else got
        check_max(got, _to_numpy(want if isinstance(want, torch.Tensor) else torch.as_tensor(want)), 2e-2, 1e-5,
                  "output")
    return run


def _randn(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _act(name):
    return getattr(importlib.import_module("nkilib.core.utils.common_types").ActFnType, name)


def _ce_backward_inputs(rng):
    logits = _randn(rng, (4, 32128), BF16)
    targets = rng.integers(0, 32128, 4, np.int32)
    ref = importlib.import_module("nkilib.experimental.loss.cross_entropy_torch").cross_entropy_forward_torch_ref
    _, lse = ref(_to_torch(logits).bfloat16(), _to_torch(targets).long())
    return {"logits_hbm": logits, "targets_hbm": targets, "lse_state_hbm": _to_numpy(lse).astype(BF16),
            "reduction": "mean", "positions_per_batch": 4, "chunk_size": 16384}


def _ce_forward_ref(inputs):
    """The library's reference on bf16 logits and int64 targets (as its test converts them)."""
    import torch
    ref = importlib.import_module("nkilib.experimental.loss.cross_entropy_torch").cross_entropy_forward_torch_ref
    out = ref(_to_torch(inputs["logits_hbm"]).to(torch.bfloat16), _to_torch(inputs["targets_hbm"]).long())
    return [_to_numpy(v) for v in out]


def _ce_backward_ref(inputs):
    import torch
    ref = importlib.import_module("nkilib.experimental.loss.cross_entropy_torch").cross_entropy_backward_torch_ref
    out = ref(_to_torch(inputs["logits_hbm"]).to(torch.bfloat16), _to_torch(inputs["targets_hbm"]).long(), "mean")
    return [_to_numpy(out)]


def _depthwise_ref(inputs):
    """Depthwise convolution = torch conv2d with groups = channels (the library test's golden)."""
    import torch
    x, w = _to_torch(inputs["img_ref"]), _to_torch(inputs["filter_ref"])
    out = torch.nn.functional.conv2d(x, w, stride=inputs["stride"], padding=(0, inputs["padding"][1][0]),
                                     groups=x.shape[1])
    return [_to_numpy(out)]


def _topk_reduce_input(rng, src_ranks, t, k, h):
    """[src_ranks*T, H+2] bf16 rows: T*K real rows (values + the token id as two bf16 halves) scattered among -1."""
    buf = np.full((src_ranks * t, h + 2), -1, dtype=BF16)
    vals = rng.standard_normal((t * k, h)).astype(BF16)
    ids = np.arange(t, dtype=np.int32).repeat(k).reshape(t * k, 1).view(BF16)
    buf[rng.permutation(src_ranks * t)[: t * k]] = np.concatenate([vals, ids], axis=1)
    return buf


def _rope_hf_inputs(rng, b, hq, hkv, s, d, dtype):
    q, k = _randn(rng, (b, hq, s, d), dtype), _randn(rng, (b, hkv, s, d), dtype)
    return {"q": q, "k": k, "q_out": np.zeros_like(q), "k_out": np.zeros_like(k), "cos": _randn(rng, (b, s, d), dtype),
            "sin": _randn(rng, (b, s, d), dtype), "backward": False}


def _norm_inputs(rng, b, s, h, dtype, hidden_actual=None, beta=False):
    out = {"input": _randn(rng, (b, s, h), dtype), "gamma": _randn(rng, (1, h), dtype),
           "output": np.zeros((128, b * s, h // 128), dtype)}
    if beta:
        out["beta"] = _randn(rng, (1, h), dtype)
    elif hidden_actual is not None:
        out["hidden_actual"] = hidden_actual
    return out


def _sparse(rng, t, e, top_k, dtype):
    """[T, E] routing mask with T*top_k/E nonzeros per column (the library test's sparsity)."""
    k = t * top_k // e
    flat = rng.permutation(np.concatenate([np.ones(k * e), np.zeros((t - k) * e)]))
    out = flat.reshape(e, t).T.astype(dtype)
    if dtype == np.float32:
        out[out > 0] = 0.1
    return out


def _flatten_inputs(t, e, f_len):
    out_len = ((e * t + 1024 + 127) // 128) * 128
    return {"input_tensor": np.arange(e * t, dtype=np.int32).reshape(e, t), "f_len": f_len, "output_len": out_len,
            "row_offsets": np.array([t // f_len * i for i in range(e)], np.int32), "row_offsets_start": None,
            "padding_val": -1}


def _mask_inputs(rng, batch, q_head, s_ctx, s_active, block_len=0):
    """Flat KV cache: every active slot of batch b sits at position cache_len[b] (the library test's layout)."""
    cache_lens = rng.integers(1, s_ctx, batch)
    pos = np.repeat(cache_lens, s_active).astype(np.float32).reshape(1, batch * s_active)
    return {"pos_ids_hbm": pos, "bs": batch, "q_head": q_head, "s_active": s_active, "s_prior": s_ctx,
            "block_len": block_len}


def _oproj_inputs(rng, b, n_heads, s, d, h, bias, transpose):
    return {"attention": _randn(rng, (d, b, n_heads, s), BF16), "weight": _randn(rng, (d * n_heads, h), BF16),
            "bias": (_randn(rng, (1, h)) * 100).astype(BF16) if bias else None, "TRANSPOSE_OUT": transpose,
            "OUT_IN_SB": False}


_QKV_REF_NAMES = {"input": "hidden", "fused_qkv_weights": "qkv_w", "gamma_norm_weights": "norm_w",
                  "fused_residual_add": "fused_add", "attention_prev": "attn_prev", "fused_norm_type": "norm_type",
                  "norm_eps": "eps", "bias": "qkv_bias", "layer_norm_bias": "norm_bias"}


def _qkv_inputs(rng, b, s, h, qkv_dim, n_q, n_kv, d, norm, fused_add, qkv_bias=False):
    types = importlib.import_module("nkilib.core.utils.common_types")
    def t(*shape):
        return _randn(rng, shape, BF16)
    return {"input": t(b, s, h), "fused_qkv_weights": t(h, qkv_dim), "output_layout": types.QKVOutputLayout.BSD,
            "bias": t(1, qkv_dim) if qkv_bias else None, "fused_residual_add": fused_add,
            "mlp_prev": t(b, s, h) if fused_add else None, "attention_prev": t(b, s, h) if fused_add else None,
            "fused_norm_type": getattr(types.NormType, norm),
            "gamma_norm_weights": t(1, h) if norm != "NO_NORM" else None, "norm_eps": 1e-6,
            "d_head": d, "num_q_heads": n_q, "num_kv_heads": n_kv}


def _attn_cte_inputs(rng, bs, sq, skv, d, causal, tp_q, tp_out, bs_kv=None):
    bs_kv = bs_kv or bs
    def u(*shape):
        return rng.random(shape).astype(BF16)
    return {"q": u(bs, sq, d) if tp_q else u(bs, d, sq), "k": u(bs_kv, d, skv), "v": u(bs_kv, skv, d),
            "scale": 1.0, "causal_mask": causal, "tp_q": tp_q, "tp_k": False, "tp_out": tp_out}


def _mlp_inputs(rng, b, s, h, i, norm):
    types = importlib.import_module("nkilib.core.utils.common_types")
    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(BF16)
    out = {"hidden_tensor": _randn(rng, (b, s, h), BF16), "gate_proj_weights_tensor": w(h, i),
           "up_proj_weights_tensor": w(h, i), "down_proj_weights_tensor": w(i, h),
           "activation_fn": types.ActFnType.SiLU, "normalization_type": getattr(types.NormType, norm)}
    if norm != "NO_NORM":
        out["normalization_weights_tensor"] = _randn(rng, (1, h), BF16)
    return out


def _mlp_ref(inputs):
    """The kernel's documented result: down(silu(gate(x')) * up(x')), x' = RMS-normalised x (eps 1e-6) if asked."""
    f = {k: np.asarray(v, np.float64) for k, v in inputs.items() if isinstance(v, np.ndarray)}
    x = f["hidden_tensor"]
    if "normalization_weights_tensor" in f:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * f["normalization_weights_tensor"][0]
    g, u = x @ f["gate_proj_weights_tensor"], x @ f["up_proj_weights_tensor"]
    return [(g / (1 + np.exp(-g)) * u) @ f["down_proj_weights_tensor"]]


def _sparse_row(rng, t, n_nonzero):
    x = np.zeros((1, t), np.float32)
    x[0, rng.choice(t, n_nonzero, replace=False)] = rng.uniform(0.01, 1.0, n_nonzero)
    return x


def _nonzero_with_count_ref(inputs):
    """Documented output: [1, T+1] int32 - the nonzero indices in order, -1 padding, the count last."""
    row = inputs["input_tensor"][0]
    idx = np.nonzero(row)[0]
    out = np.full((1, row.size + 1), -1, np.int32)
    out[0, :idx.size], out[0, -1] = idx, idx.size
    return [out]


def _rmsnorm_quant_case(root, load, rng):
    """rmsnorm_quant_kernel, row quantisation: each row RMS-normalised (x / (rms + eps) * gamma), scaled to the fp8
    range 240 and stored as fp8 e4m3 followed by its fp32 dequantisation scale (max|row| / 240) in 4 fp8 slots.
    Compared as the library's test does: values rtol 0.072, scales rtol 0.007 of the max (its maxAllClose rule)."""
    mod = importlib.import_module("nkilib.core.rmsnorm.rmsnorm_quant")
    types = importlib.import_module("nkilib.core.utils.common_types")
    b, s, h = 1, 160, 16384
    x = rng.standard_normal((b, s, h)).astype(BF16)
    gamma = rng.standard_normal((1, h)).astype(BF16)
    kargs = mod.RmsNormQuantKernelArgs(quantization_type=types.QuantizationType.ROW, lower_bound=0.0,
                                       norm_type=types.NormType.RMS_NORM, eps=1e-6)
    with target("trn2"):
        out = simulate(mod.rmsnorm_quant_kernel, x, gamma, kargs, None, lnc=2)
    raw = np.ascontiguousarray(np.asarray(out)).view(np.uint8).reshape(b, s, h + 4)
    got = raw[:, :, :h].view(ml_dtypes.float8_e4m3).astype(np.float64)
    got_scale = np.ascontiguousarray(raw[:, :, h:]).view(np.float32).astype(np.float64)
    xf = x.astype(np.float64)
    norm = xf / (np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True)) + 1e-6) * gamma.astype(np.float64)
    scale = np.abs(norm).max(axis=-1, keepdims=True) / 240.0
    want = (norm / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3).astype(np.float64)
    check_max(got, want, 0.072, 0, "values")
    check_max(got_scale, scale, 0.007, 0, "scales")


def _rotational_topk_case(root, load, rng):
    """rotational_topk on [B*S, V]: the k largest values of each row (compared sorted, as the library's test does,
    which leaves tie order free) and indices that point at those values."""
    mod = importlib.import_module("nkilib.core.topk.rotational_topk")
    bxs, vocab, k = 8, 2048, 256
    x = rng.standard_normal((bxs, vocab)).astype(np.float32)
    cfg = mod.create_topk_config(inp_shape=(bxs, 1, vocab), inp_dtype=np.float32, k=k, sorted=True, num_programs=2)
    cfg = mod.prepare_rotational_constants(mod.create_rotational_topk_config(inp_shape=x.shape, topk_config=cfg))
    try:
        with target("trn2"):
            values, indices = simulate(mod.rotational_topk, x, cfg, lnc=2)
    finally:
        mod.cleanup_rotational_constants()
    want = -np.sort(-x, axis=-1)[:, :k]
    check_max(-np.sort(-np.asarray(values, np.float64), axis=-1), want, 1e-3, 1e-5, "values")
    picked = np.take_along_axis(x, np.asarray(indices).astype(np.int64), axis=-1)
    check_max(-np.sort(-picked.astype(np.float64), axis=-1), want, 1e-3, 1e-5, "indices")


def _attn_bwd_inputs(rng, b, hq, hkv, s, d, causal):
    """Gaussian q, k, v, dy and the forward's o and lse from the library's own compute_o_lse."""
    ref = importlib.import_module("nkilib.core.attention.attention_bwd_torch")
    q, dy = (_randn(rng, (b, hq, d, s), BF16) for _ in range(2))
    k, v = (_randn(rng, (b, hkv, d, s), BF16) for _ in range(2))
    o, lse, _ = ref.compute_o_lse(_to_torch(q), _to_torch(k), _to_torch(v), causal, True, softmax_scale=None,
                                  sliding_window=-1, sinks=None, bound_min=None, bound_max=None)
    return {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": _to_numpy(o).astype(BF16), "dy_ref": dy,
            "lse_ref": _to_numpy(lse).astype(np.float32), "use_causal_mask": causal, "mixed_precision": True,
            "softmax_scale": None, "sliding_window": -1}


def _moe_tkg_inputs(rng, t, h, i, e, k):
    """Selective (top-k) experts, fp16, POST_SCALE: the library test's layout (gate/up weights [E, H, 2, I])."""
    types = importlib.import_module("nkilib.core.utils.common_types")
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    aff = np.zeros((t, e), np.float16)
    w = rng.random((t, k))
    np.put_along_axis(aff, idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float16), axis=1)
    return {"hidden_input": _randn(rng, (t, h), np.float16),
            "expert_gate_up_weights": (_randn(rng, (e, h, 2, i)) / np.sqrt(h)).astype(np.float16),
            "expert_down_weights": (_randn(rng, (e, i, h)) / np.sqrt(i)).astype(np.float16),
            "expert_affinities": aff, "expert_index": idx, "is_all_expert": False,
            "expert_affinities_scaling_mode": types.ExpertAffinityScaleMode.POST_SCALE,
            "activation_fn": types.ActFnType.SiLU}


LIB_CASES = [
    lib("cumsum", "core.cumsum.cumsum:cumsum", "core.cumsum.cumsum_torch:cumsum_torch_ref",
        lambda rng: {"x": _randn(rng, (64, 4, 1024), BF16)}, 1e-2, 1e-3),
    lib("cascaded_max", "core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
        lambda rng: {"input_tensor": _randn(rng, (4, 5, 4058))}, 1e-5, 1e-5, lnc=1),
    lib("cascaded_max_lnc2", "core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
        lambda rng: {"input_tensor": _randn(rng, (8, 5, 4058))}, 1e-5, 1e-5, lnc=2, same_kernel_as="cascaded_max"),
    lib("rope", "core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref",
        lambda rng: {"x_in": _randn(rng, (64, 1, 8, 16), BF16), "cos": _randn(rng, (32, 1, 16), BF16),
                     "sin": _randn(rng, (32, 1, 16), BF16), "lnc_shard": True, "contiguous_layout": True,
                     "relayout_in_sbuf": False}, 2**-7, 1e-3),
    lib("rope_interleaved", "core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref",
        lambda rng: {"x_in": _randn(rng, (128, 8, 1, 128), BF16), "cos": _randn(rng, (64, 8, 128), BF16),
                     "sin": _randn(rng, (64, 8, 128), BF16), "lnc_shard": True, "contiguous_layout": False,
                     "relayout_in_sbuf": True}, 2**-7, 1e-3, same_kernel_as="rope"),
    lib("rope_hf", "core.embeddings.rope_hf:rope_hf", "core.embeddings.rope_hf_torch:rope_hf_torch_ref",
        lambda rng: _rope_hf_inputs(rng, 1, 4, 2, 256, 128, np.float32), 1e-6, 1e-6),
    lib("rmsnorm_tkg", "core.subkernels.rmsnorm_tkg:rmsnorm_tkg",
        "core.subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref",
        lambda rng: _norm_inputs(rng, 2, 8, 8192, np.float16), 2e-2, 1e-5),
    lib("rmsnorm_tkg_lnc1", "core.subkernels.rmsnorm_tkg:rmsnorm_tkg",
        "core.subkernels.rmsnorm_torch:rmsnorm_tkg_torch_ref_lnc1",
        lambda rng: _norm_inputs(rng, 1, 4, 2048, np.float16, hidden_actual=1920), 2e-2, 1e-5, lnc=1,
        same_kernel_as="rmsnorm_tkg"),
    lib("layernorm_tkg", "core.subkernels.layernorm_tkg:layernorm_tkg",
        "core.subkernels.layernorm_torch:layernorm_tkg_torch_ref",
        lambda rng: _norm_inputs(rng, 2, 8, 8192, np.float16, beta=True), 2e-2, 1e-5),
    lib("layernorm_tkg_lnc1", "core.subkernels.layernorm_tkg:layernorm_tkg",
        "core.subkernels.layernorm_torch:layernorm_tkg_torch_ref_lnc1",
        lambda rng: _norm_inputs(rng, 1, 8, 8192, np.float16, beta=True), 2e-2, 1e-5, lnc=1,
        same_kernel_as="layernorm_tkg"),
    lib("find_nonzero_indices", "core.subkernels.find_nonzero_indices:find_nonzero_indices",
        "core.subkernels.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
        lambda rng: {"input_tensor": _sparse(rng, 4096, 128, 8, np.float32), "chunk_size": 4096}, 0, 0),
    lib("find_nonzero_indices_cols", "core.subkernels.find_nonzero_indices:find_nonzero_indices",
        "core.subkernels.find_nonzero_indices_torch:find_nonzero_indices_torch_ref",
        lambda rng: {"input_tensor": _sparse(rng, 4096, 128, 8, np.int32), "col_start_id": np.array([16], np.int32),
                     "n_cols": 16, "chunk_size": 4096}, 0, 0, same_kernel_as="find_nonzero_indices"),
    lib("indexed_flatten", "core.subkernels.indexed_flatten:indexed_flatten",
        "core.subkernels.indexed_flatten_torch:indexed_flatten_torch_ref", lambda rng: _flatten_inputs(4096, 3, 128),
        0, 0),
    lib("gen_mask_tkg_hbm", "core.attention.gen_mask_tkg:gen_mask_tkg_hbm",
        "core.attention.gen_mask_tkg_torch:gen_mask_tkg_hbm_torch_ref",
        lambda rng: _mask_inputs(rng, 4, 2, 4096, 7), 0, 0),
    lib("gen_mask_tkg_hbm_lnc1", "core.attention.gen_mask_tkg:gen_mask_tkg_hbm",
        "core.attention.gen_mask_tkg_torch:gen_mask_tkg_hbm_torch_ref",
        lambda rng: _mask_inputs(rng, 4, 1, 4096, 5), 0, 0, lnc=1, same_kernel_as="gen_mask_tkg_hbm"),
    lib("output_projection_tkg", "core.output_projection.output_projection_tkg:output_projection_tkg",
        "core.output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
        lambda rng: _oproj_inputs(rng, 4, 8, 4, 64, 3072, True, False), 2e-2, 1e-5),
    lib("output_projection_tkg_transposed", "core.output_projection.output_projection_tkg:output_projection_tkg",
        "core.output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref",
        lambda rng: _oproj_inputs(rng, 4, 2, 4, 128, 8192, True, True), 2e-2, 1e-5,
        same_kernel_as="output_projection_tkg"),
    lib("qkv_tkg", "core.qkv.qkv:qkv", "core.qkv.qkv_tkg_torch:qkv_tkg_torch_ref",
        lambda rng: _qkv_inputs(rng, 4, 1, 4096, 896, 5, 1, 128, "RMS_NORM", True), 2e-2, 1e-5, lnc=1,
        ref_names=_QKV_REF_NAMES),
    lib("qkv_tkg_lnc2_bias", "core.qkv.qkv:qkv", "core.qkv.qkv_tkg_torch:qkv_tkg_torch_ref",
        lambda rng: _qkv_inputs(rng, 8, 5, 3072, 640, 8, 1, 64, "RMS_NORM", False, qkv_bias=True), 2e-2, 1e-5,
        ref_names=_QKV_REF_NAMES, same_kernel_as="qkv_tkg"),
    lib("qkv_cte", "core.qkv.qkv:qkv", "core.qkv.qkv_tkg_torch:qkv_tkg_torch_ref",
        lambda rng: _qkv_inputs(rng, 1, 512, 2048, 384, 1, 1, 128, "RMS_NORM", False), 2e-2, 1e-5,
        ref_names=_QKV_REF_NAMES),
    lib("attention_cte", "core.attention.attention_cte:attention_cte",
        "core.attention.attention_cte_torch:attention_cte_torch_ref",
        lambda rng: _attn_cte_inputs(rng, 2, 512, 512, 128, True, True, False), 2e-2, 1e-5),
    lib("attention_cte_gqa_lnc1", "core.attention.attention_cte:attention_cte",
        "core.attention.attention_cte_torch:attention_cte_torch_ref",
        lambda rng: _attn_cte_inputs(rng, 4, 256, 512, 64, False, False, True, bs_kv=2), 2e-2, 1e-5, lnc=1,
        same_kernel_as="attention_cte"),
    lib("output_projection_cte", "core.output_projection.output_projection_cte.output_projection_cte:output_projection_cte",
        "core.output_projection.output_projection_cte.output_projection_cte_torch:output_projection_cte_torch_ref",
        lambda rng: {"attention": rng.random((1, 4, 128, 512)).astype(BF16),
                     "weight": rng.random((512, 2048)).astype(BF16),
                     "bias": (_randn(rng, (1, 2048)) * 100).astype(BF16)}, 2e-2, 1e-5),
    lib("find_nonzero_indices_with_count",
        "experimental.benchmark.find_nonzero_indices_with_count:find_nonzero_indices_with_count",
        _nonzero_with_count_ref, lambda rng: {"input_tensor": _sparse_row(rng, 1024, 160)}, 0, 0),
    Case("nki-library/rmsnorm_quant", "nki-library", _rmsnorm_quant_case),
    Case("nki-library/rotational_topk", "nki-library", _rotational_topk_case),
    lib("attention_bwd", "core.attention.attention_bwd:attention_bwd",
        "core.attention.attention_bwd_torch:attention_bwd_torch_ref",
        lambda rng: _attn_bwd_inputs(rng, 1, 2, 1, 512, 128, True), 2e-2, 1e-5),
    lib("moe_tkg", "core.moe.moe_tkg.moe_tkg:moe_tkg", "core.moe.moe_tkg.moe_tkg_torch:moe_tkg_torch_ref",
        lambda rng: _moe_tkg_inputs(rng, 4, 3072, 192, 8, 4), 2e-2, 1e-5),
    lib("router_topk", "core.router_topk.router_topk:router_topk",
        "core.router_topk.router_topk_torch:router_topk_torch_ref", lambda rng: {}, 2e-2, 1e-5),
    lib("mlp", "core.mlp.mlp:mlp", _mlp_ref, lambda rng: _mlp_inputs(rng, 4, 1, 2048, 1024, "RMS_NORM"), 2e-2, 1e-5),
    lib("dynamic_elementwise_add", "experimental.dynamic_shapes.dynamic_elementwise_add:dynamic_elementwise_add",
        "experimental.dynamic_shapes.dynamic_elementwise_add_torch:dynamic_elementwise_add_torch_ref",
        lambda rng: {"input_a": _randn(rng, (256, 1024), BF16), "input_b": _randn(rng, (256, 1024), BF16),
                     "num_m_tiles": np.array([[2]], np.int32)}, 1e-2, 1e-3),
    lib("cross_entropy_forward", "experimental.loss.cross_entropy:cross_entropy_forward", _ce_forward_ref,
        lambda rng: {"logits_hbm": _randn(rng, (4, 32128), BF16), "targets_hbm": rng.integers(0, 32128, 4, np.int32),
                     "positions_per_batch": 4, "chunk_size": 32128},
        1e-2, 1e-2),
    lib("cross_entropy_backward", "experimental.loss.cross_entropy:cross_entropy_backward", _ce_backward_ref,
        _ce_backward_inputs, 1e-2, 1e-2),
    lib("conv1d", "experimental.conv.conv1d:conv1d", "experimental.conv.conv1d_torch:conv1d_torch_ref",
        lambda rng: {"x_in": _randn(rng, (2, 64, 40)), "filters": _randn(rng, (5, 64, 128)),
                     "bias": _randn(rng, (128,)), "stride": 2, "padding": (2, 2), "dilation": 2,
                     "activation_fn": _act("GELU"), "lnc_shard": False}, 1e-3, 1e-3),
    lib("depthwise_conv1d", "experimental.conv.depthwise_conv1d:depthwise_conv1d_implicit_gemm", _depthwise_ref,
        lambda rng: {"img_ref": _randn(rng, (1, 256, 1, 512), BF16), "filter_ref": _randn(rng, (256, 1, 1, 64), BF16),
                     "padding": ((0, 0), (5, 5)), "stride": (1, 2), "rhs_dilation": (1, 1), "lhs_dilation": (1, 1),
                     "feature_group_count": 256, "batch_group_count": 1}, 1e-2, 1e-2),
    lib("topk_reduce", "experimental.collectives.topk_reduce:topk_reduce",
        "experimental.collectives.topk_reduce_torch:topk_reduce_torch_ref",
        lambda rng: {"input": _topk_reduce_input(rng, 8, 4, 8, 4096), "T": 4, "K": 8}, 5e-2, 5e-2),
    Case("nki-library/attention_tkg", "nki-library", _attention_tkg_case),
    Case("nki-library/moe_cte_bwmm_shard_on_block", "nki-library",
         _moe_cte_case("core.moe.moe_cte.bwmm_shard_on_block:bwmm_shard_on_block", "SHARD_ON_BLOCK", 256, 3072,
                       384, 8, 256, 4, True, "Swish", (7.0, None, 8.0, -9.0))),
    Case("nki-library/moe_cte_bwmm_shard_on_I", "nki-library",
         _moe_cte_case("core.moe.moe_cte.bwmm_shard_on_I:blockwise_mm_baseline_shard_intermediate",
                       "SHARD_ON_INTERMEDIATE", 256, 3072, 768, 8, 512, 4, False, "SiLU")),
    Case("nki-library/moe_cte_bwmm_shard_on_I_hybrid", "nki-library",
         _moe_cte_case("core.moe.moe_cte.bwmm_shard_on_I:blockwise_mm_baseline_shard_intermediate_hybrid",
                       "SHARD_ON_INTERMEDIATE_HW", 256, 3072, 768, 8, 512, 4, False, "SiLU")),
    Case("nki-library/moe_cte", "nki-library",
         _moe_cte_case("core.moe.moe_cte.moe_cte:moe_cte", "SHARD_ON_BLOCK", 256, 3072, 384, 8, 256, 4, True,
                       "Swish", (7.0, None, 8.0, -9.0), spec="shard_on_block")),
    ranks("allgather_sb2sb", "experimental.collectives.sb2sb_allgather:allgather_sb2sb",
          lambda rng: _sb2sb_inputs(rng, 128, 512, 8), _sb2sb_golden, 1e-3, 1e-3, lnc=1),
    ranks("allgather_sb2sb_tiled", "experimental.collectives.sb2sb_allgather:allgather_sb2sb_tiled",
          lambda rng: _sb2sb_inputs(rng, 256, 512, 4), _sb2sb_golden, 1e-3, 1e-3, lnc=2),
    ranks("fine_grained_allgather", "experimental.collectives.fg_allgather:fine_grained_allgather",
          lambda rng: _fg_inputs(rng, 1024, 4096, 4), _fg_allgather_golden, 1e-3, 1e-3, lnc=2),
    ranks("allgather_compute_matmul", "experimental.collectives.fgcc:allgather_compute_matmul",
          lambda rng: _fg_inputs(rng, 256, 1024, 4, n=1024), _fgcc_golden, 1e-2, 1e-2, lnc=2),
]
