"""Chunked prefill: a prompt that joins while others decode is encoded a chunk per step, the others keep
stepping, and everything equals whole-prompt prefill (fp32, eager graphs, tiny checkpoints)."""
import pytest
import torch

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig, SpeculationConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.sampling import make_generator
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.runner import Runner
from neuron_infer.runtime.sequence import Sequence, StopRule

BUILD = BuildConfig(dtype="fp32", batch_size=2, max_context_length=64, max_length=128, context_buckets=(16, 32, 64),
                    tokengen_buckets=(64, 128), kv_block_size=16,
                    tokengen_batch_buckets=(2,))  # every decode step runs over both slots, encoding or not
LONG = [(i * 13) % 290 + 5 for i in range(60)]  # 60 tokens: 4 chunks of 16
PROMPTS = [list(range(7, 19)), [3, 99, 150], LONG]  # slots: 2; LONG waits for the short second one


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("chunks") / "a"
    compile_model(tiny_dirs("gqa"), d, BUILD, backend="cpu-eager", say=lambda m: None)
    return d


@pytest.fixture(scope="module")
def spec_artifact(tiny_dirs, tmp_path_factory):
    """The same model with an INT8 self-draft (K = 2): the target encodes in chunks, the draft catches up later."""
    d = tmp_path_factory.mktemp("chunks") / "spec"
    build = BUILD.replace(speculation=SpeculationConfig("self", 2, draft_quant="int8"))
    compile_model(tiny_dirs("gqa"), d, build, backend="cpu-eager", say=lambda m: None)
    return d


def _run(artifact, chunk: int, new: list[int]):
    """The generate loop over PROMPTS, prompt i stopping after new[i] tokens -> (token ids, each iteration's output
    lengths)."""
    m = CompiledModel.load(artifact)
    runner = Runner(m.engine, options=RunOptions(prefix_caching=False, prefill_chunk=chunk))
    seqs = [Sequence(i, p, SamplingConfig(), StopRule(max_new_tokens=n), make_generator(None))
            for i, (p, n) in enumerate(zip(PROMPTS, new))]
    for s in seqs:
        runner.scheduler.add(s)
    steps = []
    while runner.scheduler.has_work:
        running = runner.decoding()
        runner.step(running, running)
        runner.prefill(runner.scheduler.admit())
        runner.scheduler.release_finished()
        steps.append([len(s.output) for s in seqs])
    return [s.output for s in seqs], steps


def test_options_are_checked_and_default_to_a_bucket():
    assert RunOptions().chunk_tokens(BUILD) == 64  # the largest context bucket <= 256
    assert RunOptions().chunk_tokens(BuildConfig()) == 256  # buckets 128, 256, 512
    big = BuildConfig(max_context_length=1024, max_length=2048, context_buckets=(512, 1024))
    assert RunOptions().chunk_tokens(big) == 512  # none <= 256: the smallest
    assert RunOptions(prefill_chunk=0).chunk_tokens(BUILD) == 0
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(NeuronInferError, match="whole number of tokens"):
            RunOptions(prefill_chunk=bad)


@pytest.mark.parametrize("draft", [False, True])
def test_a_joining_prompt_is_chunked_and_the_running_sequence_keeps_stepping(artifact, spec_artifact, draft):
    """The 60-token prompt takes a slot when the second sequence finishes; with chunk 16 it gets its first token four
    loop iterations later while the first sequence gains a token (with a draft model: 1 to 3) in each of them. Whole
    prefill (chunk 0) gives it the first token at once; the tokens of both runs are identical, and with a draft
    model equal to the model's alone (greedy)."""
    whole, whole_steps = _run(spec_artifact if draft else artifact, 0, [30, 2, 8])
    chunked, steps = _run(spec_artifact if draft else artifact, 16, [30, 2, 8])
    assert chunked == whole
    if draft:
        assert chunked == _run(artifact, 0, [30, 2, 8])[0]

    def first_token_at(trace):
        return next(i for i, s in enumerate(trace) if s[2] > 0)

    assert first_token_at(whole_steps) < first_token_at(steps)
    start = first_token_at(whole_steps)  # the iteration the long prompt was admitted in (whole: encoded at once)
    assert first_token_at(steps) == start + 3  # chunks 16 + 16 + 16 + 12
    for i in range(start, start + 4):  # the running sequence was never stalled
        assert steps[i][0] > steps[i - 1][0] if draft else steps[i][0] == steps[i - 1][0] + 1


def test_chunks_write_the_cache_and_logits_of_whole_prefill(artifact):
    """Engine level: slot 0 whole, slot 1 in chunks at uneven boundaries (one crossing a block): the next-token
    logits and every K/V position of the prompt agree (fp32; the chunks only change the attention's summation
    order: 1e-5)."""
    m = CompiledModel.load(artifact, prefix_caching=False)
    eng = m.engine
    eng.bind(0, [1, 2, 3, 4])
    eng.bind(1, [5, 6, 7, 8])
    want = eng.prefill_row(0, LONG)
    for a, b in ((0, 7), (7, 23), (23, 40)):
        assert eng.prefill_row(1, LONG, a, b).shape == want.shape
    got = eng.prefill_row(1, LONG, 40)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    k0, v0 = eng.slot_kv(0)
    k1, v1 = eng.slot_kv(1)
    torch.testing.assert_close(k1[:, :, :60], k0[:, :, :60], rtol=0, atol=1e-5)
    torch.testing.assert_close(v1[:, :, :60], v0[:, :, :60], rtol=0, atol=1e-5)


def test_chunked_prefill_with_prefix_caching_and_a_small_cache(artifact):
    """Chunks start after the cached blocks of a prefix, and a prompt that waited for blocks is chunked too: every
    output equals its run alone."""
    gib = 10 * CompiledModel.load(artifact).engine.cache_shape.block_bytes() / 2**30  # 9 usable blocks: 1 at a time
    m = CompiledModel.load(artifact, prefill_chunk=16, kv_cache_gib=gib)
    prompts = [LONG[:40] + [1, 2], LONG, LONG[:33] + [9] * 20]
    got = [o.token_ids for o in m.generate_ids(prompts, 10, ignore_eos=True).outputs]
    solo = CompiledModel.load(artifact, prefix_caching=False, prefill_chunk=0)
    assert got == [solo.generate_ids([p], 10, ignore_eos=True).outputs[0].token_ids for p in prompts]
    assert m.engine.pool.hits > 0


def test_a_draft_model_chunks_and_reuses_cached_prefixes(tiny_dirs, tmp_path):
    """With a draft model the target encodes prompts in chunks and after cached prefix blocks; the draft catches up
    before the first speculative step. Greedy tokens equal the target alone (another artifact of the same weights,
    whole prompts, no prefix caching), and the run really chunked, hit the prefix cache and speculated."""
    spec_dir, plain_dir = tmp_path / "spec", tmp_path / "plain"
    build = BUILD.replace(speculation=SpeculationConfig("self", 2, draft_quant="int8"))
    compile_model(tiny_dirs("gqa"), spec_dir, build, backend="cpu-eager", say=lambda m: None)
    compile_model(tiny_dirs("gqa"), plain_dir, BUILD, backend="cpu-eager", say=lambda m: None)
    prompts = [LONG[:40] + [1, 2], [3, 99, 150], LONG, LONG[:33] + [9] * 20]  # the 3rd and 4th join while others run
    plain = CompiledModel.load(plain_dir, prefix_caching=False, prefill_chunk=0)
    want = [o.token_ids for o in plain.generate_ids(prompts, 12, ignore_eos=True).outputs]
    m = CompiledModel.load(spec_dir, prefill_chunk=16, speculation_gate=False)
    out = m.generate_ids(prompts, 12, ignore_eos=True)
    assert [o.token_ids for o in out.outputs] == want
    stats = out.metrics[0]
    assert m.engine.pool.hits > 0 and stats.spec_steps > 0 and stats.accepted > 0 and stats.draft_catch_up > 0