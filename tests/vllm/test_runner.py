"""SlotRunner (continuous batching over cache rows) against the runtime's own `generate_ids`, request by request.

No vLLM needed. The reference for every request is `generate_ids` on that request ALONE (batch-1 artifact); the
runner serves the same requests interleaved in a batch-4 artifact with joins and leaves at different steps and row
reuse. fp32 + the tiny checkpoints (spread-out logits): greedy tokens must be identical; seeded sampling draws the
same numbers (one generator per request, one uniform per token in both paths), so it is identical too.

`Served` plays vLLM's block manager as the worker sees it: blocks are allocated only for the positions scheduled so
far (no lookahead: vLLM reserves none without its own speculative config), come from a FIFO free list (so a freed
block soon serves another request) and go back when a request leaves.
"""
from __future__ import annotations

from collections import deque

import pytest
import torch

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig, SpeculationConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.options import RunOptions
from neuron_infer.vllm_plugin.runner import SlotRunner

BUILD = BuildConfig(dtype="fp32", batch_size=4, max_context_length=64, max_length=128, context_buckets=(32, 64),
                    tokengen_buckets=(64, 128))


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    out = {}
    for bs in (1, 4):
        d = tmp_path_factory.mktemp(f"b{bs}") / "a"
        compile_model(tiny_dirs("gqa"), d, BUILD.replace(batch_size=bs), backend="cpu-eager", say=lambda m: None)
        out[bs] = CompiledModel.load(d)
    return out


class Served:
    """A SlotRunner fed block ids the way vLLM's scheduler hands them out (see the module docstring)."""

    def __init__(self, runner: SlotRunner):
        self.runner, self.bs = runner, runner.engine_cache.block_size
        self.free = deque(range(1, runner.engine_cache.blocks))
        self.held: dict[str, list[int]] = {}

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def cover(self, rid: str, positions: int) -> list[int]:
        """New blocks so that `rid` holds its first `positions` positions."""
        held = self.held.setdefault(rid, [])
        new = [self.free.popleft() for _ in range(-(-positions // self.bs) - len(held))]
        held += new
        return new

    def admit(self, rid, prompt, sampling, prompt_len=None, logprobs=None):
        return self.runner.admit(rid, prompt, sampling, self.cover(rid, len(prompt)), prompt_len=prompt_len,
                                 logprobs=logprobs)

    def join(self, rid, prompt, sampling):
        self.runner.join(rid, prompt, sampling, [])

    def encode(self, rid, upto):
        return self.encode_all({rid: upto})[rid]

    def encode_all(self, upto: dict):
        """This step's prompt chunks of every request still encoding, in one call (as the worker sends them)."""
        for rid, end in upto.items():
            self.runner.extend(rid, self.cover(rid, end))
        return self.runner.encode(upto)

    def decode(self, rids):
        for r in rids:  # the pending token's position
            self.runner.extend(r, self.cover(r, len(self.runner.slots[r])))
        return self.runner.decode(rids)

    def release(self, rid):
        self.free.extend(self.held.pop(rid, []))
        return self.runner.release(rid)


def alone(model, prompt, n, sampling):
    res, _ = generate_ids(model.engine, [prompt], n, sampling, ignore_eos=True)
    return res[0].token_ids


# (join step, prompt, tokens to generate, sampling)
SCHEDULE = [
    (0, list(range(7, 27)), 12, SamplingConfig()),
    (0, [3, 99, 150, 4], 5, SamplingConfig(temperature=0.8, top_k=50, seed=11)),
    (2, list(range(40, 80)), 9, SamplingConfig()),
    (3, [200] * 33, 7, SamplingConfig(temperature=1.2, top_p=0.9, seed=5)),
    (4, [12, 13], 10, SamplingConfig()),  # joins once a row is free
    (6, list(range(100, 164)), 6, SamplingConfig(temperature=0.7, seed=2)),  # 64 tokens: largest context bucket
]


def test_interleaved_requests_equal_each_request_alone(models):
    runner = Served(SlotRunner(models[4].engine))
    got: dict[int, list[int]] = {}
    want = {i: alone(models[1], p, n, s) for i, (_, p, n, s) in enumerate(SCHEDULE)}
    waiting, step, rows_used = list(enumerate(SCHEDULE)), 0, set()
    while waiting or runner.active:
        running = [str(i) for i in got if str(i) in runner.slots]
        for rid, toks in runner.decode(running).items():  # decode first, then admit (see runner docstring)
            assert len(toks) == 1  # no draft model: one token per request per step
            got[int(rid)].extend(toks)
        for i, (join, prompt, n, s) in list(waiting):
            if join <= step and runner.active < runner.batch:
                got[i] = [runner.admit(str(i), prompt, s)]
                rows_used.add(runner.slots[str(i)].row)
                waiting.remove((i, (join, prompt, n, s)))
        for i in list(got):
            if str(i) in runner.slots and len(got[i]) >= SCHEDULE[i][2]:
                runner.release(str(i))
        step += 1
    assert got == want
    assert rows_used == {0, 1, 2, 3}


def test_prompts_sent_in_chunks_equal_each_request_alone(models):
    """A prompt arriving in chunks (as vLLM's chunked prefill would send it: 13 tokens per step, crossing block
    boundaries) while the others decode gets no token until its last chunk, then equals its run alone. A step's
    chunks of several requests are encoded in one call of the batched prefill graph."""
    assert "context_b4_t64_s64" in models[4].engine.graphs
    runner = Served(SlotRunner(models[4].engine))
    want = {i: alone(models[1], p, n, s) for i, (_, p, n, s) in enumerate(SCHEDULE)}
    got: dict[int, list[int]] = {}
    sent: dict[int, int] = {}  # prompt tokens sent so far, per request still encoding
    waiting, step, partial, batched = list(enumerate(SCHEDULE)), 0, 0, 0
    while waiting or runner.active:
        running = [str(i) for i in got if str(i) in runner.slots and i not in sent]
        for rid, toks in runner.decode(running).items():
            got[int(rid)].extend(toks)
        for i, (join, prompt, n, s) in list(waiting):
            if join <= step and runner.active < runner.batch:
                runner.join(str(i), prompt, s)
                got[i], sent[i] = [], 0
                waiting.remove((i, (join, prompt, n, s)))
        for i in sent:
            sent[i] = min(sent[i] + 13, len(SCHEDULE[i][1]))
        firsts = runner.encode_all({str(i): end for i, end in sent.items()}) if sent else {}
        batched += len(firsts) > 1
        for i in list(sent):
            first = firsts[str(i)]
            assert len(first) == (sent[i] == len(SCHEDULE[i][1]))
            partial += not first
            got[i].extend(first)
            if first:
                del sent[i]
        for i in list(got):
            if str(i) in runner.slots and len(got[i]) >= SCHEDULE[i][2]:
                runner.release(str(i))
        step += 1
    assert got == want
    assert partial == 10  # prompts of 20, 40, 33 and 64 tokens: 1 + 3 + 2 + 4 partial chunks
    assert batched > 0  # steps whose chunks of several requests went through one (batched prefill) call


def test_runner_errors_name_the_fix(models):
    runner = Served(SlotRunner(models[1].engine))
    with pytest.raises(NeuronInferError, match="larger max_context_length"):
        runner.admit("a", list(range(65)), SamplingConfig())
    first = runner.admit("a", [5, 6], SamplingConfig())
    with pytest.raises(NeuronInferError, match="already in the batch"):
        runner.admit("a", [5], SamplingConfig())
    with pytest.raises(NeuronInferError, match="--max-num-seqs <= 1"):
        runner.admit("b", [5], SamplingConfig())
    assert runner.release("a") == [5, 6, first] and runner.active == 0
    runner.admit("b", [5], SamplingConfig())  # the freed row is reused
    assert runner.release("unknown") is None


def test_agree_decides_the_tokens_every_step_uses(models):
    """Tensor parallelism: the tokens of each step go through `agree` (rank 0's broadcast in the worker) and the
    agreed ones, not the locally sampled ones, are appended and fed back."""
    calls = []

    def agree(t):  # [n] sampled here -> [n] the group's decision (here: always token 7)
        calls.append(t.tolist())
        return torch.full_like(t, 7)

    runner = Served(SlotRunner(models[4].engine, agree=agree))
    assert runner.admit("a", [5, 6, 9], SamplingConfig()) == 7
    assert runner.admit("b", [3], SamplingConfig(temperature=0.9, seed=1)) == 7
    assert runner.decode(["a", "b"]) == {"a": [7], "b": [7]}
    assert runner.slots["a"].tokens == [5, 6, 9, 7, 7] and runner.slots["b"].tokens == [3, 7, 7]
    assert [len(c) for c in calls] == [1, 1, 2]  # one exchange per admission, one per decode step
    plain = Served(SlotRunner(models[4].engine))  # without agree: the locally sampled greedy token
    assert plain.admit("a", [5, 6, 9], SamplingConfig()) == calls[0][0]


def test_row_choice_does_not_depend_on_release_order(models):
    """vLLM hands finished request ids over as a set, iterated in a per-process order: tensor-parallel ranks
    release rows in different orders and must still give the next request the same row."""
    rows = []
    for order in (["a", "b", "c"], ["c", "a", "b"]):
        runner = Served(SlotRunner(models[4].engine))
        for r in ("a", "b", "c", "d"):
            runner.admit(r, [5, 6], SamplingConfig())
        for r in order:
            runner.release(r)
        runner.admit("e", [7], SamplingConfig())
        rows.append(runner.slots["e"].row)
    assert rows == [0, 0]


# ---- speculative artifact (draft compiled in, fused graph): 1..K+1 tokens per request per step -------------------
SPEC_SCHEDULE = [  # greedy requests must equal the non-speculative reference; sampled ones force plain steps
    (0, list(range(7, 27)), 40, SamplingConfig()),
    (0, [3, 99, 150, 4], 20, SamplingConfig()),
    (2, list(range(40, 104)), 62, SamplingConfig()),  # 64 + 62 = 126 of 128: runs into the tail
    (3, [200] * 9, 6, SamplingConfig(temperature=0.8, top_k=50, seed=11)),  # two sampled requests with ...
    (4, [12, 13], 16, SamplingConfig()),
    (5, [9] * 12, 8, SamplingConfig(temperature=0.8, top_k=50, seed=3)),  # ... the same rule: one sample graph
    (5, [4, 5, 6], 5, SamplingConfig(temperature=1.1, seed=4)),  # a different rule: plain fallback steps
]


@pytest.fixture(scope="module")
def spec_model(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("spec") / "a"
    build = BUILD.replace(speculation=SpeculationConfig("self", 3, fused=True, draft_layers=1))
    compile_model(tiny_dirs("gqa"), d, build, backend="cpu-eager", say=lambda m: None)
    return CompiledModel.load(d)


def run_schedule(runner, schedule):
    """Drive `runner` like the worker does (decode, then admit, then release finished); trims overshoot."""
    got: dict[int, list[int]] = {}
    waiting, step = list(enumerate(schedule)), 0
    while waiting or runner.active:
        running = [str(i) for i in got if str(i) in runner.slots]
        for rid, toks in runner.decode(running).items():
            got[int(rid)].extend(toks)
        for i, (join, prompt, n, s) in list(waiting):
            if join <= step and runner.active < runner.batch:
                got[i] = [runner.admit(str(i), prompt, s)]
                waiting.remove((i, (join, prompt, n, s)))
        for i in list(got):
            if str(i) in runner.slots and len(got[i]) >= schedule[i][2]:
                runner.release(str(i))
                got[i] = got[i][: schedule[i][2]]  # vLLM trims a block at max_tokens the same way
        step += 1
    return got


def test_speculative_runner_greedy_equals_non_speculative(spec_model, models):
    assert spec_model.spec is not None and spec_model.spec.mode == "fused"
    runner = Served(SlotRunner(spec_model.engine, spec_model.spec))
    got = run_schedule(runner, SPEC_SCHEDULE)
    for i, (_, prompt, n, s) in enumerate(SPEC_SCHEDULE):
        assert len(got[i]) == n
        if s.greedy:
            assert got[i] == alone(models[1], prompt, n, s), f"request {i}"
    st = runner.stats
    assert st.spec_steps > 0 and st.plain_steps > 0  # both kinds of step ran (mixed rules, tail)
    assert 0 < st.accepted < st.drafted  # a 1-layer self-draft: some accepted, some rejected


def test_speculation_under_tensor_parallelism_agrees_on_each_sampled_steps_uniforms(spec_model):
    """Every rank must draft from rank 0's uniforms (runtime/runner.py): here `agree` hands back constant uniforms,
    as if rank 0 had drawn them, and the tokens must follow them rather than the step's own draws."""
    shapes = []

    def agree(t):
        shapes.append(tuple(t.shape))
        return t if t.dim() == 1 else torch.full_like(t, 0.25)  # [B, 3K+1]: "rank 0's" uniforms

    sampled = [(0, [200] * 9, 12, SamplingConfig(temperature=0.8, top_k=50, seed=11))]
    got = run_schedule(Served(SlotRunner(spec_model.engine, spec_model.spec, agree=agree)), sampled)
    k = spec_model.spec.k
    assert (spec_model.engine.build.batch_size, 3 * k + 1) in shapes  # the uniforms went through agree
    own = run_schedule(Served(SlotRunner(spec_model.engine, spec_model.spec)), sampled)
    assert got != own  # ... and were used: the step's own draws would have given other tokens


def test_speculative_runner_seeded_sampling_is_reproducible(spec_model):
    sampled = [(0, [200] * 9, 12, SamplingConfig(temperature=0.8, top_k=50, seed=11)),
               (0, [9] * 5, 12, SamplingConfig(temperature=0.8, top_k=50, seed=3))]
    a = run_schedule(Served(SlotRunner(spec_model.engine, spec_model.spec)), sampled)
    b = run_schedule(Served(SlotRunner(spec_model.engine, spec_model.spec)), sampled)
    greedy = run_schedule(Served(SlotRunner(spec_model.engine, spec_model.spec)), [(0, p, n, SamplingConfig())
                                                                             for _, p, n, _ in sampled])
    assert a == b and a != greedy


@pytest.mark.parametrize("sampling", [
    SamplingConfig(repetition_penalty=1.6, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingConfig(temperature=0.9, min_p=0.05, presence_penalty=2.0, frequency_penalty=1.5, seed=4),
])
def test_a_resumed_request_keeps_its_output_apart_for_the_penalties(models, sampling):
    """Preemption re-admits prompt + output; with `prompt_len` the presence / frequency penalties still count only
    the output, so the continuation equals the uninterrupted run (greedy; seeded: the generator restarts, so only
    the greedy case compares tokens after the resume)."""
    prompt = [5, 9, 9, 14, 3]
    runner = Served(SlotRunner(models[4].engine))
    got = [runner.admit("r", prompt, sampling)]
    for _ in range(3):
        got += runner.decode(["r"])["r"]
    tokens = runner.release("r")
    assert tokens == prompt + got
    got.append(runner.admit("r", tokens, sampling, prompt_len=len(prompt)))
    assert runner.slots["r"].prompt == prompt and runner.slots["r"].output == got
    if not sampling.greedy:
        return
    for _ in range(4):
        got += runner.decode(["r"])["r"]
    assert got == alone(models[1], prompt, 9, sampling)


# ---- logprobs: records per request, taken every step like the worker does ---------------------------------------
LOGPROB_SCHEDULE = [  # (join step, prompt, tokens, sampling, logprobs)
    (0, list(range(7, 27)), 8, SamplingConfig(), 3),
    (0, [3, 99, 150, 4], 6, SamplingConfig(temperature=0.8, top_k=50, seed=11), 1),
    (1, list(range(40, 60)), 7, SamplingConfig(), None),
    (2, [12, 13], 5, SamplingConfig(temperature=1.1, seed=4), 0),
]


def test_logprob_records_equal_each_request_alone(models):
    runner = Served(SlotRunner(models[4].engine))
    got: dict[int, list[int]] = {}
    recs: dict[int, list[dict]] = {}
    waiting, step = list(enumerate(LOGPROB_SCHEDULE)), 0
    while waiting or runner.active:
        running = [str(i) for i in got if str(i) in runner.slots]
        for rid, toks in runner.decode(running).items():
            got[int(rid)].extend(toks)
        for i, (join, prompt, n, s, lp) in list(waiting):
            if join <= step and runner.active < runner.batch:
                got[i] = [runner.admit(str(i), prompt, s, logprobs=lp)]
                waiting.remove((i, (join, prompt, n, s, lp)))
        for i in list(got):
            new = runner.take_logprobs(str(i))
            assert len(new) == (1 if LOGPROB_SCHEDULE[i][4] is not None and str(i) in runner.slots else 0)
            recs.setdefault(i, []).extend(new)
            if str(i) in runner.slots and len(got[i]) >= LOGPROB_SCHEDULE[i][2]:
                runner.release(str(i))
        step += 1
    for i, (_, prompt, n, s, lp) in enumerate(LOGPROB_SCHEDULE):
        (want,), _ = generate_ids(models[1].engine, [prompt], n, s, ignore_eos=True, logprobs=lp)
        assert got[i] == want.token_ids, f"request {i}"
        if lp is None:
            assert recs[i] == []
            continue
        assert [r["token_id"] for r in recs[i]] == got[i] and [r["rank"] for r in recs[i]] == [
            r["rank"] for r in want.logprobs]
        for r, w in zip(recs[i], want.logprobs):  # batch-4 vs batch-1 graphs: fp32 sums may round differently
            assert len(r["top"]) == lp and [t for t, _ in r["top"]] == [t for t, _ in w["top"]]
            assert r["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
            assert [v for _, v in r["top"]] == pytest.approx([v for _, v in w["top"]], abs=1e-5)


def test_a_logprobs_request_makes_speculative_steps_plain(spec_model, models):
    runner = Served(SlotRunner(spec_model.engine, spec_model.spec))
    prompt = list(range(7, 27))
    got = {"a": [runner.admit("a", [3, 99, 150, 4], SamplingConfig())],
           "b": [runner.admit("b", prompt, SamplingConfig(), logprobs=2)]}
    recs = runner.take_logprobs("b")
    for _ in range(6):
        out = runner.decode(["a", "b"])
        assert [len(out["a"]), len(out["b"])] == [1, 1]  # plain: one token each, though "a" could speculate
        recs += runner.take_logprobs("b")
        for r in out:
            got[r] += out[r]
    assert runner.stats.spec_steps == 0 and runner.take_logprobs("a") == []
    (want,), _ = generate_ids(models[1].engine, [prompt], 7, SamplingConfig(), ignore_eos=True, logprobs=2)
    assert got["b"] == want.token_ids and [r["token_id"] for r in recs] == got["b"]
    assert [r["rank"] for r in recs] == [1] * 7  # greedy: the sampled token is the most likely
    runner.release("b")
    for _ in range(3):
        runner.decode(["a"])
    assert runner.stats.spec_steps > 0  # without it, "a" speculates again


# ---- vLLM's block manager drives the cache: prefix-cache hits and block room for speculation ----------------------
def test_a_prefix_cache_hit_encodes_only_the_rest_and_equals_alone(models, monkeypatch):
    """vLLM's prefix caching hands a request the blocks of a prefix another request wrote (still running here) and
    `num_computed_tokens` = their positions: only the rest is encoded, into the request's own blocks, and both
    requests still equal their runs alone."""
    engine = models[4].engine
    encoded = []
    real = engine.prefill_row

    def counting(slot, prompt, start=0, end=None):
        encoded.append((start, len(prompt) if end is None else end))
        return real(slot, prompt, start, end)

    monkeypatch.setattr(engine, "prefill_row", counting)
    runner = Served(SlotRunner(engine))
    bs = runner.bs
    a = list(range(7, 7 + bs + 9))  # one full block + 9 tokens
    b = a[:bs] + [200, 201, 3, 4, 5]  # the same first block, then its own tokens
    got = {"a": [runner.admit("a", a, SamplingConfig())]}
    for _ in range(3):
        got["a"] += runner.decode(["a"])["a"]
    shared = runner.held["a"][:1]
    runner.held["b"] = list(shared)  # vLLM's hit: the block is shared, not copied
    runner.runner.join("b", b, SamplingConfig(), shared + runner.cover("b", len(b)), computed=bs)
    encoded.clear()
    got["b"] = runner.runner.encode({"b": len(b)})["b"]
    assert encoded == [(bs, len(b))]  # the cached block is not encoded again
    for _ in range(5):
        for r, toks in runner.decode(["a", "b"]).items():
            got[r] += toks
    assert got["a"] == alone(models[1], a, 9, SamplingConfig())
    assert got["b"] == alone(models[1], b, 6, SamplingConfig())


def test_blocks_from_the_caller_are_checked(models):
    runner = SlotRunner(models[4].engine)
    n, bs = runner.engine_cache.blocks, runner.engine_cache.block_size
    with pytest.raises(NeuronInferError, match=f"block id {n} is outside the KV cache's blocks 1..{n - 1}"):
        runner.join("a", [5, 6, 7], SamplingConfig(), [1, n])
    assert runner.active == 0 and runner.scheduler.free_rows == 4  # the refused request took no row
    with pytest.raises(NeuronInferError, match="whole blocks"):
        runner.join("b", list(range(bs + 3)), SamplingConfig(), [1, 2], computed=5)
    with pytest.raises(NeuronInferError, match="leave a token"):
        runner.join("c", list(range(bs)), SamplingConfig(), [1], computed=bs)


def test_speculation_waits_for_blocks_that_hold_the_draft_positions(spec_model, models):
    """vLLM allocates blocks for the scheduled tokens only; the K draft positions of a speculative step must lie
    in the row's own blocks (past them the table names the shared scratch block), else the step is plain."""
    runner = SlotRunner(spec_model.engine, spec_model.spec)
    bs, k = runner.engine_cache.block_size, spec_model.spec.k
    prompt = list(range(7, 7 + bs - 2))
    got = [runner.admit("a", prompt, SamplingConfig(), [1])]  # bs - 1 tokens: the pending one is the last but one
    got += runner.decode(["a"])["a"]
    assert len(got) == 2 and runner.stats.spec_steps == 0  # its K draft positions would cross into the next block
    runner.extend("a", [2])
    got += runner.decode(["a"])["a"]
    assert runner.stats.spec_steps == 1 and 3 <= len(got) <= k + 2
    assert got == alone(models[1], prompt, len(got), SamplingConfig())


def test_engine_prefix_cache_is_off_whatever_the_options_say(models):
    """vLLM's block manager owns prefix caching through the plugin: the engine's own pool must not also match and
    share prompt blocks, whatever RunOptions a caller passes."""
    runner = SlotRunner(models[4].engine, options=RunOptions(prefix_caching=True))
    assert runner.runner.engine.pool.prefix_caching is False
