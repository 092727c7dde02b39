"""`NeuronInferPlatform`: vLLM's CPU platform with neuron-infer's worker (documented Platform hooks only).

It subclasses `CpuPlatform` (keeping `_enum = CPU`) so every CPU default (gloo, spawn, thread binding, memory
handling) still applies; on a Neuron instance the compiled graphs of the artifact run on the NeuronCores through the
Neuron backend, while vLLM itself only sees a CPU host. Hooks used:
  check_and_update_config  worker class; additional_config neuron_infer_prefix_caching as vLLM's own flag (vLLM's
                           block manager drives the engine's KV cache, with its prefix caching and chunked
                           prefill, see docs/vllm.md); early validation of the artifact/build against vLLM's limits
  validate_request         refuses request features the runner does not implement (HTTP 400 with the reason)
Step budget: vLLM publishes its scheduler stats (running and waiting requests, KV-cache use: `/metrics`) once per
step, when the step's output returns, so a step that encodes many prompts at once reports the requests it admitted
only when all of them are encoded. Left at vLLM's CPU default (2048 tokens per step, 4096 offline, times the ranks),
`--max-num-batched-tokens` becomes the runtime's prefill chunk (`RunOptions.chunk_tokens`: the largest context
bucket <= 256 tokens, at least --max-num-seqs) with chunked prefill on: each step encodes at most that many prompt
tokens and reports right after it. Any other value the user passes is kept.
Sample logprobs are the raw log-softmax of the logits (vLLM's default --logprobs-mode raw_logprobs); other modes
are refused at startup.

Tensor parallelism on CPU: vLLM starts one worker process per rank and, by default (VLLM_CPU_OMP_THREADS_BIND=auto),
binds each rank's OpenMP threads to its own NUMA node, refusing more ranks than nodes. Our ranks need no node of
their own (each holds 1/N of the weights), so when that variable is unset the platform splits this process's
allowed CPUs into N contiguous groups instead ("0|1" for two ranks on two cores); a value the user set is kept.
One worker process or one per rank (artifacts.single_worker): an artifact of one rank is served by vLLM's
single-worker "uni" executor, the worker inside the engine-core process, where vLLM's CPU default is one worker
process whose replies the engine core polls for (part of a core busy for every step, hence vLLM pins that worker to
the other cores). In process the engine's thread policy uses every core the front end leaves free.
Tensor parallelism on Neuron (not yet run on hardware): neuronx-distributed drives every NeuronCore of the group from
one process, so the platform also selects the "uni" executor, like vllm-neuron.
"""
from __future__ import annotations

import os
from typing import Any

import vllm
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from neuron_infer.artifact.manifest import read_manifest
from neuron_infer.vllm_plugin import check_vllm_version
from neuron_infer.vllm_plugin.artifacts import (
    EngineArgs,
    check_against_engine,
    default_build,
    plugin_options,
    prefix_caching,
    single_worker,
    step_tokens,
)
from neuron_infer.vllm_plugin.params import UnsupportedRequestError, check_request

logger = init_logger("vllm.neuron_infer.platform")
WORKER_CLASS = "neuron_infer.vllm_plugin.worker.NeuronInferWorker"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RAW_LOGPROBS = "raw_logprobs"  # vLLM's default logprobs_mode: what the runtime's Runner computes


def rank_cpu_binding(ranks: int) -> str:
    """vLLM's per-rank CPU list syntax ("0|1"): this process's allowed CPUs in `ranks` contiguous groups."""
    from neuron_infer.parallel.launch import rank_cpu_groups

    return "|".join(",".join(map(str, g)) for g in rank_cpu_groups(list(os.sched_getaffinity(0)), ranks))


def engine_args(vllm_config: Any) -> EngineArgs:
    mc = vllm_config.model_config
    return EngineArgs(model=str(mc.model), dtype=str(mc.dtype).removeprefix("torch."),
                      max_model_len=int(mc.max_model_len), max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
                      tensor_parallel_size=int(vllm_config.parallel_config.tensor_parallel_size))


def apply_step_budget(vllm_config: Any, build: Any) -> None:
    """vLLM's step budget (`--max-num-batched-tokens`) -> `step_tokens` (see the module docstring)."""
    from vllm.engine.arg_utils import EngineArgs as VllmEngineArgs

    sched = vllm_config.scheduler_config
    defaults = VllmEngineArgs.get_batch_defaults(int(vllm_config.parallel_config.world_size))[0].values()
    budget = step_tokens(int(sched.max_num_batched_tokens), defaults, bool(sched.enable_chunked_prefill),
                         int(sched.max_num_seqs), build)
    if budget != sched.max_num_batched_tokens:
        sched.max_num_batched_tokens = budget
        logger.info("neuron-infer: step budget %d prompt tokens (--max-num-batched-tokens): vLLM reports each "
                    "step's running and waiting requests and KV-cache use when the step returns", budget)


class NeuronInferPlatform(CpuPlatform):
    """vLLM on neuron-infer artifacts (see the module docstring)."""

    # Longest prompt the artifact encodes, learnt in check_and_update_config (which vLLM runs in the front-end
    # process before any request) and enforced per request in validate_request.
    max_prompt_len: int | None = None

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        check_vllm_version(vllm.__version__)
        par = vllm_config.parallel_config
        if par.worker_cls == "auto":
            par.worker_cls = WORKER_CLASS  # before super(): CpuPlatform only fills in "auto"
        super().check_and_update_config(vllm_config)
        if vllm_config.model_config is None:
            return
        if vllm_config.lora_config is not None:
            raise ValueError("the neuron-infer vLLM plugin does not serve LoRA adapters; drop --enable-lora")
        if vllm_config.speculative_config is not None:
            raise ValueError(
                "vLLM's --speculative-config is not used by the neuron-infer plugin: compile the artifact with fused "
                "speculation (neuron-infer compile --draft-model ... --fused-speculation) and serve that artifact"
            )
        mode = getattr(vllm_config.model_config, "logprobs_mode", RAW_LOGPROBS)
        if mode != RAW_LOGPROBS:
            raise ValueError(f"the neuron-infer vLLM plugin returns raw logprobs only (log-softmax of the model's "
                             f"logits, vLLM's default); drop --logprobs-mode {mode}")
        # vLLM's block manager drives the engine's KV cache (worker.py): its prefix caching and chunked prefill apply
        args = engine_args(vllm_config)
        options = plugin_options(vllm_config.additional_config)
        if prefix_caching(options) is not None:
            vllm_config.cache_config.enable_prefix_caching = prefix_caching(options)
        if options.get("neuron_infer_artifacts"):
            root = options["neuron_infer_artifacts"]
            manifest = read_manifest(root, verify_files=False)
            build, backend = manifest.build, manifest.backend
            check_against_engine(build, args, str(root))
        else:
            build = default_build(args, options.get("neuron_infer_build"))  # fails early on a bad dtype/override
            backend = options.get("neuron_infer_backend") or build.target  # what the plugin will compile with
        cls.max_prompt_len = build.max_context_length
        apply_step_budget(vllm_config, build)
        if single_worker(backend, build):
            par.distributed_executor_backend = "uni"  # the worker in the engine-core process (see artifacts.py)
        elif args.tensor_parallel_size > 1 and BIND_ENV not in os.environ:
            os.environ[BIND_ENV] = rank_cpu_binding(args.tensor_parallel_size)

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        kind = processed_inputs.get("type") if isinstance(processed_inputs, dict) else None
        if kind is not None and kind != "token":
            raise VLLMValidationError(
                f"the neuron-infer vLLM plugin takes text or token-id prompts only, not {kind!r} inputs"
            )
        ids = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
        try:
            check_request(params, len(ids) if ids is not None else None, cls.max_prompt_len)
        except UnsupportedRequestError as e:
            raise VLLMValidationError(str(e)) from e  # vLLM's client-error type: HTTP 400 with this message
