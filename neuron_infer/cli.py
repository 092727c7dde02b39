"""`neuron-infer` command line: compile | generate | plan | info.

Every user-fixable problem is a `NeuronInferError`: printed as one `error: ...` line, exit status 2.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import click
from safetensors import SafetensorError

from neuron_infer.errors import NeuronInferError
from neuron_infer.oserrors import as_os_error, describe_os_error


def _ints(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 128,512") from e


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def build_options(f):
    """The BuildConfig flags shared by compile and generate (None = take the preset's value)."""
    opts = [
        click.option("--config", "config", default=None, help="preset name in configs/ or a preset JSON file"),
        click.option("--target", type=click.Choice(["cpu", "neuron"]), default=None),
        click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None),
        click.option("--batch-size", type=int, default=None),
        click.option("--max-context-length", type=int, default=None, help="longest prompt (tokens)"),
        click.option("--max-length", type=int, default=None, help="longest prompt + generation (tokens)"),
        click.option("--context-buckets", default=None, help="comma list, e.g. 128,512 (default: powers of two)"),
        click.option("--tokengen-buckets", default=None, help="comma list, e.g. 256,1024 (default: powers of two)"),
        click.option("--kernels", type=click.Choice(["reference", "nki"]), default=None),
        click.option("--tp-degree", type=int, default=None, help="tensor-parallel ranks"),
        click.option("--quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]), default=None),
        click.option("--modules-to-not-convert", default=None, help="comma list or a file with one name per line"),
        click.option("--weight-tiling/--no-weight-tiling", default=None),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default=None),
        click.option("--draft-model", default=None,
                     help="speculative decoding: a draft checkpoint dir sharing the tokenizer, or 'self'"),
        click.option("--speculation-length", type=int, default=None, help="K tokens drafted per step"),
        click.option("--fused-speculation/--no-fused-speculation", default=None,
                     help="also compile one graph per bucket holding draft, verify and acceptance"),
        click.option("--draft-quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]),
                     default=None, help="self-draft: the target quantized with this scheme"),
        click.option("--draft-layers", type=int, default=None, help="self-draft: the target's first N layers"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _build_overrides(kw: dict) -> dict:
    mods = kw.pop("modules_to_not_convert", None)
    if mods is not None:
        from neuron_infer.quant import parse_modules_to_not_convert  # noqa: PLC0415

        mods = list(parse_modules_to_not_convert(mods))
    return {
        "target": kw.pop("target"), "dtype": kw.pop("dtype"), "batch_size": kw.pop("batch_size"),
        "max_context_length": kw.pop("max_context_length"), "max_length": kw.pop("max_length"),
        "context_buckets": _ints(kw.pop("context_buckets")), "tokengen_buckets": _ints(kw.pop("tokengen_buckets")),
        "kernels": kw.pop("kernels"), "tp_degree": kw.pop("tp_degree"), "quant.scheme": kw.pop("quant"),
        "quant.modules_to_not_convert": mods, "quant.weight_tiling": kw.pop("weight_tiling"),
        "quant.kv_cache_dtype": kw.pop("kv_cache_dtype"),
        **_speculation_overrides(kw),
    }


def _speculation_overrides(kw: dict) -> dict:
    draft = kw.pop("draft_model")
    if draft not in (None, "self"):
        draft = str(Path(draft).resolve())  # the manifest must not depend on the working directory
    spec = {"speculation.draft_model": draft, "speculation.length": kw.pop("speculation_length"),
            "speculation.fused": kw.pop("fused_speculation"), "speculation.draft_quant": kw.pop("draft_quant"),
            "speculation.draft_layers": kw.pop("draft_layers")}
    given = [k for k, v in spec.items() if v is not None]
    if given and (spec["speculation.draft_model"] is None or spec["speculation.length"] is None):
        raise NeuronInferError("speculative decoding needs both --draft-model (a checkpoint dir or 'self') and "
                               "--speculation-length K")
    return spec


def _preset(kw: dict, embedded: bool):
    from neuron_infer.presets import CHECKPOINT_PRESET, EMBEDDED_PRESET, load_preset  # noqa: PLC0415

    config = kw.pop("config") or (EMBEDDED_PRESET if embedded else CHECKPOINT_PRESET)
    return load_preset(config, _build_overrides(kw))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="neuron-infer")
def cli() -> None:
    """Compile Llama-family checkpoints into per-bucket graphs and generate from them."""


@cli.command("compile")
@click.argument("model_dir", required=False)
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="artifact directory to write")
@click.option("--backend", default=None, help="override the target's backend (e.g. cpu-eager for debugging)")
@click.option("--overwrite", is_flag=True, help="replace an existing artifact directory")
@build_options
def compile_cmd(model_dir, output, backend, overwrite, **kw) -> None:
    """Compile MODEL_DIR (a Hugging Face Llama checkpoint; omit for the embedded default) into OUTPUT."""
    from neuron_infer.compile.builder import compile_model  # noqa: PLC0415

    embedded = model_dir is None or model_dir == "default"
    default_limits = kw["config"] is None and kw["max_length"] is None and kw["max_context_length"] is None
    build = _preset(kw, embedded).build
    if embedded:
        from neuron_infer.embedded import default_model_dir  # noqa: PLC0415

        model_dir = default_model_dir(log=_say)
    elif default_limits:  # the model-independent default, shortened for a model with a shorter context
        from neuron_infer.config import ModelConfig  # noqa: PLC0415
        from neuron_infer.presets import fit_to_model  # noqa: PLC0415

        build = fit_to_model(build, ModelConfig.from_model_dir(model_dir).max_position_embeddings)
    compile_model(model_dir, output, build, backend=backend, overwrite=overwrite, say=_say)


@cli.command("generate")
@click.argument("artifacts", required=False)
@click.option("--prompt", "prompts", multiple=True, help="repeat for a batch")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), help="one prompt per line")
@click.option("--chat", is_flag=True, help="apply the tokenizer's chat template")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--ignore-eos", is_flag=True, help="generate max-new-tokens even past EOS (benchmarks)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (outputs and metrics)")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the graphs (default: torch's, one per core); 1 is faster on a machine whose "
                   "cores are busy with other jobs")
@build_options
def generate_cmd(artifacts, prompts, prompt_file, chat, max_new_tokens, temperature, top_k, top_p, seed,
                 ignore_eos, as_json, threads, **kw) -> None:
    """Generate from ARTIFACTS (omit to compile or reuse the embedded default model)."""
    import torch  # noqa: PLC0415

    from neuron_infer.api import LOAD_STAGES, CompiledModel  # noqa: PLC0415
    from neuron_infer.config import SamplingConfig  # noqa: PLC0415
    from neuron_infer.progress import set_bars, stages  # noqa: PLC0415

    if threads is not None:
        torch.set_num_threads(threads)
    set_bars(not as_json)

    from neuron_infer.text_input import check_text, read_text_file  # noqa: PLC0415

    prompts = [check_text(p, "--prompt") for p in prompts]
    prompts += read_text_file(prompt_file, "--prompt-file").splitlines() if prompt_file else []
    prompts = [p for p in prompts if p.strip()] or ["The capital of France is"]
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if artifacts is None:
        from neuron_infer.presets import default_artifact_dir  # noqa: PLC0415

        preset = _preset(kw, embedded=True)
        if preset.build.batch_size < len(prompts):
            preset = _preset_with_batch(kw, preset, len(prompts))
        artifacts = default_artifact_dir(preset.build, _say)
    elif any(v is not None for v in kw.values()):
        raise NeuronInferError("build flags (--dtype, --max-length, ...) apply when compiling; pass them to "
                               "`neuron-infer compile`, or omit ARTIFACTS to use the embedded default")
    with stages("loading", list(LOAD_STAGES), None, leave=False) as stage:  # a bar on a terminal, else silent
        model = CompiledModel.load(artifacts, on_stage=stage)
    stream = _Streamer(model.tokenizer) if (len(prompts) == 1 and not as_json) else None
    out = model.generate(prompts, max_new_tokens, sampling, chat=chat, ignore_eos=ignore_eos,
                         on_tokens=stream)
    _print_result(out, as_json, stream is not None)


def _preset_with_batch(kw, preset, n):
    from neuron_infer.presets import Preset  # noqa: PLC0415

    return Preset(preset.name, preset.description, preset.model, preset.build.replace(batch_size=n))


class _Streamer:
    """Prints row 0's text as it grows (decoding the whole sequence each step keeps multi-byte tokens intact)."""

    def __init__(self, tokenizer):
        self.tok, self.shown = tokenizer, ""

    def __call__(self, rows: list[list[int]]) -> None:
        text = self.tok.decode(rows[0], skip_special_tokens=True)
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def _print_result(out, as_json: bool, streamed: bool) -> None:
    if not out.outputs:  # a torchrun rank other than 0: rank 0 prints the result
        return
    d = out.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    if streamed:
        click.echo()
    else:
        for i, o in enumerate(out.outputs):
            click.echo(f"[{i}] {o.text}")
    m = d["metrics"]
    n = sum(len(o.token_ids) for o in out.outputs)
    reasons = ",".join(sorted({o.finish_reason for o in out.outputs}))
    _say(f"TTFT {m['ttft_s'] * 1000:.1f} ms | {m['ms_per_token']:.2f} ms/token | {m['tokens_per_s']:.1f} tokens/s "
         f"| {n} tokens generated | finish: {reasons}")


@cli.command("info")
@click.argument("artifacts")
def info_cmd(artifacts) -> None:
    """Print an artifact's manifest summary (and verify its files)."""
    from neuron_infer.compile.artifact import read_manifest  # noqa: PLC0415

    m = read_manifest(Path(artifacts))
    click.echo(json.dumps({"backend": m.backend, "versions": m.versions, "build": m.build.to_dict(),
                           "graphs": sorted(m.graphs), "extra": m.extra}, indent=2))


@cli.command("plan")
@click.argument("model")
@click.option("--instance", required=True, help="trn1.2xlarge, trn1.32xlarge, inf2.xlarge..inf2.48xlarge, trn2.48xlarge, trn3")
@click.option("--tp-degree", type=int, required=True)
@click.option("--quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]), default="none")
@click.option("--max-length", type=int, default=4096, show_default=True)
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--lnc", type=click.Choice(["1", "2"]), default=None, help="logical NeuronCore size (trn2/trn3)")
@click.option("--json", "as_json", is_flag=True)
def plan_cmd(model, instance, tp_degree, quant, max_length, batch_size, lnc, as_json) -> None:
    """Capacity plan for MODEL (a preset such as llama-3.1-405b, or a checkpoint dir) on an instance."""
    from neuron_infer.parallel.capacity import plan_capacity, render_capacity_text  # noqa: PLC0415
    from neuron_infer.parallel.presets import resolve_model  # noqa: PLC0415

    name, cfg = resolve_model(model)
    p = plan_capacity(cfg, instance, tp_degree, quant, max_length, batch_size, int(lnc) if lnc else None,
                      model_name=name)
    click.echo(json.dumps(p.to_dict(), indent=2) if as_json else render_capacity_text(p))


from neuron_infer.cli_quantize import quantize_cmd  # noqa: E402  (kept torch-free at import)

cli.add_command(quantize_cmd)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="neuron-infer", standalone_mode=False)
    except NeuronInferError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (OSError, SafetensorError) as e:  # only user-fixable kinds (full disk, read-only, permissions)
        os_error = as_os_error(e)
        msg = describe_os_error(os_error) if os_error is not None else None
        if msg is None:  # anything else keeps its traceback
            raise
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)


def run() -> None:
    """The `neuron-infer` console script: `main()`, then a quick interpreter exit."""
    try:
        main()
    finally:
        # The interpreter's shutdown runs full garbage collections over every live object (~350k once torch and
        # transformers are loaded): seconds of silence after the last token on a busy machine. Frozen objects are
        # skipped by those passes (they are still released with the process).
        gc.freeze()


if __name__ == "__main__":
    run()
