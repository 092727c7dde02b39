"""shard / gather: exact round trips per layout, strict gather, state dicts, and the math of the sharded layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neuron_infer.errors import ConfigError
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.shard import (
    gather,
    gather_state_dicts,
    layout_kind,
    plan_layout,
    rank_param_counts,
    rank_weight_bytes,
    shard,
    shard_state_dict,
)
from tests.parallel.test_plan import make_cfg

CASES = [  # (heads, kv, tp): MHA, GQA with kv < tp, heads not divisible by tp, SmolLM2-like
    (4, 4, 2), (4, 2, 4), (6, 2, 4), (9, 3, 2), (9, 3, 3), (9, 3, 4), (4, 1, 3),
]


def random_state_dict(cfg, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """HF Llama names and shapes, random values (biases too when the config has them)."""
    g = torch.Generator().manual_seed(seed)
    hid, d = cfg.hidden_size, cfg.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hid), "model.norm.weight": rnd(hid)}
    shapes = {"self_attn.q_proj": (cfg.num_heads * d, hid), "self_attn.k_proj": (cfg.num_kv_heads * d, hid),
              "self_attn.v_proj": (cfg.num_kv_heads * d, hid), "self_attn.o_proj": (hid, cfg.num_heads * d),
              "mlp.gate_proj": (cfg.intermediate_size, hid), "mlp.up_proj": (cfg.intermediate_size, hid),
              "mlp.down_proj": (hid, cfg.intermediate_size)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rnd(hid)
        sd[p + "post_attention_layernorm.weight"] = rnd(hid)
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = rnd(*shape)
            if (cfg.attention_bias and name.startswith("self_attn")) or (cfg.mlp_bias and name.startswith("mlp")):
                sd[p + name + ".bias"] = rnd(shape[0])
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(cfg.vocab_size, hid)
    return sd


@pytest.mark.parametrize("heads, kv, tp", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_layout_round_trips_exactly(heads, kv, tp, dtype):
    cfg = make_cfg(heads, kv, head_dim=6, inter=24, vocab=37)  # vocab 37: padding on the last rank
    plan = ShardPlan.build(cfg, tp)
    g = torch.Generator().manual_seed(heads * 100 + tp)
    full = {
        "q_heads": (heads * 6, 5), "kv_heads": (kv * 6, 5), "o_heads": (5, heads * 6), "column": (24, 5),
        "row": (5, 24), "row_bias": (5,), "vocab": (37, 5), "replicated": (5,),
    }
    for kind, shape in full.items():
        t = (torch.randn(*shape, generator=g) * 50).to(dtype)
        lay = plan_layout(plan, kind)
        shards = [shard(t, r, tp, lay) for r in range(tp)]
        assert all(s.shape == shards[0].shape for s in shards), kind  # uniform local shapes
        assert torch.equal(gather(shards, lay), t), kind
    for bias_kind, n in (("q_heads", heads * 6), ("kv_heads", kv * 6)):  # 1-D biases split like their weights
        b = torch.randn(n, generator=g).to(dtype)
        lay = plan_layout(plan, bias_kind)
        assert torch.equal(gather([shard(b, r, tp, lay) for r in range(tp)], lay), b)


def test_padding_is_zero_and_row_bias_lives_on_rank_0():
    cfg = make_cfg(9, 3, head_dim=4, inter=24, vocab=10)
    plan = ShardPlan.build(cfg, 2)  # rank 1 holds q heads (5, 6, 7, 8, None)
    q = torch.randn(36, 7) + 10  # no zeros anywhere
    o = torch.randn(7, 36) + 10
    q1 = shard(q, 1, 2, plan_layout(plan, "q_heads"))
    o1 = shard(o, 1, 2, plan_layout(plan, "o_heads"))
    assert torch.equal(q1[:16], q[20:36]) and torch.equal(q1[16:], torch.zeros(4, 7))
    assert torch.equal(o1[:, :16], o[:, 20:36]) and torch.equal(o1[:, 16:], torch.zeros(7, 4))
    bias = torch.arange(1.0, 8.0)
    lay = plan_layout(plan, "row_bias")
    assert torch.equal(shard(bias, 0, 2, lay), bias) and torch.equal(shard(bias, 1, 2, lay), torch.zeros(7))
    emb = torch.randn(10, 3) + 10
    e1 = shard(emb, 1, 2, plan_layout(plan, "vocab"))
    assert torch.equal(e1, emb[5:10])
    e = shard(emb, 2, 3, plan_layout(ShardPlan.build(cfg, 3), "vocab"))  # 10 rows over 3 ranks: 4, 4, 2 + 2 pad
    assert torch.equal(e[:2], emb[8:]) and torch.equal(e[2:], torch.zeros(2, 3))


def test_gather_rejects_corrupt_shards():
    plan = ShardPlan.build(make_cfg(6, 2, head_dim=4, inter=24), 4)  # KV heads replicated on two ranks each
    k = torch.randn(8, 5)
    lay = plan_layout(plan, "kv_heads")
    shards = [shard(k, r, 4, lay) for r in range(4)]
    shards[1] = shards[1] + 1
    with pytest.raises(ValueError, match="replicas of head 0 differ"):
        gather(shards, lay)
    qlay = plan_layout(plan, "q_heads")
    qs = [shard(torch.randn(24, 5), r, 4, qlay) for r in range(4)]
    qs[1][4:] = 1.0  # rank 1 slot 1 is padding
    with pytest.raises(ValueError, match="padding head slot 1 on rank 1"):
        gather(qs, qlay)
    blay = plan_layout(plan, "row_bias")
    with pytest.raises(ValueError, match="rank 2"):
        gather([torch.ones(3), torch.zeros(3), torch.ones(3), torch.zeros(3)], blay)


def test_state_dict_names_follow_transformers_llama():
    """Every parameter of a real transformers LlamaForCausalLM (with biases) has a layout; junk names raise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                      mlp_bias=True))
    kinds = {n: layout_kind(n) for n in hf.state_dict()}
    assert kinds["model.layers.0.self_attn.o_proj.bias"] == "row_bias"
    assert kinds["model.layers.0.mlp.down_proj.bias"] == "row_bias"
    assert kinds["model.layers.0.self_attn.k_proj.bias"] == "kv_heads"
    with pytest.raises(ConfigError, match="no tensor-parallel layout"):
        layout_kind("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("heads, kv, tp", [(9, 3, 2), (9, 3, 4), (4, 2, 4)])
def test_state_dict_round_trip_and_bytes(heads, kv, tp, tied):
    cfg = make_cfg(heads, kv, head_dim=4, inter=48, vocab=50, attention_bias=True, mlp_bias=True,
                   tie_word_embeddings=tied)
    plan = ShardPlan.build(cfg, tp)
    sd = random_state_dict(cfg, dtype=torch.bfloat16)
    shards = [shard_state_dict(sd, cfg, plan, r) for r in range(tp)]
    back = gather_state_dicts(shards, cfg, plan)
    assert list(back) == list(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    expected = sum(rank_param_counts(cfg, plan).values()) * 2  # bf16
    assert [rank_weight_bytes(s) for s in shards] == [expected] * tp


def test_sharded_parts_shrink_about_1_over_tp():
    """SmolLM2-sized attention/MLP/vocab counts per rank vs tp = 1 (reported in the README)."""
    cfg = make_cfg(9, 3, head_dim=64, inter=1536, vocab=49152)
    full = rank_param_counts(cfg, ShardPlan.build(cfg, 1))
    for tp in (2, 3, 4):
        part = rank_param_counts(cfg, ShardPlan.build(cfg, tp))
        assert part["mlp"] * tp == full["mlp"] and part["embedding"] * tp == full["embedding"]
        # attention carries padding/replication overhead: at most 5/4.5 (tp 2) or 4/3 (tp 4) of the ideal share
        assert full["attention"] / tp <= part["attention"] <= full["attention"] / tp * 4 / 3 + 1


def _layer_partial(x, sd, q_to_kv, d):
    """One attention + MLP sublayer pair without norms/RoPE: the per-rank partial sums before all-reduce."""
    b, t, _ = x.shape
    q = F.linear(x, sd["q.weight"], sd.get("q.bias")).view(b, t, -1, d).transpose(1, 2)  # [B, Hq, T, D]
    k = F.linear(x, sd["k.weight"], sd.get("k.bias")).view(b, t, -1, d).transpose(1, 2)  # [B, Hkv, T, D]
    v = F.linear(x, sd["v.weight"], sd.get("v.bias")).view(b, t, -1, d).transpose(1, 2)
    idx = torch.tensor(q_to_kv)
    att = F.scaled_dot_product_attention(q, k[:, idx], v[:, idx], is_causal=True)  # [B, Hq, T, D]
    attn = F.linear(att.transpose(1, 2).reshape(b, t, -1), sd["o.weight"], sd.get("o.bias"))  # [B, T, H]
    mlp = F.linear(F.silu(F.linear(x, sd["gate.weight"])) * F.linear(x, sd["up.weight"]), sd["down.weight"],
                   sd.get("down.bias"))
    return attn, mlp


@pytest.mark.parametrize("heads, kv, tp", CASES)
def test_sum_of_rank_partials_equals_the_full_layer(heads, kv, tp):
    """The model-side contract: padded heads contribute nothing, q_to_kv picks whole replicated KV heads, row
    biases are added once. fp64 so only summation order differs (tolerance 1e-10 relative)."""
    d, hid = 4, 12
    cfg = make_cfg(heads, kv, head_dim=d, inter=24, vocab=20)
    plan = ShardPlan.build(cfg, tp)
    g = torch.Generator().manual_seed(7)
    kinds = {"q": "q_heads", "k": "kv_heads", "v": "kv_heads", "o": "o_heads", "gate": "column", "up": "column",
             "down": "row"}
    shapes = {"q": (heads * d, hid), "k": (kv * d, hid), "v": (kv * d, hid), "o": (hid, heads * d),
              "gate": (24, hid), "up": (24, hid), "down": (hid, 24)}
    full = {f"{n}.weight": torch.randn(*s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    full |= {"q.bias": torch.randn(heads * d, generator=g, dtype=torch.float64),
             "o.bias": torch.randn(hid, generator=g, dtype=torch.float64),
             "down.bias": torch.randn(hid, generator=g, dtype=torch.float64)}
    x = torch.randn(2, 5, hid, generator=g, dtype=torch.float64)
    ref = _layer_partial(x, full, [h // (heads // kv) for h in range(heads)], d)
    parts = []
    for r in plan.ranks:
        local = {n: shard(w, r.rank, tp, plan_layout(plan, "row_bias" if n in ("o.bias", "down.bias")
                                                      else kinds[n.split(".")[0]]))
                 for n, w in full.items()}
        parts.append(_layer_partial(x, local, r.q_to_kv, d))
    for i in range(2):
        torch.testing.assert_close(sum(p[i] for p in parts), ref[i], rtol=1e-10, atol=1e-10)


def test_tied_lm_head_is_stored_once_and_must_equal_the_embedding():
    cfg = make_cfg(4, 2, head_dim=4, inter=24, vocab=30, tie_word_embeddings=True)
    plan = ShardPlan.build(cfg, 2)
    sd = random_state_dict(cfg)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # what a tied HF model's state_dict() returns
    rank_sd = shard_state_dict(sd, cfg, plan, 1)
    assert "lm_head.weight" not in rank_sd and rank_sd["model.embed_tokens.weight"].shape == (15, 16)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    with pytest.raises(ConfigError, match="lm_head.weight differs from the embedding"):
        shard_state_dict(sd, cfg, plan, 0)
