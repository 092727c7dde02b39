"""Fuzz every field of a checkpoint's config.json and of an artifact's manifest.json with values of the wrong
type or range: the CLI answers with exactly one `error:` line naming the field and exit status 2, never a
traceback. Mutations that are valid for a field (null where null means "the default", a float where a float
belongs, ...) are listed per field below and must not produce a traceback either.
"""
from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from neuron_infer.artifact.manifest import CHECKSUM, MANIFEST, seal
from tests.test_user_errors import TINY, cli

WRONG: list[Any] = ["abc", None, [1, 2], {"x": 1}, 2.7, -1, True]


def paths(d: dict, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path of a nested JSON object (objects are visited and also mutated as a whole)."""
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from paths(v, prefix + (k,))


def mutated(d: dict, path: tuple, value: Any) -> dict:
    d = copy.deepcopy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


def current(d: dict, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


def expect_named_error(code: int, lines: list[str], path: tuple) -> None:
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and not any("Traceback" in ln for ln in lines), (path, code, lines)
    assert str(path[-1]) in errors[0], (path, errors[0])


def expect_clean(code: int, lines: list[str], path: tuple) -> None:
    """Success, or one clean error line (a value of the right type may still not fit the weights)."""
    assert code in (0, 2) and not any("Traceback" in ln for ln in lines), (path, code, lines)
    if code == 2:
        assert sum(ln.startswith("error: ") for ln in lines) == 1, (path, lines)


# ---- config.json ------------------------------------------------------------------------------------------------

# Keys neuron-infer does not read (any value is accepted) and, per read key, the mutations that are valid values.
CONFIG_UNREAD = {"attention_dropout", "dtype", "initializer_range", "pad_token_id", "pretraining_tp",
                 "transformers_version", "use_cache"}
CONFIG_VALID = {
    "num_key_value_heads": [None], "head_dim": [None], "bos_token_id": [None], "eos_token_id": [None, [1, 2]],
    "rms_norm_eps": [2.7], "rope_parameters": [None], "rope_parameters.rope_theta": [2.7, None],
    "rope_parameters.rope_type": [None], "architectures": [None], "tie_word_embeddings": [True],
    "attention_bias": [True], "mlp_bias": [True],
}


def config_cases(tiny_dir: Path) -> Iterator[tuple[tuple, Any, bool]]:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    for path in paths(cfg):
        for value in WRONG:
            if value == current(cfg, path) and type(value) is type(current(cfg, path)):
                continue
            valid = path[0] in CONFIG_UNREAD or value in CONFIG_VALID.get(".".join(path), [])
            yield path, value, valid


def test_fuzz_config_json(tiny_dirs, tmp_path, capsys):
    src = tiny_dirs("gqa")
    base = json.loads((src / "config.json").read_text())
    model = tmp_path / "model"
    shutil.copytree(src, model)
    plan = ["plan", model, "--instance", "trn1.2xlarge", "--tp-degree", "1"]
    cases = list(config_cases(src))
    assert len(cases) > 100
    for path, value, valid in cases:
        (model / "config.json").write_text(json.dumps(mutated(base, path, value)))
        code, lines = cli(plan, capsys)  # parses config.json only: fast
        if valid:
            assert code == 0, (path, value, lines)
            continue
        expect_named_error(code, lines, path)
        out = tmp_path / "art"
        expect_named_error(*cli(["compile", model, "-o", out, *TINY], capsys), path)
        assert not out.exists()


# ---- manifest.json ----------------------------------------------------------------------------------------------

# Subtrees whose contents are free-form records (backend metadata, feature reports): any value is accepted or
# refused cleanly. Per typed field, the mutations that are valid values.
MANIFEST_FREE = {"extra"}
MANIFEST_VALID = {
    "versions.transformers": ["abc"], "checkpoint_fingerprint": ["abc"], "model.bos_token_id": [None],
    "model.eos_token_ids": [[1, 2]], "model.rms_norm_eps": [2.7], "model.rope_theta": [2.7],
    "model.tie_word_embeddings": [True], "model.attention_bias": [True], "model.mlp_bias": [True],
    "build.context_buckets": [None], "build.tokengen_buckets": [None], "build.quant.weight_tiling": [True],
    "build.kv_block_size": [None],  # unset: the default rule gives the same size
}


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory) -> Path:
    from neuron_infer.api import compile_model
    from neuron_infer.presets import load_preset

    out = tmp_path_factory.mktemp("fuzz") / "art"
    compile_model(tiny_dirs("gqa"), out, load_preset("tiny").build, backend="cpu-eager", say=lambda m: None)
    return out


def test_fuzz_manifest_json(artifact, capsys):
    base = json.loads((artifact / MANIFEST).read_text())
    generate = ["generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"]
    named = 0
    try:
        first_graph = min(base["graphs"])
        for path in paths(base):
            if path[0] == "graphs" and len(path) > 2 and path[1] != first_graph:
                continue  # the graph entries all have the same fields: fuzz one
            free = path[0] in MANIFEST_FREE or (path[0] == "graphs" and len(path) > 2)
            for value in (["abc", None] if free else WRONG):
                if value == current(base, path) and type(value) is type(current(base, path)):
                    continue
                edited = mutated(base, path, value)  # re-sealed: the fields are checked, not only the checksum
                (artifact / MANIFEST).write_text(json.dumps(edited if path == (CHECKSUM,) else seal(edited)))
                code, lines = cli(generate, capsys)
                graph_entry = path[0] == "graphs" and len(path) == 2 and isinstance(value, dict)  # any object
                if free or graph_entry or value in MANIFEST_VALID.get(".".join(path), []):
                    expect_clean(code, lines, path)
                else:
                    expect_named_error(code, lines, path)
                    named += 1
    finally:
        (artifact / MANIFEST).write_text(json.dumps(base))
    assert named > 200


# ---- rms_norm_eps: the model's own hyperparameter (as rope_theta) ------------------------------------------------
# Any finite number > 0 is a valid epsilon (transformers accepts it too); everything else is one error line, in
# config.json at compile time and in a manifest (re-sealed: the field's check, not the checksum) at load.
EPS_REFUSED = ["0", "0.0", "-0.0", "-1e-05", "-1", "1e-400", "NaN", "Infinity", "-Infinity", "1e400", "-1e400",
               "true", "false", '"1e-5"', "null", "[1e-05]", "{}", "9" * 30, "9" * 5000]
EPS_ACCEPTED = ["2.7", "1", "1e-300", "5e-324", "1e300", "1000000"]
DIGITS = {"9" * 30: "30 digits", "9" * 5000: "5000 digits"}  # refused by the JSON bounds, before any field


def raw_with(d: dict, section: str | None, text: str) -> str:
    """d as JSON text with (d[section] or d)["rms_norm_eps"] replaced by the raw JSON `text`."""
    d = copy.deepcopy(d)
    (d[section] if section else d)["rms_norm_eps"] = "@EPS@"
    return json.dumps(d).replace('"@EPS@"', text)


def sealed_manifest(base: dict, text: str) -> str:
    raw = raw_with(base, "model", text)
    try:
        return json.dumps(seal(json.loads(raw)))
    except ValueError:  # an integer Python's json refuses to read: the artifact's reader refuses it first
        return raw


@pytest.mark.parametrize("text", EPS_REFUSED, ids=[t[:12] for t in EPS_REFUSED])
def test_rms_norm_eps_that_is_not_a_finite_positive_number_is_one_error(tiny_dirs, artifact, tmp_path, capsys,
                                                                        text):
    from tests.test_user_errors import one_error

    word = DIGITS.get(text, "rms_norm_eps")
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    (model / "config.json").write_text(raw_with(json.loads((model / "config.json").read_text()), None, text))
    out = tmp_path / "art"
    one_error(*cli(["compile", model, "-o", out, *TINY], capsys), "config.json", word)
    assert not out.exists()
    base = json.loads((artifact / MANIFEST).read_text())
    try:
        (artifact / MANIFEST).write_text(sealed_manifest(base, text))
        one_error(*cli(["generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"], capsys), "manifest.json",
                  word)
    finally:
        (artifact / MANIFEST).write_text(json.dumps(base))


@pytest.mark.parametrize("text", EPS_ACCEPTED)
def test_any_finite_positive_rms_norm_eps_is_the_models_own(tiny_dirs, artifact, tmp_path, capsys, text):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    (model / "config.json").write_text(raw_with(json.loads((model / "config.json").read_text()), None, text))
    code, lines = cli(["plan", model, "--instance", "trn1.2xlarge", "--tp-degree", "1"], capsys)
    assert code == 0, lines
    base = json.loads((artifact / MANIFEST).read_text())
    try:
        (artifact / MANIFEST).write_text(sealed_manifest(base, text))
        code, lines = cli(["generate", artifact, "--prompt", "hi", "--max-new-tokens", "1"], capsys)
        assert code == 0, lines
    finally:
        (artifact / MANIFEST).write_text(json.dumps(base))
