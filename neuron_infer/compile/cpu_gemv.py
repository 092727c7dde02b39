"""The bf16 GEMV kernel of the CPU backend: a custom op, its PyTorch twin, and the C library AOTInductor calls.

    export:   linear on 1-5 bf16 rows -> torch.ops.neuron_infer.ni_gemv_bf16_v1(x [R, K], w [N, K]) -> [R, N]
    compile:  aot_inductor.custom_ops_to_c_shims = C_SHIMS: the generated wrapper calls the C function
              aoti_torch_cpu_ni_gemv_bf16_v1 (cpu_gemv.cpp) directly - no dispatcher, no Python
    build:    cpu_gemv.cpp -> <graph>.gemv.so next to the graph (g++, the compiler Inductor uses)
    load:     the .so is loaded with RTLD_GLOBAL before the graph, so the graph's undefined symbol resolves to it

The op's eager implementation is the reference (fp32 matmul of the same bf16 values, rounded once to bf16): the
slow twin the tests compare the kernel with. The "_v1" is part of the C symbol and must change with the kernel's
contract (arguments, result, numerics): the first library loaded in a process serves every graph calling that
symbol, so two libraries under one name must be interchangeable.
Used only where the CPU has AVX512-BF16 (`supported()`); elsewhere linears stay Inductor-generated reductions.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

from neuron_infer.errors import ArtifactError, NeuronInferError

MAX_ROWS = 5  # the C kernel is instantiated for 1..5 input rows
SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
LIB_SUFFIX = ".gemv.so"
_SYMBOL = "aoti_torch_cpu_ni_gemv_bf16_v1"
_ISA_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


@torch.library.custom_op("neuron_infer::ni_gemv_bf16_v1", mutates_args=())
def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [R, K] bf16, w [N, K] bf16 -> x @ w.T [R, N] bf16 (fp32 accumulation, one rounding). The reference."""
    return (x.float() @ w.float().t()).to(torch.bfloat16)


@gemv_bf16.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


C_SHIMS = {torch.ops.neuron_infer.ni_gemv_bf16_v1.default: [
    f"AOTITorchError {_SYMBOL}(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"]}


@lru_cache(maxsize=1)
def supported() -> bool:
    """True on x86-64 Linux CPUs with AVX512-BF16 (the kernel's instructions)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    have = set(flags.split(":", 1)[-1].split())
    return all(f in have for f in _CPU_FLAGS)


def build(out: Path) -> Path:
    """Compile cpu_gemv.cpp into `out` (written to a temporary name, then renamed)."""
    torch_dir = Path(torch.__file__).parent
    tmp = out.with_name(out.name + ".tmp")
    cmd = [torch._inductor.cpp_builder.get_cpp_compiler(), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
           *_ISA_FLAGS, f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-ltorch_cpu",
           "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        error = done.stderr[-2000:] if done.returncode else ""
    except OSError as e:
        error = str(e)
    if error:
        tmp.unlink(missing_ok=True)
        raise NeuronInferError(f"building the CPU GEMV kernel failed ({' '.join(cmd)}):\n{error}\nInstall a C++ "
                               "compiler with AVX512-BF16 support (g++ >= 10; AOTInductor needs one too)")
    os.replace(tmp, out)
    return out


_loaded: dict[str, ctypes.CDLL] = {}


def load(lib: Path, sha256: str) -> None:
    """Make the kernel's symbol visible to graphs loaded afterwards (once per process and file)."""
    key = str(Path(lib).resolve())
    if key in _loaded:
        return
    if not lib.is_file():
        raise ArtifactError(f"the GEMV kernel {lib} of a compiled graph is missing; recompile the model")
    if hashlib.sha256(lib.read_bytes()).hexdigest() != sha256:
        raise ArtifactError(f"the GEMV kernel {lib} is corrupt (its sha256 differs from the one recorded at compile "
                            "time); recompile the model")
    if not supported():
        raise ArtifactError(f"{lib} needs a CPU with {', '.join(_CPU_FLAGS)}, which this machine lacks; compile the "
                            "model on this machine")
    try:
        _loaded[key] = ctypes.CDLL(key, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"the GEMV kernel {lib} cannot be loaded ({e}); recompile the model") from e
