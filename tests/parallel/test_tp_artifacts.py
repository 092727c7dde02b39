"""TP artifacts without starting ranks: per-rank files, bytes ~ 1/tp, the plan in the manifest, per-rank int8
scales, and degrees rejected before any work."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from neuron_infer.api import CompiledModel
from neuron_infer.artifact.manifest import read_manifest, seal
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import ModelConfig, QuantConfig
from neuron_infer.errors import ConfigError
from neuron_infer.parallel import launch
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.shard import plan_layout, rank_param_counts, shard
from tests.parallel.test_tp_e2e import BUILD, SMOL_LIKE
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint

QUIET = {"backend": "cpu-eager", "say": lambda m: None}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_art")
    return {"gqa": write_tiny_checkpoint(root / "gqa", **TINY_PRESETS["gqa"]),
            "smol_like": write_tiny_checkpoint(root / "smol", **SMOL_LIKE)}


@pytest.mark.parametrize("name,tp", [("gqa", 2), ("gqa", 4), ("smol_like", 2), ("smol_like", 3), ("smol_like", 4)])
def test_rank_files_hold_about_one_tp_th_of_the_sharded_parts(ckpts, tmp_path, name, tp):
    m = compile_model(ckpts[name], tmp_path / "a", BUILD.replace(tp_degree=tp), **QUIET)
    cfg, plan = m.model, ShardPlan.from_dict(m.extra.tp_plan)
    assert plan == ShardPlan.build(cfg, tp) and m.backend == "cpu-eager" and "eagerly" in m.extra.tp_backend_note
    files = sorted(p.name for p in (tmp_path / "a" / "weights").iterdir())
    assert files == [f"rank{r}.safetensors" for r in range(tp)]
    assert all((tmp_path / "a" / "graphs" / f"rank{r}").is_dir() for r in range(tp))
    counts = rank_param_counts(cfg, plan)
    expect = 4 * (counts["attention"] + counts["mlp"] + counts["embedding"] + counts["lm_head"])  # fp32
    full = m.extra.tp_full_sharded_bytes
    for rec in m.extra.tp_rank_weights:
        assert rec.sharded_bytes == expect and rec.replicated_bytes == 4 * counts["norms"]
        assert rec.bytes == (tmp_path / "a" / "weights" / f"rank{rec.rank}.safetensors").stat().st_size - \
            _header_bytes(tmp_path / "a" / "weights" / f"rank{rec.rank}.safetensors")
    ratio = expect * tp / full  # 1.0 = no padding or replication overhead
    print(f"{name} tp={tp} {plan.strategy}: {expect} B sharded/rank, full {full} B, tp*rank/full = {ratio:.3f}")
    # overhead is bounded by the plan: padded query slots, replicated KV heads and padded vocabulary rows only
    assert 1.0 <= ratio <= 1.0 + _padding_overhead(cfg, plan)


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _padding_overhead(cfg: ModelConfig, plan: ShardPlan) -> float:
    """Upper bound of (stored - full) / full from the plan's padding and replication."""
    d, h = cfg.head_dim, cfg.hidden_size
    extra_q = (plan.padded_num_heads - cfg.num_heads) * d * h * 2
    extra_kv = (plan.local_num_kv_heads * plan.tp - cfg.num_kv_heads) * d * h * 2
    extra_vocab = (plan.local_vocab_size * plan.tp - cfg.vocab_size) * h * (1 if cfg.tie_word_embeddings else 2)
    full = (cfg.num_heads * 2 + cfg.num_kv_heads * 2) * d * h * cfg.num_layers
    full += 3 * h * cfg.intermediate_size * cfg.num_layers + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return ((extra_q + extra_kv) * cfg.num_layers + extra_vocab) / full


def test_int8_per_rank_scales(ckpts, tmp_path):
    """Column-parallel layers: int8 weights and scales are exactly tp = 1's rows. Row-parallel layers (o/down):
    per-channel scales come from the rank's column slice, so they never exceed tp = 1's (finer quantization)."""
    q = QuantConfig(scheme="int8")
    m1 = compile_model(ckpts["gqa"], tmp_path / "t1", BUILD.replace(quant=q), **QUIET)
    m2 = compile_model(ckpts["gqa"], tmp_path / "t2", BUILD.replace(quant=q, tp_degree=2), **QUIET)
    full = load_file(str(tmp_path / "t1" / "weights" / "rank0.safetensors"))
    plan = ShardPlan.from_dict(m2.extra.tp_plan)
    assert m2.extra.quant["scheme"] == "int8" and len(m2.extra.quant["per_rank"]) == 2
    finer = 0
    for r in range(2):
        mine = load_file(str(tmp_path / "t2" / "weights" / f"rank{r}.safetensors"))
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            kind = {"q_proj": "q_heads", "k_proj": "kv_heads"}.get(name.split(".")[1], "column")
            lay = plan_layout(plan, kind)
            for suffix in ("weight", "weight_scale"):
                key = f"model.layers.0.{name}.{suffix}"
                assert torch.equal(mine[key], shard(full[key], r, 2, lay)), key
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            key = f"model.layers.1.{name}.weight_scale"
            assert bool((mine[key].float() <= full[key].float()).all()), key
            finer += int((mine[key].float() < full[key].float()).sum())
    assert finer > 0  # some row-parallel rows really are quantized more finely than at tp = 1
    assert m1.extra.quant["scheme"] == "int8"


def test_degrees_the_plan_cannot_express_fail_before_any_file_is_written(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="query heads"):
        compile_model(ckpts["gqa"], tmp_path / "x", BUILD.replace(tp_degree=5), **QUIET)  # 4 heads
    with pytest.raises(ConfigError, match="intermediate_size"):
        compile_model(ckpts["gqa"], tmp_path / "x", BUILD.replace(tp_degree=3), **QUIET)  # 200 % 3
    with pytest.raises(ConfigError, match="w8a8 calibrates"):  # SmoothQuant needs full-model activations
        compile_model(ckpts["gqa"], tmp_path / "x", BUILD.replace(tp_degree=2, quant=QuantConfig(scheme="w8a8")),
                      **QUIET)
    with pytest.raises(ConfigError, match="tp_degree=0"):
        BUILD.replace(tp_degree=0)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))


def test_loading_more_ranks_than_the_host_runs_is_rejected_before_spawning(ckpts, tmp_path, monkeypatch):
    compile_model(ckpts["gqa"], tmp_path / "a", BUILD.replace(tp_degree=2), **QUIET)
    monkeypatch.setattr(launch, "MAX_RANKS_PER_CPU", 1)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 1)
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("ranks were started"))
    monkeypatch.setattr(launch.RankProcesses, "__init__", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(ConfigError, match="tp degree 2 needs 2 rank processes"):
        CompiledModel.load(tmp_path / "a")


def test_a_tampered_plan_is_rejected(ckpts, tmp_path):
    import json

    compile_model(ckpts["gqa"], tmp_path / "a", BUILD.replace(tp_degree=2), **QUIET)
    path = tmp_path / "a" / "manifest.json"
    d = json.loads(path.read_text())
    d["extra"]["tp_plan"]["ranks"][1]["kv_heads"] = [0]
    path.write_text(json.dumps(seal(d)))
    with pytest.raises(Exception, match="shard plan differs"):
        CompiledModel.load(tmp_path / "a")
    assert read_manifest(tmp_path / "a").build.tp_degree == 2
