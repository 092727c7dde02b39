"""`neuron-infer chat`: an interactive multi-turn conversation through the tokenizer's chat template.

Each line read from stdin is one user message; the whole conversation (system message, earlier turns, the new
message) is encoded with the chat template and the assistant's answer is streamed to stdout, one answer per
line. `/exit`, `/quit` or end of input (Ctrl-D, or the end of a pipe) ends the chat; `/reset` forgets the turns
(the system message stays). When the conversation no longer fits the artifact's max_context_length, the oldest
turns are dropped (a note on stderr says so). The `> ` prompt is printed to stderr, and only on a terminal, so
`printf 'Hi\\nAnd then?\\n' | neuron-infer chat > answers.txt` stores only the answers.
"""
from __future__ import annotations

import sys

import click

from neuron_infer.cli_help import examples, expect_digest_option, parse_logit_bias, path_param, sampling_options
from neuron_infer.config import SamplingConfig
from neuron_infer.errors import NeuronInferError
from neuron_infer.presets import EMBEDDED_PRESET, default_artifact_dir, load_preset
from neuron_infer.text_input import MAX_INPUT_BYTES, check_size, check_text

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def fit_conversation(tokenizer, messages: list[dict], max_tokens: int, say) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system message nor the newest user message) until the encoded
    conversation has at most `max_tokens` tokens; returns the kept messages and their token ids."""
    from neuron_infer.api import encode_chat

    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(head):]
    dropped = 0
    while True:
        ids = encode_chat(tokenizer, head + turns)
        if len(ids) <= max_tokens:
            break
        if len(turns) <= 1:
            raise NeuronInferError(
                f"this message (with the system message) has {len(ids)} tokens, more than max_context_length="
                f"{max_tokens}; send a shorter one, or recompile with a larger --max-context-length")
        turns = turns[2:] if len(turns) > 2 else turns[1:]  # one user + assistant pair
        dropped += 1
    if dropped:
        say(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit max_context_length={max_tokens})")
    return head + turns, ids


def _resolve_artifacts(artifacts: str | None, config: str | None, say) -> str:
    if artifacts is not None:
        return artifacts

    return str(default_artifact_dir(load_preset(config or EMBEDDED_PRESET).build, say))


def _read_message(stdin, interactive: bool) -> str | None:
    """The next user line (None at end of input)."""
    if interactive:
        click.echo("> ", nl=False, err=True)
    try:
        line = stdin.readline(MAX_INPUT_BYTES + 1) if stdin is not None else ""
    except UnicodeDecodeError as e:
        raise NeuronInferError(f"the chat input is not UTF-8 text (byte 0x{e.object[e.start]:02x}); type or pipe "
                               "UTF-8 text") from None
    if len(line) > MAX_INPUT_BYTES:
        raise NeuronInferError(f"a chat message is longer than {MAX_INPUT_BYTES >> 20} MiB; send a shorter one")
    return None if line == "" else check_text(line.rstrip("\r\n"), "the chat message")


@click.command("chat", epilog=examples(
    "neuron-infer chat --system 'You are a terse assistant.'",
    "neuron-infer chat artifacts/llama --temperature 0.7 --top-p 0.9 --seed 0",
    "printf 'Hi!\\nTell me more.\\n' | neuron-infer chat artifacts/llama > answers.txt",
))
@click.argument("artifacts", required=False, callback=path_param("ARTIFACTS"))
@click.option("--system", default=None, help="system message that starts the conversation, e.g. 'Be brief.'")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="longest answer in tokens  [default: until EOS or the artifact's max_length]")
@sampling_options
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for the graphs (default: the usable CPUs that other processes leave free)")
@click.option("--config", default=None,
              help="without ARTIFACTS: the build preset of the default model (as for generate), e.g. tiny")
@expect_digest_option
def chat_cmd(artifacts, system, max_new_tokens, temperature, top_k, top_p, seed, min_p, repetition_penalty,
                 presence_penalty, frequency_penalty, min_tokens, logit_bias, stop, threads, config,
                 expect_digest) -> None:
    """Chat with ARTIFACTS (omit for the embedded default model): one user message per line, answers streamed.

    /exit, /quit or end of input ends the chat; /reset forgets the conversation (the system message stays).
    """
    from neuron_infer.api import CompiledModel, encode_chat
    from neuron_infer.cli_io import TextStreamer, artifact_front

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, min_tokens=min_tokens,
                              logit_bias=parse_logit_bias(logit_bias))
    if system is not None:
        check_text(system, "--system")
    artifacts = _resolve_artifacts(artifacts, config, say)
    manifest, tokenizer = artifact_front(artifacts, expect_digest)  # cheap checks before the slow load
    if system is not None:
        check_size("--system", system, manifest.build.max_context_length)  # before it is tokenized
    start = [{"role": "system", "content": system}] if system else []
    encode_chat(tokenizer, start + [{"role": "user", "content": "hi"}])  # raises when there is no chat template
    model = CompiledModel.load(artifacts, threads=threads or "auto", tokenizer=tokenizer, expect_digest=expect_digest)
    build = manifest.build
    stdin = sys.stdin
    interactive = stdin is not None and stdin.isatty()
    if interactive:
        say("one message per line; /reset forgets the conversation, /exit or Ctrl-D ends it")
    messages = list(start)
    while (line := _read_message(stdin, interactive)) is not None:
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            break
        if text == RESET_COMMAND:
            messages = list(start)
            say("(conversation reset)")
            continue
        try:
            check_size("this message", line, build.max_context_length)  # before it is tokenized
            messages, ids = fit_conversation(tokenizer, messages + [{"role": "user", "content": line}],
                                             build.max_context_length, say)
        except NeuronInferError as e:
            say(f"error: {e}")
            continue
        stream = TextStreamer(model.tokenizer, stop)
        out = model.generate_ids([ids], max_new_tokens or build.max_length, sampling, on_tokens=stream, stop=stop)
        stream.finish(out.outputs[0].text)
        click.echo()
        messages.append({"role": "assistant", "content": out.outputs[0].text})
