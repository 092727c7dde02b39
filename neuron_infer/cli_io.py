"""What the CLI reads and prints around a generation: prompts from stdin, streamed text, JSON and JSON Lines.

Prompt from stdin (the convention of `ollama run` and `llm`, plus the Unix `-` for "standard input"):

* `--prompt -` reads the whole of stdin as one prompt (an empty stdin is an error);
* with no `--prompt` / `--prompt-file` and a stdin that is not a terminal (a pipe or a file), stdin is the prompt.
  A pipe or file with no text (`echo "$UNSET" | ...`, an empty file) is an error, never replaced by the default
  prompt; only a stdin that is neither (`< /dev/null`, no stdin at all) means "no prompt given": the default.

`--json` prints one line: `{"outputs": [{"token_ids", "text", "finish_reason"}, ...], "metrics": {...}}`; with
`--logprobs N` each output also holds `logprobs`: one `{"token_id", "token", "logprob", "top": [...]}` per token.
`--json --stream` prints JSON Lines: one `{"type": "delta", "index": i, "token_ids": [...], "text": "..."}` record
per sequence and step that produced tokens (`token_ids` are the step's new ids, `text` the newly decoded text, empty
while a character's bytes are incomplete; a last record may carry held-back text without ids; the concatenated
`token_ids` and `text` of index i equal outputs[i]), then one `{"type": "result", "outputs": ..., "metrics": ...}`.
"""
from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import click

from neuron_infer.artifact.manifest import load_verified_tokenizer, read_manifest
from neuron_infer.errors import NeuronInferError
from neuron_infer.runtime.grammar import GrammarSpec
from neuron_infer.runtime.sequence import cut_at_stop
from neuron_infer.text_input import read_bounded, read_text_file

STDIN = "-"


def read_stdin(stream=None) -> str:
    """All of stdin as text (invalid UTF-8 is a clear error)."""
    if stream is None:
        if sys.stdin is None:  # the process was started with stdin closed
            raise NeuronInferError("stdin is closed, so no prompt can be read from it; pipe the prompt in, e.g. "
                                   "`echo 'Hello' | neuron-infer generate --prompt -`, or pass --prompt TEXT")
        stream = getattr(sys.stdin, "buffer", sys.stdin)
    data = read_bounded(stream, "stdin")
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NeuronInferError(f"stdin is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r}); pass "
                               "a UTF-8 prompt") from e


def stdin_is_piped() -> bool:
    stdin = sys.stdin
    try:
        return stdin is not None and not stdin.closed and not stdin.isatty()
    except (AttributeError, ValueError):
        return False


def resolve_stdin_prompts(prompts: list[str], other_source: bool) -> list[str]:
    """Replace `--prompt -` by stdin's text; with no prompt source at all and a piped stdin, read it."""
    if STDIN in prompts:
        if prompts.count(STDIN) > 1:
            raise NeuronInferError("--prompt - (stdin) can be given once")
        text = _strip_final_newline(read_stdin())
        if not text.strip():
            raise NeuronInferError("--prompt -: stdin is empty; pipe the prompt in, e.g. "
                                   "`echo 'Hello' | neuron-infer generate --prompt -`")
        return [text if p == STDIN else p for p in prompts]
    if not prompts and not other_source and stdin_is_piped():
        raw = read_stdin()
        if raw.strip():
            return [_strip_final_newline(raw)]
        if raw or _stdin_is_pipe_or_file():
            raise NeuronInferError("the prompt piped into stdin is empty or only whitespace; pipe some text, or pass "
                                   "--prompt TEXT")
    return prompts


def _stdin_is_pipe_or_file() -> bool:
    """Whether stdin is a pipe, socket or regular file (text was meant to come from it), not e.g. /dev/null."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # no descriptor (an in-memory stream)
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _strip_final_newline(text: str) -> str:
    """`echo` appends one newline that is not part of the prompt."""
    return text.removesuffix("\n")


def artifact_front(artifacts: str | Path, expect_digest: str | None = None):
    """The manifest (checksum and `expect_digest` checked, weights and graphs not hashed yet) and the tokenizer (its
    files verified first): all the cheap checks need, before the slow load."""
    manifest = read_manifest(Path(artifacts), verify_files=False, expect_digest=expect_digest)
    return manifest, load_verified_tokenizer(Path(artifacts), manifest)


_INCOMPLETE = "\ufffd"  # what decode() shows for the first bytes of a character whose last bytes are to come


def stable_text(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """The decoded text minus a trailing incomplete character, so that it only grows as tokens arrive. With stop
    strings: cut before the first one, and hold back a tail that may be the start of one (it is shown once the
    next tokens rule that out), so the shown text never contains a stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True).rstrip(_INCOMPLETE)
    if not stop:
        return text
    text = cut_at_stop(text, stop)
    held = max((n for s in stop for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]


class TextStreamer:
    """Prints row 0's text as it grows (decoding the whole row each step keeps multi-byte characters intact);
    `finish` prints what was held back, so the printed text equals the final output's text."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.shown, self.stop = tokenizer, "", tuple(stop)

    def __call__(self, rows: list[list[int]]) -> None:
        self._show(stable_text(self.tok, rows[0], self.stop))

    def finish(self, text: str) -> None:
        self._show(text)

    def _show(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            out = sys.stdout
            if out is None:  # started with stdout closed: nothing can be shown
                raise BrokenPipeError("stdout is closed")
            out.write(text[len(self.shown):])
            out.flush()
            self.shown = text


class JsonLinesStreamer:
    """Prints one `delta` record per row and step with new tokens (see the module docstring)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.sent_ids: dict[int, int] = {}
        self.sent_text: dict[int, str] = {}

    def __call__(self, rows: list[list[int]]) -> None:
        for i, ids in enumerate(rows):
            if len(ids) > self.sent_ids.get(i, 0):
                self._delta(i, ids, stable_text(self.tok, ids, self.stop))

    def finish(self, out) -> None:
        """Flush what a row still owes, so the deltas concatenate to the final texts and ids."""
        for i, o in enumerate(out.outputs):
            if len(o.token_ids) > self.sent_ids.get(i, 0) or o.text != self.sent_text.get(i, ""):
                self._delta(i, o.token_ids, o.text)

    def _delta(self, i: int, ids: list[int], text: str) -> None:
        n, shown = self.sent_ids.get(i, 0), self.sent_text.get(i, "")
        if not text.startswith(shown):  # not seen with trailing-character hold-back; keep the ids in step
            text = shown
        emit({"type": "delta", "index": i, "token_ids": ids[n:], "text": text[len(shown):]})
        self.sent_ids[i], self.sent_text[i] = len(ids), text


def emit(record: dict) -> None:
    """One compact JSON line on stdout: valid JSON, so a number that is not finite (a NaN logprob, or -inf: a token
    of probability 0) is written as null."""
    if sys.stdout is None:
        raise BrokenPipeError("stdout is closed")
    click.echo(json.dumps(finite(record), allow_nan=False))


def finite(value):
    """`value` with every NaN or infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def grammar_spec(json_schema: str | None, regex: str | None, choice: tuple[str, ...]):
    """--json-schema FILE / --regex RE / --choice TEXT... -> a GrammarSpec, or None when none is given; one clear
    error for a missing or unreadable file, invalid JSON or more than one kind."""
    if json_schema is None and regex is None and not choice:
        return None
    text = None
    if json_schema is not None:
        text = read_text_file(json_schema, f"--json-schema {json_schema}")  # bounded; a device or FIFO never hangs
    if sum([json_schema is not None, regex is not None, bool(choice)]) > 1:
        raise NeuronInferError("--json-schema, --regex and --choice exclude each other; give one")
    return GrammarSpec(json_schema=text, regex=regex, choice=tuple(choice))
