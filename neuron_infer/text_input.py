"""Prompt text from the command line and from files, checked to be UTF-8 text before it reaches the tokenizer.

On POSIX, Python decodes command-line arguments with the `surrogateescape` handler: a byte that is not UTF-8
becomes a lone surrogate U+DC80..U+DCFF, which no tokenizer accepts. Both checks name the offending byte.
"""
from __future__ import annotations

from pathlib import Path

from neuron_infer.errors import NeuronInferError


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
        raw = Path(path).read_bytes()
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
