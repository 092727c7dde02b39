"""The C kernels of the CPU backend (GEMV, attention): custom ops, their PyTorch twins, and the C library
AOTInductor calls.

    export:   the linears that share one input x [R, K] (q/k/v, gate/up; any other linear alone: a group of one, see
              backends/cpu/gemv_groups.py) on any number of rows R -> one call, the results side by side
              [R, N_0 + N_1 + ...]:
                  bf16  torch.ops.neuron_infer.ni_gemv_bf16_v8(x, [w_0, ...])                 w_m [N_m, K] bf16
                  int8  torch.ops.neuron_infer.ni_gemv_int8_v6(x, [q_0, ...], [s_0, ...])     q_m int8, s_m [N_m]
                  w8a8  torch.ops.neuron_infer.ni_gemv_w8a8_v3(x, [q_0, ...], [s_0, ...])
              attention over the cached keys for any number of query rows per KV head (decode, verify, prefill;
              bf16, head dim a multiple of 32 up to 256) -> one call per layer (cpu_attention.cpp), reading the
              layer's block caches in place through the block table and skipping keys past each row's position:
                  attn  torch.ops.neuron_infer.ni_attn_v2(q, k, v, table, positions)
                        q [B, H, R, D], k and v [N, H, bs, D], table [B, W], positions [B, R]
    compile:  aot_inductor.custom_ops_to_c_shims = C_SHIMS: the generated wrapper calls the C functions
              aoti_torch_cpu_ni_gemv_bf16_v8, ..._int8_v6, ..._w8a8_v3 (cpu_gemv*.cpp), ..._attn_v2
              (cpu_attention.cpp) directly - no dispatcher
    build:    the sources a graph calls -> <graph>.gemv.so next to the graph (g++, the compiler Inductor uses),
              for one ISA level (ISAS); the level is recorded and checked against the CPU at load
    load:     the .so is loaded with RTLD_GLOBAL before the graph, so the graph's undefined symbols resolve to it

One call per group is one OpenMP parallel region over the columns of every matrix in it (and, for w8a8, one
quantization of the activations): a decode step of a Llama layer runs 4 GEMV regions instead of 7.
Each op's eager implementation is the reference the tests compare the kernel with (the slow twin): an fp32 matmul
of the same values, times the int8 scale, rounded once to bf16; for w8a8 the scheme's own per-token quantization
and exact integer matmul (quant.smoothquant.w8a8_matmul), which its kernel reproduces bit for bit. The version
suffix is part of the C symbol and must change with the kernel's contract (arguments, result, numerics, rows
accepted): the first library loaded in a process serves every graph calling that symbol, so two libraries under
one name must be interchangeable (the rows each accepts and up to MAX_GROUP matrices, on every ISA level).
Every kernel has a path for every ISA level: the bf16 one uses AVX512-BF16 dot products at that level and AVX2 +
FMA (bf16 widened to fp32) below it; the int8 and w8a8 ones AVX512-VNNI (int8: vpdpwssd on 16-bit activations,
w8a8: vpdpbusd) at the avx512-vnni and avx512-bf16 levels, their 256-bit VEX forms (AVX-VNNI) at avx2-vnni, int16
multiply-adds (vpmaddwd) at avx512 and avx2. Without
AVX2 + FMA linears stay Inductor-generated reductions (bf16) or the quantized module's own matmul (int8, w8a8). The
attention kernel has an AVX-512 path (every level from avx512) and an AVX2 one; without it attention stays the fp32
reductions of model/ops.py, its reference twin.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

from neuron_infer.embedded import cache_dir
from neuron_infer.errors import ArtifactError, NeuronInferError
from neuron_infer.model.ops import few_rows_attention, gather_blocks
from neuron_infer.quant.smoothquant import w8a8_matmul

MAX_ROWS = 8  # rows the kernels' GEMV takes (one pass over the weights for all rows); more: their GEMM blocks
SOURCES = {"bf16": Path(__file__).with_name("cpu_gemv.cpp"), "int8": Path(__file__).with_name("cpu_gemv_int8.cpp"),
           "w8a8": Path(__file__).with_name("cpu_gemv_w8a8.cpp"), "attn": Path(__file__).with_name("cpu_attention.cpp")}
LIB_SUFFIX = ".gemv.so"
_SYMBOLS = {"bf16": "aoti_torch_cpu_ni_gemv_bf16_v8", "int8": "aoti_torch_cpu_ni_gemv_int8_v6",
            "w8a8": "aoti_torch_cpu_ni_gemv_w8a8_v3", "attn": "aoti_torch_cpu_ni_attn_v2"}
# ISA levels, highest first: the /proc/cpuinfo flags each needs and the compiler flags it is built with. Every CPU
# with AVX512-BF16 has AVX512-VNNI (Cooper Lake, Sapphire Rapids, Zen 4 and later), so that level includes it.
# avx2-vnni is AVX2 with the VEX-encoded VNNI dot products (AVX-VNNI: Alder Lake, Zen 5); an AVX-512 CPU may lack
# it (Ice Lake, Zen 4), so the levels are not a strict chain: a level is used only where has_isa says so.
ISAS = ("avx512-bf16", "avx512-vnni", "avx512", "avx2-vnni", "avx2")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "fma")
_CPU_FLAGS = {"avx512-bf16": (*_AVX512, "avx512_vnni", "avx512_bf16"), "avx512-vnni": (*_AVX512, "avx512_vnni"),
              "avx512": _AVX512, "avx2-vnni": ("avx2", "fma", "avx_vnni"), "avx2": ("avx2", "fma")}
_CC_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]
_CC_FLAGS = {"avx512-bf16": [*_CC_AVX512, "-mavx512vnni", "-mavx512bf16"], "avx512-vnni": [*_CC_AVX512, "-mavx512vnni"],
             "avx512": _CC_AVX512, "avx2-vnni": ["-mavx2", "-mfma", "-mavxvnni"], "avx2": ["-mavx2", "-mfma"]}
LEGACY_ISA = "avx512-bf16"  # sidecars without an "isa" entry hold the AVX512-BF16 bf16 kernel


def _fake(x: torch.Tensor, ws: list[torch.Tensor], *_: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in ws))


@torch.library.custom_op("neuron_infer::ni_gemv_bf16_v8", mutates_args=())
def gemv_bf16(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """x [R, K] bf16, ws[m] [N_m, K] bf16 -> [x @ ws[0].T, x @ ws[1].T, ...] side by side [R, sum N_m] bf16 (fp32
    accumulation, one rounding). The reference."""
    return torch.cat([x.float() @ w.float().t() for w in ws], -1).to(torch.bfloat16)


@torch.library.custom_op("neuron_infer::ni_gemv_int8_v6", mutates_args=())
def gemv_int8(x: torch.Tensor, qs: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """x [R, K] bf16, qs[m] [N_m, K] int8, scales[m] [N_m] bf16 -> the (x @ q.T) * scale side by side [R, sum N_m]
    bf16 (fp32 math, one rounding). The reference: dequantize-then-matmul, the per-channel scale applied after the
    fp32 sum."""
    return torch.cat([(x.float() @ q.float().t()) * s.float() for q, s in zip(qs, scales, strict=True)],
                     -1).to(torch.bfloat16)


@torch.library.custom_op("neuron_infer::ni_gemv_w8a8_v3", mutates_args=())
def gemv_w8a8(x: torch.Tensor, qs: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    """x [R, K] bf16, qs[m] [N_m, K] int8, scales[m] [N_m] fp32 -> [R, sum N_m] bf16: per-token int8 activations,
    exact int32 dot products, both scales applied in fp32, one rounding. The reference is the scheme's own math."""
    return torch.cat([w8a8_matmul(x, q, s) for q, s in zip(qs, scales, strict=True)], -1)


for _op in (gemv_bf16, gemv_int8, gemv_w8a8):
    _op.register_fake(_fake)


@torch.library.custom_op("neuron_infer::ni_attn_v2", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """q [B, H, R, D], the block caches k and v [N, H, bs, D] bf16, table [B, W] int64 (row b's positions j live in
    block table[b, j // bs], slot j % bs), positions [B, R] int64 -> [B, H, R, D] bf16: key j is visible to row r iff
    j <= positions[b, r]; scores, softmax and the weighted sum in fp32, one rounding; a row that sees no key gets
    zeros. The reference: the table's blocks gathered, then model.ops' fp32 reductions."""
    ks, vs = gather_blocks(k, table), gather_blocks(v, table)  # [B, H, W*bs, D] each
    visible = torch.arange(ks.shape[2]).view(1, 1, 1, -1) <= positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, R, S]
    out = few_rows_attention(q, ks, vs, visible)
    return out.masked_fill(~visible.any(-1, keepdim=True), 0)


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


ATTENTION_MAX_D = 256  # head dims the attention kernel takes: multiples of 32 up to this


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the attention kernel takes these operands (q and the block caches; static shapes and dtypes at
    export)."""
    d = q.shape[-1]
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu" and d % 32 == 0
            and d <= ATTENTION_MAX_D and k.shape[1] == q.shape[1])

_LISTS = "const AtenTensorHandle* qs, int64_t qs_len_, const AtenTensorHandle* scales, int64_t scales_len_"
C_SHIMS = {
    torch.ops.neuron_infer.ni_gemv_bf16_v8.default: [
        (f"AOTITorchError {_SYMBOLS['bf16']}(AtenTensorHandle x, const AtenTensorHandle* ws, int64_t ws_len_, "
         "AtenTensorHandle* ret0)")],
    torch.ops.neuron_infer.ni_gemv_int8_v6.default: [
        f"AOTITorchError {_SYMBOLS['int8']}(AtenTensorHandle x, {_LISTS}, AtenTensorHandle* ret0)"],
    torch.ops.neuron_infer.ni_gemv_w8a8_v3.default: [
        f"AOTITorchError {_SYMBOLS['w8a8']}(AtenTensorHandle x, {_LISTS}, AtenTensorHandle* ret0)"],
    torch.ops.neuron_infer.ni_attn_v2.default: [
        (f"AOTITorchError {_SYMBOLS['attn']}(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, "
         "AtenTensorHandle table, AtenTensorHandle positions, AtenTensorHandle* ret0)")],
}
OPS = {"bf16": torch.ops.neuron_infer.ni_gemv_bf16_v8.default, "int8": torch.ops.neuron_infer.ni_gemv_int8_v6.default,
       "w8a8": torch.ops.neuron_infer.ni_gemv_w8a8_v3.default}
MAX_GROUP = 4  # weight matrices per call (the C kernels' kMaxMats)
KERNEL_OPS = {**OPS, "attn": torch.ops.neuron_infer.ni_attn_v2.default}  # every op a graph's library may provide


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return frozenset()
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.split(":", 1)[-1].split())


def has_isa(isa: str) -> bool:
    """Whether this CPU (x86-64 Linux) has every instruction set the kernels built for `isa` use."""
    return all(f in _cpu_flags() for f in _CPU_FLAGS[isa])


def cpu_isa() -> str | None:
    """The highest ISA level (ISAS) this CPU has, or None (no kernel can run here)."""
    return next((isa for isa in ISAS if has_isa(isa)), None)


def supported() -> bool:
    """True on x86-64 Linux CPUs where the bf16 kernel runs (any ISA level: AVX2 + FMA at least)."""
    return "bf16" in kernels_for(cpu_isa())


def kernels_for(isa: str | None) -> tuple[str, ...]:
    """The kernels ("bf16", "int8", "w8a8", "attn") a library built for `isa` provides: all at every level (None:
    none)."""
    return () if isa is None else ("bf16", "int8", "w8a8", "attn")


_WITHOUT_VNNI = {"avx512-vnni": "avx512", "avx2-vnni": "avx2"}


def lowest_isa(kernels: tuple[str, ...], isa: str) -> str:
    """The level to build `kernels` for on a CPU of level `isa`: only the int8 and w8a8 kernels use VNNI, so a
    library without them is built for the level below (the same code), and its graphs also load on CPUs without
    VNNI."""
    return isa if {"int8", "w8a8"} & set(kernels) else _WITHOUT_VNNI.get(isa, isa)


def build(out: Path, kernels: tuple[str, ...], isa: str = LEGACY_ISA) -> Path:
    """The library of `kernels` for `isa` at `out`: copied from the kernel cache (<cache>/kernels/<key>.so, keyed by
    the compile command and the sources' bytes), or compiled (to a temporary name, then renamed) and cached."""
    if not kernels or any(k not in kernels_for(isa) for k in kernels):
        raise ValueError(f"kernels {kernels} cannot be built for ISA {isa}")
    torch_dir = Path(torch.__file__).parent
    tmp = out.with_name(out.name + ".tmp")
    cmd = [torch._inductor.cpp_builder.get_cpp_compiler(), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
           *_CC_FLAGS[isa], f"-I{torch_dir / 'include'}", *(str(SOURCES[k]) for k in kernels),
           f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-o", str(tmp)]
    cached = _kernel_cache_path(cmd[:-1], kernels)
    try:
        shutil.copy2(cached, tmp)
        os.replace(tmp, out)
        return out
    except OSError:
        tmp.unlink(missing_ok=True)  # not cached yet (or unreadable): compile
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        error = done.stderr[-2000:] if done.returncode else ""
    except OSError as e:
        error = str(e)
    if error:
        tmp.unlink(missing_ok=True)
        raise NeuronInferError(f"building the CPU GEMV kernel failed ({' '.join(cmd)}):\n{error}\nInstall a C++ "
                               f"compiler with {isa} support (g++ >= 10; AOTInductor needs one too)")
    os.replace(tmp, out)
    _store_kernel(out, cached)
    return out


def _kernel_cache_path(cmd: list[str], kernels: tuple[str, ...]) -> Path:
    h = hashlib.sha256(torch.__version__.encode() + "\0".join(cmd).encode())
    for path in sorted({SOURCES[k] for k in kernels} | set(Path(__file__).parent.glob("cpu_gemv_*.h"))):
        h.update(path.read_bytes())
    return cache_dir() / "kernels" / f"{h.hexdigest()[:32]}{LIB_SUFFIX}"


def _store_kernel(lib: Path, cached: Path) -> None:
    """Copy a freshly built library into the kernel cache (a temporary name renamed into place)."""
    tmp = cached.with_name(f".{cached.name}.partial-{os.getpid()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, tmp)
        os.replace(tmp, cached)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only or full cache only costs the next build


_loaded: dict[str, ctypes.CDLL] = {}


def load(lib: Path, sha256: str, isa: str = LEGACY_ISA) -> None:
    """Make the kernel's symbol visible to graphs loaded afterwards (once per process and file)."""
    key = str(Path(lib).resolve())
    if key in _loaded:
        return
    if not lib.is_file():
        raise ArtifactError(f"the GEMV kernel {lib} of a compiled graph is missing; recompile the model")
    if hashlib.sha256(lib.read_bytes()).hexdigest() != sha256:
        raise ArtifactError(f"the GEMV kernel {lib} is corrupt (its sha256 differs from the one recorded at compile "
                            "time); recompile the model")
    if isa not in _CPU_FLAGS or not has_isa(isa):
        flags = ", ".join(_CPU_FLAGS.get(isa, (repr(isa),)))
        raise ArtifactError(f"{lib} needs a CPU with {flags}, which this machine lacks; compile the model on this "
                            "machine")
    try:
        _loaded[key] = ctypes.CDLL(key, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"the GEMV kernel {lib} cannot be loaded ({e}); recompile the model") from e
