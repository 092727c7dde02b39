"""Target NeuronCore generation and its hardware constants (NKI documentation)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import SimulationError

_TARGETS = {"trn1": 2, "inf2": 2, "gen2": 2, "trn2": 3, "gen3": 3, "trn3": 4, "gen4": 4}
DEFAULT_TARGET = "trn3"  # §7.1: unset and no device -> trn3


@dataclass(frozen=True)
class Target:
    """Per-generation constants used by validation and allocation accounting."""

    gen: int
    name: str
    sbuf_bytes_per_partition: int   # usable bytes/partition (tile_size.sbuf_fmax_bytes, §2.2; UNCERTAIN there)
    psum_banks: int = 8
    psum_bank_bytes: int = 2048
    pmax: int = 128

    @property
    def psum_bytes_per_partition(self) -> int:
        return self.psum_banks * self.psum_bank_bytes

    def matmul_n_max(self, dst_itemsize: int) -> int:
        """Moving free size limit: one fp32 PSUM bank on gen2/3; 4096 fp32 / 8192 bf16 on gen4 (§5.1)."""
        if self.gen < 4:
            return 512
        return 8192 if dst_itemsize == 2 else 4096


_SBUF = {2: 180_224, 3: 212_984, 4: 245_752}


def parse_target(name: str | None) -> Target:
    """Map a target string (trn1|inf2|gen2, trn2|gen3, trn3|gen4) to its constants."""
    key = (name or DEFAULT_TARGET).strip().lower()
    if key not in _TARGETS:
        raise SimulationError(f"unknown NeuronCore target {name!r}; use one of trn1|inf2|gen2, trn2|gen3, trn3|gen4")
    gen = _TARGETS[key]
    return Target(gen=gen, name=f"gen{gen}", sbuf_bytes_per_partition=_SBUF[gen])


def target_from_env() -> Target:
    """Target from NEURON_PLATFORM_TARGET_OVERRIDE (default trn3)."""
    return parse_target(os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or None)


def precise_fp_from_env() -> bool:
    """NKI_PRECISE_FP (default 1): 0 stores bf16/fp16/fp8 tensors as fp32 (§6.2)."""
    value = os.environ.get("NKI_PRECISE_FP", "1").strip()
    if value not in ("0", "1"):
        raise SimulationError(f"NKI_PRECISE_FP must be 0 or 1, got {value!r}")
    return value == "1"
