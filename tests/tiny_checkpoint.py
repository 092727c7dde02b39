"""Tiny random-weight Hugging Face Llama checkpoints, written at test time (shared by every test area).

    from tests.tiny_checkpoint import TINY_PRESETS, write_tiny_checkpoint
    model_dir = write_tiny_checkpoint(tmp_path / "m", **TINY_PRESETS["gqa"])

The directory holds what a downloaded HF model holds: `config.json` and `generation_config.json` (written by
`transformers.LlamaForCausalLM.save_pretrained(..., safe_serialization=True)`), `model.safetensors` (or shards +
`model.safetensors.index.json` when `max_shard_size` is given) and a small byte-level BPE tokenizer saved as a
`PreTrainedTokenizerFast` (bos `<s>`, eos `</s>`, pad `<pad>`, a ChatML chat template) that loads offline.

Weights are drawn from a seeded generator (same kwargs -> same bytes) with scales that keep activations O(1),
so logits are spread out and greedy decoding is not decided by near-ties. Norm weights and biases are random
too (HF initialises them to 1 / 0), so a test would notice a norm or bias that is ignored.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

# Base: 2 layers, hidden 96 (not a multiple of 128), GQA 4 query / 2 KV heads, head_dim 24, intermediate 200,
# vocab 512. Presets override it; every preset keeps at least one size that is not a multiple of 128.
TINY_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 96,
    "intermediate_size": 200,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    # multi-head attention: as many KV heads as query heads
    "mha": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 176},
    # grouped-query attention, 2 query heads per KV head
    "gqa": {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 200},
    # Llama 3.1 RoPE frequency scaling; original_max_position_embeddings small so the scaling bands matter
    "llama3_rope": {
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 320,
        "rope_theta": 500000.0, "max_position_embeddings": 1024,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    # Llama 3.2 / SmolLM2 style: lm_head shares the embedding matrix (no lm_head.weight in the file)
    "tied": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 256,
             "tie_word_embeddings": True},
    # explicit head_dim different from hidden_size // num_attention_heads (96 // 4 = 24)
    "head_dim": {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 40,
                 "intermediate_size": 200},
    # biases on q/k/v/o projections (and on the MLP)
    "attn_bias": {"hidden_size": 80, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 208,
                  "attention_bias": True, "mlp_bias": True},
}

_SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4 (pad, bos, eos: 0, 1, 2)
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "Once upon a time there was a little model that compiled itself into buckets and generated tokens.",
    "def hello(name):\n    return 'Hello, ' + name + '!'\n\nprint(hello('world'))",
    "One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 11 12",
    "Tensor parallelism splits attention heads and MLP columns across ranks; the results are gathered.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
]


def write_tiny_checkpoint(
    model_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
    tokenizer: bool = True,
    tokenizer_vocab_size: int = 320,
    **overrides: Any,
) -> Path:
    """Write a random-weight HF Llama checkpoint to `model_dir` and return it as a Path.

    Args:
        seed: weight seed (deterministic: same kwargs give identical files).
        dtype: storage dtype of the safetensors ("float32" | "bfloat16" | "float16").
        max_shard_size: e.g. "60KB" to write a sharded checkpoint with `model.safetensors.index.json`.
        tokenizer: also write the tiny tokenizer (needs tokenizer_vocab_size <= vocab_size).
        **overrides: `transformers.LlamaConfig` kwargs over `TINY_BASE`, e.g. `**TINY_PRESETS["tied"]`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**{**TINY_BASE, **overrides})
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    randomize_(model, seed)
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    if tokenizer:
        if tokenizer_vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer_vocab_size={tokenizer_vocab_size} > model vocab_size={config.vocab_size}")
        write_tiny_tokenizer(out, vocab_size=tokenizer_vocab_size)
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Seeded re-initialisation that keeps activations O(1): W ~ N(0, 1/fan_in), embeddings ~ N(0, 1/hidden),
    norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        else:  # [out, in] projection / lm_head, and embed_tokens [V, H] (std 1/sqrt(H): tied logits stay O(1))
            p.copy_(noise / math.sqrt(p.shape[1]))


def write_tiny_tokenizer(out: str | Path, vocab_size: int = 320) -> Path:
    """Train (deterministically, in milliseconds) a byte-level BPE tokenizer with `vocab_size` entries on a fixed
    corpus and save it as a PreTrainedTokenizerFast. Byte-level: any text encodes, decode(encode(t)) == t;
    encode() prepends bos `<s>` like Llama tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    # Llama-style: encode() prepends <s> (add_special_tokens=False leaves it out)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
    )
    fast.save_pretrained(Path(out))
    return Path(out)
