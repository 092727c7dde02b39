"""vLLM requests on the runtime's Runner: request ids <-> Sequences in batch slots and KV-cache blocks.

vLLM's scheduler decides which requests run, join and leave, and which KV-cache blocks each one holds; this adapter
only maps its decisions onto the one runtime: a joining request becomes a `Sequence` in a free slot whose block table
is the block ids vLLM allocated (`Scheduler.admit_now`, then `extend` as vLLM adds blocks; vLLM's block manager counts
the engine's blocks, block 0 being both vLLM's null block and our scratch block). Its first `computed` positions are
vLLM's prefix-cache hit, already in those blocks; the rest is encoded chunk by chunk as vLLM's scheduler sends it
(`Runner.prefill_to`, every request's chunk of a step in one call; the first token comes with the last chunk), each step is `Runner.step` over the scheduled
requests (plain, or speculative with a draft model: 1..K+1 tokens per request), and a finished request frees its
row. vLLM applies its own stop rules (EOS, stop ids, max_tokens, max_model_len) and trims a speculative block, so
the Sequences here never stop by themselves. A request asking for logprobs keeps its tokens' records (logprob, rank,
top-n) on its Sequence until `take_logprobs`; the Runner makes every step that schedules it plain.
No vLLM types here: `worker.py` adapts SchedulerOutput / ModelRunnerOutput to these calls, so this file is tested
directly against `generate_ids` (tests/vllm/test_runner.py).

Per step, decode runs before new requests are encoded (see runtime/runner.py for why). Tensor parallelism: every
rank runs its own adapter over its shard's engine, fed the same scheduler steps, so rows and graph calls (with their
collectives) line up across ranks; `agree` makes every rank use rank 0's sampled tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.model.kv_cache import CacheShape
from neuron_infer.model.sampling import make_generator
from neuron_infer.runtime.engine import Engine
from neuron_infer.runtime.options import RunOptions
from neuron_infer.runtime.runner import Agree, Runner
from neuron_infer.runtime.sequence import Sequence, StopRule, check_prompt
from neuron_infer.runtime.speculation import Speculation

NO_STOP = StopRule()  # vLLM decides when a request ends


class SlotRunner:
    """Maps request ids to Sequences and produces 1 (or, speculating, 1..K+1) tokens per scheduled request per
    step."""

    def __init__(self, engine: Engine, spec: Speculation | None = None, agree: Agree | None = None,
                 options: RunOptions = RunOptions()):  # noqa: B008 (frozen)
        options = dataclasses.replace(options, prefix_caching=False)  # vLLM's block manager caches prefixes
        self.runner = Runner(spec if spec is not None else engine, agree, options=options)
        self.runner.scheduler.caller_blocks = True  # vLLM allocates every block
        self.agree, self.batch = agree, engine.build.batch_size
        self.max_context, self.engine_vocab = engine.build.max_context_length, engine.vocab_size
        self.scheduler = self.runner.scheduler
        self.slots: dict[str, Sequence] = {}

    @property
    def stats(self):
        return self.runner.stats

    def reset_stats(self) -> None:
        self.runner.reset_stats()

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def engine_cache(self) -> CacheShape:
        """The (target) engine's KV cache: its block count is what vLLM's block manager hands out."""
        return self.runner.engine.cache_shape

    def admit(self, req_id: str, token_ids: list[int], sampling: SamplingConfig, blocks: list[int],
              prompt_len: int | None = None, logprobs: int | None = None, stop_ids: tuple[int, ...] = ()) -> int:
        """`join`, encode all of `token_ids` and return the first sampled token."""
        self.join(req_id, token_ids, sampling, blocks, prompt_len=prompt_len, logprobs=logprobs, stop_ids=stop_ids)
        return self.encode({req_id: len(token_ids)})[req_id][0]

    def encode(self, upto: dict[str, int]) -> dict[str, list[int]]:
        """Encode each joined request's tokens up to its position in `upto` (a chunk of its prompt; the pieces
        together in one graph call where the artifact has the batched prefill graph) -> per request [its first
        sampled token] once all are encoded, else []."""
        got = self.runner.prefill_to({self.slots[r]: end for r, end in upto.items()})
        return {r: got.get(self.slots[r], []) for r in upto}

    def join(self, req_id: str, token_ids: list[int], sampling: SamplingConfig, blocks: list[int], computed: int = 0,
             prompt_len: int | None = None, logprobs: int | None = None, stop_ids: tuple[int, ...] = (),
             prompt_logprobs: int | None = None) -> None:
        """Give `req_id` a free row whose block table is `blocks` (vLLM's block ids; the first `computed` positions
        are already cached in them); nothing is encoded yet (`encode`). `prompt_len`: for a resumed request, how many
        of `token_ids` are its prompt (the rest is output, which the presence and frequency penalties count); None =
        all prompt. `logprobs`: record each new token's logprob, rank and this many top alternatives (read them with
        `take_logprobs`); such a request makes every step plain. `stop_ids`: the ids sampling.min_tokens holds back
        (vLLM's stop token ids and EOS; its own stop rules end the request). `prompt_logprobs`: score every prompt
        token after the first as the prompt is encoded (read them with `take_prompt_logprobs`)."""
        if req_id in self.slots:
            raise NeuronInferError(f"request {req_id!r} is already in the batch")
        check_prompt(f"request {req_id!r}", token_ids, self.max_context, self.engine_vocab)
        cut = len(token_ids) if prompt_len is None else prompt_len
        seq = Sequence(req_id, list(token_ids[:cut]), sampling, NO_STOP, make_generator(sampling.seed),
                       output=list(token_ids[cut:]), logprobs=logprobs, stop_ids=tuple(stop_ids),
                       prompt_logprobs=prompt_logprobs)
        self.scheduler.admit_now(seq, blocks, computed)
        self.runner.begin(seq)
        self.slots[req_id] = seq

    def extend(self, req_id: str, blocks: list[int]) -> None:
        """vLLM allocated `blocks` (appended in order) to the running request `req_id`."""
        self.scheduler.extend(self.slots[req_id], blocks)

    def release(self, req_id: str) -> list[int] | None:
        """Free the row of `req_id` (no-op for unknown ids); return its tokens."""
        seq = self.slots.pop(req_id, None)
        if seq is None:
            return None
        self.runner.release(seq)
        return seq.tokens

    def take_logprobs(self, req_id: str) -> list[dict]:
        """The logprob records (see runtime `token_logprobs`) of the tokens `req_id` received since the last call,
        one per token, in order; [] for a request without logprobs."""
        seq = self.slots.get(req_id)
        if seq is None or seq.output_logprobs is None:
            return []
        got, seq.output_logprobs = seq.output_logprobs, []
        return got

    def constrain(self, req_id: str, allowed: torch.Tensor) -> None:
        """The next token `req_id` samples must be one of `allowed` (bool [V]: its grammar's mask for this step);
        a constrained request takes a plain step."""
        self.slots[req_id].allowed = allowed

    def take_prompt_logprobs(self, req_id: str) -> list[dict] | None:
        """The prompt's logprob records (one per prompt token after the first) once its prompt is encoded, handed
        out once; None before, afterwards, and for a request that did not ask."""
        seq = self.slots.get(req_id)
        if seq is None or seq.prompt_records is None or seq in self.runner.encoding or not seq.output:
            return None
        got, seq.prompt_records = seq.prompt_records, None
        return got

    def decode(self, req_ids: list[str]) -> dict[str, list[int]]:
        """One step over every row; the new tokens of each request in `req_ids` (one, or 1..K+1 speculating)."""
        scheduled = [self.slots[r] for r in req_ids]
        got = self.runner.step(scheduled, list(self.slots.values()))
        return {r: got[self.slots[r]] for r in req_ids}
