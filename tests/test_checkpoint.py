"""neuron_infer.checkpoint: safetensors loading (single/sharded, fp32/bf16/fp16), strict mapping, bad input."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_infer.checkpoint import (
    checkpoint_fingerprint,
    expected_shapes,
    load_checkpoint,
    load_tokenizer,
    scan_checkpoint,
)
from neuron_infer.config import ModelConfig
from neuron_infer.errors import CheckpointError
from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint


def _hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The oracle: what transformers itself loads from the directory."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gqa"), **TINY_PRESETS["gqa"])


def _rewrite(model_dir: Path, edit) -> None:
    """Apply `edit(state_dict)` to model.safetensors in place."""
    path = model_dir / "model.safetensors"
    sd = load_file(path)
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------------------
# happy paths


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_expected_shapes_match_transformers(tmp_path, preset):
    """expected_shapes names exactly HF's parameters with HF's shapes (tied: no lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS[preset])
    cfg = ModelConfig.from_model_dir(d)
    hf = LlamaForCausalLM(LlamaConfig.from_pretrained(d))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight")
    assert expected_shapes(cfg) == hf_shapes


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_load_equals_transformers(tmp_path, preset):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS[preset])
    cfg = ModelConfig.from_model_dir(d)
    sd = load_checkpoint(d, cfg)
    ref = _hf_state(d)
    assert set(sd) == set(expected_shapes(cfg))
    for k, v in sd.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, ref[k]), k  # same bytes, no arithmetic: exact


def test_sharded_equals_single(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "single", tokenizer=False, **TINY_PRESETS["attn_bias"])
    sharded = write_tiny_checkpoint(tmp_path / "sharded", tokenizer=False, max_shard_size="40KB",
                                    **TINY_PRESETS["attn_bias"])
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    cfg = ModelConfig.from_model_dir(single)
    a, b = load_checkpoint(single, cfg), load_checkpoint(sharded, cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kept_and_castable(tmp_path, dtype):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, dtype=dtype, **TINY_PRESETS["gqa"])
    cfg = ModelConfig.from_model_dir(d)
    sd = load_checkpoint(d, cfg)
    raw = load_file(d / "model.safetensors")
    assert all(v.dtype == getattr(torch, dtype) and torch.equal(v, raw[k]) for k, v in sd.items())
    as32 = load_checkpoint(d, cfg, dtype=torch.float32)
    assert all(as32[k].dtype == torch.float32 and torch.equal(as32[k], sd[k].float()) for k in sd)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["tied"])
    _rewrite(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    cfg = ModelConfig.from_model_dir(d)
    sd = load_checkpoint(d, cfg)
    assert "lm_head.weight" not in sd and set(sd) == set(expected_shapes(cfg))


def test_tied_checkpoint_with_different_lm_head_raises(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["tied"])
    _rewrite(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"] + 1.0))
    with pytest.raises(CheckpointError, match="tie_word_embeddings.*lm_head.weight differs"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_derived_rotary_buffers_are_dropped(gqa_dir, tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    _rewrite(d, lambda sd: sd.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(12)))
    sd = load_checkpoint(d, ModelConfig.from_model_dir(d))
    assert not any("inv_freq" in k for k in sd)


# ---------------------------------------------------------------------------------------------------------------
# strict mapping


def test_missing_tensor_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    _rewrite(d, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_leftover_tensors_are_listed_with_count(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    _rewrite(d, lambda sd: sd.update({f"extra.{i:02d}": torch.zeros(2) for i in range(13)}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, ModelConfig.from_model_dir(d))
    msg = str(e.value)
    assert "unexpected tensor(s) extra.00" in msg and "extra.09" in msg and "extra.10" not in msg
    assert "and 3 more" in msg


def test_config_with_fewer_layers_reports_leftovers(gqa_dir):
    cfg = ModelConfig.from_model_dir(gqa_dir)
    one_layer = ModelConfig.from_dict({**cfg.to_dict(), "num_layers": 1})
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.1\."):
        load_checkpoint(gqa_dir, one_layer)


def test_shape_mismatch_names_tensor_and_shapes(gqa_dir):
    cfg = ModelConfig.from_model_dir(gqa_dir)
    wider = ModelConfig.from_dict({**cfg.to_dict(), "intermediate_size": cfg.intermediate_size + 8})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(gqa_dir, wider)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg
    assert f"[{cfg.intermediate_size}, {cfg.hidden_size}]" in msg  # found
    assert f"[{cfg.intermediate_size + 8}, {cfg.hidden_size}]" in msg  # expected


def test_unsupported_dtype_is_refused(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    _rewrite(d, lambda sd: sd.__setitem__("model.norm.weight", sd["model.norm.weight"].double()))
    with pytest.raises(CheckpointError, match="model.norm.weight.*F64.*fp32, bf16 and fp16"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_missing_prefix_hint(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])

    def strip(sd):
        for k in [k for k in sd if k.startswith("model.")]:
            sd[k[len("model."):]] = sd.pop(k)
    _rewrite(d, strip)
    with pytest.raises(CheckpointError, match="lack the 'model.' prefix"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


# ---------------------------------------------------------------------------------------------------------------
# missing / corrupt files


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        scan_checkpoint(tmp_path / "nope")
    d = write_tiny_checkpoint(tmp_path / "m", tokenizer=False, **TINY_PRESETS["gqa"])
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_file_names_file_and_redownload(tmp_path, keep):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])  # 4: inside the length prefix; 100: inside the header; -1000: inside the data
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated or corrupt.*re-download"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_garbage_header_is_corrupt(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    path = d / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 16) + b"{not json at all" + b"\0" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt.*not valid JSON"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_index_naming_missing_shard(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, max_shard_size="40KB", **TINY_PRESETS["gqa"])
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{victim.name}"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_index_disagreeing_with_shards(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, max_shard_size="40KB", **TINY_PRESETS["gqa"])
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    files = sorted(set(data["weight_map"].values()))
    name = next(k for k, f in data["weight_map"].items() if f == files[0])
    data["weight_map"][name] = files[-1]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"maps tensor.*{name}"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_pickle_checkpoints_are_refused(tmp_path, suffix):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    (d / "model.safetensors").unlink()
    sentinel = tmp_path / "unpickled"
    # a file that would run code if unpickled: the loader must never open it with pickle
    import pickle

    class Evil:
        def __reduce__(self):
            return (Path.touch, (sentinel,))
    (d / f"pytorch_model{suffix}").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, ModelConfig.from_model_dir(d))
    msg = str(e.value)
    assert f"pytorch_model{suffix}" in msg and "arbitrary code" in msg and "safe_serialization=True" in msg
    assert not sentinel.exists()


# ---------------------------------------------------------------------------------------------------------------
# fingerprint and tokenizer


def test_fingerprint_stable_and_sensitive(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", tokenizer=False, **TINY_PRESETS["gqa"])
    b = write_tiny_checkpoint(tmp_path / "b", tokenizer=False, **TINY_PRESETS["gqa"])
    fp = checkpoint_fingerprint(a)
    assert len(fp) == 64 and fp == checkpoint_fingerprint(a) == checkpoint_fingerprint(b)  # path-independent
    c = write_tiny_checkpoint(tmp_path / "c", tokenizer=False, seed=1, **TINY_PRESETS["gqa"])
    assert checkpoint_fingerprint(c) != fp  # other weights (same names/shapes): caught by the data samples
    cfg = json.loads((b / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (b / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_fingerprint(b) != fp
    s = write_tiny_checkpoint(tmp_path / "s", tokenizer=False, max_shard_size="40KB", **TINY_PRESETS["gqa"])
    assert checkpoint_fingerprint(s) != fp


def test_tokenizer_loads_offline(gqa_dir):
    tok = load_tokenizer(gqa_dir)
    ids = tok("The capital of France is").input_ids
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")


def test_missing_tokenizer(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, **TINY_PRESETS["gqa"])
    with pytest.raises(CheckpointError, match="no tokenizer in .*tokenizer.json"):
        load_tokenizer(d)


@pytest.mark.parametrize("content", ['{"truncated": ', '{"version": "1.0", "model": 3}'])
def test_corrupt_tokenizer(tmp_path, content):
    d = write_tiny_checkpoint(tmp_path, **TINY_PRESETS["gqa"])
    (d / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match="cannot load the tokenizer in .*re-download"):
        load_tokenizer(d)


def test_invalid_index_json(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, max_shard_size="40KB", **TINY_PRESETS["gqa"])
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"index\.json is not a valid safetensors index.*re-download"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))


def test_tensor_in_two_shards(tmp_path):
    d = write_tiny_checkpoint(tmp_path, tokenizer=False, max_shard_size="40KB", **TINY_PRESETS["gqa"])
    first, second = sorted(d.glob("model-*.safetensors"))[:2]
    a, b = load_file(first), load_file(second)
    name = next(iter(a))
    save_file({**b, name: a[name]}, second, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} appears in both"):
        load_checkpoint(d, ModelConfig.from_model_dir(d))
