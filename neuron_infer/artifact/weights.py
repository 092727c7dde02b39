"""Building a model from checkpoint tensors, and an artifact's weight files: one per rank, the draft's own."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from neuron_infer.artifact.arena import ALIGN, pack_weights
from neuron_infer.checkpoint import read_header
from neuron_infer.config import BuildConfig, ModelConfig, QuantConfig
from neuron_infer.errors import ArtifactError, CheckpointError
from neuron_infer.model.llama import LlamaModel, LocalLayout
from neuron_infer.model.op_tables import get_ops
from neuron_infer.model.ops import Ops
from neuron_infer.quant import apply_quantization, default_fp8_not_convert
from neuron_infer.quant.tiled import tile_structure

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DRAFT_WEIGHTS = "weights/draft_rank0.safetensors"
# torch dtype -> its safetensors header tag (the dtypes an artifact's weights hold, and what a rewritten file may)
TAGS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8",
        torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
_NAMES = {tag: str(dtype) for dtype, tag in TAGS.items()}
# the bit pattern of every non-finite value of a float8 dtype (torch.isfinite has no float8 kernel): e4m3fn has
# NaN only (exponent and mantissa all ones), e5m2 has inf and NaN (exponent all ones)
_F8_NONFINITE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def empty_model(cfg: ModelConfig, build: BuildConfig, layout: LocalLayout | None = None,
                ops: Ops | None = None) -> LlamaModel:
    """A model skeleton on the meta device (no memory, no random init)."""
    with torch.device("meta"):
        return LlamaModel(cfg, layout, ops or get_ops(build.kernels), max_positions=build.max_length).eval()


def build_float_model(cfg: ModelConfig, build: BuildConfig, state: dict[str, torch.Tensor],
                      layout: LocalLayout | None = None, ops: Ops | None = None) -> LlamaModel:
    """Model in the build dtype from (HF-named, already validated) tensors; tied head re-shared."""
    model = empty_model(cfg, build, layout, ops)
    dtype = DTYPES[build.dtype]
    state = {k: v.to(dtype) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.materialize_buffers()
    return model


def _shared_with_embedding(model: LlamaModel) -> bool:
    head = getattr(model.lm_head, "weight", None)
    return head is not None and head is model.model.embed_tokens.weight


def save_rank_weights(model: LlamaModel, path: Path) -> int:
    """Write this rank's parameters and persistent buffers once (a tied head is stored as the embedding only)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if _shared_with_embedding(model):
        state.pop("lm_head.weight")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return sum(t.numel() * t.element_size() for t in state.values())


def read_packed(path: Path, what: str = "weights", expected: Expected | None = None) -> dict[str, torch.Tensor]:
    """A weights file's tensors, read one at a time into one huge-page block (artifact/arena.py): fewer TLB misses
    when a decode step streams them all, and no second full copy of the weights while loading. The decoder layers'
    tensors are laid out stacked (`stacked_order`). Each tensor is checked as it is copied in (its bytes still in
    cache): the name, dtype and shape `expected` gives it, and no NaN or infinity in a floating-point tensor."""
    def check(name: str, t: torch.Tensor) -> None:
        if expected is not None:
            expected.check(path, what, name, TAGS.get(t.dtype, str(t.dtype)), tuple(t.shape))
        if not _finite(t):
            raise ArtifactError(f"{what} {path}: tensor {name} holds NaN or infinite values (a model built from it "
                                "answers garbage); the file is damaged or was edited: recompile the model")

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            specs = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in names}
            order, follow = stacked_order(specs)
            capacity = path.stat().st_size + len(names) * ALIGN  # the file holds every tensor's bytes
            out = pack_weights(((k, f.get_tensor(k)) for k in order), capacity, follow, check)
    except (OSError, SafetensorError) as e:
        raise ArtifactError(f"cannot read {what} {path} ({e}); recompile the model") from e
    return out


def _finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or infinity (integer tensors: always)."""
    if t.dtype in _F8_NONFINITE:  # torch.isfinite has no float8 kernel: the bit patterns
        bits = _F8_NONFINITE[t.dtype]
        return not bool(((t.view(torch.uint8) & bits) == bits).any())
    # a finite sum proves every element finite (NaN and inf propagate); only an overflowing sum of finite values
    # needs the element-wise check. One reduction: about 1/10 the time of isfinite().all()
    return not t.dtype.is_floating_point or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def pack_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory tensors laid out as read_packed lays out a file's (one huge-page block, decoder layers stacked),
    copied one at a time."""
    order, follow = stacked_order({k: (tuple(t.shape), t.dtype) for k, t in state.items()})
    capacity = sum(t.numel() * t.element_size() + ALIGN for t in state.values())
    return pack_weights(((k, state[k]) for k in order), capacity, follow)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def stacked_order(specs: dict[str, tuple]) -> tuple[list[str], frozenset[str]]:
    """The order tensors are packed in -> (names, the names packed right after the previous one).

    `specs`: name -> (shape, dtype). For every suffix that each of the L decoder layers holds as
    `model.layers.{i}.<suffix>` with one shape and dtype, layers 0..L-1 follow each other without a gap: together
    one contiguous [L, ...] block, so each layer's tensor is block[i] and the stack is a view (LlamaModel.stack_layers,
    which the CPU backend's looped layer stack reads). Other tensors keep their own aligned place, in file order."""
    by_suffix: dict[str, dict[int, str]] = {}
    for name in specs:
        m = _LAYER.fullmatch(name)
        if m:
            by_suffix.setdefault(m.group(2), {})[int(m.group(1))] = name
    layers = 1 + max((i for per in by_suffix.values() for i in per), default=-1)
    runs = [[per[i] for i in range(layers)] for per in by_suffix.values()
            if layers > 1 and sorted(per) == list(range(layers)) and len({specs[n] for n in per.values()}) == 1]
    stacked = {n for run in runs for n in run}
    order = [n for n in specs if n not in stacked] + [n for run in runs for n in run]
    return order, frozenset(n for run in runs for n in run[1:])


def rank_model(cfg: ModelConfig, build: BuildConfig, path: Path, layout: LocalLayout | None = None,
               ops: Ops | None = None) -> LlamaModel:
    """One rank's model with the build's quantized structure, its weights read from `path`: the file's header is
    checked first (names, dtypes and shapes), and each tensor again as it is read."""
    expected = Expected(stored_layout(cfg, build, layout, ops), build)
    expected.check_header(path, "weights")
    model = empty_model(cfg, build, layout, ops)
    quant_structure(model, build)
    assign_state(model, read_packed(path, "weights", expected),
                 f"weights {path} do not match the model the manifest describes")
    return model


def stored_layout(cfg: ModelConfig, build: BuildConfig, layout: LocalLayout | None = None, ops: Ops | None = None,
                  draft_quant: str | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a weights file of this build holds: tensor name -> (safetensors dtype tag, shape). The compile builds
    the float model in the build dtype and then quantizes it, so a skeleton in the build dtype given the build's
    quantized structure (or, for a draft, its `draft_quant` scheme) has the stored dtypes: quantized weights and
    their scales keep the dtypes their scheme gives them, every other tensor has the build dtype. A head tied to
    the embedding is not stored (the load re-ties it; a stored one would be replaced silently, so it is refused)."""
    model = empty_model(cfg, build, layout, ops).to(DTYPES[build.dtype])  # meta: no memory
    if draft_quant is None:
        quant_structure(model, build)
    elif draft_quant != "none":
        apply_quantization(model, QuantConfig(scheme=draft_quant), structure_only=True)
    model.tie_weights()
    state = model.state_dict()
    if _shared_with_embedding(model):
        state.pop("lm_head.weight")
    return {k: (TAGS.get(t.dtype, str(t.dtype)), tuple(t.shape)) for k, t in state.items()}


def _tag(tag: str) -> str:
    return f"{_NAMES[tag]} ({tag})" if tag in _NAMES else repr(tag)


@dataclasses.dataclass(frozen=True)
class Expected:
    """The tensors a weights file must hold (`layout`, from stored_layout) for `build`, and the checks against it."""

    layout: dict[str, tuple[str, tuple[int, ...]]]
    build: BuildConfig

    def check_header(self, path: Path, what: str) -> None:
        """Refuse, from the safetensors header alone (no tensor data is read), a file whose tensor names, dtypes or
        shapes differ: a file rewritten with other weights of the same names and shapes (fp16 for fp32, say) is
        named here, before any graph runs."""
        try:
            header = read_header(path)[2]
        except (CheckpointError, OSError) as e:
            raise ArtifactError(f"cannot read {what} {path}: {e}; recompile the model") from e
        stored = {k: v for k, v in header.items() if k != "__metadata__"}
        missing = sorted(set(self.layout) - set(stored))
        if missing:
            raise ArtifactError(f"{_mismatch(what, path)}: {len(missing)} missing tensor(s) (first {missing[0]}); "
                                "recompile the model")
        for name, entry in stored.items():
            self.check(path, what, name, entry["dtype"], tuple(entry["shape"]))

    def check(self, path: Path, what: str, name: str, tag: str, shape: tuple[int, ...]) -> None:
        """One stored tensor's name, dtype tag and shape."""
        if name not in self.layout:
            raise ArtifactError(f"{_mismatch(what, path)}: unexpected tensor {name}; recompile the model")
        want_tag, want_shape = self.layout[name]
        if tag != want_tag:
            raise ArtifactError(f"{_mismatch(what, path)}: tensor {name} is stored as {_tag(tag)}, where a "
                                f"{self.build.dtype} build with quantization {self.build.quant.scheme} holds "
                                f"{_tag(want_tag)}; recompile the model")
        if shape != want_shape:
            raise ArtifactError(f"{_mismatch(what, path)}: tensor {name} has shape {list(shape)}, where the "
                                f"manifest's model implies {list(want_shape)}; recompile the model")


def _mismatch(what: str, path: Path) -> str:
    return f"{what} {path} do not match the model the manifest describes"


def assign_state(model: LlamaModel, state: dict[str, torch.Tensor], mismatch: str) -> None:
    """Fill a meta-device skeleton from `state` (strict; names, dtypes and shapes were checked from the file's
    header); a tied plain head reuses the embedding tensor."""
    plain_head = type(model.lm_head) is torch.nn.Linear
    if model.cfg.tie_word_embeddings and plain_head and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # torch's message spans lines: one line, shortened
        detail = " ".join(str(e).split())
        detail = detail if len(detail) <= 400 else detail[:397] + "..."
        raise ArtifactError(f"{mismatch}: {detail}; recompile the model") from e
    model.tie_weights()
    model.materialize_buffers()


# ---- the quantized structure of a build -----------------------------------------------------------------------
def resolve_quant(qcfg: QuantConfig, num_layers: int) -> QuantConfig:
    """Fill the scheme's default modules_to_not_convert (fp8: attention, first and last MLP, lm_head)."""
    if qcfg.modules_to_not_convert is not None:
        return qcfg
    default = default_fp8_not_convert(num_layers) if qcfg.scheme == "fp8" else ()
    return dataclasses.replace(qcfg, modules_to_not_convert=default)


def quant_structure(model: LlamaModel, build: BuildConfig) -> None:
    """Give a meta-device skeleton the quantized (and tiled) module structure of the build (before loading weights)."""
    if build.quant.scheme != "none":
        apply_quantization(model, resolve_quant(build.quant, model.cfg.num_layers), structure_only=True)
    if build.quant.weight_tiling:
        tile_structure(model)


# ---- draft weights: stored once, tensors equal to the target's shared ---------------------------------------------
def save_draft_weights(draft: LlamaModel, target: LlamaModel, path: Path,
                       shareable: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Write the draft tensors that differ from the target's; return the names taken from the target. At tp > 1
    `target` is rank 0's shard and `shareable` admits only tensors every rank holds whole (the norms)."""
    tstate, shared, own = target.state_dict(), [], {}
    for name, t in draft.state_dict().items():
        ref = tstate.get(name) if shareable(name) else None
        if ref is not None and ref.dtype == t.dtype and ref.shape == t.shape and torch.equal(ref, t):
            shared.append(name)
        else:
            own[name] = t.contiguous()
    tied = draft.lm_head.weight is draft.model.embed_tokens.weight if hasattr(draft.lm_head, "weight") else False
    if tied and "lm_head.weight" in own:
        own.pop("lm_head.weight")  # re-tied at load
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(path))
    return sorted(shared)


def load_draft_weights(draft: LlamaModel, target: LlamaModel, path: Path, shared: list[str], build: BuildConfig,
                       quant: str) -> None:
    """Fill a meta-device draft skeleton (quantized with `quant`): its own file plus the target's tensors named in
    `shared` (same memory). The file's header is checked first against the draft the manifest describes."""
    tstate = target.state_dict()
    layout = stored_layout(draft.cfg, build, draft_quant=quant)
    foreign = next((n for n in shared if n not in tstate or n not in draft.state_dict()), None)
    if foreign is not None:
        raise ArtifactError(f"{path}: the manifest's extra.speculation.shared names {foreign!r}, which the target and "
                            "the draft do not both hold; recompile the model")
    own = Expected({k: v for k, v in layout.items() if k not in shared}, build)
    own.check_header(path, "draft weights")
    state = read_packed(path, "draft weights", own)
    state.update({n: tstate[n] for n in shared})
    assign_state(draft, state, f"draft weights {path} do not match the manifest's draft model")
