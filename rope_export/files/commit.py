"""Where a model's external data goes, and moving a staged model and its data into place so that a reader
finds the old pair or the new one, never a mix.

A model names the file of its weights (each external tensor's ``location``), so a model and its data are
two files that must change together, and no rename changes two files at once. So a write never puts its
data under the name the model it replaces reads:

* the data is ``<name>.data`` beside the model (a file, or a folder of per-tensor files), except when the
  model being replaced reads ``<name>.data``: then it is ``<name>.2.data``, and the write after that one
  goes back to ``<name>.data`` (``data_name``);
* ``onnx_files.write`` stages both files in a folder beside the target (``fileio.staging_dir``); ``commit``
  moves the data in first (under a name no model at the target reads), then the model that names it:
  that one rename switches a reader from the old pair to the new one;
* then the old model's data is removed (``<name>.data`` or ``<name>.2.data``: other files it names are not
  rope-export's and are left); also when the new model keeps its weights inside (``never``).

A process killed anywhere (SIGKILL, a power cut) leaves the old pair or the new one: at worst the other
data file, which no model names, and the staging folder beside them. The next write of the same path
reuses that name and removes the folder (``fileio.remove_abandoned``).

Hard links (one data file under both names, swapped in three renames) would keep ``<name>.data`` always,
but onnx refuses to load external data with more than one link ("a potential hardlink attack"), and a copy
would write the weights twice: hence two names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import onnx

from rope_export.common.fileio import commit_moves, remove_abandoned, signals_deferred

SUFFIXES = (".data", ".2.data")  # the two names of a model's external data, <name>.data and <name>.2.data


class ReplacedMeanwhile(OSError):
    """Another process wrote the same path while this write was staged."""


def tensor_protos(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph``: initializers, and tensor attributes of its nodes and subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.GRAPH:
                yield from tensor_protos(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from tensor_protos(g)


def external_entries(proto: onnx.ModelProto) -> Iterator[tuple[onnx.TensorProto, dict[str, str]]]:
    """(tensor, its external_data as a dict) of every tensor stored outside the model."""
    for tensor in tensor_protos(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor, {e.key: e.value for e in tensor.external_data}


def named_files(path: str | os.PathLike) -> set[str]:
    """The names in the model's folder that the model at ``path`` reads its weights from (the first part of each
    location: a file, or a per-tensor folder); empty when there is no readable model (the proto only is read)."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - no model, or not one: it names nothing
        return set()
    return {PurePosixPath(entry["location"]).parts[0] for _, entry in external_entries(proto)
            if entry.get("location")}


def data_name(path: Path) -> str:
    """The name of the external data of a model written to ``path``: ``<name>.data``, or ``<name>.2.data`` when the
    model now at ``path`` reads ``<name>.data``."""
    first, second = (path.name + suffix for suffix in SUFFIXES)
    return second if first in named_files(path) else first


def commit(stage: Path, path: Path, data: Path | None) -> None:
    """Move ``stage/<path.name>`` onto ``path`` and, with ``data`` (the external data's path, from ``data_name``),
    ``stage/<data.name>`` onto ``data``: data first, the model last (SIGINT/SIGTERM wait until both are moved);
    then remove the replaced model's data, and what earlier writes of ``path`` left when they were killed."""
    old = named_files(path)
    if data is not None and data.name in old:  # data_name chose another name; a process wrote the path since
        raise ReplacedMeanwhile(f"cannot write {path}: another process replaced it while this write was under way; "
                                "write it again (one process at a time per output path)")
    ours = {path.name + suffix for suffix in SUFFIXES}
    stale = [path.parent / name for name in sorted(old & ours) if data is None or name != data.name]
    trash = stage / ".replaced"
    moves = [] if data is None else [(stage / data.name, data)]
    with signals_deferred():
        commit_moves([*moves, (stage / path.name, path)], trash)  # one rename switches to the new pair
        for old_data in stale:  # no model names it now
            if old_data.exists():
                trash.mkdir(exist_ok=True)
                os.replace(old_data, trash / old_data.name)
    remove_abandoned(path)
