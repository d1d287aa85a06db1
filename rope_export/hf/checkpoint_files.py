"""A transformers checkpoint folder read tensor by tensor: what ``save_pretrained`` wrote (safetensors or
PyTorch .bin, sharded or not), its headers (names, dtypes, shapes, byte ranges: no data), the match of its
names with a model's, and reads of single tensors into memory.

``CheckpointReader`` is the public per-tensor reader (the layer-streamed reference of ``check`` reads one
decoder layer at a time with it); ``rope_export.hf.checkpoints`` builds whole models from the same plans.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rope_export.common.fileio import read_range

CHUNK_BYTES = 64 * 2**20  # conversion buffer for a tensor stored in another dtype
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"
# what save_pretrained writes, in transformers' order of preference (safetensors first)
CHECKPOINT_FILES = (INDEX_FILE, SINGLE_FILE, BIN_INDEX_FILE, BIN_FILE)
# weights in a form rope-export does not read (a folder holding only these is not "config only")
OTHER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    length: int
    file_size: int = -1  # of a .safetensors file: its data must lie inside (checked before reading, after the fit)


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of one .safetensors file: name -> dtype, shape and byte range (nothing else is read)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"header of {size:,} bytes")
            header = json.loads(f.read(size))
        file_size = path.stat().st_size
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); re-save it with save_pretrained") \
            from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which rope-export cannot "
                                  f"read; supported: {', '.join(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        entries[name] = Entry(path, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin,
                               end - begin, file_size)
    return entries


def check_extents(plan: dict[str, Entry]) -> None:
    """Refuse a .safetensors tensor whose bytes are not all in its file (truncated or corrupt), before reading any."""
    for name, entry in plan.items():
        if entry.file_size < 0:
            continue
        expected = entry.dtype.itemsize * _numel(entry.shape)
        if entry.length != expected or entry.start + entry.length > entry.file_size:
            raise CheckpointError(f"{entry.file}: tensor {name!r} claims {entry.length:,} bytes at {entry.start:,} but "
                                  f"needs {expected:,} in a {entry.file_size:,}-byte file; the file is truncated or "
                                  "corrupt")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint save_pretrained wrote in ``folder`` (every shard its index lists); [] if it holds none."""
    folder = Path(folder)
    for name in CHECKPOINT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".json"):
            return [path]
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path}: not a checkpoint index ({exc}); re-save with save_pretrained") from None
        for shard in files:
            if not (folder / shard).is_file():
                raise CheckpointError(f"{path} lists {shard}, which is missing from {folder}")
        return [folder / shard for shard in files]
    return []


def other_weight_files(folder: str | os.PathLike) -> list[str]:
    """Files of ``folder`` that look like weights in a form rope-export does not read (shards without their
    index, consolidated.00.pth, model.gguf, ...)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(OTHER_WEIGHT_SUFFIXES))


def checkpoint_plan(folder: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint folder (safetensors or PyTorch .bin, sharded or not), by name."""
    if not folder.is_dir():
        raise CheckpointError(f"--weights {folder}: not a folder (give the folder save_pretrained wrote)")
    files = checkpoint_files(folder)
    if not files:
        found = sorted(p.name for p in folder.iterdir())[:8]
        raise CheckpointError(f"{folder} has none of {', '.join(CHECKPOINT_FILES)} (found: "
                              f"{', '.join(found) or 'nothing'}); save the model with save_pretrained")
    plan: dict[str, Entry] = {}
    for path in files:
        plan.update(read_header(path) if path.suffix == ".safetensors" else read_bin_header(path))
    return plan


def first_line(exc: BaseException) -> str:
    """An exception's first line (torch's and zipfile's errors run to pages)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint's tensors, memory-mapped (nothing is read until a tensor is used)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - zip, pickle and mmap errors all mean the file is not one we can map
        raise CheckpointError(f"{path}: not a PyTorch checkpoint rope-export can read ({first_line(exc)}); "
                              "re-save it with save_pretrained") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors; re-save it with save_pretrained")
    return state


def read_bin_header(path: Path) -> dict[str, Entry]:
    """The tensors of one PyTorch .bin file (memory-mapped to list them; the data is read when loading)."""
    return {name: Entry(path, t.dtype, tuple(t.shape), -1, t.nbytes) for name, t in open_bin(path).items()}


def state_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones under each name) and persistent buffers, by state-dict name."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                targets[f"{module_name}.{name}" if module_name else name] = buffer
    return targets


def without_ignored(model: nn.Module, plan: dict[str, Entry]) -> dict[str, Entry]:
    """The plan without the tensors transformers drops on loading: non-persistent buffers that old checkpoints
    stored (the rotary ``inv_freq``) and names matching the class's ``_keys_to_ignore_on_load_unexpected``."""
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    volatile = {f"{m}.{b}" if m else b for m, module in model.named_modules(remove_duplicate=False)
                for b in module._non_persistent_buffers_set}
    return {name: entry for name, entry in plan.items()
            if name not in volatile and not any(p.search(name) for p in patterns)}


def mismatch(model: nn.Module, plan: dict[str, Entry]) -> str:
    """Why the checkpoint cannot be read name by name into this model ("" if it can)."""
    targets = state_targets(model)
    unknown = sorted(set(plan) - set(targets))
    if unknown:
        return f"{len(unknown)} checkpoint tensor(s) the model does not have by that name, e.g. {unknown[0]!r}"
    for name, entry in plan.items():
        if tuple(targets[name].shape) != entry.shape:
            return f"{name!r} is {list(entry.shape)} in the checkpoint, {list(targets[name].shape)} in the model"
    loaded = {id(targets[name]) for name in plan}
    missing = sorted(name for name, t in model.named_parameters(remove_duplicate=False) if id(t) not in loaded)
    if missing:
        return f"{len(missing)} parameter(s) missing from the checkpoint, e.g. {missing[0]!r}"
    return ""


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory."""
    if not tensor.is_contiguous():
        raise CheckpointError("internal: a parameter is not contiguous")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def read_into(f, offset: int, view: memoryview, path: Path) -> None:
    done = read_range(f.fileno(), offset, view)
    if done < len(view):
        raise CheckpointError(f"{path} ended early (read {done:,} of {len(view):,} bytes of a tensor); "
                              "the file is truncated")


def read_converted(f, entry: Entry, target: torch.Tensor, buffer: bytearray, path: Path) -> bytearray:
    """Read ``entry`` in chunks and convert each into ``target``'s dtype; returns the (reused) buffer."""
    item = entry.dtype.itemsize
    per_chunk = max(1, CHUNK_BYTES // item)
    if len(buffer) < min(entry.length, per_chunk * item):
        buffer = bytearray(min(entry.length, per_chunk * item))
    flat = target.detach().reshape(-1)
    numel = _numel(entry.shape)
    for first in range(0, numel, per_chunk):
        count = min(per_chunk, numel - first)
        view = memoryview(buffer)[: count * item]
        read_into(f, entry.start + first * item, view, path)
        flat[first:first + count].copy_(torch.frombuffer(view, dtype=entry.dtype, count=count))
    return buffer


class CheckpointReader:
    """The tensors of a safetensors checkpoint whose names match ``model``'s one to one, read by name into
    new tensors in their stored dtype (a renamed, fused or .bin checkpoint is refused: CheckpointError)."""

    def __init__(self, folder: str | os.PathLike, model: nn.Module):
        plan = without_ignored(model, checkpoint_plan(Path(folder)))
        why = mismatch(model, plan)
        if why:
            raise CheckpointError(f"the checkpoint in {folder} does not name the model's tensors one to one ({why})")
        if any(entry.start < 0 for entry in plan.values()):
            raise CheckpointError(f"{folder} holds PyTorch .bin weights; reading tensor by tensor needs safetensors")
        check_extents(plan)
        self.plan = plan

    @property
    def names(self) -> list[str]:
        return list(self.plan)

    def read(self, names) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            entry = self.plan[name]
            tensor = torch.empty(tuple(entry.shape), dtype=entry.dtype)
            with open(entry.file, "rb", buffering=0) as f:
                read_into(f, entry.start, bytes_of(tensor), Path(entry.file))
            out[name] = tensor
        return out
