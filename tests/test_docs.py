"""The documentation works: its Python examples run, its relative links resolve, the README stays short.

* Every fenced ```python block of README.md and docs/*.md, and every module docstring example (``>>>`` doctests or
  fenced ```python blocks) under neuron_infer/, nki_kernels/ and scripts/, is executed. Examples name real-world
  paths ("models/Llama-3.2-1B-Instruct", "artifacts/m"); the test rewrites those quoted string literals to a tiny
  random-weight checkpoint and a temporary artifact directory, and compiles with the eager backend so the examples
  take seconds. A path literal with no substitution fails the run (the file does not exist), so a new example must
  either use the paths below or add its own. A block preceded by ``<!-- not run: REASON -->`` is skipped (e.g. code
  that needs NeuronCores); the reason is required.
* Every relative Markdown link in the repository's Markdown files points at an existing file inside the repository,
  and a ``#fragment`` at an existing heading of the target.
* README.md has at most 300 lines, and no tracked file carries development history ("session" with a number, "run" with a letter A-C,
  issue numbers, "earlier this morning") or a path outside the repository.
The helpers are also run on bad inputs below, so each check is shown to fail when it should.
"""
from __future__ import annotations

import ast
import contextlib
import doctest
import functools
import io
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S[^>]*?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
CODE_SPAN = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)  # fenced blocks and inline code: not links

# Example paths -> which test resource replaces them ("ckpt": tiny checkpoint dir, "art": fresh artifact dir).
PATHS = {
    "models/Llama-3.2-1B-Instruct": "ckpt",
    "path/to/hf-model": "ckpt",
    "path/to/model": "ckpt",
    "artifacts/llama32-1b": "art",
    "artifacts/m": "art",
}


# ---------------------------------------------------------------------------------------------- collecting code


def markdown_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line, skip reason or None, code) of each fenced python block of a Markdown text."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        out.append((line, skip.group(1) if skip else None, m.group(1)))
    return out


def docstring_examples(path: Path) -> tuple[list[str], bool]:
    """(fenced python blocks, has doctest examples) of a module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return [code for _, skip, code in markdown_blocks(doc) if skip is None], ">>>" in doc


def tracked(*patterns: str) -> list[Path]:
    """Files git tracks (plus untracked, not ignored ones) matching the patterns."""
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *patterns]
    names = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(ROOT / n for n in names if (ROOT / n).is_file())


def doc_markdown() -> list[Path]:
    return [ROOT / "README.md", *tracked("docs/*.md")]


def md_block_cases() -> list:
    cases = []
    for path in doc_markdown():
        for line, skip, code in markdown_blocks(path.read_text(encoding="utf-8")):
            marks = [pytest.mark.skip(reason=f"not run: {skip}")] if skip else []
            cases.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    return cases


def module_cases() -> list:
    cases = []
    for path in tracked("neuron_infer/*.py", "nki_kernels/*.py", "scripts/*.py"):
        blocks, has_doctest = docstring_examples(path)
        rel = str(path.relative_to(ROOT))
        cases += [pytest.param(code, id=f"{rel}:block{i}") for i, code in enumerate(blocks)]
        if has_doctest:
            cases.append(pytest.param(path, id=f"{rel}:doctest"))
    return cases


# ------------------------------------------------------------------------------------------------ running code


def substitute(code: str, paths: dict[str, str]) -> str:
    """Replace quoted string literals equal to an example path (both quote styles)."""
    for old, new in paths.items():
        for q in ('"', "'"):
            code = code.replace(f"{q}{old}{q}", repr(new))
    return code


def run_block(code: str, workdir: Path) -> str:
    """Execute `code` in a fresh namespace with `workdir` as the current directory; returns its stdout."""
    buf = io.StringIO()
    with contextlib.chdir(workdir), contextlib.redirect_stdout(buf):
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})  # noqa: S102
    return buf.getvalue()


@pytest.fixture
def example_env(tiny_dirs, tmp_path, monkeypatch):
    """Example paths -> tiny resources; compile_model forced to the eager backend (seconds, no C++ compile)."""
    import neuron_infer.api
    import neuron_infer.compile.builder

    eager = functools.partial(neuron_infer.compile.builder.compile_model, backend="cpu-eager", say=lambda m: None)
    monkeypatch.setattr(neuron_infer.api, "compile_model", eager)
    ckpt = str(tiny_dirs("llama3_rope"))  # Llama 3.x-shaped: RoPE scaling, max_position_embeddings 1024
    resources = {"ckpt": ckpt, "art": str(tmp_path / "artifact")}
    return {k: resources[v] for k, v in PATHS.items()}, tmp_path


@pytest.mark.parametrize("code", md_block_cases())
def test_markdown_python_blocks_run(code, example_env):
    paths, workdir = example_env
    run_block(substitute(code, paths), workdir)


@pytest.mark.parametrize("example", module_cases())
def test_docstring_examples_run(example, example_env):
    paths, workdir = example_env
    if isinstance(example, Path):  # a module with >>> examples
        import importlib

        name = ".".join(example.relative_to(ROOT).with_suffix("").parts)
        with contextlib.chdir(workdir):
            result = doctest.testmod(importlib.import_module(name), verbose=False, report=True)
        assert result.failed == 0 and result.attempted > 0, f"{name}: {result}"
    else:
        run_block(substitute(example, paths), workdir)


def test_examples_are_collected():
    """The README's Python example and the api.py docstring example are among the cases (collection works)."""
    ids = [p.id for p in md_block_cases()] + [p.id for p in module_cases()]
    assert any(i.startswith("README.md:") for i in ids), ids
    assert "neuron_infer/api.py:block0" in ids, ids


def test_run_block_fails_on_a_broken_example(tmp_path):
    with pytest.raises(AttributeError):  # the kind of mistake a stale example makes
        run_block("import neuron_infer\nneuron_infer.no_such_api()\n", tmp_path)
    with pytest.raises(FileNotFoundError):  # an example path the test does not substitute
        run_block(substitute("open('models/unknown/config.json')\n", {"models/other": "x"}), tmp_path)


def test_markdown_blocks_parse_fences_and_skip_markers():
    text = "a\n```python\nx = 1\n```\n<!-- not run: needs NeuronCores -->\n```python\ny = 2\n```\n```bash\nls\n```\n"
    assert markdown_blocks(text) == [(2, None, "x = 1\n"), (6, "needs NeuronCores", "y = 2\n")]


# ------------------------------------------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """Problems with the relative links of one Markdown file (external links and code blocks are ignored)."""
    text = CODE_SPAN.sub("", md.read_text(encoding="utf-8"))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md.resolve()
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{md.name}: {target} leaves the repository")
        elif not dest.exists():
            problems.append(f"{md.name}: {target} does not exist")
        elif frag and dest.suffix == ".md" and frag not in {slug(h) for h in HEADING.findall(dest.read_text())}:
            problems.append(f"{md.name}: {target} names no heading of {dest.name}")
    return problems


def test_relative_links_resolve():
    files = tracked("*.md")
    assert ROOT / "README.md" in files and len(files) > 5
    problems = [p for md in files for p in broken_links(md)]
    assert not problems, "\n".join(problems)


def test_link_check_finds_bad_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Part one\n")
    md = tmp_path / "docs" / "a.md"
    md.write_text("[ok](b.md#part-one) [web](https://example.com) [gone](missing.md) [anchor](b.md#part-two)\n"
                  "[out](../../elsewhere.md)\n```\n[in code](nope.md)\n```\n")
    assert broken_links(md, tmp_path) == [
        "a.md: missing.md does not exist",
        "a.md: b.md#part-two names no heading of b.md",
        "a.md: ../../elsewhere.md leaves the repository",
    ]


def test_slug_matches_github():
    assert slug("Neuron (Trainium / Inferentia): not yet run on hardware") == \
        "neuron-trainium--inferentia-not-yet-run-on-hardware"
    assert slug("Speculative decoding (CS1 shape)") == "speculative-decoding-cs1-shape"


# ------------------------------------------------------------------------------------------------ README size


def too_long(text: str, limit: int = README_MAX_LINES) -> bool:
    return len(text.splitlines()) > limit


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert not too_long((ROOT / "README.md").read_text(encoding="utf-8")), f"README.md has {lines} lines"
    assert too_long("x\n" * (README_MAX_LINES + 1)) and not too_long("x\n" * README_MAX_LINES)


# ------------------------------------------------------------------------------------- the repository's wording

# Development history and workplace paths have no place in the repository. Patterns are assembled from pieces so
# this file does not match itself.
HISTORY = re.compile("|".join([
    r"(?i:\bsession[ -][0-9])", r"\brun [A-C]\b", r"(?i:\bissue #?[0-9])",
    r"(?i:\bearlier (this|the same) (morning|day|session))", r"(?i:\bthis morning\b)",
    r"\.\./" + "shared",
]))


def history_mentions(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


def test_no_development_history():
    found = []
    for path in tracked("*"):
        if path.suffix in {".png", ".so", ".gguf"} or path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in history_mentions(text)]
    assert not found, "\n".join(found)


def test_history_patterns_match():
    # the examples are assembled so that a plain grep of the repository for these phrases finds nothing here
    bad = ("measured in sess" + "ion 5", "run " + "B was slower", "see issue 20", "earlier the " + "same morning",
           "as of this morning", "see ../" + "shared/docs")
    assert all(history_mentions(t) for t in bad)
    assert not history_mentions("tests ru" + "n a real vLLM; issues 4 x 2 matmuls; session-scoped fixture")


# ------------------------------------------------------------------------------------------------ the code map

MAP_ROW = re.compile(r"^\|\s*([^|]*`[^|]*)\|", re.MULTILINE)


def mapped_files(structure_md: str, package: str = "neuron_infer") -> set[str]:
    """Files the `## <package>/` table of docs/structure.md names, as paths relative to the package. In a row,
    a name without a directory (`fp8.py` after `quant/int8.py`) is in the directory of the previous name."""
    section = structure_md.split(f"## {package}/", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for cell in MAP_ROW.findall(section):
        folder = ""
        for name in re.findall(r"`([^`]+)`", cell):
            if "/" in name:
                folder = name.rsplit("/", 1)[0] + "/"
                names.add(name)
            else:
                names.add(folder + name)
    return names


def source_files(package: Path) -> set[str]:
    """Every .py, .cpp and .h file of `package`, except a sub-package's `__init__.py` that holds only a docstring."""
    found = set()
    for p in [*package.rglob("*.py"), *package.rglob("*.cpp"), *package.rglob("*.h")]:
        rel = p.relative_to(package).as_posix()
        if "__pycache__" in rel:
            continue
        if p.name == "__init__.py" and "/" in rel:
            body = ast.parse(p.read_text(encoding="utf-8")).body
            if all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body):
                continue
        found.add(rel)
    return found


def code_map_problems(structure_md: str, package: Path) -> list[str]:
    mapped, actual = mapped_files(structure_md, package.name), source_files(package)
    return ([f"{package.name}/{f} is missing from docs/structure.md" for f in sorted(actual - mapped)]
            + [f"docs/structure.md names {package.name}/{f}, which does not exist" for f in sorted(mapped - actual)])


def test_code_map_matches_the_files():
    text = (ROOT / "docs" / "structure.md").read_text(encoding="utf-8")
    assert code_map_problems(text, ROOT / "neuron_infer") == []


def test_code_map_check_finds_missing_and_stale_entries(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/b.py", "sub/c.py", "new.py"):
        (pkg / f).write_text("x = 1\n")
    (pkg / "sub" / "__init__.py").write_text('"""Only a docstring."""\n')
    text = "## pkg/\n\n| file | owns |\n|---|---|\n| `__init__.py`, `a.py` | x |\n| `sub/b.py`, `c.py`, `gone.py` | y |\n"
    assert code_map_problems(text, pkg) == ["pkg/new.py is missing from docs/structure.md",
                                            "docs/structure.md names pkg/sub/gone.py, which does not exist"]
