"""The Llama-family math, written once.

One forward serves prefill (T = context bucket), decode (T = 1) and speculative verification (T = k + 1): tokens at
`positions` write their keys/values into the block KV cache through each row's block table, then attend to the first
`attend_len` positions of the row (the blocks its table names) with a causal rule on absolute positions. Tensor
parallelism enters only through `LocalLayout` (how many heads / rows this rank holds) and the collectives in `Ops`;
quantization by swapping the `nn.Linear` modules (neuron_infer.quant).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.while_loop import while_loop_op

from neuron_infer.config import ModelConfig
from neuron_infer.model.op_tables import get_ops
from neuron_infer.model.ops import Ops


@dataclass(frozen=True)
class LocalLayout:
    """What one rank holds. `q_to_kv[h]` = local KV head serving local query head h."""

    num_heads: int
    num_kv_heads: int
    q_to_kv: tuple[int, ...]
    intermediate_size: int
    vocab_start: int
    vocab_local: int
    vocab_size: int  # the true (global) vocabulary size; logits beyond it are padding and are dropped

    @property
    def kv_groups(self) -> int:
        """G when query head h uses KV head h // G for every h (contiguous GQA groups), else 0."""
        g = self.num_heads // self.num_kv_heads
        uniform = self.num_heads % self.num_kv_heads == 0 and self.q_to_kv == tuple(h // g for h in range(self.num_heads))
        return g if uniform else 0

    @classmethod
    def single(cls, cfg: ModelConfig) -> "LocalLayout":
        return cls(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            q_to_kv=tuple(h // cfg.q_per_kv for h in range(cfg.num_heads)),
            intermediate_size=cfg.intermediate_size,
            vocab_start=0,
            vocab_local=cfg.vocab_size,
            vocab_size=cfg.vocab_size,
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [D/2] in fp32, with Llama 3.1 frequency scaling when configured."""
    d = cfg.head_dim
    # on the CPU even inside a meta-device build: a meta-device arange first imports torch's symbolic-shape and
    # dynamo stack (seconds at every load); the values are tiny and recomputed by materialize_buffers anyway
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))  # [D/2]
    rs = cfg.rope_scaling
    if rs is None:
        return inv.float()
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)  # long wavelengths: divided by factor
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / rs.factor + smooth * inv
    return torch.where(mid, blended, scaled).float()


def rope_tables(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [P, D] in fp32 for positions 0..P-1 (half-split layout), computed once at build/load time."""
    freqs = torch.arange(positions, dtype=torch.float32, device=inv_freq.device).unsqueeze(-1) * inv_freq  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, 1, T, D] (half-split layout, as Hugging Face Llama)."""
    x1, x2 = x.chunk(2, dim=-1)  # [B, H, T, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [B, H, T, D]
    return x * cos + rotated * sin


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast K/V for the cache; an fp8 cache saturates at the Neuron E4M3 range +-240 (quant.fp8.kv_to_fp8)."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-240.0, 240.0).to(dtype)
    return x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class CacheSlots:
    """Where a step's tokens write and what its attention reads in the block KV cache (computed once per step).

    Position p of batch row b lives in block table[b, p // bs] at offset p % bs. A position past the table (a padding
    token beyond the attend bucket) writes into block 0, the scratch block no sequence owns.
    """

    block: torch.Tensor  # [B, T] int64 block each token writes
    offset: torch.Tensor  # [B, T] int64 slot inside that block
    table: torch.Tensor  # [B, W] int64 blocks read, in position order

    @classmethod
    def of(cls, table: torch.Tensor, positions: torch.Tensor, block_size: int) -> CacheSlots:
        width = table.shape[1]
        col = positions // block_size  # [B, T]
        inside = col < width  # [B, T]
        block = torch.gather(table, 1, col.clamp(max=width - 1)) * inside  # [B, T]; outside -> scratch block 0
        return cls(block, positions % block_size, table)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: LocalLayout, ops: Ops):
        super().__init__()
        d, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, lay.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, lay.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, lay.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(lay.num_heads * d, cfg.hidden_size, bias=bias)
        self.register_buffer("q_to_kv", torch.tensor(lay.q_to_kv, dtype=torch.int64), persistent=False)
        self.h, self.hkv, self.d, self.ops = lay.num_heads, lay.num_kv_heads, d, ops
        # Fold the G query heads of each KV head into the token axis when the op table supports it (static).
        self.fold = lay.kv_groups if ops.gqa_fold else 0

    def forward(self, x, cos, sin, positions, k_cache, v_cache, layer: int, slots: CacheSlots):
        # x [B, T, H]; positions [B, T]; k_cache/v_cache [L, N, Hkv, bs, D] whole block caches, updated in place at
        # `layer` (writing through the 5-D tensor, not a per-layer view, keeps compiled graphs free of cache copies).
        b, t, _ = x.shape
        q = self.ops.linear(self.q_proj, x).view(b, t, self.h, self.d).transpose(1, 2)  # [B, Hq, T, D]
        k = self.ops.linear(self.k_proj, x).view(b, t, self.hkv, self.d).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.ops.linear(self.v_proj, x).view(b, t, self.hkv, self.d).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        li = torch.full((1, 1, 1), layer, dtype=torch.int64, device=x.device)  # [1, 1, 1]
        hi = torch.arange(self.hkv, device=x.device).view(1, self.hkv, 1)  # [1, Hkv, 1]
        idx = (li, slots.block.unsqueeze(1), hi, slots.offset.unsqueeze(1))  # cache[layer, blk[b,t], h, off[b,t]]
        k_cache.index_put_(idx, to_cache_dtype(k, k_cache.dtype))
        v_cache.index_put_(idx, to_cache_dtype(v, v_cache.dtype))
        o = self._attend(q, k_cache.select(0, layer), v_cache.select(0, layer), slots.table, positions)  # [B, Hq, T, D]
        o = o.transpose(1, 2).reshape(b, t, self.h * self.d)  # [B, T, Hq*D]
        return self.ops.all_reduce(self.ops.linear(self.o_proj, o))  # row-parallel: partial sums over ranks

    def _attend(self, q, kc, vc, table, positions):
        # kc, vc [N, Hkv, bs, D]: the layer's blocks; table [B, W]: each row's, in position order
        if not self.fold:
            return self.ops.attention(q, kc, vc, table, self.q_to_kv, positions)  # [B, Hq, T, D]
        b, _, t, d = q.shape
        qf = q.reshape(b, self.hkv, self.fold * t, d)  # [B, Hkv, G*T, D]: head h = kv*G + g, row = g*T + t
        pf = positions.repeat(1, self.fold)  # [B, G*T]: row g*T + t sits at position[t]
        o = self.ops.attention(qf, kc, vc, table, None, pf)  # [B, Hkv, G*T, D]; None: row block i uses KV head i
        return o.reshape(b, self.h, t, d)  # [B, Hq, T, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: LocalLayout, ops: Ops):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, lay.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, lay.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(lay.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.all_reduce(self.ops.mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.ops.linear))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: LocalLayout, ops: Ops):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, lay, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, lay, ops)

    def forward(self, x, cos, sin, positions, k_cache, v_cache, layer: int, slots: CacheSlots):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, k_cache, v_cache, layer, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


def stacked_layer_tensors(layers: nn.ModuleList) -> dict[str, torch.Tensor] | None:
    """{suffix: [L, ...] view} of the layers' parameters and persistent buffers when every layer has the same module
    structure and each suffix's L tensors lie back to back in one storage (layer i's tensor == view[i], no copy);
    None otherwise (e.g. layers quantized differently, or tensors allocated one by one)."""
    if len(layers) < 2 or any(t.device.type != "cpu" for t in layers[0].state_dict(keep_vars=True).values()):
        return None
    shapes = [[(n, type(m)) for n, m in layer.named_modules()] for layer in layers]
    states = [layer.state_dict(keep_vars=True) for layer in layers]
    if any(s != shapes[0] for s in shapes) or any(list(st) != list(states[0]) for st in states):
        return None
    derived = [{k: b for k, b in layer.named_buffers() if k not in states[0]} for layer in layers]  # e.g. q_to_kv
    if any(d.keys() != derived[0].keys() or not all(torch.equal(b, derived[0][k]) for k, b in d.items())
           for d in derived):
        return None  # the loop reads layer 0's non-persistent buffers for every layer
    out = {}
    for suffix, first in states[0].items():
        ts = [st[suffix].detach() for st in states]
        nbytes = first.numel() * first.element_size()
        if not first.is_contiguous() or any(
                t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != first.data_ptr() + i * nbytes for i, t in enumerate(ts)):
            return None
        out[suffix] = ts[0].as_strided((len(ts), *first.shape), (first.numel(), *first.stride()),
                                       ts[0].storage_offset())  # [L, ...]
    return out


class LayerStack(nn.Module):
    """The decoder layers' weights as [L, ...] views (non-persistent buffers: graph constants a backend binds by
    name, never saved), and the loop that runs layer 0's own forward with layer j's weights for j = 0..L-1."""

    def __init__(self):
        super().__init__()
        self.suffixes: dict[str, str] = {}  # buffer name -> the layer's tensor name ("self_attn.q_proj.weight")

    @property
    def ready(self) -> bool:
        return bool(self.suffixes)

    def fill(self, stacked: dict[str, torch.Tensor] | None) -> None:
        for name in self.suffixes:
            delattr(self, name)
        self.suffixes = {}
        for suffix, t in (stacked or {}).items():
            name = suffix.replace(".", "__")
            self.register_buffer(name, t, persistent=False)
            self.suffixes[name] = suffix

    def run(self, layers: nn.ModuleList, x, cos, sin, positions, k_cache, v_cache, slots: CacheSlots):
        """The layers as one while_loop: its body, layer 0's forward through functional_call with its tensors replaced
        by the stacked views at the loop index, is traced once whatever the number of layers. The operator is called
        directly with every tensor the body reads as an input (no closure), so the body is traced in the graph's own
        shape environment: its dynamic sizes keep their declared ranges (shapes.known decides the same paths as in
        an unrolled trace)."""
        n, first = len(layers), layers[0]
        stacked = {suffix: getattr(self, name) for name, suffix in self.suffixes.items()}  # suffix -> [L, ...]
        own = {**dict(first.named_parameters()), **dict(first.named_buffers())}
        fixed = {k: t for k, t in own.items() if k not in stacked}  # e.g. the head map q_to_kv: equal in every layer
        names = (*fixed, *stacked)

        def cond(i, h, *inputs):
            return i < n

        def body(i, h, cos, sin, positions, k_cache, v_cache, block, offset, table, *tensors):
            j = i.item()  # the layer index: an unbacked integer of the traced graph
            torch._check(j >= 0)
            torch._check(j < n)
            ts = dict(zip(names, tensors))
            ts.update({k: ts[k].select(0, j) for k in stacked})  # layer j's tensors: views, no copy
            args = (h, cos, sin, positions, k_cache, v_cache, j, CacheSlots(block, offset, table))
            return i + 1, torch.func.functional_call(first, ts, args)

        carried = (torch.zeros((), dtype=torch.int64, device=x.device), x)  # (layer index, hidden state [B, T, H])
        inputs = (cos, sin, positions, k_cache, v_cache, slots.block, slots.offset, slots.table,
                  *fixed.values(), *stacked.values())
        caches = ",".join(str(len(carried) + i) for i in (3, 4))  # every layer writes the caches in place
        _, h = while_loop_op(cond, body, carried, inputs, mutated_arg_indices=caches)
        return h


class VocabEmbedding(nn.Module):
    """Embedding over this rank's vocabulary range; ids outside it contribute zeros (summed over ranks)."""

    def __init__(self, lay: LocalLayout, hidden: int, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(lay.vocab_local, hidden))
        self.start, self.ops, self.sharded = lay.vocab_start, ops, lay.vocab_local != lay.vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> [B, T, H]
        if not self.sharded:  # static (build-time) property, not a data-dependent branch
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])  # [B, T]
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        return self.ops.all_reduce(x)


class Inner(nn.Module):
    """Holds the HF-named `model.*` parameters."""

    def __init__(self, cfg: ModelConfig, lay: LocalLayout, ops: Ops):
        super().__init__()
        self.embed_tokens = VocabEmbedding(lay, cfg.hidden_size, ops)
        self.layers = nn.ModuleList(Block(cfg, lay, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaModel(nn.Module):
    """Llama causal LM over a block KV cache. Parameter names equal Hugging Face's `LlamaForCausalLM`."""

    def __init__(self, cfg: ModelConfig, layout: LocalLayout | None = None, ops: Ops | None = None,
                 max_positions: int | None = None):
        super().__init__()
        self.cfg, self.layout = cfg, layout or LocalLayout.single(cfg)
        self.max_positions = max_positions or cfg.max_position_embeddings  # RoPE table rows (build.max_length)
        self.ops = ops or get_ops("reference")
        self.model = Inner(cfg, self.layout, self.ops)
        self.lm_head = nn.Linear(cfg.hidden_size, self.layout.vocab_local, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # source of the RoPE tables
        # cos/sin looked up per position instead of computed in the graph: Inductor otherwise inlines cos/sin into
        # every consumer, including inside the attention-score reduction (once per cached key).
        cos, sin = rope_tables(self.inv_freq, self.max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D] fp32
        self.register_buffer("rope_sin", sin, persistent=False)  # [P, D] fp32
        self.layer_stack = LayerStack()  # empty until stack_layers finds the layers' weights stacked in memory
        self.tie_weights()

    def stack_layers(self) -> bool:
        """Expose the decoder layers' weights as [L, ...] views (LayerStack) when they lie stacked in memory (as
        artifact/weights.py loads them): no copy. -> whether the layers can run as one loop."""
        self.layer_stack.fill(stacked_layer_tensors(self.model.layers))
        return self.layer_stack.ready

    def tie_weights(self) -> None:
        """Share the embedding with the (unquantized) head when the checkpoint ties them."""
        if self.cfg.tie_word_embeddings and type(self.lm_head) is nn.Linear:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize_buffers(self) -> None:
        """Recompute the non-persistent buffers (after building on the meta device and loading with assign=True)."""
        self.inv_freq = rope_inv_freq(self.cfg)
        self.rope_cos, self.rope_sin = rope_tables(self.inv_freq, self.max_positions)
        for layer in self.model.layers:
            layer.self_attn.q_to_kv = torch.tensor(self.layout.q_to_kv, dtype=torch.int64)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64 absolute positions
        k_cache: torch.Tensor,  # [L, N, Hkv, bs, D] updated in place (N blocks of bs token slots)
        v_cache: torch.Tensor,  # [L, N, Hkv, bs, D] updated in place
        logit_index: torch.Tensor,  # [B, n] int64: which of the T tokens need logits
        attend_len: int,  # static: cache slots visible to attention (the bucket), a multiple of bs
        block_table: torch.Tensor,  # [B, attend_len // bs] int64: the cache blocks of each batch row, in order
    ) -> torch.Tensor:  # [B, n, V] fp32 logits
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        slots = CacheSlots.of(block_table, positions, k_cache.shape[3])
        rope_pos = positions.clamp(max=self.max_positions - 1)  # [B, T] padding tokens may sit past the table
        cos = F.embedding(rope_pos, self.rope_cos).unsqueeze(1).to(x.dtype)  # [B, 1, T, D]
        sin = F.embedding(rope_pos, self.rope_sin).unsqueeze(1).to(x.dtype)  # [B, 1, T, D]
        if self.ops.loop_layers and self.layer_stack.ready:
            x = self.layer_stack.run(self.model.layers, x, cos, sin, positions, k_cache, v_cache, slots)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, positions, k_cache, v_cache, i, slots)
        x = self.model.norm(x)
        idx = logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1])  # [B, n, H]
        x = torch.gather(x, 1, idx)  # [B, n, H]
        logits = self.ops.all_gather_vocab(self.ops.linear(self.lm_head, x).float())  # [B, n, V_padded]
        return logits[..., : self.layout.vocab_size]


class BucketStep(nn.Module):
    """`LlamaModel.forward` with `attend_len` fixed: the static-shape module one compiled graph is built from.

    forward(input_ids [B, T], positions [B, T], k_cache, v_cache, logit_index [B, n], block_table [B, S/bs])
    The caches may have any number of blocks: `block_cache_args` names them for backends that export the block
    count as a dynamic dimension.
    """

    block_cache_args = (2, 3)

    def __init__(self, model: LlamaModel, attend_len: int):
        super().__init__()
        self.model, self.attend_len = model, attend_len

    def forward(self, input_ids, positions, k_cache, v_cache, logit_index, block_table):
        return self.model(input_ids, positions, k_cache, v_cache, logit_index, self.attend_len, block_table)
