"""Prompt text from the command line and from files, checked to be UTF-8 text before it reaches the tokenizer.

On POSIX, Python decodes command-line arguments with the `surrogateescape` handler: a byte that is not UTF-8
becomes a lone surrogate U+DC80..U+DCFF, which no tokenizer accepts. Both checks name the offending byte.
"""
from __future__ import annotations

import errno
import os
import select
import stat
from pathlib import Path

from neuron_infer.errors import NeuronInferError

MAX_INPUT_BYTES = 1 << 24  # 16 MiB: the most read from a prompt file or from stdin
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than this times max_context_length cannot fit: refused untokenized


def check_text(text: str, what: str) -> str:
    """`text` unchanged if it is valid UTF-8 text, else NeuronInferError naming `what` and the first bad byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NeuronInferError(f"{what} is not valid UTF-8 text ({_not_utf8(text, e)} at character {e.start}); pass "
                               "UTF-8 text (check the terminal's or the file's encoding)") from e
    return text


def _not_utf8(text: str, e: UnicodeEncodeError) -> str:
    """The first thing in `text` that is not UTF-8: an undecodable byte (kept as a lone surrogate) or a character."""
    ch = ord(text[e.start])
    return f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"character U+{ch:04X}"


def check_path(path: str | os.PathLike, what: str) -> str:
    """`path` as a str if a file could be opened under it, else NeuronInferError starting with `what`: not a path at
    all, a NUL byte, a name that is not UTF-8 (safetensors and the tokenizer library open UTF-8 paths only, and
    would report a sound file as corrupt), or a symbolic link loop on the way."""
    if not isinstance(path, str | os.PathLike):
        raise NeuronInferError(f"{what} must be a path (str or pathlib.Path), not {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or "\x00" in text:
        raise NeuronInferError(f"{what} {text!r} is not a usable path (it is bytes or holds a NUL character)")
    if text == "":
        raise NeuronInferError(f"{what} is an empty path; name a file or directory")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise NeuronInferError(f"{what} {text!r} is not a UTF-8 path ({_not_utf8(text, e)}); the libraries that read "
                               "models open UTF-8 paths only: rename it (or the directory it is in)") from None
    try:
        os.stat(text)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NeuronInferError(f"{what} {text}: a symbolic link on the way points back to itself (a loop); "
                                   "fix or remove the link") from None
    return text


PIPE_WAIT_S = 10.0  # how long a named pipe may stay without a writer before the read is given up
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_text_file(path: str | Path, what: str) -> str:
    """The contents of a UTF-8 text file; a missing, binary or non-UTF-8 file raises NeuronInferError starting with
    `what` (which names the file, e.g. "--prompt-file prompts.txt").

    Read: a regular file; stdin under any name (`/dev/stdin`); a pipe or named pipe (FIFO) once a writer has
    written to it (`<(command)`), waiting at most PIPE_WAIT_S for that: the file is opened without blocking, since
    opening a FIFO that no process writes to waits forever. Refused: a device (/dev/zero, a terminal other than
    stdin), a directory, a socket."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO and stat.S_ISSOCK(os.stat(path).st_mode):  # a socket cannot be opened
            raise NeuronInferError(f"{what}: cannot read it: it is a socket; give a text file, or pipe the text "
                                   "into stdin") from e
        raise NeuronInferError(f"{what}: cannot read it ({e.strerror or e})") from e
    try:
        _check_kind(fd, what)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
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


def _check_kind(fd: int, what: str) -> None:
    """Refuse what read_text_file does not read; wait for a pipe's writer; leave `fd` blocking."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or _is_stdin(fd)):
        if not stat.S_ISFIFO(mode):
            kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
            raise NeuronInferError(f"{what}: it is {kind}; give a text file, or pipe the text into stdin")
        _wait_for_writer(fd, what)
    os.set_blocking(fd, True)


def _is_stdin(fd: int) -> bool:
    """Whether `fd` is the file stdin reads (/dev/stdin, /proc/self/fd/0): read like stdin, whatever it is."""
    try:
        mine, stdin = os.fstat(fd), os.fstat(0)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (stdin.st_dev, stdin.st_ino)


def _wait_for_writer(fd: int, what: str) -> None:
    """Return once the pipe `fd` has data or its writer closed it (the read then ends); raise after PIPE_WAIT_S."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(PIPE_WAIT_S * 1000):
        raise NeuronInferError(f"{what}: it is a named pipe (FIFO) that nothing wrote to within {PIPE_WAIT_S:g} s; "
                               "start the program that writes to it first, or give a text file")
