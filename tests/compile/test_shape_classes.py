"""CPU graphs by shape class: one prefill graph for any prompt length, one decode graph per batch range, the compile
cache and the parallel workers (compile/builder.py, backends/graph_cache.py, compile/graph_workers.py)."""
from __future__ import annotations

import json

import pytest
import torch

from neuron_infer.artifact.plan import planned_graphs, shape_class
from neuron_infer.cache import prunable, remove, scan
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import load_rank

# fp32, buckets that force a block size of 16: prompts of 1..48 tokens, 5 context buckets, 3 decode buckets
BUILD = BuildConfig(dtype="fp32", max_context_length=48, max_length=96, context_buckets=(16, 32, 48),
                    tokengen_buckets=(32, 64, 96))


def test_classes_cover_every_bucket_with_few_graphs():
    for batch, want in ((1, {"prefill", "decode_b1_t1"}),
                        (4, {"prefill", "prefill_b2-4", "decode_b1_t1", "decode_b2-4_t1"}),
                        (12, {"prefill", "prefill_b2-12", "decode_b1_t1", "decode_b2-8_t1", "decode_b9-12_t1"})):
        build = BuildConfig(batch_size=batch, max_context_length=512, max_length=1024)
        classes = {s.name: shape_class(s, build) for s in planned_graphs(build)}
        assert {c.name for c in classes.values()} == want
        for spec in planned_graphs(build):  # the batch range of a decode class holds the bucket's batch
            dims = classes[spec.name].dynamic.get(0, {}).get(0)
            if spec.kind == "tokengen" and dims:
                assert dims[1] <= spec.batch <= dims[2]


@pytest.fixture(scope="module")
def compiled(tiny_dirs, tmp_path_factory):
    """One tiny artifact compiled through a fresh compile cache (both graphs missing: worker processes), a second
    one of the same build into another folder (both graphs from the cache), and the eager twin."""
    root = tmp_path_factory.mktemp("shape_classes")
    cache = root / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("NEURON_INFER_CACHE", str(cache))
    said: list[str] = []
    try:
        first = compile_model(tiny_dirs("gqa"), root / "a", BUILD, say=said.append)
        again: list[str] = []
        second = compile_model(tiny_dirs("gqa"), root / "b", BUILD, say=again.append)
        eager = compile_model(tiny_dirs("gqa"), root / "e", BUILD, backend="cpu-eager", say=lambda m: None)
        entries = scan(cache)
    finally:
        mp.undo()
    return {"root": root, "cache": cache, "first": first, "second": second, "eager": eager, "said": said,
            "again": again, "entries": entries}


def test_two_graph_files_serve_every_bucket(compiled):
    graphs = compiled["first"].graphs
    assert len(graphs) == len(planned_graphs(BUILD))
    assert {g["graph"] for g in graphs.values()} == {"prefill", "decode_b1_t1"}
    assert sorted((compiled["root"] / "a" / "graphs").glob("*.pt2")) == [
        compiled["root"] / "a" / "graphs" / "decode_b1_t1.pt2", compiled["root"] / "a" / "graphs" / "prefill.pt2"]
    assert any("2 worker processes" in line for line in compiled["said"]), compiled["said"]


def test_another_folder_reuses_the_cache_byte_for_byte(compiled):
    root = compiled["root"]
    assert all(g["cache"] == "miss" for g in compiled["first"].graphs.values())
    assert all(g["cache"] == "hit" for g in compiled["second"].graphs.values())
    assert not any("worker" in line for line in compiled["again"])
    for f in (root / "a" / "graphs").iterdir():
        assert (root / "b" / "graphs" / f.name).read_bytes() == f.read_bytes(), f.name


def test_cache_lists_graphs_and_prunes_only_its_own(compiled, tmp_path):
    graphs = [e for e in compiled["entries"] if e.kind == "graph"]
    assert len(graphs) == 2 and all(e.state == "current" for e in graphs)
    assert {e.kind for e in compiled["entries"]} <= {"graph", "kernel", "model"}
    # a stale entry (another package version) is pruned; a directory that only looks like an entry is not
    stale, foreign = tmp_path / "graphs" / ("a" * 32), tmp_path / "graphs" / ("b" * 32)
    for d in (stale, foreign):
        d.mkdir(parents=True)
    marker = json.loads((graphs[0].path / "neuron_infer_graph.json").read_text())
    (stale / "neuron_infer_graph.json").write_text(json.dumps({**marker, "versions": {"neuron_infer": "0.0.1"}}))
    (foreign / "notes.txt").write_text("mine")
    entries = scan(tmp_path)
    victims = prunable(entries, everything=False)
    assert [e.path for e in victims] == [stale]
    for e in victims:
        remove(e)
    assert not stale.exists() and (foreign / "notes.txt").read_text() == "mine"


def _prefill_logits(artifact, prompt, start=0):
    engine = load_rank(artifact)
    engine.bind_stripes()
    if start:
        engine.prefill_row(0, prompt, 0, start)
    return engine.prefill_row(0, prompt, start), engine


@pytest.mark.parametrize("length", [1, 2, 7, 9, 16, 17, 33, 48])
def test_prefill_of_any_length_equals_eager(compiled, length):
    """fp32: the compiled prefill graph (GEMM + SDPA at every length) against the eager model (few-row reductions up
    to 64 query rows): different summation orders, so 1e-4 relative to the logits' scale."""
    prompt = [(7 * i + 3) % 500 for i in range(length)]
    got, _ = _prefill_logits(compiled["root"] / "a", prompt)
    want, _ = _prefill_logits(compiled["root"] / "e", prompt)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_prefill_after_a_cached_prefix_and_decode_equal_eager(compiled):
    prompt = [(5 * i + 1) % 500 for i in range(40)]
    got, eng = _prefill_logits(compiled["root"] / "a", prompt, start=23)
    want, ref = _prefill_logits(compiled["root"] / "e", prompt, start=23)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    for step in range(50):  # decode across the 32- and 64-position buckets
        pos = torch.tensor([40 + step])
        tok = torch.tensor([int(want.argmax())])
        got, want = eng.decode(tok, pos)[0], ref.decode(tok, pos)[0]
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_prompt_lookup_verify_class_is_lossless(tiny_dirs, tmp_path, monkeypatch):
    """bf16, head dim 32 (the GEMV and attention kernels apply): one verify graph for every sequence length; greedy
    output with prompt lookup equals the same artifact's plain steps token for token (the verify pass computes what
    one-token steps compute, bit for bit)."""
    from neuron_infer.api import CompiledModel
    from neuron_infer.config import SpeculationConfig
    from tests.tiny_checkpoint import write_tiny_checkpoint

    monkeypatch.setenv("NEURON_INFER_CACHE", str(tmp_path / "cache"))
    ck = write_tiny_checkpoint(tmp_path / "ck", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, intermediate_size=256)
    build = BuildConfig(dtype="bf16", max_context_length=48, max_length=96, context_buckets=(16, 48),
                        tokengen_buckets=(32, 96), speculation=SpeculationConfig(draft_model="ngram", length=4))
    m = compile_model(ck, tmp_path / "a", build, say=lambda _m: None)
    verify = {n: g for n, g in m.graphs.items() if g.get("kind") == "verify"}
    assert len(verify) == 2 and {g["graph"] for g in verify.values()} == {"verify_b1_t5"}
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]  # repeats: the drafts get accepted
    spec = CompiledModel.load(tmp_path / "a", speculation_gate=False)  # speculate on every step that can
    want = spec.generate_ids([prompt], 60, ignore_eos=True, logprobs=0).outputs[0].token_ids  # logprobs: plain steps
    out = spec.generate_ids([prompt], 60, ignore_eos=True)
    assert out.outputs[0].token_ids == want
    assert out.metrics[0].spec_steps > 0 and out.metrics[0].accepted > 0  # the verify graph ran and drafts passed


class CountingGraph:
    """A compiled graph, counting its calls and recording each call's logit_index shape."""

    def __init__(self, graph):
        self.graph, self.shapes = graph, []

    def __call__(self, ids, pos, k, v, logit_index, table):
        self.shapes.append(tuple(logit_index.shape))
        return self.graph(ids, pos, k, v, logit_index, table)


def _scored(artifact, prompt, n=3):
    """Prompt logprobs of `prompt` from `artifact` -> (records, logit_index shapes of its context-graph calls)."""
    engine = load_rank(artifact)
    counted = {name: CountingGraph(g) for name, g in engine.graphs.items() if name.startswith("context")}
    engine.graphs = {**engine.graphs, **counted}
    got, _ = generate_ids(engine, [prompt], 1, prompt_logprobs=n, ignore_eos=True)
    return got[0], [s for g in counted.values() for s in g.shapes]


def test_prompt_logprobs_take_every_row_in_one_prefill_call(compiled):
    """The prefill class takes logit_index [1, R] (R >= 2 dynamic): a scored prompt's logits at all its positions
    come from one graph call, a normal prefill asks for its last row twice (R = 2). fp32, compiled vs eager: the
    logits differ by summation order (test_prefill_of_any_length_equals_eager), so logprobs within 1e-4 of a
    log-softmax over logits of scale ~1-10 (HF parity of the eager path: tests/test_prompt_logprobs.py)."""
    prompt = [(11 * i + 4) % 500 for i in range(40)]
    got, shapes = _scored(compiled["root"] / "a", prompt)
    want, _ = _scored(compiled["root"] / "e", prompt)
    assert shapes == [(1, 40)]  # one call, every position's row
    assert [r["token_id"] for r in got.prompt_logprobs] == prompt[1:]
    for a, b in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
        assert a["rank"] == b["rank"] and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert got.token_ids == want.token_ids
    _, plain = _scored(compiled["root"] / "a", prompt, n=None)
    assert plain == [(1, 2)]  # the last row, twice
