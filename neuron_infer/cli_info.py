"""`neuron-infer info ARTIFACTS`: a short human summary of a compiled artifact; `--json` for the full record.

The verification is `read_manifest`'s own (format and package versions, sha256 of every listed file): the
summary is printed either way, and a failed verification then exits with one `error:` line (status 2).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from neuron_infer.artifact.manifest import MANIFEST, manifest_digest, parse_manifest, read_manifest, read_manifest_bytes
from neuron_infer.cli_help import examples, path_param
from neuron_infer.errors import ArtifactError
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.typed import json_from_bytes


def disk_size(root: Path) -> tuple[int, int]:
    """(bytes, files) under `root`, symlinks not followed."""
    total = count = 0
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
            count += 1
    return total, count


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _params(model) -> int:
    from neuron_infer.parallel.shard import rank_param_counts

    return sum(rank_param_counts(model, ShardPlan.build(model, 1)).values())


def _rank_weights(root: Path, m) -> str:
    sizes = [(root / rel).stat().st_size for rel in sorted(m.files)
             if rel.startswith("weights/rank") and (root / rel).is_file()]
    return ", ".join(human_bytes(n) for n in sizes) or "missing"


def summary_lines(root: Path, m, size: tuple[int, int], problem: str | None, digest: str) -> list[str]:
    """The human summary of manifest `m` (see `info_record` for the same facts as JSON)."""
    c, b = m.model, m.build
    q = b.quant
    quant = q.scheme + (", tiled" if q.weight_tiling else "") + (f", kv cache {q.kv_cache_dtype}"
                                                                 if q.kv_cache_dtype != "auto" else "")
    report = m.extra.quant
    if q.scheme != "none" and {"bytes_before", "bytes_after", "compression"} <= set(report):
        quant += (f" (linear weights {human_bytes(report['bytes_before'])} -> {human_bytes(report['bytes_after'])}, "
                  f"{report['compression']:.2f}x)")
    spec = b.speculation
    lines = [
        f"{root}",
        (f"  model        Llama-family, {_params(c) / 1e6:.1f}M parameters: {c.num_layers} layers, hidden "
         f"{c.hidden_size}, {c.num_heads} heads / {c.num_kv_heads} KV heads, vocab {c.vocab_size}"),
        f"  dtype        {b.dtype}",
        f"  tp           {b.tp_degree}  (weights per rank: {_rank_weights(root, m)})",
        f"  batch        {b.batch_size}",
        (f"  buckets      context {', '.join(map(str, b.context_bucket_list))} (max prompt {b.max_context_length}); "
         f"token generation {', '.join(map(str, b.tokengen_bucket_list))} (max length {b.max_length})"),
        f"  quant        {quant}",
    ]
    if spec is not None:
        lines.append(f"  speculation  draft {spec.draft_model}, K={spec.length}{', fused' if spec.fused else ''}")
    lines += [
        f"  graphs       {_graph_count(m.graphs)}, backend {m.backend}, kernels {b.kernels}",
        f"  size         {human_bytes(size[0])} on disk ({size[1]} files)",
        "  versions     " + ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())),
        f"  verified     {'yes: versions match and every file matches its sha256' if problem is None else 'NO'}",
        f"  digest       {digest}  (sha256 of manifest.json; pin it: generate --expect-digest)",
    ]
    return lines


def info_record(m, size: tuple[int, int], problem: str | None, digest: str) -> dict:
    return {**m.to_dict(), "size_bytes": size[0], "num_files": size[1], "verified": problem is None,
            "verify_error": problem, "digest": digest}


@click.command("info", epilog=examples("neuron-infer info artifacts/llama",
                                       "neuron-infer info artifacts/llama --json | jq .build"))
@click.argument("artifacts", callback=path_param("ARTIFACTS"))
@click.option("--json", "as_json", is_flag=True, help="print the whole manifest and the checks as one JSON line")
@click.option("--no-verify", is_flag=True, help="skip hashing the files (fast; versions are still compared)")
def info_cmd(artifacts, as_json, no_verify) -> None:
    """Summarize a compiled artifact: model, dtype, tp, buckets, quant, size, backend, versions, verification."""
    root = Path(artifacts)
    if not (root / MANIFEST).is_file():
        read_manifest(root, verify_files=False)  # raises its "not a complete artifact" error
    raw = read_manifest_bytes(root / MANIFEST)
    data = json_from_bytes(raw, root / MANIFEST, "recompile the model", ArtifactError)
    if not isinstance(data, dict):
        raise ArtifactError(f"{root / MANIFEST} holds a {type(data).__name__}, not a manifest object; recompile")
    m = parse_manifest(data, str(root / MANIFEST))
    problem = None
    try:
        read_manifest(root, verify_files=not no_verify, expect_digest=manifest_digest(raw))  # the manifest shown
    except ArtifactError as e:
        problem = str(e)
    size = disk_size(root)
    if as_json:
        click.echo(json.dumps(info_record(m, size, problem, manifest_digest(raw))))
    else:
        click.echo("\n".join(summary_lines(root, m, size, problem, manifest_digest(raw))))
    if problem is not None:
        raise ArtifactError(f"verification failed: {problem}")


def _graph_count(graphs: dict) -> str:
    """'7' for one graph per bucket; '2 serving 7 buckets (decode_b1_t1, prefill)' for shape-class graphs."""
    files = sorted({g.get("graph", name) for name, g in graphs.items()})
    if len(files) == len(graphs):
        return str(len(graphs))
    return f"{len(files)} serving {len(graphs)} buckets ({', '.join(files)})"
