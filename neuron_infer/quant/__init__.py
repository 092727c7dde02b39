"""Weight quantization as a transform applied after the float model exists (one strategy class per scheme).

    report = apply_quantization(model, QuantConfig(scheme="int8"))

replaces every `torch.nn.Linear` of `model` (HF names: model.layers.{i}.self_attn.{q,k,v,o}_proj,
model.layers.{i}.mlp.{gate,up,down}_proj, lm_head) by the scheme's `QuantizedLinear`, except those matched by
`modules_to_not_convert`. With `structure_only=True` it builds empty quantized modules of the right shapes and
dtypes instead (to load a compiled artifact's state dict with `load_state_dict(strict=True)`).

`modules_to_not_convert` matching (an entry E against a linear's qualified name Q):
* E matches Q if E, or "model." + E, equals Q or one of Q's dotted prefixes: "model.layers.0.mlp" (or NxDI-style
  "layers.0.mlp") covers that layer's gate/up/down_proj; "lm_head" covers lm_head.
* E may be a shell glob (fnmatch, case-sensitive; `*` also crosses dots), tried the same way:
  "model.layers.*.self_attn" or "layers.*.self_attn" keeps every attention projection in float.
* An entry that matches no linear raises ConfigError naming it (typos never pass silently).

Schemes (registry, imported lazily): int8, fp8, mxfp8, mxfp4, w8a8. See each module's docstring.
Importing this package does not import torch (mx_golden is shared with NumPy-only code).
"""
from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_infer.errors import ConfigError
from neuron_infer.text_input import read_text_file
from neuron_infer.typed import parse_json

if TYPE_CHECKING:  # torch is imported lazily so `neuron_infer.quant.mx_golden` stays NumPy-only
    import torch
    from torch import nn

SCHEMES = {
    "int8": ("neuron_infer.quant.int8", "Int8Linear"),
    "fp8": ("neuron_infer.quant.fp8", "FP8Linear"),
    "mxfp8": ("neuron_infer.quant.mx", "MXFP8Linear"),
    "mxfp4": ("neuron_infer.quant.mx", "MXFP4Linear"),
    "w8a8": ("neuron_infer.quant.smoothquant", "W8A8Linear"),
}


def get_scheme(name: str) -> type:
    """The QuantizedLinear class of scheme `name` (lazy import)."""
    if name not in SCHEMES:
        raise ConfigError(f"quant scheme {name!r} has no implementation; choose one of {', '.join(SCHEMES)}")
    module, cls = SCHEMES[name]
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class QuantReport:
    """What apply_quantization did: converted / kept linear names and weight bytes before and after."""

    scheme: str
    converted: tuple[str, ...]
    kept: tuple[str, ...]
    bytes_before: int
    bytes_after: int

    @property
    def compression(self) -> float:
        return self.bytes_before / self.bytes_after if self.bytes_after else 1.0

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "converted": list(self.converted), "kept": list(self.kept),
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "compression": round(self.compression, 4)}


# ---------------------------------------------------------------------------------------------------------------
# modules_to_not_convert


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def entry_matches(entry: str, name: str) -> bool:
    """True if modules_to_not_convert `entry` covers the linear called `name` (rules in the module docstring)."""
    patterns = (entry, "model." + entry)
    return any(fnmatch.fnmatchcase(p, pat) for p in _prefixes(name) for pat in patterns)


def split_not_convert(names: Iterable[str], entries: Iterable[str]) -> tuple[list[str], list[str]]:
    """Partition linear `names` into (convert, keep); raise ConfigError for entries that match nothing."""
    names, entries = list(names), list(entries)
    used: set[str] = set()
    convert, keep = [], []
    for n in names:
        hits = [e for e in entries if entry_matches(e, n)]
        used.update(hits)
        (keep if hits else convert).append(n)
    unused = [e for e in entries if e not in used]
    if unused:
        sample = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ConfigError(
            f"modules_to_not_convert entr{'y' if len(unused) == 1 else 'ies'} {unused} match no linear layer "
            f"(linear names look like: {sample}); fix the spelling, or use a prefix such as 'model.layers.0.mlp' "
            "or a glob such as 'model.layers.*.self_attn'"
        )
    return convert, keep


def default_fp8_not_convert(num_layers: int) -> tuple[str, ...]:
    """AWS's documented FP8 recipe for Llama: every self_attn, the first and last decoder MLP, and lm_head stay bf16."""
    if num_layers < 1:
        raise ConfigError(f"num_layers={num_layers} must be >= 1")
    mlps = sorted({0, num_layers - 1})
    return ("lm_head", *(f"model.layers.{i}.mlp" for i in mlps),
            *(f"model.layers.{i}.self_attn" for i in range(num_layers)))


def parse_modules_to_not_convert(value: str | Path | Iterable[str]) -> tuple[str, ...]:
    """CLI value -> entries. Accepts a list, a comma-separated string, or a file: JSON (a list, {"modules_to_not_convert":
    [...]}, or NxDI's {"model": {"modules_to_not_convert": [...]}}) or text with one entry per line (# comments)."""
    if not isinstance(value, (str, Path)):
        return _bounded_modules(tuple(str(v) for v in value), "modules_to_not_convert")
    path = Path(value)
    if not path.is_file():
        return _bounded_modules(tuple(v.strip() for v in str(value).split(",") if v.strip()), "--modules-to-not-convert")
    text = read_text_file(path, f"--modules-to-not-convert {path}")  # bounded, UTF-8 checked
    if path.suffix == ".json":
        try:
            data = parse_json(text)
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from e
        if isinstance(data, dict):
            data = data.get("model", data)
            data = data.get("modules_to_not_convert") if isinstance(data, dict) else None
        if not isinstance(data, list) or not all(isinstance(v, str) for v in data):
            raise ConfigError(f"{path}: expected a JSON list of module names or {{'modules_to_not_convert': [...]}}")
        return _bounded_modules(tuple(data), str(path))
    lines = (ln.split("#", 1)[0].strip() for ln in text.splitlines())
    return _bounded_modules(tuple(ln for ln in lines if ln), str(path))


MAX_MODULES_TO_NOT_CONVERT = 1 << 16  # distinct entries: every linear layer of any model is far fewer


def _bounded_modules(entries: tuple[str, ...], where: str) -> tuple[str, ...]:
    """`entries` without repeats (first kept, order unchanged); more than MAX_MODULES_TO_NOT_CONVERT distinct ones
    (each is matched against every linear layer) is a ConfigError."""
    unique = tuple(dict.fromkeys(entries))
    if len(unique) > MAX_MODULES_TO_NOT_CONVERT:
        raise ConfigError(f"{where} names {len(unique)} modules to keep in float; at most "
                          f"{MAX_MODULES_TO_NOT_CONVERT} are accepted (name layers or their prefixes, e.g. lm_head)")
    return unique


def check_combination(qcfg, model_dtype: str = "bf16") -> None:
    """Reject scheme/option/dtype combinations that have no meaning; called before any weight is touched."""
    if qcfg.scheme in ("mxfp8", "mxfp4") and qcfg.weight_tiling:
        raise ConfigError(
            f"--weight-tiling does not apply to --quant {qcfg.scheme}: MX weights use the nc_matmul_mx x4 quad "
            "layout (neuron_infer.quant.mx_golden); drop --weight-tiling"
        )
    if qcfg.scheme == "w8a8" and qcfg.weight_tiling:
        raise ConfigError(
            "--weight-tiling does not apply to --quant w8a8 (its linears quantize activations per token; the tiled "
            "module covers float, int8 and fp8 weights); drop --weight-tiling or use --quant int8/fp8"
        )
    if model_dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--quant {qcfg.scheme} needs a float model dtype (fp32/bf16/fp16), got {model_dtype!r}")
    if qcfg.scheme != "none":
        get_scheme(qcfg.scheme)


# ---------------------------------------------------------------------------------------------------------------
# the transform


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def apply_quantization(model: nn.Module, qcfg, *, structure_only: bool = False,
                       act_dtype: torch.dtype | None = None) -> QuantReport:
    """Swap model's nn.Linear modules for `qcfg.scheme`'s module in place; return a QuantReport.

    `qcfg` is a config.QuantConfig. structure_only: build empty modules (no weights read; the float linears may be
    on the meta device) in `act_dtype` (default: each linear's weight dtype).
    """
    from torch import nn  # lazy: importing neuron_infer.quant stays torch-free (mx_golden is NumPy-only)

    from neuron_infer.quant.base import linear_weight_bytes

    check_combination(qcfg)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if qcfg.scheme == "none":
        b = sum(linear_weight_bytes(m) for m in linears.values())
        return QuantReport("none", (), tuple(linears), b, b)
    cls = get_scheme(qcfg.scheme)
    convert, keep = split_not_convert(linears, qcfg.modules_to_not_convert or ())  # None: caller resolved defaults
    before = after = sum(linear_weight_bytes(linears[n]) for n in keep)
    new_modules = {}  # build everything first, swap after: a failure leaves the model untouched
    for name in convert:
        lin = linears[name]
        before += linear_weight_bytes(lin)
        if structure_only:
            dt = act_dtype or lin.weight.dtype
            new = cls.empty(lin.in_features, lin.out_features, lin.bias is not None, dt)
        else:
            new = cls.from_linear(lin).to(lin.weight.device)
        after += new.weight_bytes()
        new_modules[name] = new
    for name, new in new_modules.items():
        _set_submodule(model, name, new)
    return QuantReport(qcfg.scheme, tuple(convert), tuple(keep), before, after)
