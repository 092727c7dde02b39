"""Frozen, strict configuration objects, each with a JSON round trip.

- `ModelConfig`   — what the checkpoint is (parsed from a Hugging Face `config.json`).
- `BuildConfig`   — how it is compiled (target, dtype, batch, buckets, kernels, TP, quantization, speculation).
- `SamplingConfig`— how tokens are chosen at generation time.

Unknown keys and invalid combinations raise `ConfigError` with a message that says what to change.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_infer.errors import ConfigError
from neuron_infer.typed import Field, parse_dataclass, parse_fields, read_json, show

# --------------------------------------------------------------------------------------------------------------
# ModelConfig


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style RoPE frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"invalid llama3 rope scaling {self}: need factor > 0 and high_freq_factor > low_freq_factor > 0"
            )


# HF config.json keys that are not read (they do not change the inference math); accepted with any value.
_HF_IGNORED_KEYS = frozenset({
    "_name_or_path", "transformers_version", "use_cache", "initializer_range", "pretraining_tp", "pad_token_id",
    "torch_dtype", "dtype", "attention_dropout", "is_llama_config", "rope_interleaved", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "add_cross_attention", "cross_attention_hidden_size", "finetuning_task",
    "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "tf_legacy_loss", "use_bfloat16",
    "torchscript", "pruned_heads", "is_decoder", "layer_types", "max_window_layers", "_model_name_or_path",
    "unk_token_id", "transformers.js_config",
})
_SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# HF config.json keys that are read, with their JSON types and defaults (checked by neuron_infer.typed).
_HF_FIELDS: dict[str, Field] = {
    "vocab_size": Field(int, positive=True),
    "hidden_size": Field(int, positive=True),
    "intermediate_size": Field(int, positive=True),
    "num_hidden_layers": Field(int, positive=True),
    "num_attention_heads": Field(int, positive=True),
    "num_key_value_heads": Field(int | None, None, positive=True),
    "head_dim": Field(int | None, None, positive=True),
    "max_position_embeddings": Field(int, 2048, positive=True),
    "rms_norm_eps": Field(float, 1e-6, positive=True),
    "rope_theta": Field(float | None, None, positive=True),
    "rope_scaling": Field(dict[str, Any] | None, None),
    "rope_parameters": Field(dict[str, Any] | None, None),
    "tie_word_embeddings": Field(bool, False),
    "attention_bias": Field(bool, False),
    "mlp_bias": Field(bool, False),
    "bos_token_id": Field(int | None, None, nonnegative=True),
    "eos_token_id": Field(int | tuple[int, ...] | None, None, nonnegative=True),
    "hidden_act": Field(str, "silu"),
    "model_type": Field(str, "llama"),
    "architectures": Field(tuple[str, ...] | None, None),
    "sliding_window": Field(int | None, None),
    "use_sliding_window": Field(bool, True),
    "quantization_config": Field(dict[str, Any] | None, None),
}


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family architecture hyper-parameters (Llama 2/3/3.1/3.2, SmolLM2, Mistral-style GQA)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model config field {name}={getattr(self, name)} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}; "
                "grouped-query attention needs every KV head to serve the same number of query heads"
            )
        for name in ("rms_norm_eps", "rope_theta"):  # the model's own hyperparameters: any finite value > 0
            if not _finite_positive(getattr(self, name)):
                raise ConfigError(f"model config field {name}={show(getattr(self, name))} must be a finite number > 0")
        if any(not 0 <= t < self.vocab_size for t in (*self.eos_token_ids, self.bos_token_id or 0)):
            raise ConfigError(f"token ids bos_token_id={self.bos_token_id}, eos_token_ids={self.eos_token_ids} "
                              f"must be in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size}: an id past it "
                              "has no embedding row, and an EOS id the model cannot emit never stops a sequence)")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---- Hugging Face config.json ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Any, where: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face Llama `config.json` dict; anything we cannot run raises `ConfigError`."""
        v = parse_fields(d, _HF_FIELDS, where, missing_hint="; is this a Llama config.json?")
        arch = v["architectures"] or ("LlamaForCausalLM",)
        if v["model_type"] != "llama" or any(a not in _SUPPORTED_ARCHITECTURES for a in arch):
            raise ConfigError(
                f"{where}: unsupported architecture model_type={v['model_type']!r} architectures={list(arch)}; "
                f"neuron-infer runs Llama-family checkpoints ({', '.join(_SUPPORTED_ARCHITECTURES)})"
            )
        unknown = sorted(k for k in d if k not in _HF_FIELDS and k not in _HF_IGNORED_KEYS)
        if unknown:
            raise ConfigError(
                f"{where}: unknown config key(s) {unknown}; neuron-infer cannot tell whether they change the model. "
                "If they do not, delete them from config.json; otherwise this model is not supported."
            )
        _reject_unsupported_hf_values(v, where)
        heads, rope = v["num_attention_heads"], _parse_rope(v, where)
        return cls(
            vocab_size=v["vocab_size"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=v["num_key_value_heads"] or heads,
            head_dim=v["head_dim"] or _head_dim(v["hidden_size"], heads, where),
            rms_norm_eps=v["rms_norm_eps"],
            rope_theta=rope["rope_theta"] or v["rope_theta"] or 10000.0,
            rope_scaling=_rope_scaling(rope, where),
            max_position_embeddings=v["max_position_embeddings"],
            tie_word_embeddings=v["tie_word_embeddings"],
            attention_bias=v["attention_bias"],
            mlp_bias=v["mlp_bias"],
            bos_token_id=v["bos_token_id"],
            eos_token_ids=_eos_tuple(v["eos_token_id"]),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            state = "is a file, not a directory" if model_dir.exists() else "does not exist"
            raise ConfigError(f"model directory {model_dir} {state}; give the directory of a Hugging Face "
                              "checkpoint (config.json, *.safetensors and tokenizer files)")
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{path} not found: a model directory needs a Hugging Face config.json next to its safetensors "
                "weights (download the full model repository, not only the weights)"
            )
        return cls.from_hf_dict(read_json(path, "re-download it"), where=str(path))

    # ---- our own JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "model config") -> "ModelConfig":
        return parse_dataclass(cls, d, where)


def _finite_positive(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:  # an integer too large for a float
        return False


def _eos_tuple(v: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if v is None:
        return ()
    return v if isinstance(v, tuple) else (v,)


def _head_dim(hidden: int, heads: int, where: str) -> int:
    if hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                          "such a checkpoint must give head_dim explicitly")
    return hidden // heads


_ROPE_FIELDS = {
    "rope_type": Field(str | None, None), "type": Field(str | None, None),
    "rope_theta": Field(float | None, None, positive=True), "factor": Field(float | None, None, positive=True),
    "low_freq_factor": Field(float | None, None, positive=True),
    "high_freq_factor": Field(float | None, None, positive=True),
    "original_max_position_embeddings": Field(int | None, None, positive=True),
}


def _parse_rope(v: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The rope dict, typed: transformers 5 writes `rope_parameters` (with rope_theta inside); older configs write
    `rope_scaling` (and a top-level rope_theta). `_key` records which one it came from."""
    key = "rope_scaling" if v["rope_scaling"] else "rope_parameters"
    d = v[key] or {}
    rope = parse_fields(d, _ROPE_FIELDS, where, field=key)
    rope["_key"] = key
    rope_type = rope["rope_type"] or rope["type"] or "default"
    if rope_type not in ("default", "llama3"):
        name = "rope_type" if rope["rope_type"] else "type"
        raise ConfigError(
            f"{where}: {key}.{name} {rope_type!r} is not supported; neuron-infer implements the rope types "
            "'default' and 'llama3' (Llama 3.1/3.2)"
        )
    unknown = sorted(k for k in d if k not in _ROPE_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} in {key}; neuron-infer cannot tell whether they "
                          "change the model")
    rope["rope_type"] = rope_type
    return rope


def _rope_scaling(rope: Mapping[str, Any], where: str) -> RopeScaling | None:
    if rope["rope_type"] == "default":
        return None
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [n for n in names if rope[n] is None]
    if missing:
        raise ConfigError(f"{where}: llama3 rope scaling is missing {missing[0]!r} in {rope['_key']}")
    try:
        return RopeScaling(**{n: rope[n] for n in names})
    except ConfigError as e:
        raise ConfigError(f"{where}: {rope['_key']}: {e}") from e


def _reject_unsupported_hf_values(v: Mapping[str, Any], where: str) -> None:
    if v["hidden_act"] != "silu":
        raise ConfigError(f"{where}: hidden_act={v['hidden_act']!r} is not supported (Llama uses 'silu')")
    if v["sliding_window"] and v["use_sliding_window"]:
        raise ConfigError(f"{where}: sliding-window attention (sliding_window={v['sliding_window']}) is not supported")
    if v["quantization_config"]:
        raise ConfigError(
            f"{where}: the checkpoint is pre-quantized (quantization_config present); give neuron-infer the "
            "original bf16/fp16/fp32 checkpoint and choose --quant at compile time"
        )


# --------------------------------------------------------------------------------------------------------------
# BuildConfig

TARGETS = ("cpu", "neuron")
DTYPES = ("fp32", "bf16")
KERNELS = ("reference", "nki")
NGRAM_SIZE = 3  # prompt-lookup default: match the last 3 tokens (then 2, then 1)
QUANT_SCHEMES = ("none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class QuantConfig:
    """Compile-time weight quantization (see neuron_infer/quant)."""

    scheme: str = "none"
    modules_to_not_convert: tuple[str, ...] | None = None  # None: the scheme's default (fp8: the AWS recipe)
    weight_tiling: bool = False
    kv_cache_dtype: str = "auto"
    smoothquant_alpha: float = 0.5  # w8a8 migration strength

    def __post_init__(self) -> None:
        if self.scheme not in QUANT_SCHEMES:
            raise ConfigError(f"quant scheme {self.scheme!r} is unknown; choose one of {', '.join(QUANT_SCHEMES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} is unknown; choose auto or fp8")
        if self.modules_to_not_convert is not None and self.scheme == "none":
            raise ConfigError("modules_to_not_convert only makes sense with --quant; add --quant or drop the list")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ConfigError(f"smoothquant_alpha={self.smoothquant_alpha} must be in [0, 1]")
        if self.scheme in ("mxfp8", "mxfp4") and self.weight_tiling:
            raise ConfigError(f"--weight-tiling does not apply to --quant {self.scheme} (MX weights use the quad "
                              "x4 layout); drop --weight-tiling")


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding: a draft model (a path, 'self' for a self-draft, or 'ngram' for prompt lookup: drafts
    copied from the prompt and output, matching their last `ngram_size` tokens) proposes `length` tokens."""

    draft_model: str
    length: int
    fused: bool = False
    draft_quant: str = "none"
    draft_layers: int | None = None
    ngram_size: int | None = None  # prompt lookup: longest suffix matched (default NGRAM_SIZE)

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 64:
            raise ConfigError(f"speculation length {self.length} must be in 1..64 (published sweet spots are 4-7)")
        if self.draft_model == "ngram":
            if self.fused:
                raise ConfigError("--fused-speculation needs a draft model; n-gram drafts come from the host, so "
                                  "--draft-model ngram runs the host loop: drop --fused-speculation")
            if self.ngram_size is not None and not 1 <= self.ngram_size <= 16:
                raise ConfigError(f"--ngram-size {self.ngram_size} must be in 1..16")
        elif self.ngram_size is not None:
            raise ConfigError("--ngram-size describes prompt-lookup drafts; use it with --draft-model ngram")
        if self.draft_model != "self" and (self.draft_quant != "none" or self.draft_layers is not None):
            raise ConfigError("--draft-quant/--draft-layers describe a self-draft; use them with --draft-model self")
        if self.draft_model == "self" and self.draft_quant == "none" and self.draft_layers is None:
            raise ConfigError("--draft-model self needs --draft-quant or --draft-layers (else the draft is the target)")

    @property
    def is_ngram(self) -> bool:
        return self.draft_model == "ngram"

    @property
    def ngram(self) -> int:
        """The longest suffix prompt lookup matches."""
        return self.ngram_size or NGRAM_SIZE


# tokens per KV-cache block when every bucket allows it: Neuron 128 (as vendors' paged caches); CPU 32, since its
# dynamic graphs attend over whole blocks (at least two): a 25-token prompt reads 64 keys, not 256 (docs/kv-cache.md)
DEFAULT_BLOCK_SIZE = {"neuron": 128, "cpu": 32}


def auto_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from `lo` up to (and always including) `hi`: auto_buckets(128, 600) == (128, 256, 512, 600)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class BuildConfig:
    """How a model is compiled. Buckets of `None` mean automatic powers of two."""

    target: str = "cpu"
    dtype: str = "bf16"
    batch_size: int = 1
    max_context_length: int = 256
    max_length: int = 512
    context_buckets: tuple[int, ...] | None = None
    tokengen_buckets: tuple[int, ...] | None = None
    tokengen_batch_buckets: tuple[int, ...] | None = None  # token-generation graphs by number of running rows
    kernels: str = "reference"
    tp_degree: int = 1
    quant: QuantConfig = field(default_factory=QuantConfig)
    speculation: SpeculationConfig | None = None
    lnc: int | None = None  # neuron: logical NeuronCore degree; None = NEURON_LOGICAL_NC_CONFIG or the platform's
    kv_block_size: int | None = None  # tokens per KV-cache block; None = gcd(128, every bucket)

    def __post_init__(self) -> None:
        _check_choice("target", self.target, TARGETS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kernels", self.kernels, KERNELS)
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be >= 1")
        if self.tp_degree < 1:
            raise ConfigError(f"tp_degree={self.tp_degree} must be >= 1")
        if self.lnc not in (None, 1, 2):
            raise ConfigError(f"lnc={self.lnc!r} is not a logical NeuronCore degree; use 1 or 2")
        if not 1 <= self.max_context_length <= self.max_length:
            raise ConfigError(
                f"max_context_length={self.max_context_length} must be in 1..max_length={self.max_length} "
                "(the prompt is part of the total length); raise --max-length or lower --max-context-length"
            )
        _check_buckets("context_buckets", self.context_buckets, self.max_context_length, "--max-context-length")
        _check_buckets("tokengen_buckets", self.tokengen_buckets, self.max_length, "--max-length")
        _check_buckets("tokengen_batch_buckets", self.tokengen_batch_buckets, self.batch_size, "--batch-size")
        _check_block_size(self.kv_block_size, self.context_bucket_list + self.tokengen_bucket_list)

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block: kv_block_size, or the largest divisor of the target's default (DEFAULT_BLOCK_SIZE)
        that divides every bucket."""
        return self.kv_block_size or math.gcd(DEFAULT_BLOCK_SIZE[self.target], *self.context_bucket_list,
                                              *self.tokengen_bucket_list)

    @property
    def default_kv_blocks(self) -> int:
        """Blocks of the default cache: batch_size sequences of max_length tokens, plus the scratch block 0."""
        return self.batch_size * (self.max_length // self.block_size) + 1

    @property
    def context_bucket_list(self) -> tuple[int, ...]:
        return self.context_buckets or auto_buckets(min(128, self.max_context_length), self.max_context_length)

    @property
    def tokengen_bucket_list(self) -> tuple[int, ...]:
        return self.tokengen_buckets or auto_buckets(min(128, self.max_length), self.max_length)

    @property
    def tokengen_batch_list(self) -> tuple[int, ...]:
        """Batch sizes with a token-generation graph; a step uses the smallest >= its running sequences."""
        return self.tokengen_batch_buckets or auto_buckets(1, self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "build config") -> "BuildConfig":
        return parse_dataclass(cls, d, where)

    def replace(self, **changes: Any) -> BuildConfig:
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")


def _check_block_size(size: int | None, buckets: tuple[int, ...]) -> None:
    if size is None:
        return
    bad = sorted({b for b in buckets if size < 1 or b % size})
    if size < 1 or bad:
        raise ConfigError(
            f"kv_block_size={size} must be a positive divisor of every context and token-generation bucket "
            f"(not of {bad}); choose a divisor of {math.gcd(*buckets)} or leave it unset")


def _check_buckets(name: str, buckets: tuple[int, ...] | None, limit: int, flag: str) -> None:
    if buckets is None:
        return
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise ConfigError(f"{name}={list(buckets)} must be a non-empty, strictly increasing list of positive sizes")
    if buckets[-1] != limit:
        raise ConfigError(
            f"the largest of {name}={list(buckets)} must equal {flag}={limit}, so every allowed length has a "
            f"bucket; append {limit} to the list or change {flag}"
        )


# --------------------------------------------------------------------------------------------------------------
# SamplingConfig


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; seed None = nondeterministic; min_p 0 = off
    (keep tokens with probability >= min_p x the top token's); repetition_penalty 1 = off (logits of tokens seen in
    prompt or output divided by it when positive, multiplied when negative); presence_penalty / frequency_penalty
    0 = off (subtracted from the logits of output tokens: presence once, frequency per occurrence); min_tokens 0 = off
    (the stop token ids cannot be sampled until the output holds this many tokens, and stop strings do not end it
    sooner); logit_bias () = off ((token id, bias) pairs added to those tokens' logits, bias in [-100, 100] as in
    OpenAI; a Mapping {id: bias} is accepted and stored as pairs sorted by id)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _normalize_numbers(self, ints=("top_k", "seed", "min_tokens"), floats=(
            "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens={self.min_tokens!r} must be an integer >= 0 (0 disables it)")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed} must be in 0..2**63-1")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1 disables nucleus sampling)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name}={getattr(self, name)} must be in [-2, 2] (0 disables it)")

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biased(self) -> bool:
        """Whether logits get an additive adjustment: logit_bias, or min_tokens holding back the stop ids."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "sampling config") -> "SamplingConfig":
        return parse_dataclass(cls, d, where)


def _normalize_numbers(obj: Any, ints: tuple[str, ...], floats: tuple[str, ...]) -> None:
    """Each field of `ints` an integer (a NumPy integer becomes an int; a bool, 2.5 or "3" is refused; a None seed
    stays None), each of `floats` a real number stored as float (a bool or a string is refused)."""
    for name in ints + floats:
        v = getattr(obj, name)
        if v is None and name == "seed":  # the one optional field: None = nondeterministic
            continue
        want = numbers.Integral if name in ints else numbers.Real
        if isinstance(v, bool) or not isinstance(v, want):
            kind = "an integer" if name in ints else "a number"
            raise ConfigError(f"{name}={v!r} must be {kind}, not {type(v).__name__}")
        try:
            value = int(v) if name in ints else float(v)
        except OverflowError:  # an int past float's range (10**400): infinite, which the range checks refuse
            value = math.inf if v > 0 else -math.inf
        object.__setattr__(obj, name, value)


MAX_LOGIT_BIAS = 100.0  # OpenAI's (and vLLM's) bound on one logit_bias value


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as a Mapping {id: bias} or pairs -> ((id, bias), ...) sorted by id; ConfigError names a bad entry."""
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError(f"logit_bias entry {item!r} must be a (token id, bias) pair")
        tok, b = item
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ConfigError(f"logit_bias token id {tok!r} must be an integer >= 0")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias value {b!r} for token {tok} must be a number in [-100, 100]")
        pairs.append((tok, float(b)))
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"logit_bias names token {next(t for t in ids if ids.count(t) > 1)} more than once")
    return tuple(sorted(pairs))
