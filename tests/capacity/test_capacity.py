"""Capacity planner: published cross-checks, byte accounting tied to real shards, presets, validation."""
from __future__ import annotations

import json

import pytest
import torch

from neuron_infer.capacity.planner import plan_capacity, render_capacity_text
from neuron_infer.capacity.presets import INSTANCES, MODEL_PRESETS, resolve_model
from neuron_infer.errors import ConfigError
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.shard import rank_param_counts, rank_weight_bytes, shard_state_dict
from tests.parallel.test_plan import make_cfg
from tests.parallel.test_shard import random_state_dict

# Published anchors (AWS Neuron documentation)
TPOT_405B_TRN2_S = 37.9e-3  # Llama-3.1-405B bf16, trn2.48xlarge TP64 LNC2, seq 12800, 10k in / 1.5k out
TTFT_405B_TRN2_S = 2442e-3
TPOT_8B_TRN1_S = 5.86e-3  # Llama-3-8B int8, trn1.32xlarge TP32, seq 4096, 128 in / 3968 out
TTFT_8B_TRN1_S = 14.75e-3


def plan_405b():
    return plan_capacity(MODEL_PRESETS["llama-3.1-405b"], "trn2.48xlarge", 64, "none", 12800, 1, 2,
                         (2048, 4096, 10240, 12288), tokengen_buckets=(12800,), model_name="llama-3.1-405b")


def test_405b_bf16_trn2_tp64_lnc2_fits_and_bounds_stay_below_published():
    p = plan_405b()
    assert p.fits and p.lnc == 2 and p.logical_cores == 64
    assert p.hbm_bytes_per_core == 24 * 2**30  # 96 GiB chip / 8 cores x LNC 2
    # weights: ~405.9e9 params x 2 bytes / 64, plus k/v replicated x8 (x8 k/v weights)
    assert 13.0e9 < p.weight_bytes_per_rank < 14.0e9
    assert p.tpot_lower_bound_s < TPOT_405B_TRN2_S
    ttft_10k = dict(p.ttft_lower_bound_s_by_bucket)[10240]  # the 10,000-token prompt runs in the 10240 bucket
    assert ttft_10k < TTFT_405B_TRN2_S
    print(f"405B: TPOT bound {p.tpot_lower_bound_s * 1e3:.2f} ms, published/bound "
          f"{TPOT_405B_TRN2_S / p.tpot_lower_bound_s:.2f}; TTFT@10240 bound {ttft_10k * 1e3:.0f} ms, "
          f"published/bound {TTFT_405B_TRN2_S / ttft_10k:.2f}")


def test_8b_int8_trn1_tp32_bounds_stay_below_published():
    p = plan_capacity(MODEL_PRESETS["llama-3.1-8b"], "trn1.32xlarge", 32, "int8", 4096, 1, None, (128,),
                      model_name="llama-3.1-8b")
    assert p.fits and p.hbm_bytes_per_core == 16 * 2**30
    assert p.tpot_lower_bound_s < TPOT_8B_TRN1_S and p.ttft_lower_bound_s < TTFT_8B_TRN1_S
    by = dict(p.weight_bytes_by_dtype)
    assert set(by) == {"int8", "bf16", "scales_fp32"}
    print(f"8B int8: TPOT bound {p.tpot_lower_bound_s * 1e3:.3f} ms, published/bound "
          f"{TPOT_8B_TRN1_S / p.tpot_lower_bound_s:.2f}; TTFT@128 bound {p.ttft_lower_bound_s * 1e3:.3f} ms, "
          f"published/bound {TTFT_8B_TRN1_S / p.ttft_lower_bound_s:.2f}")


def test_json_has_the_required_keys_and_round_trips():
    d = json.loads(json.dumps(plan_405b().to_dict()))
    for key in ("fits", "weight_bytes_per_rank", "kv_cache_bytes_per_rank", "tpot_lower_bound_s",
                "ttft_lower_bound_s"):
        assert key in d
    assert d["kv_cache_bytes_by_bucket"] == {"12800": 2 * 126 * 1 * 128 * 2 * 12800}
    text = render_capacity_text(plan_405b())
    assert "FITS" in text and "12800" in text


def test_kv_cache_formula():
    cfg = MODEL_PRESETS["llama-3.1-70b"]
    p = plan_capacity(cfg, "trn1.32xlarge", 32, "none", 4096, 4)
    # 8 KV heads replicated to 32 ranks: one per rank; 2 (K and V) x 80 layers x 1 x 128 x 2 bytes x 4 x 4096
    assert p.kv_cache_bytes_per_rank == 2 * 80 * 1 * 128 * 2 * 4 * 4096
    fp8 = plan_capacity(cfg, "trn1.32xlarge", 32, "none", 4096, 4, kv_cache_dtype="fp8")
    assert fp8.kv_cache_bytes_per_rank * 2 == p.kv_cache_bytes_per_rank


def test_405b_does_not_fit_on_one_trainium_chip():
    p = plan_capacity(MODEL_PRESETS["llama-3.1-405b"], "trn1.2xlarge", 2, "int8", 2048, 1)
    assert not p.fits and p.headroom_bytes < 0
    assert "DOES NOT FIT" in render_capacity_text(p)


@pytest.mark.parametrize("heads, kv, tp, tied", [(9, 3, 2, True), (9, 3, 4, False), (4, 2, 4, True)])
def test_weight_bytes_equal_the_real_shards(heads, kv, tp, tied):
    """The planner's bf16 per-rank bytes equal the bytes of `shard_state_dict` output for a tiny model."""
    cfg = make_cfg(heads, kv, head_dim=4, inter=48, vocab=50, attention_bias=True, tie_word_embeddings=tied)
    sd = random_state_dict(cfg, dtype=torch.bfloat16)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # as a tied HF model's state_dict() returns it
    plan = ShardPlan.build(cfg, tp)
    measured = max(rank_weight_bytes(shard_state_dict(sd, cfg, plan, r)) for r in range(tp))
    got = plan_capacity(cfg, "trn2.48xlarge", tp, "none", 64, 1, 1).weight_bytes_per_rank
    assert got == measured


def test_quantized_widths():
    cfg = MODEL_PRESETS["llama-3.1-8b"]
    plan = ShardPlan.build(cfg, 8)
    counts = rank_param_counts(cfg, plan)
    linear = counts["attention"] + counts["mlp"]  # no biases in Llama 3.1
    other_bf16 = (counts["norms"] + counts["embedding"] + counts["lm_head"]) * 2
    for quant, bits in (("mxfp4", 4.25), ("mxfp8", 8.25)):
        p = plan_capacity(cfg, "trn3", 8, quant, 1024, 1)
        assert dict(p.weight_bytes_by_dtype) == {quant: int(linear * bits / 8), "bf16": other_bf16}
    p = plan_capacity(cfg, "trn3", 8, "fp8", 1024, 1)
    assert dict(p.weight_bytes_by_dtype)["fp8"] == linear
    assert p.peak_flops_per_core == pytest.approx(1342e12 / 8 * 2)  # LNC 2 default on trn3


def test_presets_match_published_parameter_counts():
    expected = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "llama-3.1-405b": 405.85e9,
                "llama-3.2-1b": 1.236e9, "smollm2-135m": 134.5e6}
    for name, params in expected.items():
        cfg = MODEL_PRESETS[name]
        total = sum(rank_param_counts(cfg, ShardPlan.build(cfg, 1)).values())
        assert total == pytest.approx(params, rel=0.003), name


def test_resolve_model_preset_or_directory(tmp_path):
    assert resolve_model("Llama-3.1-8B")[1] is MODEL_PRESETS["llama-3.1-8b"]
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    name, cfg = resolve_model(str(tmp_path))
    assert name == tmp_path.name and cfg.num_kv_heads == 2
    with pytest.raises(ConfigError, match="neither a known preset"):
        resolve_model("llama-9")


@pytest.mark.parametrize("kwargs, match", [
    (dict(instance="trn1.32xlarge", tp=32, lnc=2), "--lnc 2 is not available on trn1.32xlarge"),
    (dict(instance="inf2.xlarge", tp=4), "--tp-degree 4 needs 4 NeuronCores but inf2.xlarge has 2"),
    (dict(instance="trn2.48xlarge", tp=128, lnc=2), "has 64 logical cores at LNC=2"),
    (dict(instance="trn1.32xlarge", tp=32, quant="int4"), "--quant 'int4' is unknown"),
    (dict(instance="p5.48xlarge", tp=8), "instance 'p5.48xlarge' is unknown"),
    (dict(instance="trn1.32xlarge", tp=0), "must be >= 1"),
])
def test_invalid_requests_name_the_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_capacity(MODEL_PRESETS["llama-3.1-8b"], **kwargs)


def test_every_instance_plans_smollm2_at_tp1():
    for name in INSTANCES:
        assert plan_capacity(MODEL_PRESETS["smollm2-135m"], name, 1, "none", 256, 1).fits


@pytest.mark.parametrize(("model", "instance", "quant"), [
    ("llama-3.1-70b", "trn1.32xlarge", "none"), ("llama-3.1-8b", "inf2.48xlarge", "none"),
    ("llama-3.1-405b", "trn2.48xlarge", "fp8"), ("llama-3.2-1b", "inf2.xlarge", "none"),
])
def test_without_tp_degree_the_smallest_fitting_degree_is_chosen(model, instance, quant):
    from neuron_infer.capacity.planner import smallest_fitting_plan, tp_candidates

    cfg = MODEL_PRESETS[model]
    p = smallest_fitting_plan(cfg, instance, quant, 4096, 1, model_name=model)
    assert p.fits and p.notes[0].startswith(f"tp {p.tp} chosen")
    inst = INSTANCES[instance]
    smaller = [t for t in tp_candidates(inst.logical_cores(inst.default_lnc)) if t < p.tp]
    assert all(not plan_capacity(cfg, instance, t, quant, 4096, 1).fits for t in smaller)
    same = plan_capacity(cfg, instance, p.tp, quant, 4096, 1, model_name=model)
    assert same.hbm_used_bytes_per_rank == p.hbm_used_bytes_per_rank


def test_tp_candidates_are_powers_of_two_and_the_core_count():
    from neuron_infer.capacity.planner import tp_candidates

    assert tp_candidates(2) == (1, 2) and tp_candidates(24) == (1, 2, 4, 8, 16, 24) and tp_candidates(1) == (1,)


def test_no_fitting_degree_is_a_clear_error_and_the_cli_picks_without_tp(capsys):
    from neuron_infer.capacity.planner import smallest_fitting_plan
    from neuron_infer.cli import main

    with pytest.raises(ConfigError, match=r"does not fit on trn1.2xlarge at any TP degree \[1, 2\].*--quant"):
        smallest_fitting_plan(MODEL_PRESETS["llama-3.1-405b"], "trn1.2xlarge", "none", 4096, 1)
    main(["plan", "llama-3.1-70b", "--instance", "trn1.32xlarge", "--json"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out)["tp"] == smallest_fitting_plan(MODEL_PRESETS["llama-3.1-70b"], "trn1.32xlarge").tp
