"""A full temporary directory while AOTInductor compiles or extracts a graph: one ArtifactError that names the
temporary directory, says it is full and how to point TMPDIR elsewhere (not "recompile the model"), and nothing the
failed step wrote there stays behind. The full file system is simulated: the compile or load step writes its scratch
folder into the temporary directory, then fails as a write to a full disk fails, and the file system reports little
free space."""
from __future__ import annotations

import errno
import hashlib
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from neuron_infer.backends.cpu import graph as cpu
from neuron_infer.errors import ArtifactError


@pytest.fixture
def full_tmp(tmp_path, monkeypatch) -> Path:
    """TMPDIR: a directory whose file system reports 1 MiB free (torch's compile cache kept elsewhere: it is torch's
    persistent cache, reused by later compiles, not a scratch folder)."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    real = shutil.disk_usage

    def usage(path):
        if str(path).startswith(str(d)):
            return real(path)._replace(free=1 << 20)
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return d


def fails_for_space(failure: BaseException):
    """A stand-in for torch's compile or load step: writes a scratch folder where torch writes one, then fails."""
    def step(*_a, **_k):
        scratch = Path(tempfile.mkdtemp(prefix="aotinductor_"))
        (scratch / "model.wrapper.cpp").write_text("// half written")
        raise failure

    return step


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("C++ compile error: fatal error: cannot write: No space left on "
                                                  "device; compilation terminated.")])
def test_compile_with_a_full_tmpdir(full_tmp, tmp_path, monkeypatch, failure):
    monkeypatch.setattr(cpu, "_export", lambda *a, **k: object())
    monkeypatch.setattr(cpu, "_gemv_kernel_file", lambda *a, **k: None)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fails_for_space(failure))
    out = tmp_path / "graphs"
    with pytest.raises(ArtifactError) as e:
        cpu.CpuBackend().compile_graph(torch.nn.Identity(), (), out, "decode")
    message = str(e.value)
    assert "temporary directory" in message and str(full_tmp) in message and "full" in message, message
    assert "TMPDIR" in message and "recompile" not in message, message
    assert list(full_tmp.iterdir()) == [], "the failed compile left files in TMPDIR"


def test_graph_load_with_a_full_tmpdir(full_tmp, tmp_path, monkeypatch):
    package = tmp_path / "decode.pt2"
    with zipfile.ZipFile(package, "w") as z:
        z.writestr("decode/data/aotinductor/model/x.wrapper.cpp", "// code")
    sha = hashlib.sha256(package.read_bytes()).hexdigest()
    failure = RuntimeError(f"Failed to extract zip file x.wrapper.cpp to destination file {full_tmp}/aotinductor_a/x, "
                           "mz_zip error string: write callback failed")
    monkeypatch.setattr(torch._inductor, "aoti_load_package", fails_for_space(failure))
    with pytest.raises(ArtifactError) as e:
        cpu._load_package(package, sha)
    message = str(e.value)
    assert str(full_tmp) in message and "full" in message and "TMPDIR" in message, message
    assert "recompile" not in message, message
    assert list(full_tmp.iterdir()) == [], "the failed load left files in TMPDIR"


def test_a_failure_with_room_to_spare_is_not_blamed_on_the_tmpdir(tmp_path, monkeypatch):
    """The same failure with a temporary directory that has room keeps its own message ("recompile")."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    package = tmp_path / "decode.pt2"
    with zipfile.ZipFile(package, "w") as z:
        z.writestr("x", "y")
    monkeypatch.setattr(torch._inductor, "aoti_load_package", fails_for_space(RuntimeError("bad archive")))
    if shutil.disk_usage(d).free < 1 << 30:
        pytest.skip("the test machine's temporary file system has less than 1 GiB free")
    with pytest.raises(ArtifactError, match="recompile the model"):
        cpu._load_package(package, hashlib.sha256(package.read_bytes()).hexdigest())
    assert list(d.iterdir()) == []
