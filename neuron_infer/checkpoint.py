"""Hugging Face checkpoint reading: safetensors (single file or sharded), strict name/shape mapping, tokenizer.

Only safetensors is read. Pickle checkpoints (`.bin`, `.pt`, `.pth`) are refused: unpickling runs arbitrary
code from the file. Tensor names are Hugging Face `LlamaForCausalLM` names, verbatim (see `expected_shapes`).

Every problem raises `CheckpointError` naming the file or tensor and the fix.
"""
from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from neuron_infer.config import ModelConfig
from neuron_infer.errors import CheckpointError, NeuronInferError
from neuron_infer.typed import json_from_bytes, parse_json, read_json, show

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# safetensors dtype tag -> torch dtype; anything else is refused
SUPPORTED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# Derived buffers some older Llama checkpoints carry; recomputed from config.json, so dropped when present.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format caps the JSON header at 100 MB
_LIST_LIMIT = 10


# ---------------------------------------------------------------------------------------------------------------
# expected names and shapes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `cfg` must hold, with its HF shape ([out, in] for linear weights).

    `lm_head.weight` is absent when `cfg.tie_word_embeddings` (the head reuses `model.embed_tokens.weight`).
    """
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, (out_f, in_f) in {"q": (q_out, h), "k": (kv_out, h), "v": (kv_out, h), "o": (h, q_out)}.items():
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out_f, in_f)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out_f,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, (out_f, in_f) in {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}.items():
            shapes[f"{p}mlp.{proj}_proj.weight"] = (out_f, in_f)
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{proj}_proj.bias"] = (out_f,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


# ---------------------------------------------------------------------------------------------------------------
# safetensors header (parsed here so truncation, dtypes and shapes are checked before any data is read)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a safetensors header."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _corrupt(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated or corrupt ({detail}); re-download it (an interrupted download or a full disk "
        "leaves a partial file), e.g. `huggingface-cli download <repo> --local-dir <dir>`"
    )


def read_header(path: Path) -> tuple[int, bytes, dict[str, Any]]:
    """Return (header_length, raw header bytes incl. the 8-byte length prefix, parsed header) of a safetensors
    file, after checking that every tensor's byte range lies inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", prefix)
        if n > _MAX_HEADER or 8 + n > size:
            raise _corrupt(path, f"header claims {n} bytes but the file has {size}")
        raw = f.read(n)
    try:
        header = parse_json(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_size = size - 8 - n
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, data_size)
    return n, prefix + raw, header


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    try:
        start, end = (int(x) for x in entry["data_offsets"])
        shape = [int(x) for x in entry["shape"]]
        dtype = str(entry["dtype"])
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"malformed header entry for tensor {name!r}") from None
    if end > data_size:
        raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data section, which has only {data_size}")
    numel = 1
    for d in shape:
        numel *= d
    if dtype in _ITEMSIZE and end - start != numel * _ITEMSIZE[dtype]:
        raise _corrupt(path, f"tensor {name!r} {dtype}{shape} spans {end - start} bytes")


def _scan_file(path: Path) -> dict[str, TensorInfo]:
    _, _, header = read_header(path)
    return {
        name: TensorInfo(path, str(e["dtype"]), tuple(int(x) for x in e["shape"]))
        for name, e in header.items() if name != "__metadata__"
    }


# ---------------------------------------------------------------------------------------------------------------
# locating the weight files


def _pickle_error(model_dir: Path, files: list[Path]) -> CheckpointError:
    names = ", ".join(p.name for p in files[:3]) + (" ..." if len(files) > 3 else "")
    return CheckpointError(
        f"{model_dir} holds only pickle checkpoint files ({names}); neuron-infer refuses them because unpickling "
        "runs arbitrary code embedded in the file. Convert once, in an environment you trust: "
        "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)` with "
        "transformers (then copy the tokenizer files), or download the repository's *.safetensors files instead."
    )


def safetensors_files(model_dir: str | Path) -> tuple[list[Path], Path | None]:
    """The checkpoint's safetensors files and its index file (None for a single-file checkpoint).

    Raises CheckpointError for a missing directory, a missing/unreadable index or shard, or a pickle-only dir.
    """
    d = Path(model_dir)
    if not d.is_dir():
        state = "is a file, not a directory" if d.exists() else "does not exist"
        raise CheckpointError(f"model directory {d} {state} (give the path of a downloaded HF model)")
    index = d / INDEX_FILE
    if index.is_file():
        return _shards_from_index(index), index
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE], None
    pickles = sorted(p for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(d, pickles)
    others = sorted(p.name for p in d.glob("*.safetensors"))
    hint = (f" It has {others} but no {INDEX_FILE} to say how they fit together; re-download the index."
            if others else " Download the repository's *.safetensors files (and the index if sharded).")
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}.{hint}")


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = parse_json(index.read_bytes())["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({e!r}); re-download it") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has an empty or invalid 'weight_map'; re-download it")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or "/" in v or v in ("", ".", "..")]
    if bad:
        raise CheckpointError(f"{index}: weight_map[{bad[0]!r}] is {weight_map[bad[0]]!r}, not a shard file name in "
                              "the same directory; re-download the index")
    return weight_map


def _shards_from_index(index: Path) -> list[Path]:
    weight_map = _read_index(index)
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{index} names shard file(s) missing from {index.parent}: {_name_list(missing)}; download them "
            "(an incomplete download?)"
        )
    return [index.parent / n for n in names]


# ---------------------------------------------------------------------------------------------------------------
# loading


def _name_list(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_LIST_LIMIT])
    return shown + (f" and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else "")


def scan_checkpoint(model_dir: str | Path) -> dict[str, TensorInfo]:
    """Name -> (file, dtype, shape) for every tensor of the checkpoint, from the headers only."""
    files, index = safetensors_files(model_dir)
    infos: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in _scan_file(path).items():
            if name in infos:
                raise CheckpointError(f"tensor {name} appears in both {infos[name].file} and {path}; re-download")
            infos[name] = info
    if index is not None:
        wrong = [n for n, f in _read_index(index).items() if n not in infos or infos[n].file.name != f]
        if wrong:
            raise CheckpointError(f"{index} maps tensor(s) to shards that do not hold them: {_name_list(wrong)}; "
                                  "the index and the shards are from different downloads, re-download both")
    return infos


def check_weight_headers(model_dir: str | Path, cfg: ModelConfig) -> None:
    """Compile-time check, from the safetensors headers only: the checkpoint holds exactly the tensors `cfg`
    implies, with their shapes and a supported dtype (CheckpointError naming the config.json field otherwise)."""
    _check_names(scan_checkpoint(model_dir), cfg, Path(model_dir))


_LAYER = re.compile(r"(?:model\.)?layers\.(\d{1,9})\.")  # without "model.": the name check's hint follows


def _size_fields(c: ModelConfig) -> tuple[tuple[str, str, int, tuple[int, int]], ...]:
    """(config.json field(s) as the message names them, a tensor whose shape shows them, the dimension that does,
    the tensor's shape config.json implies)."""
    heads = f"num_attention_heads={c.num_heads} x head_dim={c.head_dim} ({c.num_heads * c.head_dim})"
    kv_heads = f"num_key_value_heads={c.num_kv_heads} x head_dim={c.head_dim} ({c.num_kv_heads * c.head_dim})"
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return (
        (f"vocab_size={c.vocab_size}", "model.embed_tokens.weight", 0, (c.vocab_size, h)),
        (f"hidden_size={h}", "model.embed_tokens.weight", 1, (c.vocab_size, h)),
        (f"intermediate_size={c.intermediate_size}", "model.layers.0.mlp.gate_proj.weight", 0,
         (c.intermediate_size, h)),
        (heads, "model.layers.0.self_attn.q_proj.weight", 0, (q, h)),
        (kv_heads, "model.layers.0.self_attn.k_proj.weight", 0, (kv, h)),
    )


def layer_count(names: Iterable[str]) -> int:
    """The decoder layers tensor `names` hold (one past the highest `model.layers.<i>.` index; 0 for none)."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    return max(layers) + 1 if layers else 0


def check_layer_count(names: Iterable[str], cfg: ModelConfig, model_dir: Path) -> None:
    """config.json's num_hidden_layers must not exceed the decoder layers the weights (tensor `names`) hold."""
    present = layer_count(names)
    if cfg.num_layers > present:
        raise CheckpointError(
            f"{model_dir / 'config.json'}: num_hidden_layers={cfg.num_layers}, but the weights hold {present} "
            "layer(s); config.json and the weights are from different models (fix num_hidden_layers or use the "
            "config.json of these weights)"
        )


def _check_sizes(infos: dict[str, TensorInfo], cfg: ModelConfig, model_dir: Path) -> None:
    """config.json's size fields bounded by the weights present, before anything is sized from them: a
    num_hidden_layers or hidden_size the checkpoint does not hold is named at once (not after building the
    expected names of 10^9 layers)."""
    check_layer_count(infos, cfg, model_dir)
    for fields, tensor, dim, implied in _size_fields(cfg):
        shape = infos[tensor].shape if tensor in infos else ()
        if len(shape) == 2 and shape[dim] != implied[dim]:
            raise CheckpointError(
                f"{model_dir / 'config.json'}: {fields}, but the weights have {shape[dim]}: tensor {tensor} in "
                f"{infos[tensor].file} has shape {list(shape)}, where config.json implies {list(implied)}; "
                "config.json and the weights are from different models (fix the field or use the config.json of "
                "these weights)"
            )


def _check_names(infos: dict[str, TensorInfo], cfg: ModelConfig, model_dir: Path) -> None:
    _check_sizes(infos, cfg, model_dir)
    expected = expected_shapes(cfg)
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(infos))
    leftover = sorted(n for n in set(infos) - set(expected) - allowed_extra if not n.endswith(_DERIVED_SUFFIXES))
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {_name_list(missing)}")
    if leftover:
        problems.append(f"unexpected tensor(s) {_name_list(leftover)}")
    if problems:
        hint = " (names lack the 'model.' prefix: a LlamaModel, not a LlamaForCausalLM, checkpoint?)" if any(
            n.startswith(("layers.", "embed_tokens.")) for n in leftover) else ""
        raise CheckpointError(
            f"checkpoint {model_dir} does not match its config.json: {'; '.join(problems)}{hint}. "
            "neuron-infer expects Hugging Face LlamaForCausalLM tensor names; check that config.json belongs to "
            "these weights."
        )
    for name, shape in expected.items():
        if infos[name].shape != shape:
            raise CheckpointError(
                f"tensor {name} in {infos[name].file} has shape {list(infos[name].shape)}, but config.json implies "
                f"{list(shape)}; config.json and the weights are from different models"
            )
    for name, info in infos.items():
        if info.dtype not in SUPPORTED_DTYPES and not name.endswith(_DERIVED_SUFFIXES):
            raise CheckpointError(
                f"tensor {name} in {info.file} is stored as {info.dtype}; neuron-infer reads fp32, bf16 and fp16 "
                "checkpoints (pre-quantized weights are not supported: start from the original checkpoint and use "
                "--quant)"
            )


def load_checkpoint(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None
                    ) -> dict[str, torch.Tensor]:
    """Load and validate the safetensors checkpoint in `model_dir` against `cfg`.

    Returns exactly the tensors of `expected_shapes(cfg)`, in their stored dtype (fp32/bf16/fp16) unless `dtype`
    is given. Headers are checked first (names, shapes, dtypes, truncation), so a bad checkpoint fails before any
    data is read. In a tied checkpoint an `lm_head.weight` equal to the embedding is dropped; a different one
    raises.
    """
    d = Path(model_dir)
    infos = scan_checkpoint(d)
    _check_names(infos, cfg, d)
    wanted = set(expected_shapes(cfg)) | ({"lm_head.weight"} & set(infos))
    out: dict[str, torch.Tensor] = {}
    for path in sorted({infos[n].file for n in wanted}):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in sorted(n for n in wanted if infos[n].file == path):
                    out[name] = f.get_tensor(name)
                    check_finite(path, name, out[name])
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _corrupt(path, str(e)) from None
    _drop_tied_head(out, cfg, d)
    if dtype is not None:
        out = {k: t.to(dtype) for k, t in out.items()}
    return out


def check_finite(path: Path, name: str, t: torch.Tensor) -> None:
    """Refuse a float tensor holding NaN or an infinity (a model built from it emits garbage at every step)."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16) and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{path}: tensor {name} holds {bad} NaN or infinite value(s); the checkpoint is damaged: "
                              "re-download or re-export it")


def _drop_tied_head(sd: dict[str, torch.Tensor], cfg: ModelConfig, model_dir: Path) -> None:
    if not cfg.tie_word_embeddings or "lm_head.weight" not in sd:
        return
    head = sd.pop("lm_head.weight")
    if not torch.equal(head.to(torch.float32), sd["model.embed_tokens.weight"].to(torch.float32)):
        raise CheckpointError(
            f"{model_dir}: config.json says tie_word_embeddings=true, but the checkpoint's lm_head.weight differs "
            "from model.embed_tokens.weight; set \"tie_word_embeddings\": false in config.json if the head is "
            "really separate"
        )


# ---------------------------------------------------------------------------------------------------------------
# fingerprint


_SAMPLE = 64 * 1024


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """A fast sha256 identifying a checkpoint (hex string), for artifact manifests.

    Covers: the bytes of config.json and of the index file (if sharded); for each safetensors file, its name,
    its size, its full header (tensor names, dtypes, shapes, offsets, metadata) and the first and last 64 KiB of
    its data section. It does NOT hash all weight bytes (GBs), so an in-place edit of weight values in the middle
    of a file that keeps its size is not detected; any re-export, re-quantisation, resize or config change is.
    Independent of file timestamps and of the directory's path.
    """
    d = Path(model_dir)
    h = hashlib.sha256(b"neuron-infer checkpoint fingerprint v1\0")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{cfg} not found; a model directory needs its Hugging Face config.json")
    h.update(b"config.json\0" + cfg.read_bytes())
    files, index = safetensors_files(d)
    if index is not None:
        h.update(b"\0" + index.name.encode() + b"\0" + index.read_bytes())
    for path in files:
        n, raw, _ = read_header(path)
        size = path.stat().st_size
        h.update(b"\0" + path.name.encode() + b"\0" + str(size).encode() + b"\0" + raw)
        with path.open("rb") as f:
            f.seek(8 + n)
            h.update(f.read(_SAMPLE))
            f.seek(max(8 + n, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path, fix: str = "re-download the tokenizer files", shown: Path | None = None):
    """The model directory's tokenizer, through `transformers.AutoTokenizer`, from local files only (`fix`: the
    remedy an error names; `shown`: the directory messages and the tokenizer's name_or_path give, when the files
    are read from a private copy of it)."""
    d = Path(model_dir)
    shown = shown or d
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(
            f"no tokenizer in {shown}: expected one of {', '.join(_TOKENIZER_FILES)} (with tokenizer_config.json); "
            "download the tokenizer files of the model repository into the same directory"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        detail = " ".join(f"{type(e).__name__}: {e}".replace(str(d), str(shown)).split())
        raise CheckpointError(f"cannot load the tokenizer in {shown} ({detail}); {fix}") from e
    tok.name_or_path = str(shown)
    return tok


def generation_eos_ids(path: Path, vocab_size: int, fix: str, error: type[NeuronInferError] = CheckpointError,
                       raw: bytes | None = None) -> tuple[int, ...]:
    """The `eos_token_id` of a generation_config.json (absent or null: none; an id, or a list of ids, each in
    0..vocab_size-1); anything else raises `error` naming the file and ending in `fix`. `raw`: the file's bytes,
    already read (and verified) by the caller; the file is then not read again."""
    if raw is None and not path.is_file():
        return ()
    data = read_json(path, fix, error) if raw is None else json_from_bytes(raw, path, fix, error)
    eos = data.get("eos_token_id") if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise error(f"{path} holds {show(data)}, not a JSON object; {fix}")
    ids = [] if eos is None else [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                                            for i in ids):
        raise error(f"{path}: eos_token_id={show(eos)} must be a token id or a list of token ids in "
                    f"0..{vocab_size - 1}; {fix}")
    return tuple(ids)


def check_tokenizer(tokenizer_dir: str | Path, cfg: ModelConfig, shown: Path | None = None) -> None:
    """Compile-time check of the tokenizer files in `tokenizer_dir` (the copies that go into the artifact; `shown`:
    the checkpoint directory they were copied from, which messages name): a tokenizer is there, none of its ids is
    past the embedding's rows, and generation_config.json names valid EOS ids."""
    d = Path(tokenizer_dir)
    shown = Path(shown or d)
    generation = d / "generation_config.json"
    if generation.is_file():  # the bytes of the copy, named as the checkpoint's file
        generation_eos_ids(shown / generation.name, cfg.vocab_size, "fix its eos_token_id or remove the file",
                           raw=generation.read_bytes())
    check_vocab(load_tokenizer(d, shown=shown), cfg.vocab_size, shown, "config.json vocab_size",
                "use the tokenizer files that belong to this model")


def check_vocab(tok, vocab_size: int, shown: Path, field: str, fix: str,
                error: type[NeuronInferError] = CheckpointError) -> None:
    """Refuse a tokenizer with an id (added tokens included) that the model's `vocab_size` has no embedding row for:
    a prompt holding it would index past the embedding."""
    top = max(tok.get_vocab().values(), default=-1) + 1
    if top > vocab_size:
        raise error(f"the tokenizer in {shown} has token ids up to {top - 1}, but {field}={vocab_size}: ids >= "
                    f"{vocab_size} have no embedding row; {fix}")
