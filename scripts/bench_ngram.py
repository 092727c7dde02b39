"""Prompt-lookup (n-gram) speculation vs plain greedy decoding, same process, interleaved rounds, SmolLM2.

    python scripts/bench_ngram.py --k 6 --ngram-size 3 --new-tokens 160 --rounds 2

For each prompt of scripts/ngram_prompts.py (chat template applied): plain greedy decoding on the target engine,
then n-gram speculation over the same target weights, `--rounds` times interleaved; prints decode tok/s of both
(medians), their ratio, three replays of the plain greedy output (a verify step costing `--bound-cost` plain steps,
no host work): `bound`, a verify step at every step with a draft (`replay_bound`); `policy`, at the steps the
speculation policy chooses (`replay_policy`); `recent`, the same with the drafts of the most recent occurrence
instead of runtime/ngram.py's weighted vote (`propose_recent`). Then the acceptance rate, speculative / plain steps,
whether the greedy outputs are identical and the verify / plain step cost ratio the engine measured (its clock, after
that prompt).
The graphs run eagerly (the modules themselves, `eager_ngram_spec`), or, with `--artifact`, the compiled graphs of
an artifact built with `--draft-model ngram` (batch size 1, e.g.
    neuron-infer compile -o A --dtype bf16 --batch-size 1 --max-context-length 512 --max-length 640 \
        --context-buckets 512 --tokengen-buckets 640 --draft-model ngram --speculation-length 6
and `--k`, `--ngram-size`, `--dtype` are the artifact's); either way both sides run the same graph types.
`--set held-out` runs the second prompt set instead (other passages and code: a check that a change to the draft
rule or the policy is not fitted to the main set alone).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neuron_infer.artifact.weights import build_float_model
from neuron_infer.checkpoint import load_checkpoint, load_tokenizer
from neuron_infer.config import BuildConfig, ModelConfig, SpeculationConfig
from neuron_infer.runtime.generate import generate_ids
from neuron_infer.runtime.loader import eager_ngram_spec, load_rank
from neuron_infer.runtime.ngram import RowView, SeqState, plan_step, propose
from neuron_infer.runtime.ngram_spec import PRIOR_COST_RATIO, NgramSpec
from scripts.ngram_prompts import GROUNDED, HELD_OUT_GROUNDED, HELD_OUT_OPEN, OPEN_ENDED


def eager_spec(a: argparse.Namespace) -> NgramSpec:
    cfg = ModelConfig.from_model_dir(a.model_dir)
    build = BuildConfig(dtype=a.dtype, max_context_length=512, max_length=1024, context_buckets=(512,),
                        tokengen_buckets=(1024,),
                        speculation=SpeculationConfig("ngram", a.k, ngram_size=a.ngram_size))
    return eager_ngram_spec(build_float_model(cfg, build, load_checkpoint(a.model_dir, cfg)), build)


def compiled_spec(artifact: str) -> NgramSpec:
    spec = load_rank(artifact)  # the NgramSpec over the target (its .target decodes plain)
    if not isinstance(spec, NgramSpec) or spec.build.batch_size != 1:
        sys.exit(f"error: {artifact} is not a batch-size-1 artifact compiled with --draft-model ngram")
    return spec


Draft = Callable[[list[int], int, int], list[int]]  # (tokens, ngram_size, k) -> draft


def replay_bound(prompt: list[int], out: list[int], ngram_size: int, k: int, cost: float) -> float:
    """Speed-up over plain decoding if every step where the lookup finds a draft verified it: the plain greedy output
    `out` replayed, each draft accepted as far as it matches `out`, a verify step costing `cost` plain steps, no host
    work counted. Greedy output does not depend on the drafts, so this is what verifying every draft can reach."""
    return _replay(prompt, out, ngram_size, k, cost, policy=False)


def replay_policy(prompt: list[int], out: list[int], ngram_size: int, k: int, cost: float,
                  draft: Draft = propose) -> float:
    """The same replay with the drafts runtime/ngram.py's policy verifies (`plan_step` on a `SeqState`: its
    estimate, probes and declined drafts scored by the tokens that follow) at a cost ratio of `cost`: the policy's
    speed-up free of the machine's timing noise (the engine's periodic calibration steps are not replayed)."""
    return _replay(prompt, out, ngram_size, k, cost, policy=True, draft=draft)


def propose_recent(tokens: list[int], ngram_size: int, k: int) -> list[int]:
    """The simpler draft rule, for comparison: the longest suffix n <= ngram_size found earlier, and the k tokens
    that followed its most recent earlier occurrence."""
    length = len(tokens)
    for n in range(min(ngram_size, length - 1), 0, -1):
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):
            if tokens[i: i + n] == suffix:
                return tokens[i + n: i + n + k] if k > 0 else []
    return []


def _replay(prompt: list[int], out: list[int], ngram_size: int, k: int, cost: float, policy: bool,
            draft: Draft = propose) -> float:
    seq, i, steps, st = list(prompt), 0, 0.0, SeqState()
    while i < len(out):
        st.observe(seq)
        d = draft(seq, ngram_size, k)
        take = plan_step([RowView(len(d), st.accepted, st.idle)], cost)[0] if policy else len(d)
        hits = next((j for j, (a, b) in enumerate(zip(d, out[i:])) if a != b), min(len(d), len(out) - i))
        if take:
            steps += cost
            st.update(take, hits)
        else:
            steps, hits = steps + 1.0, 0
            st.update(0, 0)
            st.watch(len(seq), d)
        seq += out[i: i + hits + 1]
        i += hits + 1
    return len(out) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="SmolLM2 checkpoint (default: the embedded model)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--artifact", default=None, help="a compiled --draft-model ngram artifact (default: eager graphs)")
    ap.add_argument("--set", default="main", choices=["main", "held-out"],
                    help="which prompts of scripts/ngram_prompts.py")
    ap.add_argument("--bound-cost", type=float, default=1.3,
                    help="verify / plain step cost for the `bound` and `policy` columns (the replays)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.model_dir is None:
        from neuron_infer.embedded import default_model_dir

        a.model_dir = str(default_model_dir())
    spec = compiled_spec(a.artifact) if a.artifact else eager_spec(a)
    tok = load_tokenizer(a.model_dir)
    eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    build = spec.build
    print(f"load before: {os.getloadavg()}  {build.dtype} K={spec.k} n={spec.ngram_size} new={a.new_tokens} "
          f"threads={a.threads} graphs: {'compiled ' + a.artifact if a.artifact else 'eager'}")
    print(f"{'set':9} {'prompt':10} {'plain':>7} {'ngram':>7} {'ratio':>6} {'bound':>6} {'policy':>6} {'recent':>6} "
          f"{'accept':>6} {'spec/plain':>10} same  cost")
    sets = ((GROUNDED, OPEN_ENDED) if a.set == "main" else (HELD_OUT_GROUNDED, HELD_OUT_OPEN))
    for group, prompts in zip(("grounded", "open"), sets):
        for name, text in prompts.items():
            chat = [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            ids = tok(ids, add_special_tokens=False)["input_ids"]
            plain, fast, same, m = [], [], True, None
            for _ in range(a.rounds):
                ref, mp = generate_ids(spec.target, [ids], a.new_tokens, eos_ids=eos)
                got, m = generate_ids(spec, [ids], a.new_tokens, eos_ids=eos)
                plain.append(mp.tokens_per_s)
                fast.append(m.tokens_per_s)
                same = same and got[0].token_ids == ref[0].token_ids
            p, f = statistics.median(plain), statistics.median(fast)
            cost = spec.clock.ratio("verify", "plain", PRIOR_COST_RATIO)  # the engine's measured verify / plain
            bound = replay_bound(ids, ref[0].token_ids, spec.ngram_size, spec.k, a.bound_cost)
            pol = replay_policy(ids, ref[0].token_ids, spec.ngram_size, spec.k, a.bound_cost)
            recent = replay_policy(ids, ref[0].token_ids, spec.ngram_size, spec.k, a.bound_cost, propose_recent)
            print(f"{group:9} {name:10} {p:7.1f} {f:7.1f} {f / p:6.2f} {bound:6.2f} {pol:6.2f} {recent:6.2f} "
                  f"{m.acceptance_rate:6.2f} {m.spec_steps:>4}/{m.plain_steps:<5} {same!s:5} {cost:.2f}  "
                  f"({len(ids)} prompt tokens, "
                  f"{len(got[0].token_ids)} generated)", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
