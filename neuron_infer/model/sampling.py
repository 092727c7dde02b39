"""Token selection: greedy, temperature, top-k, top-p — one definition, on the host and inside compiled graphs.

Host-only adjustments come first, in vLLM's order: the additive `bias` [..., V] (logit_bias, and -inf at the stop ids
that min_tokens holds back: `logit_adjustment`), then the penalties (`penalized`, from `token_history`); the
compiled speculation graphs never see them (sequences using them take plain steps).

The sampling settings travel as a tensor `params [..., 3]` fp32 = (temperature, top_k, top_p) with
temperature 0 = greedy, top_k 0 = off, top_p 1 = off; one row of params per batch row (or one [3] for all rows).
`processed_probs` is the single place where they are applied: the host sampler, the speculative acceptance rule and
the fused speculation graph all call it, so the draft's and the target's distributions are processed identically
(losslessness depends on it). Randomness comes in as explicit uniforms `u` (inverse-CDF sampling), so one call
samples every row of a batch, each row from its own generator, and the same code runs inside a graph.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import ConfigError


def params_tensor(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """SamplingConfig fields -> params [3] fp32 (the compiled speculation graphs' input)."""
    return torch.tensor([temperature, float(top_k), top_p], dtype=torch.float32)


def _row(c: SamplingConfig) -> list[float]:
    return [c.temperature, float(c.top_k), c.top_p, c.min_p, c.repetition_penalty, c.presence_penalty,
            c.frequency_penalty]


def rows_params(configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """One SamplingConfig per row -> params [B, 7] fp32 (temperature, top_k, top_p, min_p, repetition, presence,
    frequency)."""
    return torch.tensor([_row(c) for c in configs], dtype=torch.float32)


def _filters_active(configs: Sequence[SamplingConfig]) -> bool:
    return any(not c.greedy and (c.top_k or c.top_p < 1.0) for c in configs)


def token_history(prompts: Sequence[list[int]], outputs: Sequence[list[int]], v: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token counts for the penalties -> (seen [B, V] bool: in prompt or output, counts [B, V] fp32: in the
    output)."""
    seen = torch.zeros(len(prompts), v, dtype=torch.bool)  # [B, V]
    counts = torch.zeros(len(prompts), v, dtype=torch.float32)  # [B, V]
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        seen[i, torch.tensor(p + o, dtype=torch.int64)] = True
        if o:
            counts[i].index_add_(0, torch.tensor(o, dtype=torch.int64), torch.ones(len(o)))
    return seen, counts


def check_vocab(c: SamplingConfig, vocab_size: int) -> None:
    """ConfigError when logit_bias names a token id outside the vocabulary 0..vocab_size-1."""
    bad = [t for t, _ in c.logit_bias if t >= vocab_size]
    if bad:
        raise ConfigError(f"logit_bias names token id {bad[0]}, outside this model's vocabulary 0..{vocab_size - 1}")


def logit_adjustment(configs: Sequence[SamplingConfig], output_lens: Sequence[int],
                     stop_ids: Sequence[Sequence[int]], v: int,
                     allowed: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor | None:
    """The additive adjustment of each row's logits -> bias [B, V] fp32, or None when no row has one: the row's
    logit_bias, plus -inf at its stop ids (EOS unless ignored, and the request's stop token ids) while its output
    holds fewer than min_tokens tokens (vLLM's min_tokens: the next token cannot end the sequence), plus -inf at
    every token its grammar does not allow next (`allowed[i]`: bool [V], or None: unconstrained)."""
    held = [list(ids) if n < c.min_tokens else [] for c, n, ids in zip(configs, output_lens, stop_ids)]
    masks = list(allowed) if allowed is not None else [None] * len(configs)
    if not any(c.logit_bias for c in configs) and not any(held) and all(m is None for m in masks):
        return None
    bias = torch.zeros(len(configs), v, dtype=torch.float32)  # [B, V]
    for i, (c, ids, mask) in enumerate(zip(configs, held, masks)):
        if c.logit_bias:
            bias[i, torch.tensor([t for t, _ in c.logit_bias])] = torch.tensor([b for _, b in c.logit_bias])
        if ids:
            bias[i, torch.tensor(ids, dtype=torch.int64)] = float("-inf")
        if mask is not None:
            bias[i].masked_fill_(~mask[:v], float("-inf"))
    return bias


def unpack_bitmask(words: np.ndarray | torch.Tensor, v: int) -> torch.Tensor:
    """A token bitmask, 32 tokens per int32 word (bit j of word i allows token 32 i + j: the layout of vLLM's
    grammar bitmask, from xgrammar) -> allowed [n, V] bool. words [n, ceil(V / 32)]."""
    w = torch.as_tensor(np.asarray(words, dtype=np.int32))  # [n, W]
    bits = (w.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [n, W, 32]
    return bits.reshape(w.shape[0], -1)[:, :v].bool()  # [n, V]


def penalized(logits: torch.Tensor, params: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Repetition (HF / vLLM: seen tokens' logits / r when positive, * r when negative), then presence and frequency
    (OpenAI: - presence * (count > 0) - frequency * count over output tokens). logits, seen, counts [..., V];
    params [..., 7] (columns 4..6)."""
    rep, pres, freq = params[..., 4:5], params[..., 5:6], params[..., 6:7]  # [..., 1] each
    scaled = torch.where(logits > 0, logits / rep, logits * rep)  # [..., V]
    logits = torch.where(seen, scaled, logits)
    return logits - pres * (counts > 0).to(logits.dtype) - freq * counts


def processed_probs(logits: torch.Tensor, params: torch.Tensor | SamplingConfig, filters: bool = True,
                    history: tuple[torch.Tensor, torch.Tensor] | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] fp32 after the bias, penalties, temperature, min-p, top-k and top-p.

    params: [3] or [7] (every row) or [..., 3] / [..., 7] (one per row of logits), or a SamplingConfig; columns
    (temperature, top_k, top_p[, min_p, repetition, presence, frequency]); width 3 (the compiled speculation graphs)
    means no min-p and no penalties. history: (seen, counts) [..., V] from `token_history`, needed by rows with
    penalties. bias [..., V]: added to the logits first (`logit_adjustment`; -inf entries are never chosen). Min-p
    keeps every token whose probability is >= min_p x the top token's. Top-k keeps every logit >=
    the k-th largest (ties kept); top-p keeps every token whose preceding mass (descending order) is < top_p, which
    always keeps the top token, then renormalizes. Greedy rows (temperature 0) get a one-hot distribution on the
    argmax of the penalized logits (ties -> lowest id, like torch.argmax). `filters=False` skips the sort (a static
    promise, made by the host, that no row uses top-k or top-p; graphs keep the default).
    """
    if isinstance(params, SamplingConfig):
        params = torch.tensor(_row(params), dtype=torch.float32)  # [7]
    logits = logits.float()
    v = logits.shape[-1]
    if bias is not None:
        logits = logits + bias  # [..., V]
    if history is not None and params.shape[-1] > 3:
        logits = penalized(logits, params, *history)  # [..., V]
    temp, top_k, top_p = params[..., 0:1], params[..., 1:2], params[..., 2:3]  # [..., 1] each
    greedy = temp <= 0  # [..., 1]
    z = logits / torch.where(greedy, torch.ones_like(temp), temp)  # [..., V]
    if params.shape[-1] > 3:  # min-p: p_i >= min_p * p_max  <=>  z_i >= max z + log(min_p)
        floor = z.amax(-1, keepdim=True) + torch.log(params[..., 3:4])  # [..., 1] (-inf when min_p = 0)
        z = z.masked_fill(z < floor, float("-inf"))
    if not filters:
        probs = torch.softmax(z, dim=-1)  # [..., V]
    else:
        ordered, order = torch.sort(z, dim=-1, descending=True)  # [..., V] each
        k_eff = torch.where(top_k > 0, torch.clamp(top_k, max=float(v)), torch.full_like(top_k, float(v)))
        kth = torch.gather(ordered, -1, (k_eff.to(torch.int64) - 1).expand(*z.shape[:-1], 1))  # [..., 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # top-k (ties with the k-th kept)
        sorted_p = torch.softmax(ordered, dim=-1)  # [..., V] descending
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [..., V] mass strictly before each token
        kept = sorted_p * ((before < top_p) | (top_p >= 1.0))  # [..., V]
        sorted_p = kept / kept.sum(-1, keepdim=True)
        probs = torch.zeros_like(sorted_p).scatter(-1, order, sorted_p)  # [..., V] back in vocabulary order
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).to(probs.dtype)  # [..., V]
    return torch.where(greedy, one_hot, probs)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (non-negative, any positive total), u [...] in [0, 1) -> ids [...].

    Token i is chosen iff cdf[i-1] <= u * total < cdf[i]; tokens of zero probability are never chosen (their cdf
    interval is empty). The index is clamped to the last token of positive probability against rounding at the top.
    A one-hot distribution always yields its token.
    """
    cdf = torch.cumsum(probs, dim=-1)  # [..., V]
    target = (u * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = (cdf <= target).sum(-1)  # [...]
    vocab = torch.arange(probs.shape[-1], device=probs.device)  # [V]
    last_positive = torch.where(probs > 0, vocab, torch.zeros_like(vocab)).amax(-1)  # [...]
    return torch.minimum(idx, last_positive)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, n: int) -> list[dict]:
    """The model's log-probabilities (log-softmax of the raw logits, before temperature and filters, as vLLM's
    default `raw_logprobs`) of the chosen tokens and the top-n alternatives: logits [m, V], ids [m] ->
    m × {"token_id", "logprob", "rank", "top": [[id, logprob], ...] (n, descending)}. `rank`: how many tokens have
    a logprob >= the chosen one's (1 = the most likely; ties count against it), vLLM's definition."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = lp.gather(-1, ids.view(-1, 1))  # [m, 1]
    ranks = (lp >= chosen).sum(-1)  # [m]
    top_v, top_i = lp.topk(min(n, lp.shape[-1]), dim=-1)  # [m, n] each
    return [{"token_id": int(t), "logprob": float(c), "rank": int(r),
             "top": [[int(i), float(v)] for i, v in zip(ti, tv)]}
            for t, c, r, ti, tv in zip(ids.tolist(), chosen.squeeze(-1).tolist(), ranks.tolist(), top_i.tolist(),
                                       top_v.tolist())]


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def host_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> ids [...] int64, torch.argmax's result (the first maximum; a NaN counts as the maximum).
    fp32 CPU tensors go through NumPy, whose argmax is the quicker one at these sizes (docs/cpu-backend.md, "Host
    loop"). Host code only: the graphs keep torch.argmax."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.shape[-1] == 0:
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(np.argmax(logits.detach().numpy(), axis=-1), dtype=np.int64))


def sample_rows(logits: torch.Tensor, configs: Sequence[SamplingConfig], u: torch.Tensor | None,
                history: tuple[torch.Tensor, torch.Tensor] | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Every row in one call: logits [B, V], one SamplingConfig per row, u [B] uniforms (None when all greedy),
    history (seen, counts) [B, V] when a row has penalties, bias [B, V] when a row has one (`logit_adjustment`)
    -> token ids [B] int64."""
    if all(c.greedy and not c.penalized for c in configs):  # the one-hot distributions' only token, no softmax
        return host_argmax(logits if bias is None else logits.float() + bias)  # [B]
    probs = processed_probs(logits, rows_params(configs), _filters_active(configs), history, bias)  # [B, V]
    if u is None:  # every row greedy
        return probs.argmax(-1)
    return sample_from_probs(probs, u)


def draw_uniforms(configs: Sequence[SamplingConfig], generators: Sequence[torch.Generator]) -> torch.Tensor | None:
    """One uniform per row from the row's own generator -> u [B] (None when every row is greedy: no draw, so a
    greedy request never advances its generator). Rows may share one generator object."""
    if all(c.greedy for c in configs):
        return None
    return torch.cat([torch.rand(1, generator=g) for g in generators])  # [B]


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """Every row with the same settings and one generator: logits [B, V] -> token ids [B] int64."""
    configs = [cfg] * logits.shape[0]
    u = None if cfg.greedy else torch.rand(logits.shape[0], generator=gen)  # [B]
    return sample_rows(logits, configs, u)
