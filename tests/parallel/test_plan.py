"""ShardPlan: head assignment invariants, the named model configurations, validation, JSON round trip."""
from __future__ import annotations

import json

import pytest

from neuron_infer.config import ModelConfig
from neuron_infer.errors import ConfigError
from neuron_infer.parallel.plan import MAX_TP_DEGREE, ShardPlan


def make_cfg(heads: int, kv: int, head_dim: int = 8, inter: int = 96, vocab: int = 100, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv, head_dim=head_dim, **kw)


SMOLLM2 = make_cfg(9, 3, head_dim=64, inter=1536, vocab=49152)


def check_invariants(cfg: ModelConfig, plan: ShardPlan) -> None:
    """Every real query head on exactly one rank, attending with its own KV head; uniform local shapes."""
    group = cfg.num_heads // cfg.num_kv_heads
    owners: dict[int, int] = {}
    for r in plan.ranks:
        assert r.num_heads == plan.local_num_heads and r.num_kv_heads == plan.local_num_kv_heads
        assert r.num_real_heads >= 1, f"rank {r.rank} holds only padding"
        assert len(r.q_to_kv) == r.num_heads
        for slot, h in enumerate(r.q_heads):
            if h is None:
                continue
            assert h not in owners, f"query head {h} on ranks {owners[h]} and {r.rank}"
            owners[h] = r.rank
            assert r.kv_heads[r.q_to_kv[slot]] == h // group  # whole KV head, the right one
    assert sorted(owners) == list(range(cfg.num_heads))
    starts = [r.intermediate_range for r in plan.ranks]
    assert starts[0][0] == 0 and starts[-1][1] == cfg.intermediate_size
    assert all(a[1] == b[0] for a, b in zip(starts, starts[1:]))
    covered = [t for r in plan.ranks for t in range(*r.vocab_range)]
    assert covered == list(range(cfg.vocab_size))
    assert plan.local_vocab_size * plan.tp >= cfg.vocab_size


@pytest.mark.parametrize("tp, strategy, q_local, kv_local", [
    (1, "kv_split", 9, 3), (2, "contiguous", 5, 2), (3, "kv_split", 3, 1), (4, "kv_replicate", 3, 1),
])
def test_smollm2_degrees(tp, strategy, q_local, kv_local):
    plan = ShardPlan.build(SMOLLM2, tp)
    check_invariants(SMOLLM2, plan)
    assert (plan.strategy, plan.local_num_heads, plan.local_num_kv_heads) == (strategy, q_local, kv_local)


def test_smollm2_tp2_layout_is_the_documented_one():
    r0, r1 = ShardPlan.build(SMOLLM2, 2).ranks
    assert (r0.q_heads, r0.kv_heads, r0.q_to_kv) == ((0, 1, 2, 3, 4), (0, 1), (0, 0, 0, 1, 1))
    assert (r1.q_heads, r1.kv_heads, r1.q_to_kv) == ((5, 6, 7, 8, None), (1, 2), (0, 1, 1, 1, 0))


@pytest.mark.parametrize("heads, inter, tp, q_local, replication", [
    (32, 14336, 8, 4, 1.0),     # Llama-3.1-8B tp 8
    (32, 14336, 32, 1, 4.0),    # Llama-3.1-8B tp 32 (trn1.32xlarge)
    (64, 28672, 32, 2, 4.0),    # Llama-3.1-70B tp 32
    (64, 28672, 64, 1, 8.0),    # Llama-3.1-70B tp 64
    (128, 53248, 64, 2, 8.0),   # Llama-3.1-405B tp 64 (trn2.48xlarge LNC2)
])
def test_llama_31_degrees(heads, inter, tp, q_local, replication):
    cfg = make_cfg(heads, 8, head_dim=128, inter=inter, vocab=128256)
    plan = ShardPlan.build(cfg, tp)
    check_invariants(cfg, plan)
    assert plan.local_num_heads == q_local and plan.padded_num_heads == heads  # no padding needed
    assert plan.local_num_kv_heads * tp / 8 == replication == plan.kv_replication
    assert plan.strategy == ("kv_split" if tp == 8 else "kv_replicate")


@pytest.mark.parametrize("heads, kv", [(4, 4), (4, 2), (4, 1), (6, 2), (6, 3), (9, 3), (12, 4), (10, 5), (8, 8)])
def test_invariants_hold_for_every_degree(heads, kv):
    cfg = make_cfg(heads, kv, inter=2 * 3 * 4 * 5 * 7 * 9 * 11)
    for tp in range(1, heads + 1):
        check_invariants(cfg, ShardPlan.build(cfg, tp))


def test_replication_pads_within_groups():
    # 6 query heads / 2 KV heads at tp 4: each KV head on two ranks, its 3 query heads split 2 + 1 (+1 padding)
    plan = ShardPlan.build(make_cfg(6, 2, inter=96), 4)
    assert plan.strategy == "kv_replicate"
    assert [r.q_heads for r in plan.ranks] == [(0, 1), (2, None), (3, 4), (5, None)]
    assert [r.kv_heads for r in plan.ranks] == [(0,), (0,), (1,), (1,)]


@pytest.mark.parametrize("tp, match", [
    (0, "must be >= 1"), (-2, "must be >= 1"), (True, "integer"), (2.0, "integer"),
    (10, "exceeds the model's 9 query heads"), (MAX_TP_DEGREE + 1, "supported maximum"),
])
def test_invalid_degrees_are_rejected_with_the_fix(tp, match):
    with pytest.raises(ConfigError, match=match):
        ShardPlan.build(SMOLLM2, tp)


def test_intermediate_that_tp_cannot_split_lists_valid_degrees():
    cfg = make_cfg(4, 2, inter=90)  # 90 % 4 != 0
    with pytest.raises(ConfigError, match=r"does not divide intermediate_size=90.*\[1, 2, 3\]"):
        ShardPlan.build(cfg, 4)


def test_json_round_trip():
    plan = ShardPlan.build(SMOLLM2, 4)
    again = ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    bad = plan.to_dict() | {"extra": 1}
    with pytest.raises(ConfigError, match="recompile"):
        ShardPlan.from_dict(bad)


def test_rank_fields_build_the_models_local_layout():
    from neuron_infer.model.llama import LocalLayout

    r = ShardPlan.build(SMOLLM2, 2).ranks[1]
    lay = LocalLayout(**r.local_layout_fields())
    assert (lay.num_heads, lay.num_kv_heads, lay.q_to_kv) == (5, 2, (0, 1, 1, 1, 0))
    assert (lay.vocab_start, lay.vocab_local, lay.vocab_size, lay.intermediate_size) == (24576, 24576, 49152, 768)
