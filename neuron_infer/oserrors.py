"""OSErrors a user can fix (a full disk, a read-only file system, missing permissions, a file where a directory
belongs) as one line that says what to do; any other OSError is a bug or an unexpected state and keeps its
traceback. Also the check that an output location can be created, made before a long compile.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
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


_LOW_SPACE = 256 << 20  # bytes: below this a failed compile or graph extraction is taken to be for lack of space
_SPACE_WORDS = ("No space left on device", "Disk quota exceeded", "write callback failed", "os error 28")


@contextmanager
def scratch_tmpdir(what: str) -> Iterator[Path]:
    """Run `what` (AOTInductor's compile or package loading) with TMPDIR pointed at a private directory, removed
    afterwards whatever happens: the C++ compiler's temporaries and the extracted `aotinductor_*` folders never stay
    behind. Torch's own compile cache (TORCHINDUCTOR_CACHE_DIR, by default torchinductor_<user> in the temporary
    directory) is pinned first and kept: it is reused by later compiles. A failure while the temporary directory or
    that cache lies on a (nearly) full file system becomes one ArtifactError saying which one is full and how to
    point it elsewhere; other failures pass through unchanged."""
    cache = _inductor_cache_dir()
    base = tempfile.gettempdir()
    try:
        private = tempfile.mkdtemp(prefix="neuron-infer-scratch-", dir=base)
    except OSError as e:
        raise _space_error(what, base, cache, e) or e
    saved_env, saved_module = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = private
    try:
        yield Path(private)
    except Exception as e:  # noqa: BLE001  (torch raises RuntimeError, CppCompileError, OSError...: all looked at)
        raise _space_error(what, base, cache, e) or e
    finally:
        tempfile.tempdir = saved_module
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(private, ignore_errors=True)


def _inductor_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    return cache_dir()  # also fixes TORCHINDUCTOR_CACHE_DIR, so it does not follow TMPDIR into the private directory


def _space_error(what: str, tmp: str, cache: str | None, e: BaseException) -> ArtifactError | None:
    """An ArtifactError naming the full directory when `e` looks like a lack of space there, else None."""
    def free(d: str) -> int:
        try:
            return shutil.disk_usage(d).free
        except OSError:
            return 1 << 62

    said_space = any(w in str(e) for w in _SPACE_WORDS) or (
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
    tmp_fix = "point TMPDIR at a directory with room (e.g. `TMPDIR=/var/tmp neuron-infer ...`)"
    cache_fix = "set TORCHINDUCTOR_CACHE_DIR to a directory with room"
    for d, name, fix in ((tmp, "the temporary directory", tmp_fix), (cache, "torch's compile cache", cache_fix)):
        if d is not None and (free(d) < _LOW_SPACE or (said_space and free(d) < 4 * _LOW_SPACE)):
            return ArtifactError(f"{name} {d} is full ({free(d) / 2**20:.1f} MiB free on its file system) while "
                                 f"{what}; free some space there, or {fix}")
    return None
