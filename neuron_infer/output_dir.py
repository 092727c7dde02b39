"""Output directories neuron-infer writes (compiled artifacts, `quantize` outputs): where they may go, what
`--overwrite` may replace, and how they appear.

- An output is never a source directory (the checkpoint, a draft checkpoint) nor a directory that contains one.
- An existing directory is replaced only with `overwrite=True`, and only when it is empty or a previous output of
  the same kind whose every file is its own (listed by its manifest). Anything else is refused; nothing is deleted.
- One writer at a time: `.NAME.lock` beside the output is held (flock) for the whole write and names the writer's
  pid; a second writer of the same output fails at once instead of silently replacing the first one's result.
  Caches (the default model's artifacts, the vLLM plugin's) wrap their check-then-compile in `one_at_a_time`, so a
  second process waits for the first compile and reuses it.
- The output is built in `.NAME.partial-XXXXXXXX` beside it and appears by one rename (a killed write never leaves a
  directory that loads). Holding the lock proves that no live writer owns a leftover `.NAME.partial-*` or
  `.NAME.old-*`; those left by killed writers are removed when they hold our marker file (PARTIAL_MARKER, written
  into each such directory we create), and left alone otherwise.
- A replaced output is renamed aside, then only the files its manifest lists (and the directories holding them)
  are deleted. Empty directories, symbolic links and special files inside an output are not ours: an output
  holding one is refused like one holding any other file.
- Files get the permissions the umask allows (mkdtemp creates 0700), so another account can read them.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from neuron_infer.errors import ConfigError

PARTIAL_MARKER = ".neuron-infer-partial"  # inside the temporary directories we create (never in a final output)

# relative POSIX paths of every file a previous output of this kind owns (a name ending in '/': a directory it always
# has, even when empty), or None when the directory is not one
OwnedFiles = Callable[[Path], "set[str] | None"]


@contextmanager
def atomic_output(final: str | Path, *, overwrite: bool, owned: OwnedFiles, what: str,
                  sources: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield an empty temporary directory beside `final`; on success it replaces `final`, on error it is deleted.

    `what` names the kind of output in messages (e.g. "compiled artifact"); `sources` are the input directories.
    """
    final = Path(os.path.abspath(final))
    check_not_source(final, sources)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(final.with_name(f".{final.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666))
    except OSError as e:  # e.g. -o /proc/x: a directory that holds no files of ours
        raise ConfigError(f"-o {final}: cannot create files in {final.parent} ({e.strerror or e}); choose another "
                          "-o directory") from None
    with _writer_lock(final):
        check_target(final, overwrite, owned, what)
        _remove_stale(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
        mark(tmp)
        try:
            yield tmp
            (tmp / PARTIAL_MARKER).unlink()
            apply_umask(tmp)
            check_target(final, overwrite, owned, what)  # again: a directory may have appeared meanwhile
            _replace(tmp, final, what, owned(final) or set())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


@contextmanager
def one_at_a_time(final: str | Path) -> Iterator[None]:
    """Wait (blocking) until no other process is inside this block for `final`: a cache fill checks for a finished
    output inside it, so a second process waits for the first one's compile and then reuses it."""
    final = Path(os.path.abspath(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.wait"), "a") as f:  # kept: unlinking a waited-on lock file races
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def check_not_source(final: Path, sources: Iterable[str | Path]) -> None:
    """Refuse an output that is, or contains, one of the input directories."""
    out = final.resolve()
    for s in sources:
        src = Path(s).resolve()
        if out == src or out in src.parents:
            rel = "is" if out == src else "contains"
            raise ConfigError(f"-o {final} {rel} the input directory {src}, which must never be replaced; write the "
                              f"output to a new directory, e.g. -o {src.parent / (src.name + '-out')}")


def check_target(final: Path, overwrite: bool, owned: OwnedFiles, what: str) -> None:
    """Accept a missing or empty `final`, or (with overwrite) a previous output of this kind holding only its files."""
    if not os.path.lexists(final):
        return
    if final.is_symlink():  # replacing it would replace the link, or write into a directory we did not create
        raise ConfigError(f"{final} is a symbolic link (to {os.readlink(final)}); give -o the real directory "
                          "path, or choose another -o directory")
    if not final.is_dir():
        raise ConfigError(f"{final} exists and is not a directory; choose another -o directory")
    if not any(final.iterdir()):
        return
    mine = owned(final)
    if mine is None:
        raise ConfigError(f"{final} is not empty and is not a neuron-infer {what}, so it is never replaced (not even "
                          "with --overwrite); choose a new or empty -o directory")
    foreign = foreign_entries(final, mine)
    if foreign:
        raise ConfigError(f"{final} holds files that are not part of its neuron-infer {what} "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); move them away or "
                          "choose another -o directory")
    if not overwrite:
        raise ConfigError(f"{final} already holds a neuron-infer {what}; pass --overwrite to replace it, or choose "
                          "another -o directory")


def foreign_entries(root: Path, mine: set[str]) -> list[str]:
    """Entries under `root` that are not the files in `mine` (a name ending in '/': a directory the output always
    has, even when empty) or the directories holding them: other files, empty or foreign directories, symbolic links (never followed) and special files, each described."""
    dirs = {rel.rstrip("/") if rel.endswith("/") else Path(rel).parent.as_posix() for rel in mine} - {"."}
    dirs |= {Path(d).parents[i].as_posix() for d in list(dirs) for i in range(len(Path(d).parents) - 1)}
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel, mode = p.relative_to(root).as_posix(), p.lstat().st_mode
            if stat.S_ISLNK(mode):
                out.append(f"{rel} (a symbolic link)")
            elif stat.S_ISDIR(mode):
                if rel not in dirs:
                    out.append(f"{rel}/ (a directory)")
            elif not stat.S_ISREG(mode):
                out.append(f"{rel} (not a regular file)")
            elif rel not in mine:
                out.append(rel)
    return out


def mark(directory: Path) -> None:
    """Mark a temporary directory as ours (a later writer may delete it once its writer is gone)."""
    (directory / PARTIAL_MARKER).write_text("a temporary directory of neuron-infer; safe to delete\n")


def is_marked(directory: Path) -> bool:
    """Whether `directory` is a real directory (not a link) holding our marker as a regular file."""
    try:
        return (stat.S_ISDIR(directory.lstat().st_mode)
                and stat.S_ISREG((directory / PARTIAL_MARKER).lstat().st_mode))
    except OSError:
        return False


def apply_umask(root: Path) -> None:
    """Give `root` and everything under it the umask's permissions (executables and directories keep x bits)."""
    mask = current_umask()
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        full = 0o777 if p.is_dir() or p.stat().st_mode & 0o111 else 0o666
        os.chmod(p, full & ~mask)


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it (os.umask can only swap)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def _writer_lock(final: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `final` (flock; released by the kernel if we die) and write our pid into it."""
    path = final.with_name(f".{final.name}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"{final} is being written by another neuron-infer process (pid {holder}); wait for "
                              "it to finish, or choose another -o directory") from None
        if _still_named(fd, path):
            break
        os.close(fd)  # the previous holder unlinked it between our open and our lock: lock the new file
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # still locked: a process that opened it sees it unnamed and retries
        os.close(fd)


def _still_named(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _remove_stale(final: Path) -> None:
    """Remove the temporary siblings of dead writers (called with the lock held, so no live writer owns one)."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.(partial-[a-z0-9_]{{8}}|old-[0-9]+)")
    for p in final.parent.iterdir():
        if pattern.fullmatch(p.name) and is_marked(p):  # unmarked: not ours (or not finished being marked)
            shutil.rmtree(p, ignore_errors=True)


def _replace(tmp: Path, final: Path, what: str, mine: set[str]) -> None:
    """Rename `tmp` to `final`; a non-empty `final` (checked replaceable; `mine`: its files) is moved aside first,
    then its files are deleted."""
    if final.is_dir() and any(final.iterdir()):
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(old, final)
            raise
        mark(old)
        _remove_owned(old, mine)
        return
    try:
        os.rename(tmp, final)  # onto a missing or empty directory; fails instead of replacing a non-empty one
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise ConfigError(f"{final} was created by another program while this {what} was being written; nothing "
                          "was replaced; choose another -o directory") from e


def _remove_owned(old: Path, mine: set[str]) -> None:
    """Delete the files in `mine` and then the emptied directories; anything else (which the checks refused, but
    which may have appeared since) stays, with the marked directory holding it."""
    inside = old.resolve()
    mine = {rel for rel in mine if not rel.startswith("/") and ".." not in rel.split("/")}
    for rel in mine:
        p = old / rel
        if not p.is_symlink() and p.is_file() and inside in p.resolve().parents:
            p.unlink()
    dirs = {q for rel in mine for q in (old / rel).parents if old in q.parents}
    dirs |= {old / rel.rstrip("/") for rel in mine if rel.endswith("/")}
    for d in sorted(dirs, key=lambda q: -len(q.parts)):
        try:
            d.rmdir()
        except OSError:
            pass
    if {p.name for p in old.iterdir()} == {PARTIAL_MARKER}:
        (old / PARTIAL_MARKER).unlink()
        old.rmdir()
