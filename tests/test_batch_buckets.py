"""Token-generation graphs for several batch sizes: planning, routing by the number of running sequences, and
equality with the full-batch graph (fp32, eager graphs, tiny checkpoints)."""
import json

import pytest
import torch

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.artifact.manifest import MANIFEST, read_manifest, seal
from neuron_infer.artifact.plan import planned_graphs
from neuron_infer.config import BuildConfig
from neuron_infer.errors import ConfigError
from neuron_infer.runtime.engine import take_rows

BUILD = BuildConfig(dtype="fp32", batch_size=4, max_context_length=64, max_length=128, context_buckets=(32, 64),
                    tokengen_buckets=(64, 128))


def test_default_buckets_are_powers_of_two_up_to_the_batch_size():
    assert BUILD.tokengen_batch_list == (1, 2, 4)
    assert BUILD.replace(batch_size=6).tokengen_batch_list == (1, 2, 4, 6)
    names = {g.name for g in planned_graphs(BUILD)}
    assert {"tokengen_t1_s64", "tokengen_b1_t1_s64", "tokengen_b2_t1_s128"} <= names
    assert not any(n.startswith("tokengen_b4") for n in names)  # the full batch keeps its own graph
    assert BUILD.replace(tokengen_batch_buckets=(4,)).tokengen_batch_list == (4,)


def test_buckets_must_end_at_the_batch_size():
    with pytest.raises(ConfigError, match="must equal --batch-size=4"):
        BUILD.replace(tokengen_batch_buckets=(1, 2))


@pytest.fixture(scope="module")
def models(tiny_dirs, tmp_path_factory):
    out = {}
    for bs in (1, 4):
        d = tmp_path_factory.mktemp(f"b{bs}") / "a"
        compile_model(tiny_dirs("gqa"), d, BUILD.replace(batch_size=bs), backend="cpu-eager", say=lambda m: None)
        out[bs] = CompiledModel.load(d)
    return out


def counting(engine):
    """Wrap every graph of `engine` to count calls by name."""
    calls = {}
    for name, fn in list(engine.graphs.items()):
        def wrapped(*args, _fn=fn, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args)
        engine.graphs[name] = wrapped
    return calls


def test_steps_use_the_smallest_graph_holding_the_running_sequences(models):
    m = models[4]
    calls = counting(m.engine)
    one = m.generate_ids([list(range(3, 20))], 6, ignore_eos=True).outputs[0].token_ids
    assert calls.get("tokengen_b1_t1_s64") == 5 and "tokengen_t1_s64" not in calls  # 5 decode steps, batch 1
    assert one == models[1].generate_ids([list(range(3, 20))], 6, ignore_eos=True).outputs[0].token_ids
    calls.clear()
    three = [list(range(5, 15)), [9] * 20, list(range(40, 47))]
    got = [o.token_ids for o in m.generate_ids(three, 5, ignore_eos=True).outputs]
    assert calls.get("tokengen_t1_s64") == 4 and not any("tokengen_b" in n for n in calls)  # 3 rows: batch-4 graph
    assert calls.get("context_b4_t64_s64") == 1  # the three prompts encoded in one call
    assert got == [models[1].generate_ids([p], 5, ignore_eos=True).outputs[0].token_ids for p in three]


def test_a_bucket_graph_on_scattered_rows_equals_the_full_graph(models):
    """Slots 1 and 3 (not 0, 1): the b2 graph reads and writes exactly the blocks of those slots."""
    eng = models[4].engine
    eng.bind_stripes()  # each slot its own blocks, as a runner would bind them
    prompts = {1: list(range(3, 15)), 3: [7] * 9}
    firsts = {r: int(eng.prefill_row(r, p).argmax()) for r, p in prompts.items()}
    k0, v0 = eng.k_cache.clone(), eng.v_cache.clone()
    rows = sorted(prompts)
    tokens = torch.tensor([firsts[r] for r in rows])  # [2]
    positions = torch.tensor([len(prompts[r]) for r in rows])  # [2]
    got = eng.decode_rows(rows, tokens, positions)  # [2, V]
    k_got = torch.stack([eng.slot_kv(r)[0] for r in rows])  # [2, L, Hkv, S, D]
    eng.k_cache.copy_(k0)
    eng.v_cache.copy_(v0)
    full_t, full_p = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)  # [B] each
    full_t[rows], full_p[rows] = tokens, positions
    want = eng.decode(full_t, full_p)[rows]  # [2, V]
    # fp32: the same math on 2 rows instead of 4 (a matmul over another row count may sum in another order):
    # a few ulps of O(1..10) values, ~2e-6 measured
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    k_want = torch.stack([eng.slot_kv(r)[0] for r in rows])  # [2, L, Hkv, S, D]
    assert torch.allclose(k_got, k_want, atol=1e-5, rtol=0)  # O(1) keys, ~1e-6 measured


def test_take_rows_is_a_view_for_a_run_of_rows_in_order_and_a_copy_otherwise():
    """A step's logits [n, V] for its scheduled rows: all of them, or a run in order (every batch-1 step), are a
    view; any other selection the indexing copy."""
    t = torch.arange(20.0).view(5, 4)  # [5, 4]
    runs = ([0, 1, 2, 3, 4], [1, 2], [3])
    for rows in (*runs, [3, 1], [0, 2, 4], [1, 1], []):
        got = take_rows(t, rows)
        assert torch.equal(got, t[rows])
        assert (got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) == (rows in runs)


def test_a_manifest_without_batch_buckets_holds_the_full_batch_graph_only(models):
    root = models[4].root
    d = json.loads((root / MANIFEST).read_text())
    d["build"].pop("tokengen_batch_buckets")
    (root / MANIFEST).write_text(json.dumps(seal(d)))
    assert read_manifest(root, verify_files=False).build.tokengen_batch_list == (4,)
