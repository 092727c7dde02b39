"""The module each planned graph is traced from at compile time and bound to at load time.

    step_modules(model, build)                      {name: BucketStep}        the core graphs (artifact/plan.py)
    speculation_modules(target, draft, build)       {name: (module, example args)}   draft, verify and fused graphs

A draft graph runs the draft model alone; a verify graph runs the target over K+1 tokens with logits at every
token; a fused graph is a whole speculative step (model/spec_step.py) over both caches.
"""
from __future__ import annotations

from neuron_infer.artifact.plan import cache_shape, example_args, planned_graphs, spec_graph_list
from neuron_infer.config import BuildConfig
from neuron_infer.model.llama import BucketStep, LlamaModel
from neuron_infer.model.spec_step import FusedSpecStep, SpecCacheLayout, fused_example_args


def step_modules(model: LlamaModel, build: BuildConfig) -> dict[str, BucketStep]:
    """Every core graph of a build: its step module over `model`."""
    return {spec.name: BucketStep(model, spec.attend) for spec in planned_graphs(build)}


def spec_cache_layout(target: LlamaModel, draft: LlamaModel, build: BuildConfig) -> SpecCacheLayout:
    return SpecCacheLayout(cache_shape(target, build), cache_shape(draft, build))


def speculation_modules(target: LlamaModel, draft: LlamaModel | None, build: BuildConfig) -> dict[str, tuple]:
    """name -> (module, example_args) of every speculation graph a build compiles; without a draft (prompt
    lookup) the target's verify graphs alone."""
    if draft is None:
        cache = cache_shape(target, build)
        return {g.name: (BucketStep(target, g.attend), example_args(cache, g))
                for g in spec_graph_list(build, draft=False)}
    k, layout, out = build.speculation.length, spec_cache_layout(target, draft, build), {}
    for g in spec_graph_list(build):
        if g.kind == "fused":
            out[g.name] = (FusedSpecStep(target, draft, k, g.attend, layout, g.sample),
                           fused_example_args(layout, k, g.batch, g.attend))
        else:
            model, cache = (draft, layout.draft) if g.model == "draft" else (target, layout.target)
            out[g.name] = (BucketStep(model, g.attend), example_args(cache, g))
    return out
