"""`NeuronInferWorker`: vLLM's worker contract (v1 engine) on top of a neuron-infer artifact.

Startup (called by vLLM's executor, in order): init_device (gloo process group over the tensor-parallel ranks) ->
load_model (find or compile the artifact, load it with a KV cache of additional_config `neuron_infer_kv_cache_gib`
GiB per rank, default batch_size sequences of max_length) -> get_kv_cache_spec (one full-attention spec per layer:
the artifact's block size, KV heads, head dim and cache dtype) -> determine_available_memory (that cache's bytes, so
vLLM counts exactly its blocks) -> initialize_from_config (vLLM's block count; the engine's cache already holds it)
-> compile_or_warm_up_model (one prefill + decode so the first request does not pay graph loading).

The KV cache is vLLM's to manage: its scheduler allocates the blocks, shares them between requests with a common
prefix (`--enable-prefix-caching`, on by default), preempts when they run out and splits long prompts into chunks
(chunked prefill); its metrics (KV-cache usage, prefix-cache hit rate) are the truth. The worker only writes and reads
K/V in the blocks vLLM names: a new request's block table is `block_ids`, a running one's grows by `new_block_ids`,
and a prefix-cache hit arrives as `num_computed_tokens` > 0 (those positions are not encoded again).

Per step: execute_model(SchedulerOutput) -> ModelRunnerOutput with the new tokens of each request whose prompt is
fully encoded: one, or 1..K+1 when the artifact has a draft model (speculative decoding; vLLM appends them in order
and trims at a stop), and `[]` for a request whose prompt is still arriving in chunks; plus, for requests asking for
`logprobs`, each new token's logprob, rank and top-n (`LogprobsLists`, see logprobs.py; such requests make the step
plain, one token each). vLLM reserves blocks only for the tokens it scheduled, so a speculative step runs only when
every row's blocks hold its K draft positions (otherwise the step is plain).

Tensor parallelism (`--tensor-parallel-size N`, artifact compiled with tp_degree N): vLLM's executor starts one
worker per rank and sends every rank the same SchedulerOutput. Worker r loads only shard r (weights/rank{r},
graphs/rank{r}, the KV cache of its own KV heads); the graphs' all-reduces and logits all-gather run over the gloo
group vLLM initialised, each rank samples, and rank 0's tokens are broadcast (SlotRunner `agree`), so every rank
keeps identical request state. A speculative artifact serves the same way: each rank runs the whole draft next to its
target shard, and the runner agrees on rank 0's uniforms of every sampled speculative step (runtime/runner.py). vLLM returns rank 0's ModelRunnerOutput. The N ranks share this host's cores, so
each gets cores // N threads. On Neuron (not yet run on hardware) one worker drives the whole group instead: the
platform selects vLLM's single-worker executor, and CompiledModel.load gives an engine whose graphs run on every
NeuronCore of the group through neuronx-distributed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.logger import init_logger
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from neuron_infer.api import CompiledModel
from neuron_infer.config import SamplingConfig
from neuron_infer.model.sampling import unpack_bitmask
from neuron_infer.parallel.launch import broadcast_from_rank0, rank_threads
from neuron_infer.runtime.loader import load_serving_rank
from neuron_infer.runtime.speculation import split
from neuron_infer.vllm_plugin.artifacts import (
    ensure_artifact,
    kv_cache_gib,
    plugin_options,
    resolve_model_dir,
    run_options,
)
from neuron_infer.vllm_plugin.logprobs import logprobs_arrays, prompt_logprobs_arrays
from neuron_infer.vllm_plugin.params import (
    check_request,
    requested_logprobs,
    requested_prompt_logprobs,
    stop_ids,
    to_sampling_config,
)
from neuron_infer.vllm_plugin.platform import engine_args
from neuron_infer.vllm_plugin.runner import SlotRunner

logger = init_logger("vllm.neuron_infer.worker")  # vLLM configures handlers for the `vllm` logger tree only
LOG_EVERY_SPEC_STEPS = 100  # a speculation summary line in the server log every this many speculative steps


class NeuronInferWorker(WorkerBase):
    """One worker process per tensor-parallel rank of the artifact (see the module docstring)."""

    def init_device(self) -> None:
        par = self.parallel_config
        if par.pipeline_parallel_size != 1 or par.data_parallel_size != 1:
            raise ValueError(
                "the neuron-infer vLLM plugin parallelises with tensor parallelism only; pass "
                "--pipeline-parallel-size 1 and --data-parallel-size 1 (and --tensor-parallel-size = the artifact's "
                "tp_degree)"
            )
        self.tp = int(par.tensor_parallel_size)
        # Neuron tensor parallelism: the platform chose vLLM's single-worker executor and this one process drives
        # every rank (neuronx-distributed inside the artifact's engine).
        self.group_in_process = self.tp > 1 and par.distributed_executor_backend == "uni"
        self.device = torch.device("cpu")
        self._init_group()
        torch.manual_seed(self.model_config.seed or 0)
        self.compiled = None
        self.runner: SlotRunner | None = None
        self._pending: set[str] = set()  # requests whose prompt (or resumed tokens) is not all encoded yet
        self._preempted: dict[str, list[int]] = {}  # tokens of preempted requests (re-encoded on resume)
        self._params: dict[str, Any] = {}  # SamplingParams of admitted requests (needed again on resume)
        self._prompt_lens: dict[str, int] = {}  # prompt length per request (penalties tell prompt from output)
        self._scored: set[str] = set()  # requests whose prompt logprobs vLLM has received
        self._deferred: Any = None  # a SchedulerOutput waiting for its grammar bitmask (sample_tokens)

    def _init_group(self) -> None:
        """vLLM's distributed init (its executor builds message queues on these groups), even at world size 1."""
        if self.tp > 1 and not self.group_in_process:  # one process per rank: the ranks share this host's cores
            torch.set_num_threads(rank_threads(self.tp))
        # vLLM's CPU communicator names its shared-memory group after this (set by its own CPUWorker, read by
        # every tp/pp group it builds): the rendezvous port, identical on all ranks of this engine.
        init = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (os.path.basename(init.removeprefix("file://")) if init.startswith("file://")
                                         else init.split(":")[-1])
        if self.group_in_process:  # vLLM's own groups are of size 1; the ranks live inside the engine
            init_distributed_environment(1, 0, self.distributed_init_method, self.local_rank, "gloo")
            ensure_model_parallel_initialized(1, 1)
        else:
            init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                                self.local_rank, "gloo")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("the neuron-infer plugin loads weights from its artifact; drop --load-format dummy")
        options = plugin_options(self.vllm_config.additional_config)
        args = engine_args(self.vllm_config)
        root = ensure_artifact(args, options, say=logger.info)
        explicit = bool(options.get("neuron_infer_artifacts"))
        expect = resolve_model_dir(args.model) if explicit else None  # the artifact must come from --model
        t0 = time.perf_counter()
        gib = kv_cache_gib(options)
        run = run_options(options)
        if self.tp == 1 or self.group_in_process:
            self.compiled = CompiledModel.load(root, expect_checkpoint=expect, kv_cache_gib=gib)
            manifest, engine, spec = self.compiled.manifest, self.compiled.engine, self.compiled.spec
            self.runner = SlotRunner(engine, spec, options=run)
        else:  # this rank's shard (the group was initialised in init_device)
            manifest, model = load_serving_rank(Path(root), self.rank, self.tp, expect_checkpoint=expect,
                                                kv_cache_gib=gib)
            engine, spec = split(model)
            self.runner = SlotRunner(engine, spec, agree=broadcast_from_rank0, options=run)
        self._kv_heads = -(-manifest.model.num_kv_heads // self.tp)  # equal on every rank: vLLM compares the specs
        build = manifest.build
        rank = f", rank {self.rank} of tp {self.tp}, {torch.get_num_threads()} threads" if self.runner.agree else ""
        logger.info("neuron-infer: loaded %s in %.1f s (backend %s, %s, batch %d, max_length %d%s%s)", root,
                    time.perf_counter() - t0, manifest.backend, build.dtype, build.batch_size, build.max_length,
                    f", quant {build.quant.scheme}" if build.quant.scheme != "none" else "", rank)
        if build.speculation is not None:
            logger.info("neuron-infer: speculative decoding (%s, draft %s, k=%d): up to %d tokens per request per "
                        "step", self.runner.runner.spec.mode, build.speculation.draft_model, build.speculation.length,
                        build.speculation.length + 1)

    def get_kv_cache_spec(self) -> dict:
        """One full-attention spec per layer (vLLM's layer naming); vLLM's block manager then counts our blocks."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        shape = self.runner.engine_cache
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=self._kv_heads, head_size=shape.head_dim,
                                 dtype=shape.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(shape.layers)}

    def determine_available_memory(self) -> int:
        """The bytes vLLM turns into exactly the engine's block count (its block 0, the null block, is our scratch
        block): blocks x layers x one layer's page (as vLLM computes it from the spec)."""
        spec = next(iter(self.get_kv_cache_spec().values()))
        shape = self.runner.engine_cache
        return shape.blocks * shape.layers * spec.page_size_bytes

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """vLLM's block count (the smallest over the ranks) must fit the engine's cache, which load_model
        allocated; block ids past it are never handed out."""
        shape, n = self.runner.engine_cache, int(kv_cache_config.num_blocks)
        if n > shape.blocks:
            raise ValueError(f"vLLM sized the KV cache at {n} blocks but the engine holds {shape.blocks}; leave "
                             "--num-gpu-blocks-override unset (size the cache with additional_config "
                             "neuron_infer_kv_cache_gib)")
        logger.info("neuron-infer: KV cache of %d blocks of %d tokens (%.3f GiB per rank), managed by vLLM's block "
                    "manager", n - 1, shape.block_size, shape.with_blocks(n).nbytes() / 2**30)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        t0 = time.perf_counter()
        self.runner.admit("__warmup__", [0], SamplingConfig(), blocks=[])  # no blocks: writes the scratch block
        self.runner.decode(["__warmup__"])
        self.runner.release("__warmup__")
        self.runner.reset_stats()  # count served requests only
        return CompilationTimes(language_model=time.perf_counter() - t0, encoder=0.0)

    def _log_stats(self) -> None:
        st = self.runner.stats
        logger.info("neuron-infer: %d speculative steps so far (acceptance %.3f, %d of %d draft tokens) and %d plain "
                    "steps", st.spec_steps, st.acceptance_rate, st.accepted, st.drafted, st.plain_steps)

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.stats.spec_steps:
            self._log_stats()
        super().shutdown()

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> torch.nn.Module:
        raise NotImplementedError("the neuron-infer worker runs compiled graphs; there is no torch model to inspect")

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        so = scheduler_output
        for req_id in so.finished_req_ids:  # a set: its order may differ per rank; the runner's row choice does not
            self.runner.release(req_id)
            self._pending.discard(req_id)
            self._preempted.pop(req_id, None)
            self._params.pop(req_id, None)
            self._prompt_lens.pop(req_id, None)
            self._scored.discard(req_id)
        for req_id in so.preempted_req_ids or ():  # vLLM took its blocks back
            tokens = self.runner.release(req_id)
            self._pending.discard(req_id)
            if tokens is not None:
                self._preempted[req_id] = tokens
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if so.has_structured_output_requests:  # vLLM computes the grammar bitmask now and hands it to sample_tokens
            self._deferred = so
            return None
        return self._step(so, None)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        """The step execute_model deferred, with the grammar bitmask of its structured-output requests (one row per
        request id, xgrammar's 32 tokens per int32 word; None: no request needs one this step)."""
        so, self._deferred = self._deferred, None
        if so is None:
            raise RuntimeError("sample_tokens without a deferred execute_model step")
        return self._step(so, grammar_output)

    def _step(self, so: Any, grammar_output: Any) -> ModelRunnerOutput:
        upto = self._take_blocks(so)  # joins new and resumed requests, grows running ones
        if grammar_output is not None and grammar_output.structured_output_request_ids:
            masks = unpack_bitmask(grammar_output.grammar_bitmask, self.runner.engine_vocab)  # [n, V]
            for req_id, allowed in zip(grammar_output.structured_output_request_ids, masks):
                if req_id in self.runner.slots:
                    self.runner.constrain(req_id, allowed)
        sampled = self._decode_running(so)
        encoded = self.runner.encode(upto) if upto else {}  # then this step's prompt tokens (chunks of prompts)
        for req_id, first in encoded.items():
            sampled[req_id] = first
            if first:
                self._pending.discard(req_id)
        req_ids = list(so.num_scheduled_tokens)
        tokens = [sampled.get(r, []) for r in req_ids]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=tokens, logprobs=self._logprobs(req_ids, tokens),
                                 prompt_logprobs_dict=self._prompt_logprobs(req_ids))

    def _prompt_logprobs(self, req_ids: list[str]) -> dict[str, LogprobsTensors]:
        """The prompt logprobs of each request whose prompt was completed this step (vLLM takes them whole, with
        the request's first token)."""
        out = {}
        for r in req_ids:
            records = self.runner.take_prompt_logprobs(r)
            if records is not None:
                n = requested_prompt_logprobs(self._params[r], self.runner.engine_vocab)
                out[r] = LogprobsTensors(*(torch.from_numpy(a) for a in prompt_logprobs_arrays(records, n)))
                self._scored.add(r)
        return out

    def _logprobs(self, req_ids: list[str], tokens: list[list[int]]) -> LogprobsLists | None:
        """This step's sample logprobs of the requests asking for them (one record per new token)."""
        per_request = [self.runner.take_logprobs(r) for r in req_ids]
        for r, toks, recs in zip(req_ids, tokens, per_request):
            asked = r in self._params and getattr(self._params[r], "logprobs", None) is not None
            if asked and len(recs) != len(toks):
                raise RuntimeError(f"request {r!r} got {len(toks)} tokens but {len(recs)} logprob records this step")
        arrays = logprobs_arrays(per_request)
        return LogprobsLists(*arrays) if arrays is not None else None

    def _decode_running(self, so: Any) -> dict[str, list[int]]:
        """Requests whose prompt is encoded: one decode step over all rows (before this step's prompt tokens)."""
        running = [r for r in so.scheduled_cached_reqs.req_ids if r in self.runner.slots and r not in self._pending]
        before = self.runner.stats.spec_steps
        out = self.runner.decode(running)
        if self.runner.stats.spec_steps // LOG_EVERY_SPEC_STEPS > before // LOG_EVERY_SPEC_STEPS:
            self._log_stats()
        return out

    def _take_blocks(self, so: Any) -> dict[str, int]:
        """New and resumed requests join with the blocks vLLM gave them, running ones get their new blocks ->
        {request still encoding its prompt: the position this step's tokens take it to}."""
        upto: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            check_request(new.sampling_params)
            tokens = list(new.prompt_token_ids or [])
            self._params[new.req_id], self._prompt_lens[new.req_id] = new.sampling_params, len(tokens)
            self._join(new.req_id, tokens, new.block_ids[0], new.num_computed_tokens)
            upto[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i][0] if cached.new_block_ids[i] else []
            if req_id in cached.resumed_req_ids:  # all of its blocks, and its tokens to encode again
                self.runner.release(req_id)
                tokens = cached.all_token_ids.get(req_id) or self._preempted.pop(req_id, None)
                if tokens is None:
                    raise RuntimeError(f"vLLM resumed request {req_id!r} without its tokens; cannot re-encode it")
                self._join(req_id, list(tokens), blocks, cached.num_computed_tokens[i])
            elif blocks:
                self.runner.extend(req_id, blocks)
            if req_id in self._pending:
                upto[req_id] = cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id]
        return upto

    def _prompt_scoring(self, req_id: str, params: Any) -> int | None:
        """prompt_logprobs for a request that has not yet had them (a resumed request that had them with its first
        token does not get them again: vLLM takes them once)."""
        return None if req_id in self._scored else requested_prompt_logprobs(params, self.runner.engine_vocab)

    def _join(self, req_id: str, tokens: list[int], blocks: list[int], computed: int) -> None:
        """A request takes a row with vLLM's blocks; its first `computed` positions are cached there."""
        params = self._params.get(req_id)
        self.runner.join(req_id, tokens, to_sampling_config(params), blocks, computed,
                         prompt_len=self._prompt_lens.get(req_id),
                         logprobs=requested_logprobs(params, self.runner.engine_vocab), stop_ids=stop_ids(params),
                         prompt_logprobs=self._prompt_scoring(req_id, params))
        self._pending.add(req_id)
