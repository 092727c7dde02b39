"""`neuron-infer cache list|prune`: only entries neuron-infer created (marker files, exact names) are removed."""
import json
import os
import shutil
import time

import pytest
from click.testing import CliRunner

from neuron_infer import cache
from neuron_infer.artifact.manifest import seal
from neuron_infer.cli import cli
from neuron_infer.cli_info import human_bytes
from neuron_infer.embedded import MODEL_NAME, SOURCE_FILE
from neuron_infer.output_dir import mark
from tests.tiny_artifact import compile_tiny

SHA = "0123456789abcdef" + "0" * 48
OLD = time.time() - 2 * 3600


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory):
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("cache") / "a")


def age(path, when=OLD):
    os.utime(path, (when, when))


@pytest.fixture
def root(tmp_path, art, monkeypatch):
    """A cache with every kind of entry; returns (root, {name: path})."""
    r = tmp_path / "cache"
    monkeypatch.setenv("NEURON_INFER_CACHE", str(r))
    monkeypatch.setattr(cache, "_current_gguf_sha16", lambda: SHA[:16])
    models, arts = r / "models", r / "artifacts"
    p = {}
    p["model"] = models / f"{MODEL_NAME}-{SHA[:16]}"
    p["old_model"] = models / f"{MODEL_NAME}-{'f' * 16}"
    for d, sha in ((p["model"], SHA), (p["old_model"], "f" * 64)):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"w" * 1000)
        (d / SOURCE_FILE).write_text(json.dumps({"gguf_sha256": sha}))
    p["current"] = arts / f"smollm2-135m-{'1' * 16}"
    p["stale"] = arts / f"smollm2-135m-{'2' * 16}"
    shutil.copytree(art, p["current"])
    shutil.copytree(art, p["stale"])
    mf = p["stale"] / "manifest.json"
    m = json.loads(mf.read_text())
    m["versions"]["neuron_infer"] = "0.0.1"
    mf.write_text(json.dumps(seal(m)))
    p["partial"] = arts / f".smollm2-135m-{'3' * 16}.partial-ab_12x"
    p["young_partial"] = arts / f".smollm2-135m-{'4' * 16}.partial-cd34yz"
    p["tmp_model"] = models / f".tmp-{MODEL_NAME}-{SHA[:16]}-q1w2e3"
    for d in (p["partial"], p["young_partial"], p["tmp_model"]):
        d.mkdir()
        mark(d)  # what a killed writer leaves: its directory with our marker
        (d / "x.bin").write_bytes(b"p" * 500)
    age(p["partial"])
    age(p["tmp_model"])
    # leftover names without our marker, or with a newline after the name: kept
    p["unmarked_partial"] = arts / f".smollm2-135m-{'7' * 16}.partial-ef56gh"
    p["newline_stale"] = arts / f"smollm2-135m-{'8' * 16}\n"
    shutil.copytree(art, p["newline_stale"])
    p["unmarked_partial"].mkdir()
    (p["unmarked_partial"] / "keep.txt").write_text("mine")
    age(p["unmarked_partial"])
    # never ours: no marker, other names, a symlink to a real artifact, files of the user
    p["no_marker"] = arts / f"smollm2-135m-{'5' * 16}"
    p["no_marker"].mkdir()
    (p["no_marker"] / "notes.txt").write_text("mine")
    p["user_dir"] = arts / "my-artifact"
    shutil.copytree(art, p["user_dir"])
    outside = tmp_path / "outside"
    shutil.copytree(art, outside)
    p["link"] = arts / f"smollm2-135m-{'6' * 16}"
    p["link"].symlink_to(outside)
    p["venv"] = r / "vllm-venv-0.32.0"
    p["venv"].mkdir()
    (p["venv"] / "pyvenv.cfg").write_text("home = /usr")
    p["old_user_tmp"] = arts / ".tmp-something"
    p["old_user_tmp"].mkdir()
    age(p["old_user_tmp"])
    return r, p


def states(r):
    return {e.path.name: (e.kind, e.state) for e in cache.scan(r)}


def test_scan_classifies_every_entry(root):
    r, p = root
    s = states(r)
    assert s[p["model"].name] == ("model", "current") and s[p["old_model"].name] == ("model", "stale")
    assert s[p["current"].name] == ("artifact", "current") and s[p["stale"].name] == ("artifact", "stale")
    assert s[p["partial"].name] == ("partial", "partial") and s[p["tmp_model"].name] == ("partial", "partial")
    assert s[p["young_partial"].name] == ("partial", "in progress")
    for k in ("no_marker", "user_dir", "link", "venv", "old_user_tmp"):
        assert s[p[k].name] == ("other", "other"), k


def test_list_shows_entries_and_sizes(root):
    r, p = root
    res = CliRunner().invoke(cli, ["cache", "list"])
    assert res.exit_code == 0 and str(r) in res.stdout
    line = next(x for x in res.stdout.splitlines() if p["stale"].name in x)
    assert "artifact" in line and "stale" in line and "neuron_infer 0.0.1" in line
    d = json.loads(CliRunner().invoke(cli, ["cache", "list", "--json"]).stdout)
    by_name = {os.path.basename(e["path"]): e for e in d["entries"]}
    assert by_name[p["model"].name]["size_bytes"] == cache.tree_size(p["model"]) > 1000


def test_dry_run_deletes_nothing_and_says_what_it_would_free(root):
    r, p = root
    before = sorted(x.relative_to(r) for x in r.rglob("*"))
    res = CliRunner().invoke(cli, ["cache", "prune", "--dry-run"])
    assert res.exit_code == 0 and sorted(x.relative_to(r) for x in r.rglob("*")) == before
    freed = sum(cache.tree_size(p[k]) for k in ("old_model", "stale", "partial", "tmp_model"))
    assert res.stdout.count("would remove") == 4
    assert res.stdout.strip().splitlines()[-1] == f"4 entries, would free {human_bytes(freed)}"


def test_prune_removes_stale_and_partial_only(root):
    _, p = root
    res = CliRunner().invoke(cli, ["cache", "prune"])
    assert res.exit_code == 0 and res.stdout.count("removed ") == 4 and "freed" in res.stdout
    gone = {"old_model", "stale", "partial", "tmp_model"}
    for k, path in p.items():
        assert (os.path.lexists(path)) == (k not in gone), k
    assert (p["link"] / "manifest.json").is_file()  # the symlink's target is untouched


def test_prune_all_removes_current_entries_but_never_others(root):
    _, p = root
    res = CliRunner().invoke(cli, ["cache", "prune", "--all"])
    assert res.exit_code == 0
    kept = {"young_partial", "no_marker", "user_dir", "link", "venv", "old_user_tmp", "unmarked_partial",
            "newline_stale"}
    for k, path in p.items():
        assert os.path.lexists(path) == (k in kept), k
    assert (p["user_dir"] / "manifest.json").is_file() and (p["no_marker"] / "notes.txt").read_text() == "mine"


def test_remove_refuses_what_is_not_ours(root):
    _, p = root
    with pytest.raises(ValueError, match="not a neuron-infer cache entry"):
        cache.remove(cache.CacheEntry(p["user_dir"], "other", "other", 0))
    assert p["user_dir"].is_dir()


def test_an_empty_or_missing_cache_lists_and_prunes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_INFER_CACHE", str(tmp_path / "none"))
    assert CliRunner().invoke(cli, ["cache", "list"]).exit_code == 0
    res = CliRunner().invoke(cli, ["cache", "prune"])
    assert res.exit_code == 0 and res.stdout.startswith("0 entries") and not (tmp_path / "none").exists()
