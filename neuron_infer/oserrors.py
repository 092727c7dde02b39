"""OSErrors a user can fix (a full disk, a read-only file system, missing permissions, a file where a directory
belongs) as one line that says what to do; any other OSError is a bug or an unexpected state and keeps its
traceback. Also the check that an output location can be created, made before a long compile.
"""
from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from neuron_infer.errors import ArtifactError

# errno -> what to do
_OS_ERROR_FIXES = {
    errno.ENOSPC: "free some space on that file system, or write elsewhere (-o DIR; the cache: NEURON_INFER_CACHE)",
    errno.EDQUOT: "the disk quota is used up: free some space, or write elsewhere (-o DIR)",
    errno.EROFS: "that file system is read-only: write elsewhere (-o DIR)",
    errno.EACCES: "you lack the permission: write elsewhere (-o DIR) or fix the permissions",
    errno.EPERM: "the operation is not permitted there: write elsewhere (-o DIR) or fix the permissions",
    errno.ENOTDIR: "a part of that path is a file, not a directory",
    errno.EFBIG: "the file is too large for that file system: write elsewhere (-o DIR)",
    errno.ENAMETOOLONG: "the path is too long: choose a shorter one",
}


def describe_os_error(e: OSError) -> str | None:
    """One line for a user-fixable OSError (see _OS_ERROR_FIXES), else None."""
    fix = _OS_ERROR_FIXES.get(e.errno)
    if fix is None:
        return None
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or os.strerror(e.errno)}; {fix}"


def as_os_error(e: BaseException) -> OSError | None:
    """`e` as an OSError: itself, or the OS error a safetensors writer reports as text ("... (os error 28)")."""
    if isinstance(e, OSError):
        return e
    found = re.search(r"\(os error (\d+)\)", str(e)) if isinstance(e, SafetensorError) else None
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


@contextmanager
def writing_to(out: Path) -> Iterator[None]:
    """User-fixable OSErrors raised while writing the directory `out` (or its temporary siblings) become one
    ArtifactError that names `out`; other errors pass through unchanged."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        os_error = as_os_error(e)
        msg = describe_os_error(os_error) if os_error is not None else None
        if msg is None or not _concerns(os_error, Path(out)):
            raise
        raise ArtifactError(f"cannot write {out}: {msg}") from e


def _concerns(e: OSError, out: Path) -> bool:
    """Whether `e` happened writing `out`: a failed write() names no file; otherwise the file is an ancestor of
    `out` or lies in out's parent directory (the temporary sibling a compile writes into)."""
    if not e.filename:
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    out, path = out.resolve(), Path(os.fsdecode(e.filename)).resolve()
    return path in out.parents or out.parent in path.parents


def check_output_location(final: Path) -> None:
    """Fail fast (before a long compile) when `final` cannot be created: its nearest existing ancestor must be a
    directory this process can write into."""
    final = Path(final).absolute()
    if final.exists() and not final.is_dir():
        raise ArtifactError(f"-o {final} is a file, not a directory; choose another -o directory")
    if final.parent == final:
        raise ArtifactError(f"-o {final} is the root of the file system; choose a new directory for the output")
    ancestor = next(p for p in final.parents if p.exists())
    if not ancestor.is_dir():
        raise ArtifactError(f"-o {final}: {ancestor} is a file, not a directory; choose another -o directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(ancestor) else "is not writable by you"
        raise ArtifactError(f"-o {final}: {ancestor} {why}; choose another -o directory")


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
