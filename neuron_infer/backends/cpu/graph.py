"""CPU backend: one AOTInductor package per (sub-model, shape class), weights shared by every graph.

    compile: torch.export.export(step, example_args, dynamic)        traced with the CPU op table (ops.py: the
                                                                     C kernels, few-row GEMVs); the shape class's
                                                                     dynamic dims and the KV caches' block count,
                                                                     in-place KV-cache writes kept
             -> group_gemvs                                          kernel calls sharing an input: one call
             -> torch._inductor.aoti_compile_and_package(..., package_constants_in_so=False)
             -> graphs/<name>.pt2 (generated C++ kernels + wrapper .so, no weights), graphs/<name>.json and,
                when the graph calls C kernels, graphs/<name>.gemv.so (cpu_gemv*.cpp, cpu_attention.cpp, built with
                the graph)
    load:    <name>.gemv.so (RTLD_GLOBAL, sha256 checked), then torch._inductor.aoti_load_package(graphs/<name>.pt2)
             -> load_constants({fqn: module tensor}, user_managed=True)   the graph reads the module's own tensors

Why this design (measured with scripts/perf_cpu_backends.py; see docs/cpu-backend.md):
- A graph is compiled ahead of time into a shared library, so `generate` never traces or compiles.
- Weights are not inside the package (`package_constants_in_so=False`): each .pt2 holds only code (a few MB) and
  all graphs point at the one copy of the weights the runtime already loaded. `user_managed=True` stores
  the tensor pointers, so the returned callable keeps those tensors alive.
- Inductor freezing / max-autotune GEMM templates would prepack the weights into new constants that only exist
  inside each package (one weight copy per graph), so they are not used.
- Batch-1 decode is bound by streaming the weights. oneDNN's bf16 GEMM at M=1 streams them at a fraction of the
  machine's bandwidth, so the CPU op table (ops.py) traces linear layers on few rows as GEMVs; larger inputs
  (prefill) keep the GEMM.
  bf16 linears on 1-8 rows call the C kernel of cpu_gemv.cpp (each weight row loaded once for all rows: AVX512-BF16
  dot-product instructions, or bf16 widened to fp32 and FMAs on AVX-512 or AVX2), which the generated wrapper calls
  directly (a C shim); its step costs are in docs/performance.md. Without AVX2 + FMA, and for fp32, a GEMV on at most
  `gemv_max_rows` rows is an fp32 multiply-and-sum that Inductor turns into a vectorised, row-parallel C++ reduction
  reading each weight once; with 2-5 rows each row gets its own reduction over the shared weight and Inductor fuses
  them into one pass. In a 30-layer linear stack that reduction loses to the GEMM at 8 rows, hence at most 5 by
  default; the kernel keeps every row in registers over one weight load, so it takes 1-8 rows regardless
  (CpuCompileOptions).
- Inductor inlines cheap producers into the reductions that read them, so an RMSNorm in front of a GEMV (or RoPE
  in front of the attention scores) would be recomputed for every output row. `computed_once` (model/ops.py) makes
  the GEMV input, the scaled queries and the softmax probabilities buffers of their own, and the generated C++ may
  fuse multiply-adds (INDUCTOR_CONFIGS).
- bf16 attention over few query rows (decode, speculative verify) calls the C kernel of cpu_attention.cpp where the
  CPU has AVX2 + FMA (the op table's attention): each cached key and value is widened once for all query rows of a
  KV head and only the keys a row sees are read; elsewhere it is model/ops.py's reductions, its reference.
- The KV caches are graph inputs mutated in place (index_put_); AOTInductor applies the mutation to the caller's
  tensors, so no cache is returned or copied by the runtime.
- The decoder layers are traced as one while_loop over the stacked per-layer weights where the loaded model has them
  (`stack_layers`, model/llama.py LayerStack): export and Inductor handle one layer instead of L (compile time), and
  the graph binds the stacked views, which share the loaded memory. Kernel calls and GEMV groups are found in the
  loop body as in the outer graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuron_infer import cpu_threads
from neuron_infer.backends.cpu import kernels as cpu_gemv
from neuron_infer.backends.cpu.gemv_groups import group_gemvs
from neuron_infer.backends.cpu.ops import cpu_ops
from neuron_infer.errors import ArtifactError, ConfigError
from neuron_infer.model.llama import LlamaModel
from neuron_infer.model.ops import tables_replaced
from neuron_infer.oserrors import scratch_tmpdir

GRAPH_FORMAT = "aotinductor-pt2"
# Weights stay outside the package (shared by every graph); the generated C++ may contract a * b + c into one
# fused multiply-add (-ffp-contract=fast: one rounding instead of two, never less accurate), which the GEMV and
# attention reductions are made of; every bf16 op's result is rounded to bf16 as eager PyTorch rounds it, also inside
# fused kernels (emulate_precision_casts), so a value does not depend on what Inductor fused: a residual sum feeding
# an RMSNorm was otherwise read unrounded in a one-token step and rounded in a verify pass over several tokens
# (docs/cpu-backend.md, "Batch invariance"). The wrapper code (the C++ that calls the kernels) is compiled at -O1,
# fixed here rather than left to AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL: measured on SmolLM2, -O0 compiled no faster
# and made a decode step 4% slower, and -O2 crashes g++ 12 (docs/performance.md, "Compile time and the first answer").
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False, "cpp.enable_floating_point_contract_flag": "fast",
                    "emulate_precision_casts": True, "aot_inductor.compile_wrapper_opt_level": "O1"}
PACKAGE_SUFFIX = ".pt2"
SIDECAR_SUFFIX = ".json"


@dataclass(frozen=True)
class CpuCompileOptions:
    """How the CPU backend compiles a graph.

    gemv_max_rows: float linear layers (nn.Linear) whose input has at most this many rows (product of the leading
        dims) and that no C kernel takes become GEMV reductions Inductor generates (ops.py); 0 keeps every linear a
        GEMM call (no C kernel either). Default 5: the fused reductions lose to the GEMM at 8 rows.
    gemv_kernel: bf16 linears on bf16 rows call the bf16 C kernel (cpu_gemv.cpp: AVX512-BF16 or AVX2 + FMA) where
        the CPU has AVX2 + FMA, int8 linears (quant.int8) on bf16 rows the int8 C kernel (cpu_gemv_int8.cpp,
        AVX512-VNNI, AVX-512, AVX-VNNI or AVX2) and w8a8 linears (quant.smoothquant) the w8a8 one (cpu_gemv_w8a8.cpp,
        the same levels), any row count and regardless of gemv_max_rows (> 0): on 1-8 rows a kernel streams the
        weights once for all rows, on more (prefill) it computes blocks of rows per weight block in cache (bf16 and
        int8 past 64 rows: ATen's GEMM, called from the kernel). Elsewhere, and for fp32, GEMVs are the reductions above. With it, bf16 attention
        (decode, verify and prefill) calls the attention kernel (cpu_attention.cpp).
    gemv_isa: the highest ISA level the C kernels may use ("auto": the best this CPU has; "avx512-vnni", "avx512",
        "avx2-vnni" or "avx2" force it down, e.g. to build and test the paths of CPUs without AVX512-BF16 or VNNI;
        a level this CPU lacks gives the next lower one it has).
    """

    gemv_max_rows: int = 5
    gemv_kernel: bool = True
    gemv_isa: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.gemv_max_rows, int) or self.gemv_max_rows < 0:
            raise ConfigError(f"gemv_max_rows={self.gemv_max_rows!r} must be an int >= 0 (0 disables the GEMV path)")
        if not isinstance(self.gemv_kernel, bool):
            raise ConfigError(f"gemv_kernel={self.gemv_kernel!r} must be True or False")
        if self.gemv_isa != "auto" and self.gemv_isa not in cpu_gemv.ISAS:
            raise ConfigError(f"gemv_isa={self.gemv_isa!r} must be 'auto' or one of {', '.join(cpu_gemv.ISAS)}")

    def kernel_isa(self) -> str | None:
        """The ISA level the C kernels of graphs compiled on this machine are built for; None: no C kernel."""
        best = cpu_gemv.cpu_isa()
        if not self.gemv_kernel or self.gemv_max_rows == 0 or best is None:
            return None
        if self.gemv_isa == "auto":
            return best
        start = max(cpu_gemv.ISAS.index(self.gemv_isa), cpu_gemv.ISAS.index(best))
        return next((isa for isa in cpu_gemv.ISAS[start:] if cpu_gemv.has_isa(isa)), None)

    @property
    def uses_kernel(self) -> bool:
        """Whether bf16 GEMVs of graphs compiled on this machine call the C kernel."""
        return "bf16" in cpu_gemv.kernels_for(self.kernel_isa())

    @property
    def uses_int8_kernel(self) -> bool:
        """Whether int8 and w8a8 linears on 1-8 bf16 rows of graphs compiled on this machine call C kernels."""
        return "int8" in cpu_gemv.kernels_for(self.kernel_isa())


def stack_layers(module: torch.nn.Module) -> None:
    """Give every model in `module` its stacked layer weights where they lie stacked in memory (LlamaModel.stack_layers:
    views, no copy): its layers are then traced as one loop, and the graph binds the stacked views by name."""
    for m in module.modules():
        if isinstance(m, LlamaModel):
            m.stack_layers()


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by fully qualified name, tied tensors under each of their names."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


Dynamic = dict[int, dict[int, tuple[str, int, int]]]  # arg index -> {dim: (name, min, max)}


def _dynamic_shapes(module: torch.nn.Module, args: tuple, dynamic: Dynamic | None) -> tuple | None:
    """Dynamic shapes of an export: the block count (dim 1) of the KV caches a step module names in
    `block_cache_args` is left dynamic, so one graph serves a cache of any number of blocks (the run-time budget),
    and so is every dim `dynamic` names (one torch.export.Dim per name: dims sharing a name are equal)."""
    names = getattr(module, "block_cache_args", ())
    dims = {i: {1: ("kv_blocks", 2, None)} for i in names}
    for i, per_arg in (dynamic or {}).items():
        dims.setdefault(i, {}).update(per_arg)
    if not dims:
        return None
    made: dict[str, torch.export.Dim] = {}
    for per_arg in dims.values():
        for name, lo, hi in per_arg.values():
            made.setdefault(name, torch.export.Dim(name, min=lo, **({} if hi is None else {"max": hi})))
    return tuple({d: made[spec[0]] for d, spec in dims[i].items()} if i in dims else None for i in range(len(args)))


def _export(module: torch.nn.Module, example_args: tuple, options: CpuCompileOptions,
            dynamic: Dynamic | None = None) -> torch.export.ExportedProgram:
    """Export `module` traced with the CPU op table (backends/cpu/ops.py: the C kernels and the few-row GEMV
    reductions), then merge kernel calls that share an input (backends/cpu/gemv_groups.py). Shape conditions export
    cannot prove for every size in the dynamic ranges become run-time asserts instead of export errors."""
    isa = options.kernel_isa()
    stack_layers(module)
    # Export records in-place cache writes only outside inference mode; inference tensors are cloned out of it.
    with (torch.inference_mode(False), torch.no_grad(),
          tables_replaced(module, lambda table: cpu_ops(table, options.gemv_max_rows, isa))):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in example_args)
        program = torch.export.export(module, args, dynamic_shapes=_dynamic_shapes(module, args, dynamic),
                                      strict=False, prefer_deferred_runtime_asserts_over_guards=True)
    for gm in program.graph_module.modules():  # the outer graph and its subgraphs (the looped layers' body)
        if isinstance(gm, torch.fx.GraphModule):
            group_gemvs(gm)  # linears sharing an input: one kernel call
    return program


@contextlib.contextmanager
def _all_cores():
    """Compile with every core visible: Inductor emits OpenMP loops only when the compiling process has > 1 thread,
    and a graph compiled under torch.set_num_threads(1) would stay single-threaded at every later run. The parallel
    code follows the run-time thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Warnings torch's own export/compile machinery raises about torch's own internals: they name torch files (e.g.
# copyreg.py, where deepcopy re-creates a pytree LeafSpec) and nothing a user of neuron-infer can change. Matched by
# category and message, only while compiling; every other warning still shows.
_TORCH_INTERNAL_WARNINGS = ((FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),)


@contextlib.contextmanager
def _hide_torch_internal_warnings():
    with warnings.catch_warnings():
        for category, message in _TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _tensor_spec(t: torch.Tensor) -> list:
    return [list(t.shape), str(t.dtype).removeprefix("torch.")]


class CpuBackend:
    """torch.export + AOTInductor packages; see the module docstring."""

    name = "cpu"

    def __init__(self, options: CpuCompileOptions | None = None):
        self.options = options or CpuCompileOptions()

    dynamic_shapes = True  # a graph may serve a range of sizes (compile/builder.py: shape classes)

    def cache_key(self) -> dict:
        """What of this backend determines a graph's code (backends/graph_cache.py): its options and the ISA level
        its C kernels are built for on this machine."""
        return {"name": self.name, "options": dataclasses.asdict(self.options), "isa": self.options.kernel_isa(),
                "inductor": INDUCTOR_CONFIGS}

    def compile_graph(self, module: torch.nn.Module, example_args: tuple, out_dir: Path, graph_name: str,
                      dynamic: Dynamic | None = None) -> dict:
        """Write `<graph_name>.pt2` (code only), `<graph_name>.json` (the weights it expects) and, when bf16 GEMVs
        call it, `<graph_name>.gemv.so` (the C kernel) into out_dir. `dynamic`: the dims of example_args left
        dynamic (besides the caches' block count)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with _hide_torch_internal_warnings():
            program = _export(module, example_args, self.options, dynamic)
        t1 = time.perf_counter()
        package = out_dir / f"{graph_name}{PACKAGE_SUFFIX}"
        configs = dict(INDUCTOR_CONFIGS)
        with scratch_tmpdir(f"compiling graph {graph_name}"):  # g++ temporaries, extracted package: removed after
            kernel = _gemv_kernel_file(program, out_dir, graph_name, self.options.kernel_isa())  # None: no C kernel
            shims = {"aot_inductor.custom_ops_to_c_shims": cpu_gemv.C_SHIMS} if kernel else {}
            with torch.inference_mode(False), torch.no_grad(), _all_cores(), _hide_torch_internal_warnings():
                torch._inductor.aoti_compile_and_package(program, package_path=str(package),
                                                         inductor_configs={**configs, **shims})
            t2 = time.perf_counter()
            needed = torch._inductor.aoti_load_package(str(package)).get_constant_fqns()
        tensors = module_tensors(module)
        foreign = [f for f in needed if f not in tensors]
        if foreign:
            raise ConfigError(
                f"graph {graph_name}: the module uses tensors {foreign} that are neither parameters nor buffers, so "
                "the compiled graph could not share them; register them with module.register_buffer(...)"
            )
        constants = {fqn: _tensor_spec(tensors[fqn]) for fqn in needed}
        inputs = [_tensor_spec(a) if isinstance(a, torch.Tensor) else repr(a) for a in example_args]
        sidecar = {"format": GRAPH_FORMAT, "torch": torch.__version__, "inputs": inputs, "constants": constants,
                   "gemv_max_rows": self.options.gemv_max_rows, "inductor_configs": configs,
                   "package_sha256": _sha256(package), "gemv_kernel": kernel}
        (out_dir / f"{graph_name}{SIDECAR_SUFFIX}").write_text(json.dumps(sidecar, indent=1, sort_keys=True))
        files = [package.name, f"{graph_name}{SIDECAR_SUFFIX}"] + ([kernel["file"]] if kernel else [])
        return {"files": files, "format": GRAPH_FORMAT, "gemv_kernel": bool(kernel),
                "export_seconds": round(t1 - t0, 3), "compile_seconds": round(t2 - t1, 3),
                "package_bytes": package.stat().st_size, "gemv_max_rows": self.options.gemv_max_rows}

    def load_graph(self, out_dir: Path, graph_name: str, module: torch.nn.Module) -> Callable[..., Any]:
        """Load `<graph_name>.pt2` and point it at `module`'s tensors (checked against the sidecar first)."""
        package = Path(out_dir) / f"{graph_name}{PACKAGE_SUFFIX}"
        sidecar = _read_sidecar(Path(out_dir) / f"{graph_name}{SIDECAR_SUFFIX}")
        stack_layers(module)
        tensors = module_tensors(module)
        constants = {}
        for fqn, (shape, dtype) in sidecar["constants"].items():
            t = _lookup(tensors, fqn, package)
            if _tensor_spec(t) != [shape, dtype]:
                raise ArtifactError(
                    f"{package}: the graph was compiled for {fqn} of shape {shape} {dtype}, but the loaded weights "
                    f"have {_tensor_spec(t)}; the weights and graphs come from different compiles - recompile"
                )
            constants[fqn] = t.contiguous()
        if sidecar.get("gemv_kernel"):
            kernel = sidecar["gemv_kernel"]
            lib, isa = Path(out_dir) / kernel["file"], kernel.get("isa", cpu_gemv.LEGACY_ISA)
            cpu_gemv.load(lib, kernel["sha256"], isa)  # before the graph that calls it
        compiled = _load_package(package, sidecar["package_sha256"])
        try:
            compiled.load_constants(constants, check_full_update=True, user_managed=True)
        except RuntimeError as e:
            raise ArtifactError(f"{package}: cannot attach the weights to the graph ({e}); recompile") from e
        return LoadedGraph(compiled, constants, graph_name)


def _gemv_kernel_file(program: torch.export.ExportedProgram, out_dir: Path, graph_name: str,
                      isa: str | None) -> dict | None:
    """Build the C GEMV kernels a graph calls next to it and load them (the compile test-loads the graph)."""
    targets = {node.target for gm in program.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
               for node in gm.graph.nodes}  # the outer graph and its subgraphs (the looped layers' body)
    kernels = tuple(k for k, op in cpu_gemv.KERNEL_OPS.items() if op in targets)
    if not kernels:
        return None
    isa = cpu_gemv.lowest_isa(kernels, isa)
    lib = cpu_gemv.build(out_dir / f"{graph_name}{cpu_gemv.LIB_SUFFIX}", kernels, isa)
    sha = _sha256(lib)
    cpu_gemv.load(lib, sha, isa)
    return {"file": lib.name, "sha256": sha, "isa": isa}


class LoadedGraph:
    """A loaded AOTInductor graph; holds the weight tensors it points at so they outlive it."""

    def __init__(self, compiled: Any, constants: dict[str, torch.Tensor], name: str):
        self.compiled, self.constants, self.name = compiled, constants, name

    def __call__(self, *args: Any) -> Any:
        cpu_threads.tick()  # an "auto" thread count follows the load (set in the thread that runs the graph)
        return self.compiled(*args)

    def __repr__(self) -> str:
        return f"LoadedGraph({self.name!r}, {len(self.constants)} weight tensors shared)"


def _lookup(tensors: dict[str, torch.Tensor], fqn: str, package: Path) -> torch.Tensor:
    if fqn not in tensors:
        raise ArtifactError(
            f"{package}: the graph needs weight {fqn!r}, which the loaded model does not have; "
            "the model structure differs from the one compiled (other version or options) - recompile"
        )
    return tensors[fqn]


def _read_sidecar(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ArtifactError(f"compiled graph description {path} is missing; recompile the model") from e
    except (OSError, ValueError) as e:
        raise ArtifactError(f"compiled graph description {path} is unreadable ({e}); recompile the model") from e
    if (not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT or not isinstance(data.get("constants"), dict)
            or not isinstance(data.get("package_sha256"), str) or not _kernel_entry_ok(data.get("gemv_kernel"))):
        raise ArtifactError(f"{path} is not a {GRAPH_FORMAT} graph description; recompile the model")
    if data.get("torch") != torch.__version__:
        raise ArtifactError(
            f"{path} was compiled with torch {data.get('torch')}, this is torch {torch.__version__}; compiled "
            "graphs only load in the torch version that built them - recompile, or install that torch version"
        )
    return data


def _kernel_entry_ok(entry: Any) -> bool:
    """A sidecar's "gemv_kernel": absent/None, or {"file": "<name>.gemv.so", "sha256": hex, "isa": level} naming a
    sibling file (no "isa": the bf16 kernel's level)."""
    if entry is None:
        return True
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("file"), str)
            and entry["file"].endswith(cpu_gemv.LIB_SUFFIX) and Path(entry["file"]).name == entry["file"]
            and entry.get("isa", cpu_gemv.LEGACY_ISA) in cpu_gemv.ISAS)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_package(package: Path, sha256: str) -> Any:
    """Load a package whose bytes match the recorded hash (a damaged library could load and then crash)."""
    if not package.is_file():
        raise ArtifactError(f"compiled graph {package} is missing; recompile the model")
    if not zipfile.is_zipfile(package):
        raise ArtifactError(f"compiled graph {package} is corrupt (not a .pt2 archive); recompile the model")
    if _sha256(package) != sha256:
        raise ArtifactError(f"compiled graph {package} is corrupt (its sha256 differs from the one recorded at "
                            "compile time); recompile the model")
    try:
        # Loading compares the package's CPU ISA with this machine's. By default torch finds the machine's ISA by
        # compiling a probe per candidate ISA and dlopen-ing each in a child Python (3 g++ runs and 6 interpreters
        # here: seconds, most of a graph load). Nothing is compiled at
        # load, so the ISAs the CPU flags list are taken as usable (Linux clears the flags of ISAs the OS does not
        # enable); compiles run without this patch and probe for real. The package is extracted into a private
        # temporary directory, removed once its library is loaded (a full TMPDIR is named as such).
        quiet = logging.getLogger("torch._inductor.package.package")  # its fallback's "outdated pt2 file" warning
        level, _ = quiet.level, quiet.setLevel(logging.ERROR)
        try:
            with torch._inductor.config.patch({"cpp.vec_isa_ok": True}), scratch_tmpdir(f"loading graph {package}"):
                return torch._inductor.aoti_load_package(str(package))
        finally:
            quiet.setLevel(level)
    except ArtifactError:
        raise
    except Exception as e:  # the loader raises RuntimeError, OSError or zip errors for damaged packages
        raise ArtifactError(f"compiled graph {package} cannot be loaded ({type(e).__name__}: {e}); "
                            "recompile the model") from e
