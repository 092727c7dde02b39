"""ModelConfig / BuildConfig / SamplingConfig: parsing, strictness, JSON round trips, presets."""
import json

import pytest

from neuron_infer.config import BuildConfig, ModelConfig, QuantConfig, SamplingConfig, SpeculationConfig, auto_buckets
from neuron_infer.errors import ConfigError
from neuron_infer.presets import all_presets, load_preset, merge_build

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def test_llama31_legacy_rope_scaling_key():
    cfg = ModelConfig.from_hf_dict(LLAMA31)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_per_kv) == (32, 8, 128, 4)
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_position_embeddings == 8192
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_transformers5_rope_parameters_key_gives_the_same_config():
    d = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta")}
    d["rope_parameters"] = dict(LLAMA31["rope_scaling"], rope_theta=500000.0)
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_hf_dict(LLAMA31)


def test_llama32_tied_and_explicit_head_dim():
    d = dict(LLAMA31, tie_word_embeddings=True, hidden_size=2048, num_attention_heads=32, head_dim=64)
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.tie_word_embeddings and cfg.head_dim == 64


def test_model_config_json_round_trip():
    cfg = ModelConfig.from_hf_dict(LLAMA31)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
    ({"frobnicate": 3}, r"unknown config key\(s\) \['frobnicate'\]"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"num_key_value_heads": 5}, "not a multiple"),
    ({"quantization_config": {"quant_method": "gptq"}}, "pre-quantized"),
])
def test_unsupported_hf_configs_raise_with_the_reason(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(dict(LLAMA31, **change))


def test_missing_required_key_is_named():
    d = {k: v for k, v in LLAMA31.items() if k != "hidden_size"}
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        ModelConfig.from_hf_dict(d)


def test_auto_buckets_are_powers_of_two_ending_at_the_limit():
    assert auto_buckets(128, 600) == (128, 256, 512, 600)
    assert auto_buckets(128, 128) == (128,)
    b = BuildConfig(max_context_length=300, max_length=1024)
    assert b.context_bucket_list == (128, 256, 300) and b.tokengen_bucket_list == (128, 256, 512, 1024)


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="fp16"), "dtype='fp16' is not valid"),
    (dict(target="gpu"), "target='gpu'"),
    (dict(max_context_length=2048, max_length=1024), "max_context_length=2048"),
    (dict(context_buckets=(128, 64), max_context_length=128), "strictly increasing"),
    (dict(context_buckets=(128,), max_context_length=256), "must equal --max-context-length=256"),
    (dict(tokengen_buckets=(256,), max_length=512), "must equal --max-length=512"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(tp_degree=0), "tp_degree=0"),
    (dict(kernels="fast"), "kernels='fast'"),
])
def test_invalid_build_configs_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        BuildConfig(**kw)


def test_build_config_json_round_trip_with_nested_groups():
    b = BuildConfig(dtype="fp32", context_buckets=(64, 256), max_context_length=256,
                    quant=QuantConfig(scheme="fp8", modules_to_not_convert=("lm_head",)),
                    speculation=SpeculationConfig(draft_model="self", length=4, draft_layers=8))
    assert BuildConfig.from_dict(json.loads(json.dumps(b.to_dict()))) == b


def test_build_config_unknown_key_raises():
    with pytest.raises(ConfigError, match="unknown key"):
        BuildConfig.from_dict({"dtype": "bf16", "n_positions": 128})


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_raises(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingConfig(**kw)


def test_every_preset_loads_and_validates():
    presets = {p.name: p for p in all_presets()}
    assert {"tiny", "smollm2-cpu", "cs1-llama2-70b-speculative-trn1", "cs2-open-llama-7b-int8-trn1",
            "cs3-llama3.1-405b-baseline-trn2", "cs3-llama3.1-405b-fp8-fused-spec-trn2"} <= set(presets)
    cs3 = presets["cs3-llama3.1-405b-fp8-fused-spec-trn2"].build
    assert cs3.tp_degree == 64 and cs3.speculation.length == 7 and cs3.quant.scheme == "fp8"
    assert cs3.context_bucket_list == (2048, 4096, 10240, 12288) and cs3.tokengen_bucket_list == (12800,)


def test_flags_override_preset_fields():
    p = load_preset("smollm2-cpu", {"dtype": "fp32", "batch_size": None, "quant.scheme": "int8"})
    assert p.build.dtype == "fp32" and p.build.batch_size == 1 and p.build.quant.scheme == "int8"


def test_a_limit_alone_derives_its_buckets():
    # the preset's context list [64, 128, 512] no longer ends at 128: the buckets follow the new limit
    p = load_preset("smollm2-cpu", {"max_context_length": 128})
    assert p.build.context_bucket_list == (128,) and p.build.tokengen_bucket_list == (256, 1024)
    b = merge_build({"max_length": 1024, "tokengen_buckets": [256, 1024]}, {"max_length": 2048})
    assert b.tokengen_bucket_list == (128, 256, 512, 1024, 2048)
    same = merge_build({"max_length": 1024, "tokengen_buckets": [256, 1024]}, {"max_length": 1024})
    assert same.tokengen_buckets == (256, 1024), "a list that still ends at the limit is kept"


def test_a_limit_alone_moves_the_other_to_leave_room_to_generate():
    base = load_preset("default").build.to_dict()  # prompts up to 512 of 1024 in all
    short = merge_build(base, {"max_length": 256})
    assert (short.max_context_length, short.max_length) == (128, 256) and short.context_bucket_list[-1] == 128
    long = merge_build(base, {"max_context_length": 2048})
    assert (long.max_context_length, long.max_length) == (2048, 4096) and long.tokengen_bucket_list[-1] == 4096
    assert merge_build(base, {"max_length": 4096}).max_context_length == 512, "a limit with room is kept"
    with pytest.raises(ConfigError, match="max_context_length=600 must be in 1..max_length=256"):
        merge_build(base, {"max_length": 256, "max_context_length": 600})  # both given: the user's, checked


@pytest.mark.parametrize("flags, limits", [
    ([], (256, 512)),  # the default, fitted to the tiny model's max_position_embeddings=512
    (["--max-context-length", "128"], (128, 512)),
    (["--max-context-length", "300"], (300, 512)),
    (["--max-length", "256"], (128, 256)),
    (["--max-context-length", "64", "--max-length", "200"], (64, 200)),
])
def test_compile_with_one_limit_flag_on_a_short_model(tiny_dirs, tmp_path, monkeypatch, flags, limits):
    from neuron_infer.cli import main
    from neuron_infer.compile import builder

    seen = []
    monkeypatch.setattr(builder, "compile_model", lambda model_dir, out, build, **k: seen.append(build))
    with pytest.raises(SystemExit) as e:
        main(["compile", str(tiny_dirs("gqa")), "-o", str(tmp_path / "a"), *flags])
        raise SystemExit(0)
    assert e.value.code == 0 and (seen[0].max_context_length, seen[0].max_length) == limits
    assert seen[0].context_bucket_list[-1] == limits[0] and seen[0].tokengen_bucket_list[-1] == limits[1]


def test_a_prompt_limit_filling_the_model_is_one_error(tiny_dirs, tmp_path, capsys):
    from neuron_infer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["compile", str(tiny_dirs("gqa")), "-o", str(tmp_path / "a"), "--max-context-length", "512"])
    assert e.value.code == 2 and "leaves no room to generate" in capsys.readouterr().err


def test_buckets_given_with_their_limit_are_still_checked():
    with pytest.raises(ConfigError, match="must equal --max-length"):
        merge_build({"max_length": 1024}, {"max_length": 2048, "tokengen_buckets": [256, 1024]})


def test_the_checkpoint_default_preset_is_model_independent():
    from neuron_infer.presets import CHECKPOINT_PRESET, EMBEDDED_PRESET, fit_to_model

    default = load_preset(CHECKPOINT_PRESET)
    assert CHECKPOINT_PRESET != EMBEDDED_PRESET and "smollm" not in (CHECKPOINT_PRESET + default.model).lower()
    assert load_preset(EMBEDDED_PRESET).model == "default"  # the embedded model keeps its own preset
    assert fit_to_model(default.build, 131072) == default.build
    short = fit_to_model(default.build, 300)  # a model with a shorter context than the default's limits
    assert (short.max_length, short.max_context_length) == (300, 150)
    assert short.context_bucket_list[-1] == 150 and short.tokengen_bucket_list[-1] == 300


@pytest.mark.parametrize("name, value, match", [
    ("temperature", float("nan"), "temperature=nan"), ("temperature", float("inf"), "temperature=inf"),
    ("top_p", float("nan"), "top_p=nan"),
])
def test_non_finite_sampling_values_are_refused(name, value, match):
    with pytest.raises(ConfigError, match=match):
        SamplingConfig(**{name: value})


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": "abc"}, 'hidden_size must be an integer, not "abc"'),
    ({"hidden_size": None}, "hidden_size must be an integer, not null"),
    ({"num_hidden_layers": 2.7}, "num_hidden_layers must be an integer, not 2.7"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be an integer, not 2.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, not true"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be an integer or an array of integers"),
    ({"eos_token_id": -1}, "eos_token_id must be non-negative"),
    ({"rope_scaling": dict(LLAMA31["rope_scaling"], factor="8")}, "rope_scaling.factor must be a finite number"),
    ({"rope_scaling": dict(LLAMA31["rope_scaling"], beta=1)}, r"unknown key\(s\) \['beta'\] in rope_scaling"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be an array of strings"),
])
def test_hf_config_values_of_the_wrong_type_name_the_key(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(dict(LLAMA31, **change))


@pytest.mark.parametrize("data", [[1, 2], "abc", None, 3])
def test_a_config_json_that_is_not_an_object_is_refused(data):
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_hf_dict(data)


def test_hf_nulls_mean_the_default():
    d = dict(LLAMA31, num_key_value_heads=None, head_dim=None, bos_token_id=None, rope_scaling=None)
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.bos_token_id, cfg.rope_scaling) == (32, 128, None, None)


@pytest.mark.parametrize("change, match", [
    ({"dtype": 16}, 'dtype must be a string, not 16'),
    ({"max_length": "1024"}, "x.json: max_length must be an integer"),
    ({"context_buckets": [64, 128.5]}, r"x.json: context_buckets\[1\] must be an integer"),
    ({"quant": "int8"}, "x.json: quant must be a JSON object"),
    ({"quant": {"scheme": None}}, "x.json: quant.scheme must be a string, not null"),
    ({"speculation": {"draft_model": "self", "length": "4"}}, "x.json: speculation.length must be an integer"),
    ({"speculation": {"draft_model": "self"}}, "required key 'speculation.length' is missing"),
    ({"batch_size": -1}, "x.json: batch_size=-1 must be >= 1"),
])
def test_typed_build_dict_names_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        BuildConfig.from_dict(dict(BuildConfig().to_dict(), **change), where="x.json")


@pytest.mark.parametrize("kw, match", [
    (dict(draft_model="/ckpt/draft", length=4, draft_quant="int8"), "describe a self-draft"),
    (dict(draft_model="ngram", length=4, draft_layers=2), "describe a self-draft"),
    (dict(draft_model="self", length=4), "needs --draft-quant or --draft-layers"),
    (dict(draft_model="ngram", length=4, ngram_size=0), "must be in 1..16"),
    (dict(draft_model="self", length=4, draft_layers=1, ngram_size=2), "use it with --draft-model ngram"),
])
def test_invalid_speculation_configs_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match):
        SpeculationConfig(**kw)
