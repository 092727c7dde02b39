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
