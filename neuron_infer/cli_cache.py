"""`neuron-infer cache list | prune`: the converted default model and its cached compiles (neuron_infer/cache.py)."""
from __future__ import annotations

import json

import click

from neuron_infer.cache import prunable, remove, scan
from neuron_infer.cli_help import examples
from neuron_infer.cli_info import human_bytes
from neuron_infer.embedded import cache_dir


def _root():
    return cache_dir()


@click.group("cache", epilog=examples("neuron-infer cache list", "neuron-infer cache prune --dry-run",
                                      "NEURON_INFER_CACHE=/data/ni-cache neuron-infer cache prune --all"))
def cache_group() -> None:
    """The cache: the embedded default model, its compiles, compiled graphs and C kernels ($NEURON_INFER_CACHE, else
    ~/.cache/neuron-infer)."""


@cache_group.command("list", epilog=examples("neuron-infer cache list", "neuron-infer cache list --json"))
@click.option("--json", "as_json", is_flag=True, help="print the entries as one JSON line")
def list_cmd(as_json) -> None:
    """List the cached converted models and compiled artifacts, their state and size."""
    root = _root()
    entries = scan(root)
    if as_json:
        click.echo(json.dumps({"cache": str(root), "entries": [e.to_dict() for e in entries]}))
        return
    click.echo(f"cache: {root}" + ("" if root.is_dir() else " (empty)"))
    for e in entries:
        size = human_bytes(e.size_bytes) if e.kind != "other" else "-"
        reason = f"  ({e.reason})" if e.reason and e.kind != "other" else ""
        click.echo(f"  {e.kind:<9} {e.state:<12} {size:>9}  {e.path.relative_to(root)}{reason}")
    ours = [e for e in entries if e.kind != "other"]
    click.echo(f"  {len(ours)} neuron-infer entries, {human_bytes(sum(e.size_bytes for e in ours))}; "
               f"{len(entries) - len(ours)} other (never pruned)")


@cache_group.command("prune", epilog=examples("neuron-infer cache prune --dry-run", "neuron-infer cache prune",
                                              "neuron-infer cache prune --all"))
@click.option("--all", "everything", is_flag=True,
              help="also remove current entries (they are rebuilt on next use)")
@click.option("--dry-run", is_flag=True, help="only print what would be removed and the space it would free")
def prune_cmd(everything, dry_run) -> None:
    """Remove stale cache entries (other versions, interrupted builds); only entries neuron-infer created."""
    root = _root()
    entries = scan(root)
    victims = prunable(entries, everything)
    for e in entries:
        if e.state == "kept":
            click.echo(f"kept {e.path}: {e.reason}")
    freed = 0
    for e in victims:
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.path}  ({human_bytes(e.size_bytes)}, "
                   f"{e.state}{': ' + e.reason if e.reason else ''})")
        if not dry_run:
            remove(e)
        freed += e.size_bytes
    verb = "would free" if dry_run else "freed"
    click.echo(f"{len(victims)} entr{'y' if len(victims) == 1 else 'ies'}, {verb} {human_bytes(freed)}"
               + ("" if victims or everything else "; nothing stale (use --all to remove current entries too)"))
