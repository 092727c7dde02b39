"""Known model configurations and Neuron instance types for the capacity planner (`neuron-infer plan`).

Model presets are the public Hugging Face `config.json` values (architecture fields only):
    llama-3.1-8b    meta-llama/Llama-3.1-8B        https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    llama-3.1-70b   meta-llama/Llama-3.1-70B       https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    llama-3.1-405b  meta-llama/Llama-3.1-405B      https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    llama-3.2-1b    meta-llama/Llama-3.2-1B        https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    smollm2-135m    HuggingFaceTB/SmolLM2-135M-Instruct (the embedded default model)
                    https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json

Chip figures (docs/case-studies.md "Background figures"; AWS NKI documentation; AWS Neuron docs
about-neuron/arch/neuron-hardware/{trainium,inferentia2,trainium2,trainium3}.rst):

| chip        | NeuronCores | HBM     | HBM bandwidth | dense BF16 TFLOPS | FP8 TFLOPS            | MX TFLOPS |
|-------------|-------------|---------|---------------|-------------------|-----------------------|-----------|
| Trainium    | 2 (v2)      | 32 GiB  | 820 GB/s      | 190               | 190 (cFP8)            | -         |
| Inferentia2 | 2 (v2)      | 32 GiB  | 820 GB/s      | 190               | 190 (cFP8)            | -         |
| Trainium2   | 8 (v3)      | 96 GiB  | 2.9 TB/s      | 667               | 1,299                 | -         |
| Trainium3   | 8 (v4)      | 144 GiB | 4.9 TB/s      | 671               | 1,342 (2 x BF16, [U]) | 2,517     |
[U] = uncertain: the Trn3 docs give MXFP8/MXFP4 only; plain FP8 at twice BF16 mirrors Trn2.
The Trainium/Inferentia2 pages say "820 GiB/sec" in one version and "820 GB/sec" in another; we use 820e9 B/s
(the smaller, so the time bounds are not flattered).

Instances (chips per instance): trn1.2xlarge 1, trn1.32xlarge 16 (trn1-arch.rst); inf2.xlarge 1, inf2.8xlarge 1,
inf2.24xlarge 6, inf2.48xlarge 12 (https://aws.amazon.com/ec2/instance-types/inf2/); trn2.48xlarge 16
(trn2-arch; 128 physical cores = 64 logical at LNC=2). `trn3` is ASSUMED to be one
server of a Trn3 Gen1 UltraServer: 16 Trainium3 chips (trn3-arch.rst: "four servers with 16 Trainium3 devices per
server"); Gen2 UltraServers use 4-chip servers, so check your instance before trusting trn3 rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neuron_infer.config import ModelConfig, RopeScaling
from neuron_infer.errors import ConfigError

_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
_LLAMA3_COMMON = dict(vocab_size=128256, head_dim=128, num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,))

MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                                rope_scaling=_LLAMA31_ROPE, **_LLAMA3_COMMON),
    "llama-3.1-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                                 rope_scaling=_LLAMA31_ROPE, **_LLAMA3_COMMON),
    "llama-3.1-405b": ModelConfig(hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128,
                                  rope_scaling=_LLAMA31_ROPE, **_LLAMA3_COMMON),
    "llama-3.2-1b": ModelConfig(
        hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, tie_word_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        **{**_LLAMA3_COMMON, "head_dim": 64},
    ),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                                eos_token_ids=(2,)),
}


@dataclass(frozen=True)
class Chip:
    """Published per-chip figures (see the module table)."""

    name: str
    cores: int  # physical NeuronCores
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float  # dense, per second
    fp8_flops: float
    mx_flops: float  # MXFP8/MXFP4 (0 = no MX support)


_GIB = 2**30
TRAINIUM = Chip("Trainium", 2, 32 * _GIB, 820e9, 190e12, 190e12, 0.0)
INFERENTIA2 = Chip("Inferentia2", 2, 32 * _GIB, 820e9, 190e12, 190e12, 0.0)
TRAINIUM2 = Chip("Trainium2", 8, 96 * _GIB, 2.9e12, 667e12, 1299e12, 0.0)
TRAINIUM3 = Chip("Trainium3", 8, 144 * _GIB, 4.9e12, 671e12, 1342e12, 2517e12)


@dataclass(frozen=True)
class Instance:
    """An instance type: `chips` x `chip`; `lnc_options` lists the logical-NeuronCore sizes it supports."""

    name: str
    chip: Chip
    chips: int
    lnc_options: tuple[int, ...] = (1,)
    default_lnc: int = 1

    @property
    def physical_cores(self) -> int:
        return self.chip.cores * self.chips

    def logical_cores(self, lnc: int) -> int:
        return self.physical_cores // lnc


INSTANCES: dict[str, Instance] = {i.name: i for i in (
    Instance("trn1.2xlarge", TRAINIUM, 1),
    Instance("trn1.32xlarge", TRAINIUM, 16),
    Instance("inf2.xlarge", INFERENTIA2, 1),
    Instance("inf2.8xlarge", INFERENTIA2, 1),
    Instance("inf2.24xlarge", INFERENTIA2, 6),
    Instance("inf2.48xlarge", INFERENTIA2, 12),
    Instance("trn2.48xlarge", TRAINIUM2, 16, lnc_options=(1, 2), default_lnc=2),
    Instance("trn3", TRAINIUM3, 16, lnc_options=(1, 2), default_lnc=2),
)}


def get_instance(name: str) -> Instance:
    if name not in INSTANCES:
        raise ConfigError(f"instance {name!r} is unknown; choose one of {', '.join(INSTANCES)}")
    return INSTANCES[name]


def resolve_model(model: str) -> tuple[str, ModelConfig]:
    """A preset name (case-insensitive) or a checkpoint directory with a Hugging Face config.json."""
    key = model.lower()
    if key in MODEL_PRESETS:
        return key, MODEL_PRESETS[key]
    if Path(model).exists() or "/" in model:  # a path: ModelConfig says what is wrong with it
        return Path(model).name, ModelConfig.from_model_dir(model)
    raise ConfigError(
        f"model {model!r} is neither a known preset ({', '.join(MODEL_PRESETS)}) nor a checkpoint directory "
        "with a config.json"
    )
