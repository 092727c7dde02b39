"""Compile -> load -> generate against Hugging Face greedy generation, buckets, stopping, batching, sampling.

Greedy identity (fp32) is exact token equality with `LlamaForCausalLM.generate(do_sample=False)`; the tiny
checkpoints have spread-out logits (tests/tiny_checkpoint.py), so no step is decided by a near-tie.
"""
import gc

import pytest
import torch
from transformers import LlamaForCausalLM

from neuron_infer.api import CompiledModel, compile_model
from neuron_infer.config import BuildConfig, SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.generate import gc_paused, generate_ids
from tests.tiny_checkpoint import TINY_PRESETS

BUILD = BuildConfig(dtype="fp32", max_context_length=64, max_length=128, context_buckets=(32, 64),
                    tokengen_buckets=(64, 128))
QUIET = dict(say=lambda m: None)


def hf_greedy(model_dir, prompt: list[int], n: int, dtype=torch.float32) -> list[int]:
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def compiled(tiny_dirs, tmp_path_factory):
    """preset -> CompiledModel (fp32, eager graphs: this module tests the runtime, not the graph compiler)."""
    cache = {}

    def get(preset, build=BUILD, backend="cpu-eager"):
        key = (preset, build, backend)
        if key not in cache:
            out = tmp_path_factory.mktemp(preset)
            compile_model(tiny_dirs(preset), out / "a", build, backend=backend, **QUIET)
            cache[key] = CompiledModel.load(out / "a")
        return cache[key]

    return get


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_greedy_64_tokens_equal_hf(compiled, tiny_dirs, preset):
    prompt = list(range(7, 27))
    got = compiled(preset).generate_ids([prompt], 64, ignore_eos=True).outputs[0]
    assert got.token_ids == hf_greedy(tiny_dirs(preset), prompt, 64)
    assert got.finish_reason == "max_new_tokens"


def test_compiled_cpu_graphs_equal_hf(compiled, tiny_dirs):
    """The default CPU backend (AOTInductor graphs, not eager): one context and one token-generation bucket."""
    build = BuildConfig(dtype="fp32", max_context_length=32, max_length=96, context_buckets=(32,),
                        tokengen_buckets=(96,))
    prompt = list(range(11, 40))
    got = compiled("tied", build, backend=None).generate_ids([prompt], 64, ignore_eos=True).outputs[0]
    assert got.token_ids == hf_greedy(tiny_dirs("tied"), prompt, 64)


@pytest.mark.parametrize("length", [32, 33, 64])
def test_prompts_at_and_past_a_bucket_edge(compiled, tiny_dirs, length):
    prompt = [(i * 7) % 500 + 3 for i in range(length)]
    got = compiled("gqa").generate_ids([prompt], 16, ignore_eos=True).outputs[0].token_ids
    assert got == hf_greedy(tiny_dirs("gqa"), prompt, 16)


def test_prompt_longer_than_the_largest_bucket_is_a_clear_error(compiled):
    with pytest.raises(NeuronInferError, match="65 tokens, more than max_context_length=64"):
        compiled("gqa").generate_ids([list(range(3, 68))], 4)


def test_reaching_max_length_stops_cleanly_with_the_reason(compiled, tiny_dirs):
    prompt = list(range(3, 63))  # 60 tokens; max_length 128 leaves room for 68 new tokens
    out = compiled("gqa").generate_ids([prompt], 500, ignore_eos=True).outputs[0]
    assert out.finish_reason == "max_length" and len(prompt) + len(out.token_ids) == 128
    assert out.token_ids == hf_greedy(tiny_dirs("gqa"), prompt, 68)


def test_eos_stops_a_sequence(compiled):
    m = compiled("gqa")
    prompt = list(range(3, 20))
    first = m.generate_ids([prompt], 1).outputs[0].token_ids[0]
    res, _ = generate_ids(m.engine, [prompt], 10, eos_ids=(first,))
    assert res[0].token_ids == [first] and res[0].finish_reason == "eos"
    res, _ = generate_ids(m.engine, [prompt], 10, eos_ids=(first,), ignore_eos=True)
    assert len(res[0].token_ids) == 10


def test_batch_rows_equal_their_single_runs(compiled):
    batched = compiled("gqa", BUILD.replace(batch_size=3))
    single = compiled("gqa")
    prompts = [list(range(3, 13)), list(range(50, 90)), list(range(200, 221))]
    got = batched.generate_ids(prompts, 24, ignore_eos=True).outputs
    for p, g in zip(prompts, got):
        assert g.token_ids == single.generate_ids([p], 24, ignore_eos=True).outputs[0].token_ids


def test_more_prompts_than_the_batch_take_rows_as_they_free(compiled):
    """Continuous batching: 5 prompts on a batch-2 artifact; later prompts are encoded into freed rows while the
    remaining rows hold other sequences, and each output equals its single run."""
    batched, single = compiled("gqa", BUILD.replace(batch_size=2)), compiled("gqa")
    prompts = [[5, 6, 7], list(range(8, 30)), [40] * 9, list(range(100, 105)), [7]]
    out = batched.generate_ids(prompts, 9, ignore_eos=True)
    for p, o in zip(prompts, out.outputs):
        assert o.token_ids == single.generate_ids([p], 9, ignore_eos=True).outputs[0].token_ids
    assert len(out.metrics) == 1 and out.metrics[0].decode_tokens == 5 * 8


def test_seeded_sampling_is_reproducible_and_seed_dependent(compiled):
    m = compiled("gqa")
    s = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, seed=123)
    a = m.generate_ids([[5, 6, 7]], 32, s, ignore_eos=True).outputs[0].token_ids
    b = m.generate_ids([[5, 6, 7]], 32, s, ignore_eos=True).outputs[0].token_ids
    c = m.generate_ids([[5, 6, 7]], 32, SamplingConfig(temperature=1.0, seed=7), ignore_eos=True).outputs[0]
    assert a == b and a != c.token_ids


def test_bf16_agrees_with_hf_fp32_on_teacher_forced_next_tokens(compiled, tiny_dirs):
    """bf16 criterion: next-token argmax equals HF fp32's at >= 90% of 96 teacher-forced positions.

    bf16 keeps 8 mantissa bits, so logits move by ~1e-2 relative; only near-tied positions may flip. Measured on
    these presets: 100% (tiny models, spread logits); 90% leaves margin without accepting a broken model (a wrong
    op gives ~1/vocab agreement).
    """
    m = compiled("gqa", BUILD.replace(dtype="bf16"))
    seq = [(i * 13) % 500 + 3 for i in range(96)]
    hf = LlamaForCausalLM.from_pretrained(tiny_dirs("gqa"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].argmax(-1)  # [T]
    eng = m.engine
    logits = [eng.prefill([seq[:32]])[0]]
    for pos in range(32, 96):
        logits.append(eng.decode(torch.tensor([seq[pos]]), torch.tensor([pos]))[0])
    ours = torch.stack(logits).argmax(-1)  # predictions for positions 31..95
    agree = (ours == ref[31:96]).float().mean().item()
    assert agree >= 0.90, agree


def test_cli_threads_option_sets_torch_threads_and_keeps_tokens(compiled, capsys):
    """`generate` follows the load by default; `--threads 1` fixes one torch thread and gives the same greedy
    tokens; 0 is refused."""
    import json

    from neuron_infer import cpu_threads
    from neuron_infer.cli import main

    root = str(compiled("gqa").root)
    before = torch.get_num_threads()
    runs = {}
    try:
        for threads in ([], ["--threads", "1"]):
            main(["generate", root, "--prompt", "hello there", "--max-new-tokens", "6", "--ignore-eos", "--json",
                  *threads])
            runs[tuple(threads)] = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
            if threads:
                assert torch.get_num_threads() == 1 and cpu_threads._governor is None
            else:
                assert cpu_threads._governor is not None  # the default: "auto"
    finally:
        cpu_threads.use(before)
    assert runs[()] == runs[("--threads", "1")] and len(runs[()]) == 6
    with pytest.raises(SystemExit) as e:
        main(["generate", root, "--prompt", "x", "--threads", "0"])
    assert e.value.code == 2


def test_gc_is_paused_inside_a_generation_loop_and_restored():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failing step")
    assert gc.isenabled()  # restored on errors too
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's choice to keep it off is kept
    finally:
        gc.enable()
