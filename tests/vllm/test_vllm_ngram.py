"""Prompt-lookup (n-gram) speculation through the real vLLM: the plugin compiles an artifact with
`--draft-model ngram` (verify graphs only, no draft model) and its greedy tokens equal neuron-infer's
non-speculative generate token for token (fp32 tiny model), with speculative steps really taken."""
from __future__ import annotations

import json

from tests.vllm.vllm_helpers import require_vllm, run_script

require_vllm()

from neuron_infer.api import CompiledModel
from tests.vllm.test_vllm_speculation import SCRIPT, plain  # noqa: F401  (the plain-artifact fixture)

PASSAGE = [11, 40, 7, 93, 250, 31, 64, 12, 99, 180, 5, 77]
PROMPTS = [PASSAGE + [3] + PASSAGE[:4], [5, 9, 33], list(range(100, 160)), [42] * 7]
N = 40
SPEC = {"draft_model": "ngram", "length": 4}


def test_ngram_greedy_through_vllm_equals_plain_generate(tmp_path, tiny, plain):  # noqa: F811
    cache = tmp_path / "cache"
    cache.mkdir()
    res = run_script(SCRIPT, [str(tiny), str(cache), json.dumps(PROMPTS), str(N), json.dumps(SPEC)],
                     timeout=420)
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    art = CompiledModel.load(root)
    assert art.spec is not None and art.spec.mode == "ngram" and art.spec.k == 4
    for prompt, got in zip(PROMPTS, res["greedy"]):
        assert got == plain.generate_ids([prompt], N, ignore_eos=True).outputs[0].token_ids
    want = plain.generate_ids([PROMPTS[0]], 6, ignore_eos=True).outputs[0].token_ids
    assert res["short"] == [want[:1], want[:2], want[:5], want[:6]]
    m = art.generate_ids(PROMPTS, N, ignore_eos=True).metrics[0]
    assert m.spec_steps > 0 and m.accepted > 0
