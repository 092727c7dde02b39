"""Metrics of generation: latency, throughput and (when a draft model speculates) speculation counters.

One type for every caller: `CompiledModel.generate` (one Metrics per static batch), tensor-parallel ranks and the
vLLM runner (cumulative counters over the steps it served).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    """Latency and counters of a run of steps.

    token_latencies_s holds one entry per decode step (emission to emission, after the first token); a speculative
    step emits 1..K+1 tokens per sequence, so tokens_per_s / ms_per_token count the tokens actually emitted.
    The speculation counters stay zero (and k == 0) without a draft model.
    """

    ttft_s: float = 0.0
    token_latencies_s: list[float] = field(default_factory=list)
    num_generated: int = 0  # tokens of the longest sequence
    decode_tokens: int = 0  # tokens after each sequence's first one, summed over sequences
    tokens_per_s: float = 0.0  # decode tokens of all sequences per second
    ms_per_token: float = 0.0  # per sequence
    k: int = 0  # speculation length (0: no draft)
    mode: str = ""  # "fused" | "unfused" when speculating
    spec_steps: int = 0  # speculative steps (all scheduled sequences together)
    plain_steps: int = 0  # one-token steps
    gated_steps: int = 0  # of those, steps that could speculate but the gate measured speculation not to pay
    draft_catch_up: int = 0  # draft passes that wrote what prompt encoding and plain steps left out (catch_up)
    gate: dict = field(default_factory=dict)  # the gate's last measurements (SpecGate.summary), {} without a gate
    drafted: int = 0  # draft tokens proposed to scheduled sequences
    accepted: int = 0  # of those, accepted by the target
    emitted_per_step: list[int] = field(default_factory=list)  # per (speculative step, sequence): tokens emitted
    kv_blocks: int = 0  # usable KV-cache blocks (the scratch block aside)
    kv_blocks_in_use: int = 0  # the most blocks held at once by running sequences
    prefix_blocks_queried: int = 0  # full prompt blocks looked up in the prefix cache (cumulative on the engine)
    prefix_blocks_hit: int = 0  # of those, found (not encoded again)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_blocks_hit / self.prefix_blocks_queried if self.prefix_blocks_queried else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens_per_step(self) -> float:
        e = self.emitted_per_step
        return sum(e) / len(e) if e else 0.0

    def finish(self, sequences: int) -> None:
        """Derive the rates once the run ended (`sequences` ran together)."""
        t = sum(self.token_latencies_s)
        if t > 0 and self.decode_tokens:
            self.tokens_per_s = self.decode_tokens / t
            self.ms_per_token = 1000.0 * t * sequences / self.decode_tokens

    def speculation(self) -> dict | None:
        if not self.k:
            return None
        return {"k": self.k, "mode": self.mode, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_tokens_per_step": self.mean_accepted_tokens_per_step, "spec_steps": self.spec_steps,
                "plain_steps": self.plain_steps, "gated_steps": self.gated_steps,
                "draft_catch_up": self.draft_catch_up, "drafted": self.drafted, "accepted": self.accepted,
                **({"gate": self.gate} if self.gate else {})}

    def to_dict(self) -> dict:
        out = {"ttft_s": self.ttft_s, "ms_per_token": self.ms_per_token, "tokens_per_s": self.tokens_per_s,
               "num_generated": self.num_generated, "token_latencies_s": self.token_latencies_s,
               "kv_cache": {"blocks": self.kv_blocks, "blocks_in_use": self.kv_blocks_in_use,
                            "prefix_blocks_queried": self.prefix_blocks_queried,
                            "prefix_blocks_hit": self.prefix_blocks_hit, "prefix_hit_rate": self.prefix_hit_rate}}
        spec = self.speculation()
        return out if spec is None else {**out, "speculation": spec}


def pooled(batches: list[Metrics]) -> dict:
    """The metrics of several static batches of one request, for `generate --json`."""
    steps = [x for b in batches for x in b.token_latencies_s]
    decode = sum(b.decode_tokens for b in batches)
    out = {"ttft_s": batches[0].ttft_s if batches else 0.0,
           "ms_per_token": (sum(b.ms_per_token for b in batches) / len(batches)) if batches else 0.0,
           "tokens_per_s": decode / sum(steps) if steps and decode else 0.0,
           "token_latencies_s": steps, "batches": [b.to_dict() for b in batches]}
    spec = [b for b in batches if b.k]
    if spec:
        total = Metrics(k=spec[0].k, mode=spec[0].mode)
        for b in spec:
            total.spec_steps += b.spec_steps
            total.plain_steps += b.plain_steps
            total.gated_steps += b.gated_steps
            total.draft_catch_up += b.draft_catch_up
            total.drafted += b.drafted
            total.accepted += b.accepted
            total.emitted_per_step += b.emitted_per_step
        out["speculation"] = total.speculation()
    return out
