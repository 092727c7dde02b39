"""Prompt text from the command line and from files, checked to be UTF-8 text before it reaches the tokenizer.

On POSIX, Python decodes command-line arguments with the `surrogateescape` handler: a byte that is not UTF-8
becomes a lone surrogate U+DC80..U+DCFF, which no tokenizer accepts. Both checks name the offending byte.
"""
from __future__ import annotations

from pathlib import Path

from neuron_infer.errors import NeuronInferError

MAX_INPUT_BYTES = 1 << 24  # 16 MiB: the most read from a prompt file or from stdin
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this times max_context_length cannot fit: refused untokenized


def check_text(text: str, what: str) -> str:
    """`text` unchanged if it is valid UTF-8 text, else NeuronInferError naming `what` and the first bad byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        byte = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"character U+{ch:04X}"
        raise NeuronInferError(f"{what} is not valid UTF-8 text ({byte} at character {e.start}); pass UTF-8 "
                               "text (check the terminal's or the file's encoding)") from e
    return text


def read_text_file(path: str | Path, what: str) -> str:
    """The contents of a UTF-8 text file; a missing, binary or non-UTF-8 file raises NeuronInferError starting with
    `what` (which names the file, e.g. "--prompt-file prompts.txt")."""
    try:
        with open(path, "rb") as f:
            raw = read_bounded(f, what)
    except OSError as e:
        raise NeuronInferError(f"{what}: cannot read it ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NeuronInferError(f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                               "give a UTF-8 text file") from e
    if "\x00" in text:
        raise NeuronInferError(f"{what} is a binary file (it contains NUL bytes); give a UTF-8 text file")
    return text


def read_bounded(stream, what: str) -> bytes:
    """At most MAX_INPUT_BYTES from a binary stream (a longer input, or an endless one like /dev/zero, is refused)."""
    data = stream.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise NeuronInferError(f"{what} holds more than {MAX_INPUT_BYTES >> 20} MiB; give a shorter prompt")
    return data


def split_lines(text: str) -> list[str]:
    """Lines split at \\n and \\r\\n only (not at the other characters str.splitlines() breaks at, such as form
    feed, \\x1e, U+0085, U+2028 or a lone \\r, which are kept inside the line); a final newline ends the last line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.removesuffix("\r") for ln in lines]


def check_size(label: str, prompt: str, max_context_length: int) -> None:
    """Refuse, before tokenizing it, a prompt too long to fit max_context_length tokens whatever the tokenizer."""
    limit = max_context_length * MAX_CHARS_PER_TOKEN
    if len(prompt) > limit:
        raise NeuronInferError(f"{label} has {len(prompt)} characters: it cannot fit max_context_length="
                               f"{max_context_length} tokens (at most {MAX_CHARS_PER_TOKEN} characters per token are "
                               "counted); shorten it or recompile with a larger --max-context-length")
