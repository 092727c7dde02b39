"""Nothing in an artifact is used before it is verified, and nothing outside it is read; chat templates run under
limits. Each case: one `error:` line (exit 2) naming the file, and the tampered content never reached its user."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from neuron_infer.api import CompiledModel, encode_chat
from neuron_infer.artifact.manifest import CHECKSUM, MANIFEST, seal
from neuron_infer.checkpoint import load_tokenizer
from neuron_infer.errors import ArtifactError, NeuronInferError
from tests.test_user_errors import cli, one_error
from tests.tiny_artifact import compile_tiny, relist

GENERATE = ["generate", "--chat", "--prompt", "hi", "--max-new-tokens", "1"]


@pytest.fixture(scope="module")
def art(tiny_dirs, tmp_path_factory) -> Path:
    return compile_tiny(tiny_dirs("gqa"), tmp_path_factory.mktemp("trust") / "a")


@pytest.fixture
def copy(art, tmp_path) -> Path:
    dst = tmp_path / "a"
    shutil.copytree(art, dst)
    return dst


@pytest.fixture
def uses(monkeypatch) -> list[str]:
    """Records every read of the tokenizer directory and every load of weights and graphs."""
    import transformers

    from neuron_infer import api

    seen: list[str] = []
    real_tok, real_rank = transformers.AutoTokenizer.from_pretrained, api.load_rank

    def tok(path, *a, **k):
        seen.append("tokenizer")
        return real_tok(path, *a, **k)

    def rank(*a, **k):
        seen.append("weights and graphs")
        return real_rank(*a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok)
    monkeypatch.setattr(api, "load_rank", rank)
    return seen


def tamper(path: Path) -> None:
    """Change a file so that any use of it would show: a template that raises, JSON that says USED, flipped bytes."""
    if path.name == "chat_template.jinja":
        path.write_text("{{ raise_exception('USED') }}")
    elif path.suffix == ".json" and isinstance(json.loads(path.read_text()), dict):
        d = json.loads(path.read_text())
        path.write_text(json.dumps({**d, "chat_template": "{{ raise_exception('USED') }}", "eos_token_id": 0}))
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def test_every_file_is_verified_before_it_is_used(art, tmp_path, capsys, uses):
    files = sorted(json.loads((art / MANIFEST).read_text())["files"])
    assert any(f.startswith("tokenizer/") for f in files) and any(f.startswith("weights/") for f in files)
    for rel in files:
        dst = tmp_path / rel.replace("/", "_")
        shutil.copytree(art, dst)
        tamper(dst / rel)
        uses.clear()
        msg = one_error(*cli([GENERATE[0], dst, *GENERATE[1:]], capsys), rel, "corrupted", "recompile")
        assert "USED" not in msg
        # a tokenizer file: the tokenizer is never read; any other file: the weights and graphs are never loaded
        assert uses == ([] if rel.startswith("tokenizer/") else ["tokenizer"]), (rel, uses)
        with pytest.raises(ArtifactError, match="corrupted"):
            CompiledModel.load(dst)
        shutil.rmtree(dst)


def test_the_tokenizer_is_verified_even_when_the_files_are_not_hashed(copy, uses):
    tamper(copy / "tokenizer" / "chat_template.jinja")
    with pytest.raises(ArtifactError, match="chat_template.jinja is corrupted"):
        CompiledModel.load(copy, verify_files=False)
    assert uses == []


def test_an_edited_manifest_is_refused(copy, capsys):
    m = json.loads((copy / MANIFEST).read_text())
    m["model"]["rope_theta"] = 1.0  # would silently change the model
    (copy / MANIFEST).write_text(json.dumps(m))
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), "does not match its manifest_sha256", "recompile")
    one_error(*cli(["info", copy], capsys), "manifest_sha256")
    del m[CHECKSUM]
    (copy / MANIFEST).write_text(json.dumps(m))
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), "has no manifest_sha256")


@pytest.mark.parametrize("entry", ["../../../../etc/hostname", "/proc/self/environ", "tokenizer/../../x", "./x",
                                   "a//b", ""])
def test_a_files_entry_outside_the_artifact_is_refused(copy, capsys, entry):
    m = json.loads((copy / MANIFEST).read_text())
    m["files"][entry] = "0" * 64
    (copy / MANIFEST).write_text(json.dumps(seal(m)))  # a consistent manifest: the entry itself is refused
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), repr(entry), "not a path inside")
    one_error(*cli(["info", copy], capsys), "not a path inside")


def test_a_symlinked_tokenizer_directory_is_refused(copy, tmp_path, capsys, uses):
    """A link to a copy whose extra special_tokens_map.json would change the EOS ids: the walk sees the link."""
    other = tmp_path / "other-tokenizer"
    shutil.copytree(copy / "tokenizer", other)
    (other / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    shutil.rmtree(copy / "tokenizer")
    os.symlink(other, copy / "tokenizer")
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), "tokenizer is a symbolic link")
    one_error(*cli(["info", copy], capsys), "symbolic link")
    assert uses == []


def test_a_symlinked_file_or_an_unlisted_file_is_refused(copy, tmp_path, capsys, uses):
    target = copy / "tokenizer" / "tokenizer.json"
    moved = tmp_path / "tokenizer.json"
    shutil.move(target, moved)
    os.symlink(moved, target)  # same bytes, same sha256: refused for being a link
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), "tokenizer.json is a symbolic link")
    target.unlink()
    shutil.move(moved, target)
    (copy / "tokenizer" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    one_error(*cli([GENERATE[0], copy, *GENERATE[1:]], capsys), "special_tokens_map.json is not listed")
    assert uses == []


def test_a_link_to_the_artifact_itself_is_fine(art, tmp_path):
    link = tmp_path / "link"
    os.symlink(art, link)
    assert CompiledModel.load(link).generate(["hi"], max_new_tokens=1).outputs[0].token_ids


@pytest.mark.parametrize("value", ['"abc"', '[2, "x"]', "{}", "[-1]", "[100000]", "true", "{bad json"])
def test_a_bad_generation_config_is_refused_at_compile_time(tiny_dirs, tmp_path, capsys, value):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs("gqa"), model)
    body = value if value == "{bad json" else '{"eos_token_id": ' + value + "}"
    (model / "generation_config.json").write_text(body)
    out = tmp_path / "out"
    one_error(*cli(["compile", model, "-o", out, "--config", "tiny", "--backend", "cpu-eager"], capsys),
              "generation_config.json")
    assert not out.exists()


# ---- chat templates under limits ---------------------------------------------------------------------------------

HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge repeat": "{{ 'x' * 3000000000 }}",
    "float repeat": "{{ 'x' * 3e9 }}",
    "doubling concat": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling plus": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "wide filter": "{{ 'x'|center(3000000000) }}",
    "wide method": "{{ 'x'.ljust(3000000000) }}",
    "replace blowup": "{{ ('x' * 1000000).replace('', 'y' * 100) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "big power": "{{ 9 ** (9 ** 9) }}",
    "list repeat": "{{ (range(100000)|list) * 1000 }}",
    "long output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "attribute escape": "{{ messages.__class__.__mro__ }}",
    "mutation": "{{ messages.append(1) }}",
    "syntax error": "{% for %}",
    "division by zero": "{{ 1 / 0 }}",
    "raise_exception": "{{ raise_exception('System role not supported') }}",
    "lorem ipsum": "{{ lipsum(n=1000000, min=100, max=100) }}",  # one call: the step budget never sees inside
    "slow filter": "{{ ('x ' * 5000000)|wordwrap(1) }}",  # textwrap: seconds per MiB, inside one call
}


def with_template(copy: Path, source: str) -> Path:
    (copy / "tokenizer" / "chat_template.jinja").write_text(source)
    relist(copy)  # a consistent artifact whose own template is hostile: the limits, not the checks, stop it
    return copy


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_one_error_naming_the_file(copy, capsys, name):
    from tests.test_fuzz_hostile import deadline

    with_template(copy, HOSTILE[name])
    with deadline(f"template {name}"):
        code, lines = cli([GENERATE[0], copy, *GENERATE[1:]], capsys)
    msg = one_error(code, lines, "chat_template.jinja: the chat template")
    if name == "raise_exception":
        assert msg.endswith("refused this conversation: System role not supported")


def test_chat_system_refused_by_the_template_is_one_error(copy, capsys):
    with_template(copy, "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    one_error(*cli(["chat", copy, "--system", "Be brief."], capsys), "System role not supported")



RICH = """{%- set ns = namespace(sys='') -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0]['content'] %}{% endif -%}
{{ bos_token }}{% if ns.sys %}<<SYS>>{{ ns.sys | trim }}<</SYS>>{% endif %}
{%- for m in messages if m['role'] != 'system' %}
{%- if loop.index0 > 40 %}{% break %}{% endif %}
<|{{ m['role'] }}|>{% generation %}{{ m['content'] | replace('\\n', ' ') ~ ' ' }}{% endgeneration %}{{ eos_token }}
{%- if m['role'] == 'user' and m['content'] is string %}{{ (m['content'] | length) % 7 }}{% endif %}
{% endfor -%}
{{ {'n': messages | length, 'r': messages | map(attribute='role') | list} | tojson }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


@pytest.mark.parametrize("template", ["shipped", "rich"])
def test_rendering_matches_transformers(art, template):
    tok = load_tokenizer(art / "tokenizer")
    if template == "rich":
        tok.chat_template = RICH
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "é\nwhat {{ x }}?"},
         {"role": "assistant", "content": "No."}, {"role": "user", "content": "again"}],
    ]
    for messages in conversations:
        ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert encode_chat(tok, messages) == ref


def test_api_template_errors_are_neuron_infer_errors(art):
    tok = load_tokenizer(art / "tokenizer")
    tok.chat_template = HOSTILE["nested loops"]
    with pytest.raises(NeuronInferError, match="more than 2000000 steps"):
        encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_tokenizer_files_are_read_once_so_a_swap_after_the_check_is_never_used(copy, monkeypatch):
    """An attacker who can write the artifact swaps the chat template and generation_config.json right after they
    were verified (simulated: at the moment the tokenizer is built). What is used is either the verified content or
    nothing (an error): never the swapped one."""
    from neuron_infer import checkpoint

    real = checkpoint.load_tokenizer
    tok_dir = copy / "tokenizer"
    original_template = (tok_dir / "chat_template.jinja").read_text()

    def swap_then_load(*a, **k):
        (tok_dir / "chat_template.jinja").write_text("SWAPPED {{ raise_exception('SWAPPED') }}")
        (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "load_tokenizer", swap_then_load)
    try:
        model = CompiledModel.load(copy)
    except ArtifactError as e:  # the generation config, read after the swap: refused, not used
        assert "generation_config.json is corrupted" in str(e), e
    else:
        assert 7 not in model.eos_ids
        assert model.tokenizer.chat_template == original_template


def test_the_tokenizer_is_built_from_the_verified_bytes(copy, monkeypatch):
    """Only the chat template is swapped after the check: the load succeeds with the verified template, and
    messages name the artifact's tokenizer directory (not the private copy the bytes were loaded from)."""
    from neuron_infer import checkpoint

    real = checkpoint.load_tokenizer
    template = copy / "tokenizer" / "chat_template.jinja"
    original = template.read_text()

    def swap_then_load(*a, **k):
        template.write_text("SWAPPED")
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "load_tokenizer", swap_then_load)
    model = CompiledModel.load(copy)
    assert model.tokenizer.chat_template == original
    assert Path(model.tokenizer.name_or_path) == copy / "tokenizer"


# ---- the digest: a trust anchor outside the artifact -------------------------------------------------------------
def _digest_line(root: Path) -> str:
    from click.testing import CliRunner

    from neuron_infer.cli import cli as click_cli

    r = CliRunner().invoke(click_cli, ["info", str(root)])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["digest"])
    return line.split()[1]


def test_info_prints_the_digest_of_the_manifest_as_stored(art):
    import hashlib

    from click.testing import CliRunner

    from neuron_infer.cli import cli as click_cli

    digest = hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()  # what sha256sum manifest.json prints
    assert _digest_line(art) == digest
    r = CliRunner().invoke(click_cli, ["info", str(art), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["digest"] == digest


def rewritten(root: Path) -> None:
    """A rewrite the checksums cannot catch: rope_theta changed, a tokenizer file changed, every hash and the
    manifest checksum recomputed (as whoever can write the artifact can do)."""
    m = json.loads((root / MANIFEST).read_text())
    m["model"]["rope_theta"] = 1.0
    (root / MANIFEST).write_text(json.dumps(m))
    cfg = root / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_max_length": 7}))
    relist(root)


def test_a_rewrite_with_recomputed_checksums_loads_unless_the_digest_is_pinned(art, copy, capsys, uses):
    pinned = _digest_line(art)
    rewritten(copy)
    code, lines = cli([GENERATE[0], copy, *GENERATE[1:]], capsys)
    assert code == 0, lines  # the checksums all match: without a pinned digest the rewrite loads
    assert CompiledModel.load(copy).manifest.model.rope_theta == 1.0
    for run in (GENERATE, ["chat"]):
        uses.clear()
        msg = one_error(*cli([run[0], copy, *run[1:], "--expect-digest", pinned], capsys), str(copy / MANIFEST),
                        f"not the expected {pinned}", "nothing in it was used")
        assert uses == [], (run, uses)  # neither the tokenizer nor the weights and graphs were read
        assert _digest_line(copy) in msg
    uses.clear()
    with pytest.raises(ArtifactError, match=f"not the expected {pinned}"):
        CompiledModel.load(copy, expect_digest=pinned)
    assert uses == []
    assert CompiledModel.load(copy, expect_digest=_digest_line(copy)).manifest.model.rope_theta == 1.0


def test_the_pinned_digest_loads_the_artifact_it_names(art, capsys):
    pinned = _digest_line(art)
    for given in (pinned, pinned.upper(), f"sha256:{pinned}"):
        code, lines = cli([GENERATE[0], art, *GENERATE[1:], "--expect-digest", given], capsys)
        assert code == 0, (given, lines)
    assert CompiledModel.load(art, expect_digest=f" {pinned}\n").manifest.files  # as pasted from a file


@pytest.mark.parametrize("given", ["abc", "", "g" * 64, "a" * 63, "a" * 65, "sha1:" + "a" * 64,
                                   "a" * 32 + " " + "a" * 31])
def test_an_expected_digest_that_is_not_a_sha256_is_one_error(art, capsys, uses, given):
    one_error(*cli([GENERATE[0], art, *GENERATE[1:], "--expect-digest", given], capsys), "--expect-digest",
              "not a sha256 digest", "neuron-infer info")
    assert uses == []
    with pytest.raises(NeuronInferError, match="expect_digest=.* is not a sha256 digest"):
        CompiledModel.load(art, expect_digest=given)


@pytest.mark.parametrize("given", [123, b"a" * 64, ["a" * 64], None])
def test_the_api_refuses_a_digest_of_the_wrong_type_or_without_hashing(art, uses, given):
    if given is None:  # the digest pins the files through their hashes: the files must be hashed
        with pytest.raises(NeuronInferError, match="needs verify_files=True"):
            CompiledModel.load(art, verify_files=False, expect_digest=_digest_line(art))
    else:
        with pytest.raises(NeuronInferError, match="is not a sha256 digest"):
            CompiledModel.load(art, expect_digest=given)
    assert uses == []
