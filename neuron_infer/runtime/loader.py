"""The one artifact loader: `load_rank(artifact, rank) -> Engine | Speculation`, used by every path that runs a
compiled model.

    model = load_rank("artifacts/m")             # tp = 1 (CompiledModel.load)
    model = load_rank("artifacts/m-tp2", rank=1)  # one CPU rank process of a tensor-parallel artifact

An Engine is one rank's graphs and KV cache. For a tensor-parallel CPU artifact each rank process (the rank group,
or one vLLM worker per rank) loads only its own shard (weights/rank{r}.safetensors, graphs/rank{r}) and a cache of
its local KV heads; a Neuron tensor-parallel artifact is loaded once in-process (neuronx-distributed drives every
NeuronCore of the group). With a draft model compiled in, the loader returns the SpecEngine over the target and
draft (at tp > 1: this rank's target shard and the whole, replicated draft), with `--draft-model ngram` an NgramSpec
over the target: the speculation strategy a Runner steps (runtime/speculation.py), whose `.target` is the Engine.
Engines are built here and nowhere else.
"""
from __future__ import annotations

from pathlib import Path

import psutil

from neuron_infer.artifact.manifest import Manifest, check_checkpoint, read_manifest
from neuron_infer.artifact.plan import (
    batch_context_graphs,
    cache_shape,
    planned_graphs,
    run_bytes,
    shape_class,
    spec_graph_list,
)
from neuron_infer.artifact.steps import speculation_modules, step_modules
from neuron_infer.artifact.weights import DRAFT_WEIGHTS, empty_model, load_draft_weights, rank_model
from neuron_infer.backends import get_backend
from neuron_infer.backends.neuron import tp_graphs as neuron_tp
from neuron_infer.backends.neuron.tp import rank_cache
from neuron_infer.backends.neuron.tp_spec import DeviceSpecLayout, device_spec_graphs, draft_cache
from neuron_infer.checkpoint import layer_count, read_header
from neuron_infer.config import BuildConfig, QuantConfig
from neuron_infer.errors import ArtifactError, CheckpointError
from neuron_infer.model.llama import LlamaModel
from neuron_infer.model.spec_step import SpecCacheLayout
from neuron_infer.parallel.plan import ShardPlan
from neuron_infer.parallel.rank import rank_layout, tp_ops
from neuron_infer.quant import apply_quantization
from neuron_infer.runtime.engine import Engine, budget_blocks
from neuron_infer.runtime.ngram_spec import NgramSpec
from neuron_infer.runtime.spec_engine import SpecEngine
from neuron_infer.runtime.speculation import Speculation


def manifest_plan(manifest: Manifest, where: Path) -> ShardPlan:
    """The artifact's shard plan, checked against its model and build."""
    d = manifest.extra.tp_plan
    if d is None:
        raise ArtifactError(f"{where}: manifest extra.tp_plan is missing for tp_degree={manifest.build.tp_degree}; "
                            "recompile the model")
    plan = ShardPlan.from_dict(d)
    if plan.tp != manifest.build.tp_degree or plan != ShardPlan.build(manifest.model, plan.tp):
        raise ArtifactError(f"{where}: the recorded shard plan differs from the one this neuron-infer builds for "
                            f"tp={manifest.build.tp_degree}; recompile the model")
    return plan


def load_rank(artifact: str | Path, rank: int = 0, manifest: Manifest | None = None, *,
              spec_mode: str | None = None, kv_cache_gib: float | None = None) -> Engine | Speculation:
    """Rank `rank`'s model, what a Runner runs: its Engine (weights, graphs, cache), or, when the build speculates,
    the speculation strategy over it (SpecEngine, NgramSpec; `.target` is the Engine). `manifest`: the caller's
    already verified manifest (read here, without re-hashing the files, when None). kv_cache_gib: this rank's
    KV-cache budget (None: the build's batch_size sequences of max_length)."""
    root = Path(artifact)
    manifest = manifest or read_manifest(root, verify_files=False)
    build, tp = manifest.build, manifest.build.tp_degree
    if not 0 <= rank < tp:
        raise ArtifactError(f"{root}: rank {rank} does not exist in an artifact of tp_degree={tp}")
    if not (tp > 1 and manifest.backend == "neuron"):  # no skeleton of more layers than the weights hold
        _check_layers(manifest, root, root / "weights" / f"rank{rank}.safetensors")
    if kv_cache_gib is not None and manifest.backend == "neuron":
        raise ArtifactError(f"{root}: Neuron graphs hold the KV cache of the compiled batch_size x max_length; "
                            "--kv-cache-gib applies to CPU artifacts")
    weights = root / "weights" / f"rank{rank}.safetensors"
    if tp == 1:
        model, graphs_dir = rank_model(manifest.model, build, weights), root / "graphs"
    else:
        plan = manifest_plan(manifest, root)
        if manifest.backend == "neuron":  # NxD runs the ranks on NeuronCores from this one process
            return _load_neuron_tp(root, manifest, plan, spec_mode)
        model = rank_model(manifest.model, build, weights, rank_layout(plan.ranks[rank]), tp_ops(build.kernels))
        graphs_dir = root / "graphs" / f"rank{rank}"
    modules = step_modules(model, build)
    for g in batch_context_graphs(build):  # artifacts compiled without the batched prefill graph encode row by row
        if g.name not in manifest.graphs:
            modules.pop(g.name)
    cache = cache_shape(model, build)
    if kv_cache_gib is not None:
        cache = cache.with_blocks(budget_blocks(cache, kv_cache_gib))
    _check_cache_fits(cache, root, build, kv_cache_gib, manifest.model.vocab_size)
    files = _graph_files(manifest, modules, root)
    engine = Engine(_load_graphs(manifest.backend, graphs_dir, modules, files), build, cache,
                    manifest.model.vocab_size, shape_classes=any(f != n for n, f in files.items()))
    if build.speculation is None:
        return engine
    return load_speculation(root, manifest, model, engine, spec_mode, graphs_dir)


def _graph_files(manifest: Manifest, modules: dict, root: Path) -> dict[str, str]:
    """The compiled graph serving each name (a shape-class graph serves several): the name's own graph, or the
    shape class the plan puts it in; a manifest naming any other graph (one of other shapes, whose calls would fail
    or answer for other inputs) is refused."""
    build = manifest.build
    specs = planned_graphs(build) + (spec_graph_list(build, not build.speculation.is_ngram)
                                     if build.speculation is not None else [])
    classes = {g.name: shape_class(g, build).name for g in specs if g.kind != "fused"}
    files = {}
    for name in modules:
        file = manifest.graphs.get(name, {}).get("graph", name)
        if file not in (name, classes.get(name)):
            raise ArtifactError(f"{Path(root) / 'manifest.json'}: graphs.{name}.graph={file!r} is not a graph that serves {name} "
                                f"({name!r} or {classes.get(name, name)!r}); the manifest is damaged or was edited: "
                                "recompile the model")
        files[name] = file
    return files


def _check_layers(manifest: Manifest, root: Path, weights: Path) -> None:
    """The manifest's num_layers must be the layers its weights file holds (read from the header only)."""
    try:
        held = layer_count(read_header(weights)[2])
    except (CheckpointError, OSError) as e:
        raise ArtifactError(f"cannot read the weights of {root}: {e}; recompile the model") from e
    if manifest.model.num_layers != held:
        raise ArtifactError(f"{root}: manifest.json says model.num_layers={manifest.model.num_layers}, but {weights} "
                            f"holds {held} layer(s); the manifest and the weights are from different compiles: "
                            "recompile the model")


def _check_cache_fits(cache, root: Path, build: BuildConfig, kv_cache_gib: float | None, vocab_size: int) -> None:
    """The KV cache and the batch's logits (run_bytes) must fit the memory available now: an error line instead of
    the kernel's out-of-memory kill."""
    free, need = psutil.virtual_memory().available, run_bytes(cache, build, vocab_size)
    if need <= free:
        return
    what = (f"--kv-cache-gib {kv_cache_gib:g}" if kv_cache_gib is not None else
            f"the compiled batch_size={build.batch_size} x max_length={build.max_length}")
    raise ArtifactError(f"{root}: {what} needs {need / 2**30:.1f} GiB (a KV cache of {cache.nbytes() / 2**30:.1f} "
                        f"GiB and the logits of a full batch), more than the "
                        f"{free / 2**30:.1f} GiB of memory available on this machine now; give a smaller budget "
                        "(--kv-cache-gib, or kv_cache_gib=), free memory, or recompile with a lower --batch-size or "
                        "--max-length")


def _load_graphs(backend: str, graphs_dir: Path, modules: dict, files: dict[str, str] | None = None) -> dict:
    """Every graph by name; `files`: the compiled graph serving each name, each loaded once."""
    be, files, loaded = get_backend(backend), files or {}, {}
    for name, module in modules.items():
        file = files.get(name, name)
        if file not in loaded:
            loaded[file] = be.load_graph(graphs_dir, file, module)
    return {name: loaded[files.get(name, name)] for name in modules}


def _spec_mode(build: BuildConfig, mode: str | None) -> str:
    return mode or ("fused" if build.speculation.fused else "unfused")


def _check_ngram_mode(root: Path, mode: str | None) -> None:
    if mode == "fused":
        raise ArtifactError(f"{root}: prompt-lookup speculation (--draft-model ngram) runs the host loop only")


# ---- speculation: the draft model and the extra graphs ---------------------------------------------------------
def load_speculation(root: Path, manifest: Manifest, target: LlamaModel, target_engine: Engine,
                     mode: str | None = None, graphs_dir: Path | None = None) -> SpecEngine | NgramSpec:
    """The SpecEngine of an artifact (mode: 'fused' if compiled with --fused-speculation, else 'unfused'), or the
    NgramSpec of a prompt-lookup artifact (`--draft-model ngram`; mode 'ngram', the host loop). `target`: this
    rank's target model; `graphs_dir`: this rank's graphs (root/graphs at tp = 1)."""
    build, info = manifest.build, manifest.extra.speculation
    if info is None:
        raise ArtifactError(f"{root}: manifest extra.speculation is missing; recompile with --draft-model")
    graphs_dir = graphs_dir or Path(root) / "graphs"
    if build.speculation.is_ngram:  # prompt lookup: the target's verify graphs only
        modules = {name: module for name, (module, _) in speculation_modules(target, None, build).items()}
        graphs = _load_graphs(manifest.backend, graphs_dir, modules, _graph_files(manifest, modules, root))
        _check_ngram_mode(root, mode)
        return NgramSpec(target_engine, graphs, build.speculation.length, build.speculation.ngram)
    draft = empty_model(info.config, build)  # whole on every rank: no collectives
    if info.quant["scheme"] != "none":
        apply_quantization(draft, QuantConfig(scheme=info.quant["scheme"]), structure_only=True)
    load_draft_weights(draft, target, Path(root) / DRAFT_WEIGHTS, info.shared, build, info.quant["scheme"])
    modules = {name: module for name, (module, _) in speculation_modules(target, draft, build).items()}
    graphs = _load_graphs(manifest.backend, graphs_dir, modules)
    return assemble_spec(target_engine, draft, graphs, build, _spec_mode(build, mode))


def assemble_spec(target_engine: Engine, draft: LlamaModel, graphs: dict, build: BuildConfig,
                  mode: str) -> SpecEngine:
    """SpecEngine from loaded graphs (draft_* graphs go to the draft engine under their core names)."""
    dgraphs = {n[len("draft_"):]: g for n, g in graphs.items() if n.startswith("draft_")}
    sgraphs = {n: g for n, g in graphs.items() if not n.startswith("draft_")}
    dshape = cache_shape(draft, build, target_engine.cache_shape.blocks)
    draft_engine = Engine(dgraphs, build, dshape, draft.cfg.vocab_size)
    layout = SpecCacheLayout(target_engine.cache_shape, dshape)
    return SpecEngine(target_engine, draft_engine, sgraphs, layout, build.speculation.length, mode)


def _load_neuron_tp(root: Path, manifest: Manifest, plan: ShardPlan, spec_mode: str | None
                    ) -> Engine | Speculation:
    """An in-process Engine whose graphs run every rank on its NeuronCore (NxD drives the ranks), or the
    speculation over it as for any artifact. NOT YET RUN ON HARDWARE."""
    build = manifest.build
    traced = neuron_tp.load_tp_model(root, manifest, plan)
    engine = Engine(neuron_tp.core_graphs(traced, build), build, rank_cache(manifest.model, build, plan),
                    manifest.model.vocab_size)
    if build.speculation is None:
        return engine
    if build.speculation.is_ngram:
        _check_ngram_mode(root, spec_mode)
        return NgramSpec(engine, neuron_tp.verify_graphs(traced, build), build.speculation.length,
                         build.speculation.ngram)
    dcfg = manifest.extra.speculation.config
    dgraphs, sgraphs = device_spec_graphs(traced, build, neuron_tp.device_step)
    draft = Engine(dgraphs, build, draft_cache(dcfg, build, plan.tp), dcfg.vocab_size)
    layout = DeviceSpecLayout(engine.cache_shape, draft.cache_shape)
    return SpecEngine(engine, draft, sgraphs, layout, build.speculation.length, _spec_mode(build, spec_mode))


def eager_spec_engine(target: LlamaModel, draft: LlamaModel, build: BuildConfig, mode: str = "unfused"
                      ) -> SpecEngine:
    """A SpecEngine whose graphs are the modules themselves (no backend): for tests and debugging."""
    engine = Engine(step_modules(target, build), build, cache_shape(target, build), target.cfg.vocab_size)
    graphs = {n: m for n, (m, _) in speculation_modules(target, draft, build).items()}
    return assemble_spec(engine, draft, graphs, build, mode)


def eager_ngram_spec(target: LlamaModel, build: BuildConfig) -> NgramSpec:
    """A prompt-lookup NgramSpec whose graphs are the modules themselves (no backend): for tests and debugging."""
    engine = Engine(step_modules(target, build), build, cache_shape(target, build), target.cfg.vocab_size)
    graphs = {n: m for n, (m, _) in speculation_modules(target, None, build).items()}
    return NgramSpec(engine, graphs, build.speculation.length, build.speculation.ngram)


def load_serving_rank(root: Path, rank: int, world_size: int, expect_checkpoint: Path | None = None,
                      kv_cache_gib: float | None = None) -> tuple[Manifest, Engine | Speculation]:
    """Rank `rank`'s manifest and model (load_rank), for a long-lived process that already joined a group of `world_size`
    ranks (one vLLM worker per rank; the model's collectives run on torch.distributed's default group)."""
    manifest = read_manifest(root, verify_files=True)
    if expect_checkpoint is not None:
        check_checkpoint(manifest, root, expect_checkpoint)
    tp = manifest.build.tp_degree
    if tp != world_size or not 0 <= rank < tp:
        raise ArtifactError(f"{root}: artifact of tp_degree={tp} cannot serve rank {rank} of {world_size}; run it "
                            f"with {tp} ranks (vLLM: --tensor-parallel-size {tp})")
    if manifest.backend == "neuron" and tp > 1:
        raise ArtifactError(f"{root}: serving a Neuron tensor-parallel artifact from one process per rank is not "
                            "supported (neuronx-distributed drives every NeuronCore of the group from one process); "
                            "load it with CompiledModel.load instead")
    return manifest, load_rank(root, rank, manifest, kv_cache_gib=kv_cache_gib)
