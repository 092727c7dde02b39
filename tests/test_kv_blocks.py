"""The block KV cache: position -> (block, offset) mapping against a dense cache, the block pool's accounting, the
scheduler's admission by blocks, block tables across requests, and prefix caching (fp32, eager graphs, tiny
checkpoints)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint
from neuron_infer.config import BuildConfig, ModelConfig, SamplingConfig
from neuron_infer.errors import ConfigError, NeuronInferError
from neuron_infer.model.llama import CacheSlots
from neuron_infer.runtime.blocks import BlockPool, block_hashes
from neuron_infer.runtime.scheduler import Scheduler
from neuron_infer.runtime.sequence import Sequence, StopRule

BUILD = BuildConfig(dtype="fp32", batch_size=4, max_context_length=64, max_length=128, context_buckets=(32, 64),
                    tokengen_buckets=(64, 128), kv_block_size=16)
ROOT = Path(__file__).resolve().parents[1]
SHARED = [(i * 7) % 300 + 3 for i in range(40)]  # a 40-token prefix: two full blocks of 16


# ---- config ------------------------------------------------------------------------------------------------------
def test_block_size_default_and_validation():
    assert BuildConfig().block_size == 32  # CPU: buckets 128, 256, 512, blocks of at most 32
    assert BuildConfig(target="neuron").block_size == 128  # Neuron: at most 128
    assert BUILD.replace(kv_block_size=None).block_size == 32  # gcd(128, 32, 64, 128)
    with pytest.raises(ConfigError, match=r"kv_block_size=24 must be a positive divisor of every .* \[32, 64, 128\]"):
        BUILD.replace(kv_block_size=24)
    assert BUILD.default_kv_blocks == 4 * 128 // 16 + 1  # batch x max_length, plus the scratch block


# ---- model: writes and reads through the table -------------------------------------------------------------------
def _model(tiny_dirs):
    cfg = ModelConfig.from_model_dir(tiny_dirs("gqa"))
    return cfg, build_float_model(cfg, BuildConfig(dtype="fp32"), load_checkpoint(tiny_dirs("gqa"), cfg))


def test_block_cache_equals_a_dense_cache(tiny_dirs):
    """Two rows through scrambled block tables (bs 8) vs one dense row each (one block of 48 slots): same logits at
    prefill and every decode step, and each position's key lands in table[p // 8] at offset p % 8."""
    cfg, model = _model(tiny_dirs)
    ids = torch.randint(3, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))  # [B, T]
    dense_k = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, 48, cfg.head_dim)
    dense_v, dense_t = torch.zeros_like(dense_k), torch.tensor([[0], [1]])
    blk_k = torch.zeros(cfg.num_layers, 13, cfg.num_kv_heads, 8, cfg.head_dim)
    blk_v = torch.zeros_like(blk_k)
    table = torch.tensor([[7, 2, 11, 4, 9, 1], [3, 12, 5, 10, 6, 8]])  # [2, 48/8]
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        want = model(ids[:, :16], pos, dense_k, dense_v, pos, 48, dense_t)
        got = model(ids[:, :16], pos, blk_k, blk_v, pos, 48, table)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for t in range(16, 20):
            p, li = torch.full((2, 1), t), torch.zeros(2, 1, dtype=torch.long)
            want = model(ids[:, t:t + 1], p, dense_k, dense_v, li, 48, dense_t)
            got = model(ids[:, t:t + 1], p, blk_k, blk_v, li, 48, table)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for row in range(2):
        for p in (0, 7, 8, 19):
            torch.testing.assert_close(blk_k[:, table[row, p // 8], :, p % 8], dense_k[:, row, :, p])
    assert blk_k[:, 0].abs().sum() == 0 and blk_k[:, 4].abs().sum() == 0  # no position reached them
    assert blk_k[:, 12].abs().sum() > 0  # row 1's second block


def test_positions_past_the_table_write_the_scratch_block():
    table = torch.tensor([[5, 6]])  # [1, 2]: positions 0..15 with bs 8
    s = CacheSlots.of(table, torch.arange(12, 20).view(1, 8), 8)
    assert s.block.tolist() == [[6, 6, 6, 6, 0, 0, 0, 0]] and s.offset.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]


# ---- the pool ----------------------------------------------------------------------------------------------------
def test_pool_accounting_and_lru_eviction():
    pool = BlockPool(6, 4, prefix_caching=True)  # blocks 1..5 usable
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (1, 2, 3) and pool.in_use == 3 and pool.free == 2
    ha, hb = block_hashes(list(range(8)), 4)
    pool.register(a, ha)
    pool.register(b, hb)
    pool.take(a)  # a second holder
    pool.release([a, b])
    assert pool.refs[a] == 1 and pool.refs[b] == 0 and pool.free == 3  # b: free but still cached
    assert pool.lookup([ha, hb]) == [a, b] and pool.hit_rate == 1.0
    pool.release([a, c])
    assert pool.free == 5 and pool.in_use == 0
    # fresh blocks come from never-cached ones first (c, 4, 5), then the least recently freed cached one (b, a)
    got = [pool.allocate() for _ in range(5)]
    assert got[:3] == [4, 5, 3] and got[3:] == [b, a]
    assert pool.lookup([ha]) == []  # evicted: the prefix is forgotten
    with pytest.raises(NeuronInferError, match="no free block"):
        pool.allocate()


def test_chained_hashes_depend_on_every_earlier_block():
    x = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    y = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(x) == 2 and x[0] != y[0] and x[1] != y[1]  # same second block, different first: different chains
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == x


# ---- the scheduler -----------------------------------------------------------------------------------------------
def _seq(i: int, n: int, new: int) -> Sequence:
    return Sequence(i, list(range(3, 3 + n)), SamplingConfig(), StopRule(new, max_length=64), torch.Generator())


def test_a_sequence_waits_for_blocks_and_starts_when_one_finishes():
    pool = BlockPool(9, 8)  # 8 usable blocks of 8 tokens
    sched = Scheduler(4, pool, max_length=64)
    for i, (n, new) in enumerate([(20, 12), (30, 10), (10, 5)]):  # 4, 5 and 2 blocks at most
        sched.add(_seq(i, n, new))
    first = sched.admit()
    assert [s.seq_id for s in first] == [0] and pool.reserved == 4  # the second would need 5 of the 4 left
    assert sched.admit() == [] and len(sched.waiting) == 2  # first come, first served: the third waits too
    sched.grow(first[0], 21)
    assert len(first[0].blocks) == 3 and pool.reserved == 1 and pool.in_use == 3
    first[0].finish_reason = "eos"
    sched.release_finished()
    assert pool.reserved == 0 and pool.in_use == 0
    assert [s.seq_id for s in sched.admit()] == [1, 2]


def test_a_request_larger_than_the_whole_cache_is_one_error():
    sched = Scheduler(2, BlockPool(3, 8), max_length=64)
    sched.add(_seq(0, 20, 20))
    with pytest.raises(NeuronInferError, match="does not fit the KV cache of 2 blocks even alone"):
        sched.admit()


# ---- engines -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("blocks") / "a"
    compile_model(tiny_dirs("gqa"), d, BUILD, backend="cpu-eager", say=lambda m: None)
    return d


def _gib(artifact, blocks: int) -> float:
    shape = CompiledModel.load(artifact).engine.cache_shape
    return blocks * shape.block_bytes() / 2**30


def _prompts():
    return [SHARED + [5, 6, 7], SHARED[:33] + [9] * 12, list(range(50, 80)), SHARED + [11] * 9,
            [SHARED[0] + 1] + SHARED[1:] + [5, 6, 7]]


def _solo(artifact, prompts, n):
    m = CompiledModel.load(artifact, prefix_caching=False)
    return [m.generate_ids([p], n, ignore_eos=True).outputs[0].token_ids for p in prompts]


def test_requests_in_a_small_cache_never_share_blocks_and_equal_their_solo_runs(artifact):
    """A cache of 12 blocks (4 slots would need 32): requests wait for blocks; the running ones hold disjoint
    blocks at every step; each output equals its run alone."""
    m = CompiledModel.load(artifact, kv_cache_gib=_gib(artifact, 13), prefix_caching=False)
    seen = []

    def check(_outputs):
        held = [b for slot in m.engine.slots for b in slot]
        assert len(held) == len(set(held)) and 0 not in held
        seen.append(sum(1 for slot in m.engine.slots if slot))

    out = m.generate_ids(_prompts(), 20, ignore_eos=True, on_tokens=check)
    assert max(seen) < 4  # never all four slots at once: the blocks ran out first
    assert [o.token_ids for o in out.outputs] == _solo(artifact, _prompts(), 20)
    assert out.metrics[0].kv_blocks == 12 and 0 < out.metrics[0].kv_blocks_in_use <= 12


def test_a_cache_smaller_than_one_long_request_serves_short_ones_and_names_the_fix_for_long_ones(artifact):
    m = CompiledModel.load(artifact, kv_cache_gib=_gib(artifact, 3), prefix_caching=False)  # 2 blocks + scratch
    short = [5, 9, 33]
    assert m.generate_ids([short], 6, ignore_eos=True).outputs[0].token_ids == _solo(artifact, [short], 6)[0]
    with pytest.raises(NeuronInferError, match="does not fit the KV cache of 2 blocks even alone; raise "
                                               "--kv-cache-gib"):
        m.generate_ids([list(range(50, 80))], 40, ignore_eos=True)  # 70 positions: more than 2 blocks hold
    with pytest.raises(NeuronInferError, match="needs at least 2 .*one block and the scratch block"):
        CompiledModel.load(artifact, kv_cache_gib=_gib(artifact, 1))


# ---- prefix caching ----------------------------------------------------------------------------------------------
def test_prefix_caching_gives_the_tokens_of_no_caching(artifact):
    on = CompiledModel.load(artifact)
    first = on.generate_ids(_prompts(), 12, ignore_eos=True)
    again = on.generate_ids(_prompts()[::-1], 12, ignore_eos=True)  # a later call hits this engine's cache
    want = _solo(artifact, _prompts(), 12)
    assert [o.token_ids for o in first.outputs] == want
    assert [o.token_ids for o in again.outputs] == want[::-1]
    m = again.metrics[0]
    assert m.prefix_blocks_hit > 0 and 0 < m.prefix_hit_rate <= 1


def test_cached_prefixes_are_shared_and_different_prefixes_never_are(artifact):
    m = CompiledModel.load(artifact)
    m.generate_ids([SHARED + [1]], 2, ignore_eos=True)  # caches SHARED's two full blocks
    holders = []

    def check(_outputs):
        holders.append([list(slot) for slot in m.engine.slots])

    m.generate_ids([SHARED + [2, 3], [SHARED[0] + 1] + SHARED[1:] + [2, 3]], 3, ignore_eos=True, on_tokens=check)
    a, b = holders[0][0], holders[0][1]
    assert a[:2] != [] and not set(a) & set(b)  # the second prompt differs in its first token: nothing shared
    m.generate_ids([SHARED + [4]], 2, ignore_eos=True, on_tokens=check)
    assert holders[-1][0][:2] == a[:2]  # the same prefix: the same cached blocks


def test_a_request_whose_prefix_was_evicted_equals_its_solo_run(artifact):
    m = CompiledModel.load(artifact, kv_cache_gib=_gib(artifact, 13))
    target = SHARED + [8, 9, 10]
    before = m.generate_ids([target], 10, ignore_eos=True)
    others = [[(i * 31 + j) % 300 + 3 for j in range(60)] for i in range(6)]  # fill every block with new prompts
    m.generate_ids(others, 8, ignore_eos=True)
    hits = m.engine.pool.hits
    after = m.generate_ids([target], 10, ignore_eos=True)
    assert m.engine.pool.hits == hits  # evicted: nothing of the prefix was found
    solo = _solo(artifact, [target], 10)[0]
    assert before.outputs[0].token_ids == after.outputs[0].token_ids == solo


def test_a_finished_sequences_output_blocks_are_cached(artifact):
    """A chat's next turn repeats prompt + output: the blocks written while decoding are found too."""
    m = CompiledModel.load(artifact)
    prompt = [(i * 5) % 290 + 7 for i in range(20)]
    out = m.generate_ids([prompt], 30, ignore_eos=True).outputs[0].token_ids  # 50 tokens, 49 of them cached
    hits = m.engine.pool.hits
    turn = prompt + out + [7]
    got = m.generate_ids([turn], 5, ignore_eos=True).outputs[0].token_ids
    assert m.engine.pool.hits - hits == 3  # 49 // 16 full blocks; only the first held prompt tokens alone
    assert got == _solo(artifact, [turn], 5)[0]


def test_a_new_runner_frees_every_block_and_keeps_the_cached_prefixes():
    pool = BlockPool(5, 4, prefix_caching=True)
    a, b = pool.allocate(), pool.allocate()
    (h,) = block_hashes([1, 2, 3, 4], 4)
    pool.register(a, h)
    pool.reserved = 2
    pool.release_all()
    assert pool.in_use == 0 and pool.reserved == 0 and pool.lookup([h]) == [a]
    assert [pool.allocate() for _ in range(4)] == [3, 4, b, a]  # the cached block is evicted last


def test_an_artifact_from_before_the_block_cache_asks_for_a_recompile(artifact, tmp_path):
    import json
    import shutil

    from neuron_infer.artifact.manifest import MANIFEST, read_manifest
    from neuron_infer.errors import ArtifactError

    old = tmp_path / "old"
    shutil.copytree(artifact, old)
    d = json.loads((old / MANIFEST).read_text())
    assert d["build"]["kv_block_size"] == 16  # recorded in the manifest
    d["format_version"] = 1
    d["build"].pop("kv_block_size")
    (old / MANIFEST).write_text(json.dumps(d))
    with pytest.raises(ArtifactError, match="format_version=1 .*recompile"):
        read_manifest(old, verify_files=False)


def test_eight_short_requests_run_at_once_in_a_cache_sized_for_them(tiny_dirs, tmp_path):
    """A batch-8 artifact whose static layout would hold 8 x max_length positions: in a cache of 9 of 129 blocks
    (one block per request and the scratch block), 8 requests of max_length / 16 positions still run all at once,
    with the tokens of the full-size cache (the tiny model's max_length 512 and 32 positions per request stand for
    SmolLM2's 4096 and 256)."""
    build = BuildConfig(dtype="fp32", batch_size=8, max_context_length=32, max_length=512, context_buckets=(32,),
                        tokengen_buckets=(64, 512), tokengen_batch_buckets=(8,), kv_block_size=32)
    d = tmp_path / "long"
    compile_model(tiny_dirs("gqa"), d, build, backend="cpu-eager", say=lambda m: None)
    full = CompiledModel.load(d, prefix_caching=False)
    shape = full.engine.cache_shape
    assert shape.blocks == build.default_kv_blocks == 8 * 512 // 32 + 1
    sized = 8 + 1  # one 32-token block per request and the scratch block
    small = CompiledModel.load(d, prefix_caching=False, kv_cache_gib=sized * shape.block_bytes() / 2**30)
    assert small.engine.cache_shape.nbytes() * 129 == shape.nbytes() * 9  # 1/14.3 of the static cache
    assert 2 * small.engine.k_cache.nbytes == small.engine.cache_shape.nbytes()  # what was allocated
    prompts = [[(i * 37 + j * 11) % 300 + 3 for j in range(24)] for i in range(8)]
    busy = []
    got = small.generate_ids(prompts, 8, ignore_eos=True,
                             on_tokens=lambda _o: busy.append(sum(1 for s in small.engine.slots if s)))
    assert max(busy) == 8  # nobody waited for blocks
    want = full.generate_ids(prompts, 8, ignore_eos=True)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert got.metrics[0].kv_blocks_in_use == 8  # one block of 32 per request


def test_the_kv_memory_benchmark_sizes_a_cache_for_its_requests(artifact, capsys):
    """scripts/bench_kv_memory.py on the tiny artifact: 4 requests of 20 + 4 tokens in 16-token blocks need
    2 blocks each, so the sized cache holds 9 of the default 33 blocks and gives the same tokens."""
    spec = importlib.util.spec_from_file_location("bench_kv_memory", ROOT / "scripts" / "bench_kv_memory.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(artifact), "--requests", "4", "--prompt-len", "20", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "sized | 9 |" in out and "default | 33 |" in out
    assert "9 / 33 blocks = 1/3.7 of the static-size cache" in out and "tokens identical: True" in out
