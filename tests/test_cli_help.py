"""Every command has help text and examples; every flag has help text."""
import click
import pytest
from click.testing import CliRunner

from neuron_infer.cli import cli


def all_commands(group=cli, prefix=()):
    for name, cmd in sorted(group.commands.items()):
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, (*prefix, name))


COMMANDS = list(all_commands())


def test_the_top_level_help_has_examples():
    r = CliRunner().invoke(cli, ["--help"])
    assert r.exit_code == 0 and "Examples:" in r.output and "neuron-infer generate" in r.output


def test_every_command_is_listed():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"compile", "generate", "chat", "info", "doctor", "plan", "quantize", "cache", "cache list", "cache prune"} <= names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_command_help_has_a_description_an_example_and_help_on_every_flag(path, cmd):
    assert (cmd.help or "").strip(), f"{' '.join(path)} has no help text"
    assert "Examples:" in (cmd.epilog or ""), f"{' '.join(path)} has no examples"
    assert all(line.strip().startswith("neuron-infer") or "neuron-infer " in line
               for line in cmd.epilog.splitlines()[2:]), "examples are command lines"
    missing = [p.name for p in cmd.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not missing, f"{' '.join(path)}: flags without help: {missing}"
    r = CliRunner().invoke(cli, [*path, "--help"])
    assert r.exit_code == 0 and "Examples:" in r.output
