"""Python API front door: the api.py docstring example runs, CompiledModel.default(), the threads parameter."""
import re

import pytest
import torch

import neuron_infer.api as api
from neuron_infer.api import CompiledModel
from neuron_infer.config import BuildConfig
from neuron_infer.errors import NeuronInferError

TINY_BUILD = BuildConfig(dtype="fp32", max_context_length=64, max_length=128, context_buckets=(32, 64),
                         tokengen_buckets=(64, 128))


def eager_compiles(monkeypatch):
    """Route compiles to the eager backend: these tests check the API's entry points, not the graph compiler
    (tests/compile covers it; a compiled tiny build takes minutes on a busy 2-core machine). Returns the calls."""
    from neuron_infer.compile import builder

    real, calls = builder.compile_model, []

    def compile_eager(*args, **kwargs):
        calls.append(args)
        kwargs["backend"] = "cpu-eager"
        return real(*args, **kwargs)

    monkeypatch.setattr(builder, "compile_model", compile_eager)
    monkeypatch.setattr(api, "compile_model", compile_eager)
    return calls


def test_the_module_docstring_example_runs(tiny_dirs, tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", api.__doc__, re.DOTALL).group(1)
    assert "compile_model(" in code and "CompiledModel.load(" in code and ".tokens_per_s" in code
    eager_compiles(monkeypatch)
    monkeypatch.chdir(tmp_path)
    before = torch.get_num_threads()
    try:
        exec(compile(code.replace("path/to/hf-model", str(tiny_dirs("tied"))), "api.__doc__", "exec"), {})
    finally:
        torch.set_num_threads(before)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].endswith(" tokens/s") and (tmp_path / "artifacts/m/manifest.json").is_file()


def test_default_compiles_once_into_the_cache_and_reuses_it(tiny_dirs, tmp_path, monkeypatch):
    import neuron_infer.embedded as embedded
    from neuron_infer.presets import default_artifact_dir

    monkeypatch.setenv("NEURON_INFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "default_model_dir", lambda log=None: tiny_dirs("gqa"))
    calls = eager_compiles(monkeypatch)
    m = CompiledModel.default(TINY_BUILD)
    assert len(calls) == 1 and m.root.parent == tmp_path / "cache" / "artifacts"
    assert m.root == default_artifact_dir(TINY_BUILD, lambda _m: None)  # the directory the CLI uses
    again = CompiledModel.default(TINY_BUILD)
    assert len(calls) == 1 and again.root == m.root
    ids = [5, 6, 7, 8]
    assert (again.generate_ids([ids], 8, ignore_eos=True).outputs[0].token_ids
            == CompiledModel.load(m.root).generate_ids([ids], 8, ignore_eos=True).outputs[0].token_ids)


def test_threads_parameter_sets_torch_threads_and_rejects_nonsense(tiny_dirs, tmp_path, monkeypatch):
    eager_compiles(monkeypatch)
    api.compile_model(tiny_dirs("gqa"), tmp_path / "a", TINY_BUILD, say=lambda _m: None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        CompiledModel.load(tmp_path / "a", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, 1.5, True, "many"):
        with pytest.raises(NeuronInferError, match="must be an int >= 1 or 'auto'"):
            CompiledModel.load(tmp_path / "a", threads=bad)


def test_metrics_properties_match_the_json_record(tiny_dirs, tmp_path, monkeypatch):
    eager_compiles(monkeypatch)
    api.compile_model(tiny_dirs("gqa"), tmp_path / "a", TINY_BUILD.replace(batch_size=1), say=lambda _m: None)
    out = CompiledModel.load(tmp_path / "a").generate_ids([[5, 6, 7], [9, 10]], 6, ignore_eos=True)
    m = out.to_dict()["metrics"]
    assert (out.ttft_s, out.tokens_per_s, out.ms_per_token) == (m["ttft_s"], m["tokens_per_s"], m["ms_per_token"])
    assert len(out.metrics) == 1  # one run: the second prompt takes the row the first one freed
    assert out.tokens_per_s == pytest.approx(out.metrics[0].tokens_per_s)
