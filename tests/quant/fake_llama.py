"""A tiny HF-named Llama-like module tree (nn.Linear projections, RMSNorm weights) for quantization tests.

Names match the real model: model.embed_tokens, model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head. The forward is a simplified Llama block
(causal GQA attention without RoPE, SwiGLU MLP) — enough for the SmoothQuant fold to be checked end to end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attn(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):  # x [B, S, H]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d).transpose(1, 2)  # [B, h, S, d]
        k = self.k_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)  # [B, kv, S, d]
        v = self.v_proj(x).view(b, s, self.kv, self.d).transpose(1, 2)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, h, S, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, h, S, d]
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.h * self.d))  # [B, S, H]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden, inter, heads, kv_heads, head_dim, bias) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = Attn(hidden, heads, kv_heads, head_dim, bias)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, inter)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, vocab, hidden, inter, layers, heads, kv_heads, head_dim, bias) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, inter, heads, kv_heads, head_dim, bias) for _ in range(layers))
        self.norm = RMSNorm(hidden)


class FakeLlama(nn.Module):
    def __init__(self, vocab=96, hidden=64, inter=96, layers=3, heads=4, kv_heads=2, head_dim=16, bias=False,
                 seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = Inner(vocab, hidden, inter, layers, heads, kv_heads, head_dim, bias)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():  # non-trivial norm weights and a few outlier input channels (what smoothing targets)
            for layer in self.model.layers:
                layer.input_layernorm.weight.uniform_(0.5, 1.5)
                layer.input_layernorm.weight[:3] *= 20.0
                layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)

    def forward(self, ids):  # ids [B, S] -> logits [B, S, V]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
