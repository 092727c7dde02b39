"""`neuron-infer quantize`: offline checkpoint conversion (registered in cli.py as `cli.add_command(quantize_cmd)`).

Two inputs, told apart by the checkpoint's tensors:

* a float HF Llama checkpoint (fp32/bf16/fp16): `--quant {int8,fp8,mxfp8,mxfp4,w8a8}` quantizes it exactly as
  `neuron-infer compile --quant` does (same defaults: the fp8 recipe; SmoothQuant calibration on pydoc_data text)
  and writes OUT/model.safetensors with the quantized module tensors (e.g. `model.layers.0.mlp.up_proj.weight`
  int8 [out, in] + `...weight_scale` bf16 [out]; per scheme see neuron_infer/quant/*), the float tensors
  (embedding, norms, kept linears) in `--dtype`, OUT/quantization_config.json (scheme, modules_to_not_convert,
  report, formats) and config.json + tokenizer files copied.
* an FP8 checkpoint (`float8_e4m3fn` weights with `<name>_scale` siblings, e.g. an OCP e4m3fn export, +-448):
  checked against Neuron's E4M3 range (+-240). Out of range without `--rescale` -> a clear error (exit 2);
  with `--rescale` every FP8 weight is rescaled with scale compensation (quant.fp8.rescale_fp8_state_dict,
  method pow2 (exact) or nxdi), *verified* element by element against the original, and written with all other
  tensors unchanged (scales become float32 [out]).

Who reads the output (honestly): `load_quantized_checkpoint(OUT)` below rebuilds the quantized LlamaModel from a
float-conversion output with strict state-dict loading (tests compare it with in-process quantization).
`neuron-infer compile` reads *float* checkpoints only: to deploy, compile the float checkpoint with the same
`--quant` (deterministic: the artifact holds the same quantized tensors). A rescaled FP8 checkpoint is in the
"weight + weight_scale" layout that NxDI's quantized-checkpoint loading uses on Neuron (not yet run on hardware);
neuron-infer's compile cannot consume it yet.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
from safetensors import safe_open

from neuron_infer.cli_help import path_param
from neuron_infer.config import BuildConfig, ModelConfig, QuantConfig
from neuron_infer.errors import CheckpointError, ConfigError
from neuron_infer.oserrors import check_output_location, writing_to
from neuron_infer.output_dir import atomic_output
from neuron_infer.quant import parse_modules_to_not_convert
from neuron_infer.typed import parse_json, read_json

FORMAT = "neuron-infer-quantized-v1"
CONFIG_FILE = "quantization_config.json"
WEIGHTS_FILE = "model.safetensors"
_FP8_TAGS = ("F8_E4M3",)


def checkpoint_has_fp8(model_dir: Path) -> bool:
    """True if any tensor of the checkpoint is stored as float8 e4m3 (header scan, no data read)."""
    from neuron_infer.checkpoint import read_header, safetensors_files

    for path in safetensors_files(model_dir)[0]:
        read_header(path)  # a damaged header: one CheckpointError naming the file, before the native reader sees it
        with safe_open(str(path), framework="pt") as f:
            if any(f.get_slice(k).get_dtype() in _FP8_TAGS for k in f.keys()):  # noqa: SIM118  (safe_open is not a dict)
                return True
    return False


def _copy_side_files(model_dir: Path, out: Path) -> None:
    from neuron_infer.compile.inputs import TOKENIZER_FILES

    for name in ("config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)


def quantized_files(root: Path) -> set[str] | None:
    """The files a previous `quantize` output in `root` owns, or None if it is not one (for --overwrite)."""
    from neuron_infer.compile.inputs import TOKENIZER_FILES

    try:
        meta = parse_json((root / CONFIG_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    return {WEIGHTS_FILE, CONFIG_FILE, "config.json", *TOKENIZER_FILES}


def _output(src: Path, out: Path, overwrite: bool):
    """The atomic output directory (neuron_infer.output_dir): written aside, renamed into place when complete."""
    return atomic_output(out, overwrite=overwrite, owned=quantized_files, what="quantize output", sources=[src])


def quantize_float_checkpoint(model_dir: Path, out: Path, scheme: str, modules, dtype: str) -> dict:
    """Float HF checkpoint -> quantized safetensors + quantization_config.json; returns the written config."""
    import torch
    from safetensors.torch import save_file

    from neuron_infer.artifact.weights import build_float_model
    from neuron_infer.checkpoint import load_checkpoint
    from neuron_infer.compile.quantize_step import quantize_model

    cfg = ModelConfig.from_model_dir(model_dir)
    build = BuildConfig(dtype=dtype, quant=QuantConfig(scheme=scheme, modules_to_not_convert=modules))
    model = build_float_model(cfg, build, load_checkpoint(model_dir, cfg))
    record = quantize_model(model, build, model_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings and type(model.lm_head) is torch.nn.Linear:
        state.pop("lm_head.weight")  # still shared with the embedding (lm_head kept in float)
    meta = {"format": FORMAT, "dtype": dtype, "quant": record,
            "build_quant": {"scheme": scheme, "modules_to_not_convert": record.get("modules_to_not_convert", [])}}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt", "neuron_infer": json.dumps(meta)})
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def rescale_fp8_checkpoint(model_dir: Path, out: Path, rescale: bool, method: str) -> dict:
    """FP8 checkpoint -> range check (rescale=False) or rescale + verification into `out`."""
    from safetensors.torch import load_file, save_file

    from neuron_infer.checkpoint import safetensors_files
    from neuron_infer.quant.fp8 import fp8_weight_names, rescale_fp8_state_dict

    files, _ = safetensors_files(model_dir)
    state = {}
    for path in files:
        state.update(load_file(str(path)))
    fixed = rescale_fp8_state_dict(state, rescale, method)  # raises CheckpointError when out of range w/o rescale
    names = fp8_weight_names(state)
    meta = {"format": FORMAT, "fp8": {"range": "neuron e4m3 +-240", "rescaled": rescale,
                                      "method": method if rescale else None, "verified": rescale,
                                      "weights": len(names)}}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in fixed.items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt", "neuron_infer": json.dumps(meta)})
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_quantized_checkpoint(path: str | Path):
    """A float-conversion output of `neuron-infer quantize` -> the quantized LlamaModel (strict load)."""
    import torch
    from safetensors.torch import load_file

    from neuron_infer.artifact.weights import empty_model, quant_structure
    from neuron_infer.checkpoint import check_layer_count, read_header

    root = Path(path)
    meta_file = root / CONFIG_FILE
    meta = read_json(meta_file, "run `neuron-infer quantize` again", CheckpointError) if meta_file.is_file() else {}
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("format") != FORMAT or "build_quant" not in meta:
        raise CheckpointError(f"{root} is not a float-conversion output of `neuron-infer quantize` "
                              f"(no {CONFIG_FILE} with format {FORMAT!r} and a scheme)")
    bq = meta["build_quant"]
    build = BuildConfig(dtype=meta["dtype"], quant=QuantConfig(bq["scheme"], tuple(bq["modules_to_not_convert"])))
    cfg = ModelConfig.from_model_dir(root)
    check_layer_count(read_header(root / WEIGHTS_FILE)[2], cfg, root)  # before 10^9 empty layers are built
    model = empty_model(cfg, build)
    quant_structure(model, build)
    state = load_file(str(root / WEIGHTS_FILE))
    if model.cfg.tie_word_embeddings and type(model.lm_head) is torch.nn.Linear:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.materialize_buffers()
    return model


@click.command("quantize", epilog="\b\nExamples:\n"
               "  neuron-infer quantize path/to/Llama-3.2-1B -o llama-int8 --quant int8\n"
               "  neuron-infer quantize path/to/fp8-checkpoint -o fp8-neuron --rescale")
@click.argument("model_dir", callback=path_param("MODEL_DIR"))
@click.option("-o", "--output", required=True, metavar="DIR", callback=path_param("-o"),
              help="directory to write (new, empty, or with --overwrite a previous quantize output)")
@click.option("--quant", type=click.Choice(["int8", "fp8", "mxfp8", "mxfp4", "w8a8"]), default=None,
              help="scheme for a float checkpoint (an FP8 checkpoint is only checked/rescaled)")
@click.option("--modules-to-not-convert", default=None, help="comma list or a file (default: the scheme's recipe)")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="dtype of the float tensors kept unquantized")
@click.option("--rescale", is_flag=True, help="FP8 checkpoint: rescale OCP e4m3fn (+-448) into Neuron's +-240")
@click.option("--rescale-method", type=click.Choice(["pow2", "nxdi"]), default="pow2", show_default=True,
              help="pow2: halve values, double scales (near-exact); nxdi: scale by 448/240 (the NxDI recipe)")
@click.option("--overwrite", is_flag=True, help="replace a previous quantize output (never other files)")
def quantize_cmd(model_dir, output, quant, modules_to_not_convert, dtype, rescale, rescale_method, overwrite) -> None:
    """Convert MODEL_DIR offline: quantize a float checkpoint, or check/rescale an FP8 one, into OUTPUT."""
    src, out = Path(model_dir), Path(output)
    check_output_location(out)
    with writing_to(out):  # a full disk or read-only file system: one line naming OUTPUT
        _quantize(src, out, quant, modules_to_not_convert, dtype, rescale, rescale_method, overwrite)


def _quantize(src: Path, out: Path, quant, modules_to_not_convert, dtype, rescale, rescale_method,
              overwrite) -> None:
    if checkpoint_has_fp8(src):
        if quant not in (None, "fp8") or modules_to_not_convert:
            raise ConfigError(f"{src} is already an FP8 checkpoint: --quant {quant} / --modules-to-not-convert do "
                              "not apply (only --rescale); quantize its bf16 source instead")
        with _output(src, out, overwrite) as tmp:
            meta = rescale_fp8_checkpoint(src, tmp, rescale, rescale_method)
            _copy_side_files(src, tmp)
        click.echo(f"{out}: {meta['fp8']['weights']} FP8 weights "
                   f"{'rescaled and verified' if rescale else 'within the Neuron range (copied)'}", err=True)
        return
    if rescale:
        raise ConfigError(f"--rescale applies to FP8 checkpoints; {src} has no float8 tensors (drop --rescale)")
    if quant is None:
        raise ConfigError("--quant is required for a float checkpoint (int8, fp8, mxfp8, mxfp4 or w8a8)")
    mods = None
    if modules_to_not_convert is not None:
        mods = parse_modules_to_not_convert(modules_to_not_convert)
    with _output(src, out, overwrite) as tmp:
        meta = quantize_float_checkpoint(src, tmp, quant, mods, dtype)
        _copy_side_files(src, tmp)
    q = meta["quant"]
    click.echo(f"{out}: --quant {quant}, {len(q['converted'])} linears converted, {len(q['kept'])} kept; linear "
               f"weights {q['bytes_before'] / 1e6:.1f} -> {q['bytes_after'] / 1e6:.1f} MB "
               f"({q['compression']:.2f}x)", err=True)
