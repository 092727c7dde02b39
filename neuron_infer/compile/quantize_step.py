"""The compile-time quantization step: resolve the scheme's defaults, calibrate when needed, apply, report."""
from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

import torch

from neuron_infer.artifact.weights import resolve_quant
from neuron_infer.checkpoint import load_tokenizer
from neuron_infer.config import BuildConfig
from neuron_infer.model.llama import LlamaModel
from neuron_infer.quant import apply_quantization, check_combination
from neuron_infer.quant.smoothquant import smoothquant
from neuron_infer.quant.tiled import tile_model

CALIBRATION_WINDOWS = 4
CALIBRATION_TOKENS = 256


def calibration_text() -> str:
    """English text every CPython has: the pydoc topic help (used for SmoothQuant calibration)."""
    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_runner(model: LlamaModel, model_dir: Path):
    """A callable running the float model over a few fixed windows of calibration text."""
    chars = CALIBRATION_WINDOWS * CALIBRATION_TOKENS * 8  # ample for the windows, cheap to tokenize
    ids = load_tokenizer(model_dir)(calibration_text()[:chars])["input_ids"]
    t = min(CALIBRATION_TOKENS, model.max_positions)  # the RoPE tables hold build.max_length positions
    windows = [ids[i * t:(i + 1) * t] for i in range(CALIBRATION_WINDOWS) if len(ids) >= (i + 1) * t]
    cfg, lay = model.cfg, model.layout
    dtype = next(model.parameters()).dtype

    def run() -> None:
        for w in windows:
            k = torch.zeros(cfg.num_layers, 1, lay.num_kv_heads, t, cfg.head_dim, dtype=dtype)  # one block of t
            pos = torch.arange(t).view(1, t)
            table = torch.zeros(1, 1, dtype=torch.int64)  # [1, 1]: the one block
            model(torch.tensor([w]), pos, k, torch.zeros_like(k), pos[:, -1:], t, table)

    return run


def quantize_model(model: LlamaModel, build: BuildConfig, model_dir: Path) -> dict:
    """Quantize (then, with --weight-tiling, tile) `model` in place per build.quant; return the manifest record."""
    record = _quantize(model, build, model_dir)
    if build.quant.weight_tiling:
        record["weight_tiling"] = tile_model(model)  # after quantization (and, under TP, after sharding)
    return record


def _quantize(model: LlamaModel, build: BuildConfig, model_dir: Path) -> dict:
    if build.quant.scheme == "none":  # nothing converted; the report still gives the float linear bytes
        return apply_quantization(model, build.quant).to_dict()

    check_combination(build.quant, build.dtype)  # before calibration: w8a8/MX + tiling fail fast
    qcfg = resolve_quant(build.quant, model.cfg.num_layers)
    if qcfg.scheme == "w8a8":
        with torch.no_grad():
            report = smoothquant(model, calibration_runner(model, model_dir), qcfg.smoothquant_alpha,
                                 qcfg.modules_to_not_convert)
    else:
        report = apply_quantization(model, qcfg)
    return {**report.to_dict(), "modules_to_not_convert": list(qcfg.modules_to_not_convert)}
