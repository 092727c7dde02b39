"""`neuron-infer` command line: compile | generate | chat | info | plan | quantize | cache.

Every user-fixable problem is a `NeuronInferError`: printed as one `error: ...` line, exit status 2.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import click
from safetensors import SafetensorError

from neuron_infer.cli_help import (
    SectionedCommand,
    examples,
    expect_digest_option,
    option_names,
    parse_logit_bias,
    path_param,
    sampling_options,
)
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
        click.option("--config", "config", default=None,
                     help="build preset: a name in configs/ (e.g. tiny, smollm2-cpu) or a preset JSON file"),
        click.option("--target", type=click.Choice(["cpu", "neuron"]), default=None,
                     help="cpu: compiled CPU graphs; neuron: NEFFs through the Neuron SDK"),
        click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None, help="weights and compute dtype"),
        click.option("--batch-size", type=int, default=None, help="prompts per static batch, e.g. 4"),
        click.option("--max-context-length", type=int, default=None, help="longest prompt (tokens), e.g. 512"),
        click.option("--max-length", type=int, default=None, help="longest prompt + generation (tokens), e.g. 1024"),
        click.option("--context-buckets", default=None, help="comma list, e.g. 128,512 (default: powers of two)"),
        click.option("--tokengen-buckets", default=None, help="comma list, e.g. 256,1024 (default: powers of two)"),
        click.option("--tokengen-batch-buckets", default=None,
                     help="batch sizes with a token-generation graph, e.g. 1,2,4 (default: powers of two up to "
                          "--batch-size); each step uses the smallest that holds its running sequences"),
        click.option("--kv-block-size", type=int, default=None,
                     help="tokens per KV-cache block; must divide every bucket (default: the largest divisor of "
                          "128 that does)"),
        click.option("--kernels", type=click.Choice(["reference", "nki"]), default=None,
                     help="reference torch ops, or the NKI kernels (NumPy simulator on CPU)"),
        click.option("--tp-degree", type=int, default=None,
                     help="tensor-parallel ranks, e.g. 2 (one process per rank on CPU)"),
        click.option("--lnc", type=click.Choice(["1", "2"]), default=None,
                     help="neuron: logical NeuronCore size (default: NEURON_LOGICAL_NC_CONFIG, else 2 on trn2/trn3)"),
        click.option("--quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]), default=None,
                     help="weight quantization scheme (none = float weights)"),
        click.option("--modules-to-not-convert", default=None,
                     help="modules kept in float with --quant: comma list (e.g. lm_head) or a file with one name "
                          "per line"),
        click.option("--weight-tiling/--no-weight-tiling", default=None,
                     help="store quantized weights in the tiled layout of the kernels"),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default=None,
                     help="KV cache dtype: auto = the model dtype, fp8 halves the cache"),
        click.option("--draft-model", default=None, callback=path_param("--draft-model", ("self", "ngram")),
                     help="speculative decoding: a draft checkpoint dir sharing the tokenizer, 'self', or 'ngram' "
                          "(prompt lookup: drafts copied from the prompt and output, no draft model)"),
        click.option("--speculation-length", type=int, default=None, help="K tokens drafted per step, e.g. 4"),
        click.option("--fused-speculation/--no-fused-speculation", default=None,
                     help="also compile one graph per bucket holding draft, verify and acceptance"),
        click.option("--draft-quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]),
                     default=None, help="self-draft: the target quantized with this scheme"),
        click.option("--draft-layers", type=int, default=None, help="self-draft: the target's first N layers, e.g. 1"),
        click.option("--ngram-size", type=int, default=None,
                     help="--draft-model ngram: match the last N tokens, then N-1 ... 1 (default 3)"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


BUILD_OPTION_NAMES = option_names(build_options)
GENERATE_EXAMPLES = examples(
    "neuron-infer generate --prompt 'The capital of France is'",
    "neuron-infer generate artifacts/llama --chat --prompt 'Write a haiku' --max-new-tokens 64",
    "echo 'Once upon a time' | neuron-infer generate artifacts/llama --json",
    "neuron-infer generate artifacts/llama --prompt-file prompts.txt --json --stream",
)


def _build_overrides(kw: dict) -> dict:
    mods, lnc = kw.pop("modules_to_not_convert", None), kw.pop("lnc")
    if mods is not None:
        mods = list(parse_modules_to_not_convert(mods))
    return {
        "target": kw.pop("target"), "dtype": kw.pop("dtype"), "batch_size": kw.pop("batch_size"),
        "max_context_length": kw.pop("max_context_length"), "max_length": kw.pop("max_length"),
        "context_buckets": _ints(kw.pop("context_buckets")), "tokengen_buckets": _ints(kw.pop("tokengen_buckets")),
        "tokengen_batch_buckets": _ints(kw.pop("tokengen_batch_buckets")), "kv_block_size": kw.pop("kv_block_size"),
        "kernels": kw.pop("kernels"), "tp_degree": kw.pop("tp_degree"), "quant.scheme": kw.pop("quant"),
        "lnc": lnc if lnc is None else int(lnc),
        "quant.modules_to_not_convert": mods, "quant.weight_tiling": kw.pop("weight_tiling"),
        "quant.kv_cache_dtype": kw.pop("kv_cache_dtype"),
        **_speculation_overrides(kw),
    }


def _speculation_overrides(kw: dict) -> dict:
    draft = kw.pop("draft_model")
    if draft not in (None, "self", "ngram"):
        draft = str(Path(draft).resolve())  # the manifest must not depend on the working directory
    spec = {"speculation.draft_model": draft, "speculation.length": kw.pop("speculation_length"),
            "speculation.fused": kw.pop("fused_speculation"), "speculation.draft_quant": kw.pop("draft_quant"),
            "speculation.draft_layers": kw.pop("draft_layers"), "speculation.ngram_size": kw.pop("ngram_size")}
    given = [k for k, v in spec.items() if v is not None]
    if given and (spec["speculation.draft_model"] is None or spec["speculation.length"] is None):
        raise NeuronInferError("speculative decoding needs both --draft-model (a checkpoint dir, 'self' or 'ngram') and "
                               "--speculation-length K")
    return spec


def _preset(kw: dict, embedded: bool):
    config = kw.pop("config") or (EMBEDDED_PRESET if embedded else CHECKPOINT_PRESET)
    return load_preset(config, _build_overrides(kw))


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=examples(
    "neuron-infer generate --prompt 'The capital of France is'",
    "neuron-infer compile path/to/Llama-3.2-1B -o artifacts/llama",
    "neuron-infer generate artifacts/llama --chat --prompt 'Name three French cheeses.'",
    "neuron-infer COMMAND --help",
))
@click.version_option(package_name="neuron-infer")
def cli() -> None:
    """Compile Llama-family checkpoints into graphs (on a CPU one per phase, on Neuron one per bucket) and generate
    from them."""


@cli.command("compile", epilog=examples(
    "neuron-infer compile path/to/Llama-3.2-1B -o artifacts/llama --dtype bf16 --max-length 2048",
    "neuron-infer compile path/to/Llama-3.2-1B -o artifacts/llama-int8 --quant int8 --tp-degree 2",
    "neuron-infer compile -o artifacts/tiny-default --config tiny",
))
@click.argument("model_dir", required=False, callback=path_param("MODEL_DIR"))
@click.option("-o", "--output", required=True, metavar="DIR", callback=path_param("-o"),
              help="artifact directory to write (new, empty, or with --overwrite a previous artifact)")
@click.option("--backend", default=None,
              help="override the target's backend, e.g. cpu-eager (no graph compile; debugging)")
@click.option("--overwrite", is_flag=True, help="replace an existing artifact directory")
@build_options
def compile_cmd(model_dir, output, backend, overwrite, **kw) -> None:
    """Compile MODEL_DIR (a Hugging Face Llama checkpoint; omit for the embedded default) into OUTPUT."""
    from neuron_infer.compile.builder import compile_model

    embedded = model_dir is None or model_dir == "default"
    default_total = kw["config"] is None and kw["max_length"] is None  # the preset's, not the user's choice
    user_context = kw["max_context_length"] is not None
    build = _preset(kw, embedded).build
    if embedded:
        model_dir = default_model_dir(log=_say)
    elif default_total:  # the model-independent default, shortened for a model with a shorter context

        max_pos = ModelConfig.from_model_dir(model_dir).max_position_embeddings
        build = fit_to_model(build, max_pos, keep_context=user_context)
    compile_model(model_dir, output, build, backend=backend, overwrite=overwrite, say=_say)


@cli.command("generate", cls=SectionedCommand, epilog=GENERATE_EXAMPLES,
             sections=(("Build options (only without ARTIFACTS: compile or reuse the default model)",
                        BUILD_OPTION_NAMES),))
@click.argument("artifacts", required=False, callback=path_param("ARTIFACTS"))
@click.option("--prompt", "prompts", multiple=True,
              help="prompt text; repeat for a batch; '-' reads it from stdin (also read when stdin is a pipe and "
                   "no prompt is given)")
@click.option("--prompt-file", default=None, metavar="FILE", callback=path_param("--prompt-file"),
              help="a UTF-8 text file with one prompt per line, e.g. prompts.txt")
@click.option("--chat", is_flag=True, help="wrap each prompt as a user message in the tokenizer's chat template")
@click.option("--max-new-tokens", type=int, default=None,
              help="tokens to generate per prompt  [default: 128, fewer when max_length leaves less room]")
@sampling_options
@click.option("--ignore-eos", is_flag=True, help="generate max-new-tokens even past EOS (benchmarks)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON line: outputs and metrics")
@click.option("--stream", "stream_json", is_flag=True,
              help="with --json: JSON Lines, one delta record per step, then the result record")
@click.option("--logprobs", type=click.IntRange(min=0), default=None,
              help="with --json: each output token's logprob and the top N alternatives (with their text)")
@click.option("--json-schema", "json_schema", default=None, metavar="FILE", callback=path_param("--json-schema"),
              help="structured output: each output is JSON valid against this JSON schema file (needs xgrammar)")
@click.option("--regex", default=None, help="structured output: each output matches this regex, e.g. '[0-9]{3}'")
@click.option("--choice", "choice", multiple=True,
              help="structured output: each output is one of these texts; repeatable, e.g. --choice yes --choice no")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the graphs (default: the usable CPUs that other processes leave free, "
                   "re-evaluated twice a second)")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="KV-cache memory per rank in GiB (default: what batch_size sequences of max_length need); "
                   "prompts that do not fit wait for finishing ones")
@click.option("--no-prefix-caching", "no_prefix_caching", is_flag=True,
              help="never reuse KV blocks across prompts (default: a prompt reuses the cached blocks of a common prefix)")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=None,
              help="prompt tokens encoded per step while other prompts decode (default: the largest context "
                   "bucket <= 256; 0: whole prompts)")
@expect_digest_option
@build_options
def generate_cmd(artifacts, prompts, prompt_file, chat, max_new_tokens, temperature, top_k, top_p, seed, min_p, repetition_penalty,
                 presence_penalty, frequency_penalty, min_tokens, logit_bias, stop,
                 ignore_eos, as_json, stream_json, logprobs, json_schema, regex, choice, threads, kv_cache_gib,
                 no_prefix_caching, prefill_chunk, expect_digest,
                 **kw) -> None:
    """Generate from ARTIFACTS (omit to compile or reuse the embedded default model)."""
    from neuron_infer.api import LOAD_STAGES, CompiledModel, check_request, encode_prompt
    from neuron_infer.cli_io import JsonLinesStreamer, TextStreamer, artifact_front, grammar_spec, resolve_stdin_prompts
    from neuron_infer.runtime.grammar import check_ends_at_eos

    set_bars(not as_json)
    if stream_json and not as_json:
        raise NeuronInferError("--stream selects JSON Lines output and needs --json (text output always streams "
                               "a single prompt)")
    if logprobs is not None and not as_json:
        raise NeuronInferError("--logprobs adds per-token logprobs to the JSON output and needs --json")
    if artifacts is not None and any(v is not None for v in kw.values()):
        raise NeuronInferError("build flags (--dtype, --max-length, ...) apply when compiling; pass them to "
                               "`neuron-infer compile`, or omit ARTIFACTS to use the embedded default")
    grammar = grammar_spec(json_schema, regex, choice)  # checked before any slow step
    check_ends_at_eos(grammar, ignore_eos)
    prompts = resolve_stdin_prompts([check_text(p, "--prompt") for p in prompts], prompt_file is not None)
    prompts = collect_prompts(prompts, prompt_file)  # empty ones refused, never swapped or dropped
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, min_tokens=min_tokens,
                              logit_bias=parse_logit_bias(logit_bias))
    if artifacts is None:
        from neuron_infer.checkpoint import load_tokenizer

        preset = _preset(kw, embedded=True)
        if preset.build.batch_size < len(prompts):
            preset = _preset_with_batch(kw, preset, len(prompts))
        tokenizer = load_tokenizer(default_model_dir(log=_say))  # cheap checks before a first-run compile
        check_sizes(prompts, preset.build.max_context_length)
        check_request(preset.build, [len(encode_prompt(tokenizer, p, chat)) for p in prompts], max_new_tokens)
        artifacts = default_artifact_dir(preset.build, _say)
    manifest, tokenizer = artifact_front(artifacts, expect_digest)  # cheap checks before the slow load
    check_sizes(prompts, manifest.build.max_context_length)
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    check_request(manifest.build, [len(x) for x in ids], max_new_tokens)
    with stages("loading", list(LOAD_STAGES), None, leave=False) as stage:  # a bar on a terminal, else silent
        model = CompiledModel.load(artifacts, threads=threads or "auto", tokenizer=tokenizer, on_stage=stage,
                                   kv_cache_gib=kv_cache_gib, prefix_caching=not no_prefix_caching,
                                   prefill_chunk=prefill_chunk, expect_digest=expect_digest)
    if as_json:
        stream = JsonLinesStreamer(model.tokenizer, stop) if stream_json else None
    else:
        stream = TextStreamer(model.tokenizer, stop) if len(prompts) == 1 else None
    with model:  # a tensor-parallel artifact's rank processes stop when generation ends
        out = model.generate_ids(ids, max_new_tokens or 128, sampling, ignore_eos=ignore_eos, on_tokens=stream,
                                 stop=stop, logprobs=logprobs, grammar=grammar)
    _print_result(out, as_json, stream)


def _preset_with_batch(kw, preset, n):
    return Preset(preset.name, preset.description, preset.model, preset.build.replace(batch_size=n))


def _print_result(out, as_json: bool, stream) -> None:
    from neuron_infer.cli_io import emit

    if not out.outputs:  # a torchrun rank other than 0: rank 0 prints the result
        return
    if as_json:
        if stream is not None:
            stream.finish(out)
            emit({"type": "result", **out.to_dict()})
        else:
            emit(out.to_dict())
        return
    if stream is not None:
        stream.finish(out.outputs[0].text)
        click.echo()
    else:
        for i, o in enumerate(out.outputs):
            click.echo(f"[{i}] {o.text}")
    n = sum(len(o.token_ids) for o in out.outputs)
    reasons = ",".join(sorted({o.finish_reason for o in out.outputs}))
    _say(f"TTFT {out.ttft_s * 1000:.1f} ms | {out.ms_per_token:.2f} ms/token | {out.tokens_per_s:.1f} tokens/s "
         f"| {n} tokens generated | finish: {reasons}")


@cli.command("plan", epilog=examples(
    "neuron-infer plan llama-3.1-405b --instance trn2.48xlarge --quant fp8",
    "neuron-infer plan path/to/Llama-3.2-1B --instance inf2.xlarge --tp-degree 2 --json",
))
@click.argument("model")
@click.option("--instance", required=True,
              help="instance type: trn1.2xlarge, trn1.32xlarge, inf2.xlarge..inf2.48xlarge, trn2.48xlarge, trn3")
@click.option("--tp-degree", type=int, default=None,
              help="tensor-parallel ranks  [default: the smallest of 1, 2, 4, ... (and the core count) that fits]")
@click.option("--quant", type=click.Choice(["none", "int8", "fp8", "mxfp8", "mxfp4", "w8a8"]), default="none",
              show_default=True, help="weight quantization scheme")
@click.option("--max-length", type=int, default=4096, show_default=True,
              help="prompt + generation tokens the KV cache holds per sequence")
@click.option("--batch-size", type=int, default=1, show_default=True, help="sequences decoded together")
@click.option("--lnc", type=click.Choice(["1", "2"]), default=None, help="logical NeuronCore size (trn2/trn3)")
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON line")
def plan_cmd(model, instance, tp_degree, quant, max_length, batch_size, lnc, as_json) -> None:
    """Capacity plan for MODEL (a preset such as llama-3.1-405b, or a checkpoint dir) on an instance."""
    from neuron_infer.capacity.planner import (
        plan_capacity,
        render_capacity_text,
        smallest_fitting_plan,
    )

    name, cfg = resolve_model(model)
    lnc_n = int(lnc) if lnc else None
    if tp_degree is None:
        p = smallest_fitting_plan(cfg, instance, quant, max_length, batch_size, lnc_n, model_name=name)
    else:
        p = plan_capacity(cfg, instance, tp_degree, quant, max_length, batch_size, lnc_n, model_name=name)
    click.echo(json.dumps(p.to_dict()) if as_json else render_capacity_text(p))


from neuron_infer.cli_quantize import quantize_cmd  # noqa: E402  (kept torch-free at import)

cli.add_command(quantize_cmd)

import os

from neuron_infer.capacity.presets import resolve_model
from neuron_infer.cli_cache import cache_group  # noqa: E402
from neuron_infer.cli_chat import chat_cmd  # noqa: E402
from neuron_infer.cli_doctor import doctor_cmd  # noqa: E402
from neuron_infer.cli_info import info_cmd  # noqa: E402
from neuron_infer.config import ModelConfig, SamplingConfig
from neuron_infer.embedded import default_model_dir
from neuron_infer.presets import (
    CHECKPOINT_PRESET,
    EMBEDDED_PRESET,
    Preset,
    default_artifact_dir,
    fit_to_model,
    load_preset,
)
from neuron_infer.progress import set_bars, stages
from neuron_infer.prompts import check_sizes, collect_prompts
from neuron_infer.quant import parse_modules_to_not_convert
from neuron_infer.text_input import check_text

cli.add_command(chat_cmd)
cli.add_command(info_cmd)
cli.add_command(doctor_cmd)
cli.add_command(cache_group)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="neuron-infer", standalone_mode=False)
    except NeuronInferError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:  # a bad flag or value: one line, like every other error
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly
        _silence_stdout()
        sys.exit(1)
    except (OSError, SafetensorError) as e:  # only user-fixable kinds (full disk, read-only, permissions)
        os_error = as_os_error(e)
        msg = describe_os_error(os_error) if os_error is not None else None
        if msg is None:  # anything else keeps its traceback
            raise
        click.echo(f"error: {msg}", err=True)
        sys.exit(2)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
    except OSError:
        pass


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
