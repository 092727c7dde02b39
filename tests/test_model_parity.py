"""The model math against Hugging Face `LlamaForCausalLM` (fp32): prefill and every decode step.

Tolerance: 1e-4 absolute on logits. Both sides are fp32 with the same operation order up to matmul blocking and
softmax fusion (SDPA vs HF eager), so differences are a few ulps of O(1..10) logits (~1e-6 measured); 1e-4 leaves
room for BLAS differences across machines while catching any real math error (which moves logits by >1e-2).
"""
import pytest
import torch
from transformers import LlamaForCausalLM

from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import BuildConfig, ModelConfig
from neuron_infer.model.llama import rope_tables
from tests.tiny_checkpoint import TINY_PRESETS

ATOL = 1e-4
PRESETS = sorted(TINY_PRESETS)
BS = 8  # KV-cache block size of these tests


def _cache(cfg, rows: int, slots: int):
    """A block cache holding `rows` sequences of `slots` positions each: [L, rows*slots/BS, Hkv, BS, D]."""
    k = torch.zeros(cfg.num_layers, rows * slots // BS, cfg.num_kv_heads, BS, cfg.head_dim)
    return k, torch.zeros_like(k)


def _table(rows: int, slots: int, attend: int) -> torch.Tensor:
    """Row r's blocks (r's own stripe of slots/BS blocks), the first attend/BS of them: [rows, attend/BS]."""
    per = slots // BS
    return torch.tensor([[r * per + j for j in range(attend // BS)] for r in range(rows)])


def _pair(model_dir):
    cfg = ModelConfig.from_model_dir(model_dir)
    ours = build_float_model(cfg, BuildConfig(dtype="fp32"), load_checkpoint(model_dir, cfg))
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return cfg, ours, hf


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_and_every_decode_step_match_hf(tiny_dirs, preset):
    cfg, ours, hf = _pair(tiny_dirs(preset))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (2, 24), generator=g)  # [B, T]
    prompt, cache_len = 16, 48
    with torch.no_grad():
        ref = hf(ids).logits  # [B, T, V]
        k, v = _cache(cfg, 2, cache_len)
        pos = torch.arange(prompt).expand(2, prompt)
        out = ours(ids[:, :prompt], pos, k, v, pos, 32, _table(2, cache_len, 32))  # logits for every prompt token
        assert (out - ref[:, :prompt]).abs().max().item() < ATOL
        for t in range(prompt, ids.shape[1]):
            step = ours(ids[:, t:t + 1], torch.full((2, 1), t), k, v, torch.zeros(2, 1, dtype=torch.long),
                        cache_len, _table(2, cache_len, cache_len))
            assert (step[:, 0] - ref[:, t]).abs().max().item() < ATOL, f"decode step at position {t}"


def test_a_wrong_rope_scaling_would_be_caught(tiny_dirs):
    """Power check: dropping the llama3 scaling changes logits far beyond the tolerance."""
    cfg, ours, hf = _pair(tiny_dirs("llama3_rope"))
    unscaled = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    ours.rope_cos, ours.rope_sin = rope_tables(unscaled, ours.max_positions)
    ids = torch.arange(3, 3 + 200).view(1, 200) % cfg.vocab_size
    with torch.no_grad():
        k, v = _cache(cfg, 1, 200)
        pos = torch.arange(200).view(1, 200)
        out = ours(ids, pos, k, v, pos, 200, _table(1, 200, 200))
        assert (out - hf(ids).logits).abs().max().item() > 1e-2


def test_batch_rows_with_different_positions_are_independent(tiny_dirs):
    """Row 1 decoding at another position than row 0 gives the same logits as running it alone."""
    cfg, ours, _ = _pair(tiny_dirs("gqa"))
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))

    def run(rows, lens):
        b = len(rows)
        k, v = _cache(cfg, b, 32)
        pos = torch.arange(12).expand(b, 12)
        with torch.no_grad():
            ours(ids[rows], pos, k, v, torch.zeros(b, 1, dtype=torch.long), 16, _table(b, 32, 16))
            nxt = ids[rows, 0:1]
            return ours(nxt, torch.tensor(lens).view(b, 1), k, v, torch.zeros(b, 1, dtype=torch.long), 32,
                        _table(b, 32, 32))

    both = run([0, 1], [7, 12])
    alone = run([1], [12])
    assert (both[1] - alone[0]).abs().max().item() < ATOL
