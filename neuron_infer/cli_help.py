"""Help-text helpers: option sections in `--help` and the examples shown under every command."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import click

from neuron_infer.artifact.manifest import check_digest
from neuron_infer.errors import NeuronInferError
from neuron_infer.text_input import check_path


def option_names(decorator: Callable) -> frozenset[str]:
    """Parameter names an option decorator (e.g. `build_options`) adds to a command."""

    def probe() -> None: ...

    decorator(probe)
    return frozenset(p.name for p in getattr(probe, "__click_params__", []))


class SectionedCommand(click.Command):
    """A command whose `--help` lists some options under their own headings.

    `sections` is a sequence of (heading, parameter names); options not named there are listed under "Options".
    """

    def __init__(self, *args, sections: Iterable[tuple[str, Iterable[str]]] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = tuple((title, frozenset(names)) for title, names in sections)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        grouped: dict[str, list[tuple[str, str]]] = {"Options": []}
        grouped.update({title: [] for title, _ in self.sections})
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:
                continue
            title = next((t for t, names in self.sections if param.name in names), "Options")
            grouped[title].append(record)
        for title, records in grouped.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def examples(*lines: str) -> str:
    """A command's epilog: its examples, one command line each (\b keeps click from rewrapping them)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def sampling_options(f: Callable) -> Callable:
    """The SamplingConfig flags shared by generate and chat."""
    opts = [
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="sampling temperature; 0 = greedy"),
        click.option("--top-k", type=int, default=0, show_default=True, help="sample among the k most likely; 0 = all"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling mass; 1 = off"),
        click.option("--seed", type=int, default=None, help="sampling seed (same seed, same tokens)"),
        click.option("--min-p", type=float, default=0.0, show_default=True,
                     help="keep tokens with probability >= MIN_P x the top token's; 0 = off"),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
                     help="divide (positive) or multiply (negative) the logits of tokens already in prompt or "
                          "output; 1 = off, e.g. 1.1"),
        click.option("--presence-penalty", type=float, default=0.0, show_default=True,
                     help="subtract from the logits of tokens already generated; 0 = off, range [-2, 2]"),
        click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
                     help="subtract this times each token's count in the output; 0 = off, range [-2, 2]"),
        click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                     help="generate at least this many tokens: EOS cannot be sampled (and stop strings do not end "
                          "the output) before; 0 = off"),
        click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID:BIAS",
                     help="add BIAS (in [-100, 100]) to token ID's logit; repeatable, e.g. --logit-bias 2:-100 "
                          "(never token 2)"),
        click.option("--stop", "stop", multiple=True,
                     help="stop when the output contains this text (cut before it, finish_reason 'stop'); "
                          "repeatable, e.g. --stop '\\n\\n' --stop 'User:'"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def parse_logit_bias(values: tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID:BIAS values -> ((id, bias), ...); NeuronInferError names a malformed one (SamplingConfig
    checks the ranges)."""
    pairs = []
    for v in values:
        tok, sep, bias = v.partition(":")
        try:
            pairs.append((int(tok), float(bias)))
        except ValueError:
            raise NeuronInferError(f"--logit-bias {v!r} must be TOKEN_ID:BIAS, e.g. 2:-100") from None
        if not sep:
            raise NeuronInferError(f"--logit-bias {v!r} must be TOKEN_ID:BIAS, e.g. 2:-100")
    return tuple(pairs)


def path_param(what: str, keep: Iterable[str] = ()) -> Callable:
    """A click callback that checks a path argument where it enters (`check_path`: no NUL, UTF-8, no link loop);
    None and the words in `keep` (e.g. 'self' for --draft-model) pass unchanged."""

    def check(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        return value if value is None or value in keep else check_path(value, what)

    return check


def _digest(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else check_digest(value, "--expect-digest")


expect_digest_option = click.option(
    "--expect-digest", default=None, metavar="SHA256", callback=_digest,
    help="load the artifact only if its digest (the sha256 of its manifest.json, which `neuron-infer info` prints) "
         "is this one: checked before anything in it is used")
