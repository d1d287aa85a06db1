"""ONNX files of any size: lazy loading, atomic writes of a model and its external weights, checks.

Real models have weights far past protobuf's 2 GB limit, so:

* ``load(path)`` returns an ``onnx_ir.Model`` whose external weights stay on disk
  (``ExternalTensor``: nothing is read until a tensor's bytes are asked for); errors name the file.
* ``write(model, path, external=...)`` writes the model and its weights atomically. The weights
  go to ``<name>.data`` beside the model (``<name>.2.data`` when the model it replaces reads
  ``<name>.data``, see ``rope_export.files.commit``), one file (``single``) or a folder with one file per
  tensor (``per-tensor``); ``auto`` (the default) keeps them inside the ``.onnx`` up to
  ``AUTO_INLINE_MAX`` (32 MB: tiny and test models stay one file) and writes ``single`` above it;
  ``never`` keeps them inside up to protobuf's limit (``EXTERNAL_DATA_THRESHOLD``) and refuses a
  model too big for one file. Why not in-file up to 2 GB: protobuf serializes a whole ModelProto
  in memory (the weights copied into it, then into the bytes written), and every reader parses it
  whole again; a 135M-parameter model's 538 MB took 9.6 s and 4.2 GB of peak RSS to write inside
  the ``.onnx`` against 1.1 s and 0.75 GB beside it, and onnx.checker's full check on the file 2.9
  s against 0.0 s (2026-11-28, load 9 on 2 cores). onnxruntime-genai's model builder and mobius
  always write ``model.onnx.data``. Tensors are streamed one at a time from wherever they live (torch, an input
  file) in large sequential writes past the page cache (``rope_export.files.tensor_stream``,
  ``rope_export.files.direct``), so writing never holds a second copy of the weights. Everything is
  written into a
  staging folder beside the target, checked there (``check=True``: onnx.checker on the path),
  then moved into place so that a reader finds the old model and data or the new ones, never a mix,
  whenever the process stops, SIGKILL included (``rope_export.files.commit``); an error or interrupt
  removes the staging folder and leaves existing files as they were.
* ``check(path)``: onnx.checker's full check on the file (external data stays on disk).

Tensors up to ``INLINE_LIMIT`` bytes always stay inside the ``.onnx``: onnx_ir's shape inference
serializes those (it leaves larger ones out), so a pass over a loaded model never opens the data.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from rope_export.common.bounds import format_bytes
from rope_export.common.fileio import check_writable, staging_dir
from rope_export.common.steps import detail, file_sizes
from rope_export.files import EXTERNAL_DATA
from rope_export.files.commit import SUFFIXES, commit, data_name, external_entries, named_files
from rope_export.files.direct import open_stream
from rope_export.files.tensor_stream import SequentialWriter

EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26  # protobuf's 2 GB limit, with room for the graph itself
AUTO_INLINE_MAX = 32 * 2**20  # bytes of weights ``auto`` keeps inside the .onnx (see the module doc)
INLINE_LIMIT = 1024  # bytes; onnx's own default threshold, above onnx_ir's 1000-byte shape-inference cut


class OnnxFileError(ValueError):
    """A file that cannot be read or written as asked; the message names the file and the fix."""


def output_files(path: str | os.PathLike) -> list[tuple[Path, int]]:
    """The model file and the external data it reads (files or folders beside it), with their sizes."""
    return file_sizes([Path(path), *data_files(path)])


def data_path(path: str | os.PathLike) -> Path:
    """The usual name of the external weights of ``path``: ``<name>.data`` beside it (a file or a folder); a write
    that replaces a model reading that name uses ``<name>.2.data`` (``rope_export.files.commit``)."""
    path = Path(path)
    return path.with_name(path.name + SUFFIXES[0])


def data_files(path: str | os.PathLike) -> list[Path]:
    """The files and folders beside ``path`` that the model there reads its weights from (its proto is read)."""
    path = Path(path)
    return [path.parent / name for name in sorted(named_files(path))]


def remove(path: str | os.PathLike) -> None:
    """Remove the model at ``path`` and the external data it reads."""
    for data in data_files(path):
        shutil.rmtree(data, ignore_errors=True) if data.is_dir() else data.unlink(missing_ok=True)
    Path(path).unlink(missing_ok=True)


def _initializers(model: ir.Model) -> Iterator[ir.Value]:
    for graph in model.graphs():
        yield from graph.initializers.values()


def weight_bytes(model: ir.Model) -> int:
    """Bytes of all initializer data (read from the tensors' headers, never from their data)."""
    return sum(v.const_value.nbytes for v in _initializers(model) if v.const_value is not None)


# -- load ------------------------------------------------------------------------------------

def load(path: str | os.PathLike) -> ir.Model:
    """The model at ``path``, weights left on disk (lazy ``ExternalTensor``s); OnnxFileError if unusable."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    if path.is_dir():
        raise OnnxFileError(f"{path} is a folder; give the .onnx file in it")
    if path.stat().st_size == 0:
        raise OnnxFileError(f"{path} is empty (0 bytes), not an ONNX model; export or copy it again")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OnnxFileError(f"{path}: not a readable ONNX file ({first}); check that it is a .onnx model") from None
    if proto.ir_version <= 0 or not proto.HasField("graph") or not (proto.graph.node or proto.graph.output):
        raise OnnxFileError(f"{path}: not an ONNX model (no IR version or no graph); check that it is a .onnx model")
    _check_external_data(proto, path)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:  # noqa: BLE001 - a malformed graph
        raise OnnxFileError(f"{path}: the ONNX graph is malformed ({exc}); re-export the model") from None
    ir.external_data.set_base_dir(model.graph, str(path.parent))
    return model


def _check_external_data(proto: onnx.ModelProto, path: Path) -> None:
    """Every external location exists inside the model's folder and is long enough (sizes only)."""
    sizes: dict[str, int] = {}
    for tensor, entry in external_entries(proto):
        name = tensor.name
        location = entry.get("location", "")
        target = (path.parent / location).resolve()
        if not location or os.path.isabs(location) or path.parent.resolve() not in (target, *target.parents):
            raise OnnxFileError(f"{path}: tensor {name!r} names external data {location!r} outside the model's folder; "
                                "re-save the model with relative data locations")
        if location not in sizes:
            if not target.is_file():
                raise OnnxFileError(f"{path} keeps its weights in {location}, which is missing beside it; copy "
                                    f"{location} into {path.parent}")
            sizes[location] = target.stat().st_size
        end = int(entry.get("offset") or 0) + int(entry.get("length") or 0)
        if end > sizes[location]:
            raise OnnxFileError(f"{path}: {location} is {sizes[location]:,} bytes but tensor {name!r} ends at byte "
                                f"{end:,}; the data file is truncated or belongs to another model")


def load_to_memory(model: ir.Model) -> ir.Model:
    """Read every external tensor of ``model`` into memory (small models only); returns the model."""
    for value in _initializers(model):
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = _in_memory(value.const_value)
    return model


# -- write -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Written:
    path: Path
    external: str  # "never" (all inside the .onnx), "single" or "per-tensor"
    files: list[tuple[Path, int]]  # every file written, with its size in bytes
    weights: int  # bytes of initializer data


def resolve_external(external: str, weights: int) -> str:
    if external not in EXTERNAL_DATA:
        raise OnnxFileError(f"external data {external!r}: choose one of {', '.join(EXTERNAL_DATA)}")
    too_big = weights >= EXTERNAL_DATA_THRESHOLD
    if external == "never" and too_big:
        raise OnnxFileError(f"the model has {format_bytes(weights)} of weights, past protobuf's 2 GB limit for "
                            "one file; "
                            "write them beside it (external data auto, single or per-tensor)")
    if external == "auto":
        return "single" if too_big or weights > AUTO_INLINE_MAX else "never"
    return external


def write(model: ir.Model | onnx.ModelProto, path: str | os.PathLike, *, external: str = "auto", check: bool = False,
          progress: Callable[[str], None] | None = None) -> Written:
    """Write ``model`` to ``path`` (weights per ``external``, see the module doc), atomically.

    ``check``: run onnx.checker's full check on the staged file and raise (writing nothing) if
    it fails. ``progress``: a callable of one string; a ``StepLog`` also gets per-tensor details.
    The model is left as it was.
    """
    proto = model if isinstance(model, onnx.ModelProto) else None
    if proto is not None:
        model = ir.from_proto(proto)
    path = Path(path)
    check_writable(path)
    weights = weight_bytes(model)
    mode = resolve_external(external, weights)
    data = None if mode == "never" else path.with_name(data_name(path))  # the name the model there does not read
    say = progress or (lambda message: None)
    with staging_dir(path) as stage:
        _check_free_space(stage, weights, path)
        if mode == "never":
            say(f"writing {path} ({format_bytes(weights)} of weights inside it)")
            if proto is not None and not _has_external(proto):
                onnx.save_model(proto, str(stage / path.name))  # as given, byte for byte
            else:
                _write_inline(model, stage / path.name)
        else:
            where = data.name + ("/" if mode == "per-tensor" else "")
            say(f"writing {path} and its weights ({format_bytes(weights)}) to {where}")
            _write_external(model, stage, path.name, data.name, mode, progress)
        if check:
            say(f"checking {path.name} (onnx.checker, full check, on the file)")
            check_file(stage / path.name)
        commit(stage, path, data)  # a reader finds the old pair or the new one
    written = [path] + ([data] if data is not None else [])
    return Written(path, mode, file_sizes(written), weights)


def _has_external(proto: onnx.ModelProto) -> bool:
    return any(True for _ in external_entries(proto))


def _check_free_space(folder: Path, weights: int, path: Path) -> None:
    free = shutil.disk_usage(folder).free
    if weights > free:
        raise OnnxFileError(f"cannot write {path}: its weights need {format_bytes(weights)} and {folder.parent} "
                            f"has {format_bytes(free)} "
                            "free; free some space or write elsewhere")


class _SwappedTensors:
    """Temporarily give initializers other tensors (e.g. their external copies); restores on exit."""

    def __init__(self, swaps: dict[ir.Value, ir.TensorProtocol]):
        self.swaps = swaps
        self.saved = {value: value.const_value for value in swaps}

    def __enter__(self):
        for value, tensor in self.swaps.items():
            value.const_value = tensor
        return self

    def __exit__(self, *exc):
        for value, tensor in self.saved.items():
            value.const_value = tensor


def _in_memory(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    if isinstance(tensor, ir.ExternalTensor):
        return ir.Tensor(tensor.numpy().copy(), dtype=tensor.dtype, name=tensor.name)
    return tensor


def _write_inline(model: ir.Model, target: Path) -> None:
    """One .onnx with every tensor inside it (tensors read from an input's data file are loaded)."""
    swaps = {v: _in_memory(v.const_value) for v in _initializers(model) if isinstance(v.const_value, ir.ExternalTensor)}
    with _SwappedTensors(swaps):
        proto = ir.to_proto(model)
    onnx.save_model(proto, str(target))


def _write_external(model: ir.Model, stage: Path, model_name: str, data_name: str, mode: str,
                    progress: Callable[[str], None] | None) -> None:
    values = [v for v in _initializers(model) if v.const_value is not None]
    big = [v for v in values if v.const_value.nbytes > INLINE_LIMIT]
    small = {v: _in_memory(v.const_value) for v in values if v.const_value.nbytes <= INLINE_LIMIT
             and isinstance(v.const_value, ir.ExternalTensor)}
    total, done = sum(v.const_value.nbytes for v in big), 0
    external: dict[ir.Value, ir.TensorProtocol] = {}
    if mode == "single":
        offset = 0
        with open_stream(stage / data_name) as f, SequentialWriter(f) as writer:
            for i, value in enumerate(big, 1):
                tensor = value.const_value
                writer.write(tensor)
                external[value] = ir.ExternalTensor(data_name, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                    name=value.name, base_dir=str(stage))
                offset += tensor.nbytes
                done += tensor.nbytes
                detail(progress, f"writing weights: tensor {i} of {len(big)}, {format_bytes(done)} of "
                                 f"{format_bytes(total)}")
        size = (stage / data_name).stat().st_size
        if size != offset:
            raise OnnxFileError(f"writing {data_name}: wrote {size:,} bytes where {offset:,} were expected")
    else:
        folder = stage / data_name
        folder.mkdir()
        names: set[str] = set()
        for i, value in enumerate(big, 1):
            tensor = value.const_value
            file_name = _tensor_file_name(value.name or f"tensor_{i}", names)
            with open_stream(folder / file_name) as f, SequentialWriter(f) as writer:
                writer.write(tensor)
            external[value] = ir.ExternalTensor(f"{data_name}/{file_name}", 0, tensor.nbytes, tensor.dtype,
                                                shape=tensor.shape, name=value.name, base_dir=str(stage))
            done += tensor.nbytes
            detail(progress, f"writing weights: tensor {i} of {len(big)}, {format_bytes(done)} of "
                             f"{format_bytes(total)}")
    with _SwappedTensors({**small, **external}):
        proto = ir.to_proto(model)
    onnx.save_model(proto, str(stage / model_name))


def _tensor_file_name(name: str, taken: set[str]) -> str:
    """A portable, unique file name for a tensor (names like 'model.layers.0.q_proj.weight' or 'val_12')."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:180] or "tensor"
    candidate, n = base, 1
    while candidate.lower() in taken:  # case-insensitive file systems
        n += 1
        candidate = f"{base}.{n}"
    taken.add(candidate.lower())
    return candidate


# -- check -----------------------------------------------------------------------------------

def check_file(path: str | os.PathLike) -> None:
    """onnx.checker's full check (with shape inference) on the file; external data stays on disk."""
    onnx.checker.check_model(str(path), full_check=True)
