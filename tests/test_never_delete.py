"""`--overwrite` and the clean-up of leftovers delete only what neuron-infer wrote: anything else in the way is
refused with one `error:` line naming it, and stays as it was."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from neuron_infer.artifact.manifest import MANIFEST, artifact_files, seal
from neuron_infer.cli import main
from neuron_infer.output_dir import PARTIAL_MARKER, _remove_owned, foreign_entries, mark
from tests.tiny_artifact import compile_tiny

TINY = ["--config", "tiny", "--backend", "cpu-eager"]


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("never") / "a")


@pytest.fixture
def old(art, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(art, dst)
    return dst


def cli(args, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().err.splitlines()


def refused(code: int, lines: list[str], *words: str) -> None:
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and not any("Traceback" in ln for ln in lines), lines
    assert all(w in errors[0] for w in words), (words, errors[0])


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (links not followed): file bytes, link targets, directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                        else p.read_bytes().hex() if p.is_file() else "special")
    return out


@pytest.mark.parametrize("intruder", ["empty directory", "directory link", "file link", "fifo"])
def test_overwrite_refuses_an_output_holding_what_is_not_ours(old, tiny_dirs, tmp_path, capsys, intruder):
    user = tmp_path / "user-data"
    user.mkdir()
    (user / "precious.txt").write_text("mine")
    if intruder == "empty directory":
        (old / "weights" / "my-notes").mkdir()
    elif intruder == "directory link":
        (old / "backup").symlink_to(user)
    elif intruder == "file link":
        (old / "tokenizer" / "extra.txt").symlink_to(user / "precious.txt")
    else:
        os.mkfifo(old / "pipe")
    before, user_before = snapshot(old), snapshot(user)
    refused(*cli(["compile", tiny_dirs("mha"), "-o", old, "--overwrite", *TINY], capsys), "not part of its")
    assert snapshot(old) == before and snapshot(user) == user_before
    assert not list(tmp_path.glob(".out.*"))


def test_quantize_overwrite_refuses_an_empty_directory_inside(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli(["quantize", tiny_dirs("gqa"), "-o", out, "--quant", "int8"], capsys)[0] == 0
    (out / "keep").mkdir()
    before = snapshot(out)
    refused(*cli(["quantize", tiny_dirs("gqa"), "-o", out, "--quant", "int8", "--overwrite"], capsys),
            "keep/ (a directory)")
    assert snapshot(out) == before


def test_a_manifest_listing_paths_outside_is_not_an_artifact_of_ours(old, tiny_dirs, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    m = json.loads((old / MANIFEST).read_text())
    m["files"]["../victim.txt"] = "0" * 64
    (old / MANIFEST).write_text(json.dumps(seal(m)))
    assert artifact_files(old) is None
    refused(*cli(["compile", tiny_dirs("mha"), "-o", old, "--overwrite", *TINY], capsys), "is not a neuron-infer")
    assert victim.read_text() == "mine"


def test_the_replaced_output_loses_only_its_listed_files(old):
    mine = artifact_files(old)
    assert foreign_entries(old, mine) == []
    (old / "weights" / "late.txt").write_text("appeared after the check")
    mark(old)
    _remove_owned(old, mine)
    assert snapshot(old) == {"weights": "dir", "weights/late.txt": b"appeared after the check".hex(),
                             PARTIAL_MARKER: snapshot(old)[PARTIAL_MARKER]}


def test_overwrite_of_our_own_output_still_works(old, tiny_dirs, capsys):
    fingerprint = json.loads((old / MANIFEST).read_text())["checkpoint_fingerprint"]
    assert cli(["compile", tiny_dirs("mha"), "-o", old, "--overwrite", *TINY], capsys)[0] == 0
    assert json.loads((old / MANIFEST).read_text())["checkpoint_fingerprint"] != fingerprint
    assert not list(old.parent.glob(".out.*"))
