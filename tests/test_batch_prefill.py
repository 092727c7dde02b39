"""Several prompts encoded in one graph call (Engine.prefill_rows, the batched prefill shape class of CPU builds with
batch_size >= 2) against the same pieces encoded one by one (Engine.prefill_row): the logits, the K/V written at every
real position, the blocks of other rows, and whole generations through the runner."""
from __future__ import annotations

import random

import pytest
import torch

from neuron_infer.artifact import plan
from neuron_infer.artifact.plan import batch_context_graphs, planned_graphs, shape_class
from neuron_infer.compile.builder import compile_model
from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import load_rank

# batch 3: the batched prefill class serves 2..3 rows, the decode class 2..3 (a range inside the fp32 GEMV rows)
BUILD = BuildConfig(dtype="fp32", batch_size=3, max_context_length=48, max_length=96, context_buckets=(16, 32, 48),
                    tokengen_buckets=(32, 64, 96))


def test_only_cpu_builds_of_several_rows_plan_a_batched_prefill_graph():
    for build, want in ((BUILD, ["context_b3_t48_s48"]), (BUILD.replace(batch_size=1), []),
                        (BUILD.replace(target="neuron"), [])):
        assert [g.name for g in batch_context_graphs(build)] == want
        assert set(want) <= {g.name for g in planned_graphs(build)}
    cls = shape_class(batch_context_graphs(BUILD.replace(batch_size=8))[0], BUILD.replace(batch_size=8))
    assert cls.name == "prefill_b2-8"
    assert cls.dynamic[plan.IDS] == {0: ("batch", 2, 8), 1: ("tokens", 2, 48)}
    assert cls.dynamic[plan.LOGIT_INDEX] == {0: ("batch", 2, 8)}  # one logit row per prompt: its last token
    assert shape_class(batch_context_graphs(BUILD.replace(batch_size=2))[0], BUILD).name == "prefill_b2"


@pytest.fixture(scope="module")
def engines(tiny_dirs, tmp_path_factory):
    """fp32 and bf16 artifacts of BUILD (compiled graphs), and an fp32 one compiled without the batched graph."""
    root = tmp_path_factory.mktemp("batch_prefill")
    mp = pytest.MonkeyPatch()
    mp.setenv("NEURON_INFER_CACHE", str(root / "cache"))
    try:
        out = {}
        for dtype in ("fp32", "bf16"):
            compile_model(tiny_dirs("gqa"), root / dtype, BUILD.replace(dtype=dtype), say=lambda m: None)
            out[dtype] = root / dtype
        mp.setattr(plan, "batch_context_graphs", lambda build: [])  # as artifacts of builds before the graph
        compile_model(tiny_dirs("gqa"), root / "without", BUILD, say=lambda m: None)
        out["without"] = root / "without"
    finally:
        mp.undo()
    return out


def _pieces(vocab: int) -> list[tuple[int, list[int], int, int]]:
    """(slot, prompt, start, end): a whole prompt, a longer one, a one-token prompt, and a piece after 20 cached
    positions (a chunk, or a prefix-cache hit)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 41, 1, 37)]
    return [(0, prompts[0], 0, 5), (1, prompts[1], 0, 41), (2, prompts[2], 0, 1)], (0, prompts[3], 20, 37)


def _alone_and_together(engine, pieces):
    """Encode `pieces` one by one and then together from the same cache state -> (logits, caches) of each way."""
    k0, v0 = engine.k_cache.clone(), engine.v_cache.clone()
    alone = torch.stack([engine.prefill_row(s, p, a, b) for s, p, a, b in pieces])  # [n, V]
    caches_alone = engine.k_cache.clone(), engine.v_cache.clone()
    engine.k_cache.copy_(k0)
    engine.v_cache.copy_(v0)
    together = engine.prefill_rows(pieces)  # [n, V]
    return alone, together, caches_alone, (engine.k_cache.clone(), engine.v_cache.clone())


def _real_slots(engine, pieces) -> list[tuple[int, int]]:
    """(block, offset) of every position the pieces' real tokens wrote."""
    bs = engine.block_size
    return [(engine.slots[s][p // bs], p % bs) for s, _, a, b in pieces for p in range(a, b)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prompts_encoded_together_equal_each_encoded_alone(engines, dtype):
    """fp32: within 1e-5 of the logits' scale (the GEMMs and the attention's sums over a wider padded key range may
    group fp32 additions differently); bf16: bit-equal (the C kernel computes each row's sums in the same order
    for any row count up to 64, and the attention each row's own keys)."""
    engine = load_rank(engines[dtype])
    assert "context_b3_t48_s48" in engine.graphs
    engine.bind_stripes()
    first, chunk = _pieces(engine.vocab_size)
    engine.prefill_rows([(0, chunk[1], 0, 20)])  # the cached positions the chunk continues from
    for pieces in (first, [chunk, first[1]]):
        alone, together, (ka, va), (kt, vt) = _alone_and_together(engine, pieces)
        real = _real_slots(engine, pieces)
        blocks = torch.tensor([b for b, _ in real])
        offsets = torch.tensor([o for _, o in real])
        if dtype == "bf16":
            assert torch.equal(together, alone)
            assert torch.equal(kt[:, blocks, :, offsets], ka[:, blocks, :, offsets])
            assert torch.equal(vt[:, blocks, :, offsets], va[:, blocks, :, offsets])
        else:
            torch.testing.assert_close(together, alone, rtol=0, atol=1e-5 * float(alone.abs().max()))
            torch.testing.assert_close(kt[:, blocks, :, offsets], ka[:, blocks, :, offsets], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vt[:, blocks, :, offsets], va[:, blocks, :, offsets], rtol=1e-5, atol=1e-5)
        mine = {b for s, *_ in pieces for b in engine.slots[s]} | {0}  # the rows' blocks and the scratch block
        others = [b for b in range(engine.k_cache.shape[1]) if b not in mine]
        assert torch.equal(kt[:, others], ka[:, others]) and torch.equal(vt[:, others], va[:, others])


def test_generation_of_several_prompts_equals_row_by_row_and_alone(engines):
    """Through the runner (generate_ids admits the prompts together, so they are encoded in one call), fp32 with
    spread-out tiny-model logits: greedy and seeded tokens equal those of the same build encoding row by row (one
    generator serves a call's prompts, so seeded draws match only call for call); greedy tokens also equal each
    prompt generated alone."""
    together, row_by_row = load_rank(engines["fp32"]), load_rank(engines["without"])
    graph, calls = together.graphs["context_b3_t48_s48"], []
    together.graphs["context_b3_t48_s48"] = lambda *args: calls.append(args[0].shape) or graph(*args)
    rng = random.Random(1)
    prompts = [[rng.randrange(together.vocab_size) for _ in range(n)] for n in (3, 30, 12)]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.9, seed=4)):
        got, _ = generate_ids(together, prompts, 8, sampling, ignore_eos=True)
        want, _ = generate_ids(row_by_row, prompts, 8, sampling, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        if sampling.greedy:
            alone = [generate_ids(together, [p], 8, sampling, ignore_eos=True)[0][0].token_ids for p in prompts]
            assert [r.token_ids for r in got] == alone
    # the three prompts in one call each time, padded to the longest piece (the second run's prompts start after
    # the blocks the first one left in the prefix cache: 16 of the 30-token prompt's positions)
    assert calls == [(3, 30), (3, 14)]


def test_an_artifact_without_the_batched_graph_encodes_row_by_row(engines):
    without, fp32 = load_rank(engines["without"]), load_rank(engines["fp32"])
    assert "context_b3_t48_s48" not in without.graphs
    first, _ = _pieces(without.vocab_size)
    for engine in (without, fp32):
        engine.bind_stripes()
    want = fp32.prefill_rows(first)  # [3, V]
    torch.testing.assert_close(without.prefill_rows(first), want, rtol=0, atol=1e-5 * float(want.abs().max()))
