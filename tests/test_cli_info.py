"""`neuron-infer info`: a short human summary, the full record under --json, verification reported."""
import json

import pytest
from click.testing import CliRunner

from neuron_infer.artifact.manifest import read_manifest
from neuron_infer.cli import cli
from neuron_infer.cli_info import human_bytes
from neuron_infer.errors import ArtifactError
from tests.tiny_artifact import compile_tiny


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("info") / "a")


def on_disk(root):
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_summary_names_the_facts_a_user_asks_for(art):
    r = CliRunner().invoke(cli, ["info", str(art)])
    assert r.exit_code == 0, r.output
    m = read_manifest(art)
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines()[1:])
    rank0 = (art / "weights" / "rank0.safetensors").stat().st_size
    assert lines["dtype"] == "fp32" and lines["quant"] == "none"
    assert lines["tp"] == f"1  (weights per rank: {human_bytes(rank0)})"
    assert lines["buckets"].startswith("context 64, 256 (max prompt 256); token generation 320 (max length 320)")
    assert "2 layers, hidden 96, 4 heads / 2 KV heads, vocab 512" in lines["model"]
    assert f"backend {m.backend}" in lines["graphs"]
    assert f"neuron_infer {m.versions['neuron_infer']}" in lines["versions"]
    assert lines["verified"].startswith("yes")
    assert f"({sum(1 for p in art.rglob('*') if p.is_file())} files)" in lines["size"]
    assert len(r.stdout.splitlines()) <= 14  # short: the manifest's file hashes are not listed


def test_json_is_the_full_record_on_one_line(art):
    r = CliRunner().invoke(cli, ["info", str(art), "--json"])
    assert r.exit_code == 0 and r.stdout.count("\n") == 1
    d = json.loads(r.stdout)
    m = read_manifest(art)
    assert d["build"] == json.loads(json.dumps(m.build.to_dict())) and d["files"] == m.files and d["graphs"] == m.graphs
    assert d["verified"] is True and d["verify_error"] is None and d["size_bytes"] == on_disk(art)


def test_a_corrupted_file_prints_the_summary_then_fails(art, tmp_path):
    import shutil

    dst = tmp_path / "a"
    shutil.copytree(art, dst)
    w = dst / "weights" / "rank0.safetensors"
    w.write_bytes(w.read_bytes()[:-1] + b"\0")
    r = CliRunner().invoke(cli, ["info", str(dst)])
    assert "verified     NO" in r.stdout
    assert isinstance(r.exception, ArtifactError) and "rank0.safetensors is corrupted" in str(r.exception)
    r = CliRunner().invoke(cli, ["info", str(dst), "--no-verify"])
    assert r.exit_code == 0 and "verified     yes" in r.stdout


def test_a_quantized_tp2_artifact_shows_each_rank_and_the_compression(tiny_dirs, tmp_path):
    from neuron_infer.api import compile_model
    from neuron_infer.config import QuantConfig
    from tests.tiny_artifact import CLI_BUILD

    build = CLI_BUILD.replace(tp_degree=2, quant=QuantConfig(scheme="int8"))
    compile_model(tiny_dirs("gqa"), tmp_path / "a", build, backend="cpu-eager", say=lambda _m: None)
    r = CliRunner().invoke(cli, ["info", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines()[1:])
    sizes = [human_bytes((tmp_path / "a" / "weights" / f"rank{i}.safetensors").stat().st_size) for i in (0, 1)]
    assert lines["tp"] == f"2  (weights per rank: {sizes[0]}, {sizes[1]})"
    report = read_manifest(tmp_path / "a").extra.quant
    assert lines["quant"].startswith("int8 (linear weights") and f"{report['compression']:.2f}x" in lines["quant"]


def test_graph_count_names_the_shape_class_graphs():
    from neuron_infer.cli_info import _graph_count

    assert _graph_count({"a": {}, "b": {}}) == "2"
    shared = {"context_t64_s64": {"graph": "prefill"}, "context_t128_s128": {"graph": "prefill"},
              "tokengen_t1_s256": {"graph": "decode_b1_t1"}}
    assert _graph_count(shared) == "2 serving 3 buckets (decode_b1_t1, prefill)"
