"""The optimization profile of ``rope-export build``: min/opt/max of every dynamic input dimension.

Without ``--shape`` the profile comes from the file itself: its dynamic dims are named (``batch``,
``seq``, ``past`` by rope-export's exports), and how far a sequence can go is the rotary caches'
length (the rows of the ``[max_pos, rd/2]`` caches the rotary nodes read), else the
``rope_export.cache_len`` metadata, else the model's ``max_position_embeddings`` in the metadata.
Defaults: batch 1..``max_batch`` (opt 1), seq 1..L (opt min(L, 256)), past 0..L-1 (opt min(L-1, 256)).

A partial ``--shape`` binds the named dims of the inputs it gives; every other input then gets the
same ranges for the same names (position_ids follows hidden_states' batch and seq), and the rest
take the defaults. Shapes that contradict each other or the file (a static dim, a rank, two ranges
for one name, min > opt > max) are refused with the reason. Pure ONNX: testable without TensorRT.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from rope_export.common.errors import CLIError

ShapeSpec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # min, opt, max
Range = tuple[int, int, int]

OPT_SEQ = 256  # the optimization point of sequence and past lengths, when the cache allows it
METADATA_PREFIX = "rope_export."


class ProfileError(CLIError):
    """A --shape that contradicts the file or another --shape, or a dim with no default."""


@dataclass(frozen=True)
class InputDims:
    name: str
    dims: tuple[int | str | None, ...]  # int: static, str: named dynamic, None: unnamed dynamic


def graph_inputs(model: onnx.ModelProto) -> list[InputDims]:
    """The runtime inputs (not initializers) with their dims."""
    initializers = {i.name for i in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = []
        for d in value.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
        out.append(InputDims(value.name, tuple(dims)))
    return out


def _rotary_cache_rows(model: onnx.ModelProto) -> int | None:
    """Rows of the position-indexed caches the rotary nodes read (the longest, if they differ)."""
    from rope_export.op.nodes import carries_contract

    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    rows = [shapes[n.input[1]][0] for n in model.graph.node
            if carries_contract(n) and len(n.input) > 3 and n.input[3] and len(shapes.get(n.input[1], ())) == 2]
    return max(rows) if rows else None


def max_sequence(model: onnx.ModelProto) -> tuple[int | None, str]:
    """How long a sequence the file serves, and where that came from."""
    rows = _rotary_cache_rows(model)
    if rows:
        return rows, f"the rotary caches' {rows} rows"
    props = {p.key.removeprefix(METADATA_PREFIX): p.value for p in model.metadata_props
             if p.key.startswith(METADATA_PREFIX)}
    if props.get("cache_len", "").isdigit():
        return int(props["cache_len"]), "rope_export.cache_len"
    for key in ("preset", "rope", "hf_config"):
        try:
            value = json.loads(props.get(key, "")).get("max_position_embeddings")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, int) and value > 0:
            return value, f"max_position_embeddings in rope_export.{key}"
    return None, "the file has no rotary cache with positions and no rope_export metadata giving a length"


def _check_range(label: str, r: Range) -> None:
    if not r[0] <= r[1] <= r[2]:
        raise ProfileError(f"--shape {label}: needs MIN <= OPT <= MAX, got {r[0]}, {r[1]}, {r[2]}")


def derive_profile(
    model: onnx.ModelProto, given: Mapping[str, ShapeSpec] | None = None, *, max_batch: int = 1
) -> tuple[dict[str, ShapeSpec], list[str]]:
    """(min/opt/max of every runtime input, notes saying where each named dim's range came from)."""
    given = dict(given or {})
    inputs = {i.name: i for i in graph_inputs(model)}
    unknown = sorted(set(given) - set(inputs))
    if unknown:
        raise ProfileError(f"--shape names {', '.join(unknown)}, not inputs of the file (inputs: {', '.join(inputs)})")
    bound: dict[str, tuple[Range, str]] = {}
    for name, spec in given.items():
        dims = inputs[name].dims
        if len(spec[0]) != len(dims):
            raise ProfileError(f"--shape {name}: rank {len(spec[0])}, but the file's {name} has rank {len(dims)}")
        for axis, dim in enumerate(dims):
            r = (spec[0][axis], spec[1][axis], spec[2][axis])
            label = f"{name} dim {axis}" + (f" ({dim})" if isinstance(dim, str) else "")
            _check_range(label, r)
            if isinstance(dim, int) and r != (dim, dim, dim):
                raise ProfileError(f"--shape {label}: the file fixes it to {dim}, got {r[0]}:{r[1]}:{r[2]}")
            if isinstance(dim, str):
                if dim in bound and bound[dim][0] != r:
                    prev, source = bound[dim]
                    raise ProfileError(
                        f"--shape {label} is {r[0]}:{r[1]}:{r[2]} but {source} gives '{dim}' "
                        f"{prev[0]}:{prev[1]}:{prev[2]}; one name is one range")
                bound.setdefault(dim, (r, f"--shape {name}"))
    notes = [f"{dim}: {r[0]}..{r[2]} (opt {r[1]}) from {source}" for dim, (r, source) in bound.items()]
    length, length_source = None, ""
    profile: dict[str, ShapeSpec] = {}
    for name, inp in inputs.items():
        if name in given:
            profile[name] = given[name]
            continue
        lo, opt, hi = [], [], []
        for axis, dim in enumerate(inp.dims):
            if isinstance(dim, int):
                r = (dim, dim, dim)
            elif dim in bound:
                r = bound[dim][0]
            else:
                if dim not in ("batch", "seq", "past"):
                    what = f"'{dim}'" if dim else "an unnamed dynamic dim"
                    raise ProfileError(
                        f"{name} dim {axis} is {what}, which has no default range; pass "
                        f"--shape {name}:MIN:OPT:MAX (dims joined by x)")
                if dim == "batch":
                    r, source = (1, 1, max_batch), f"--max-batch {max_batch}"
                else:
                    if length is None:
                        length, length_source = max_sequence(model)
                    if length is None:
                        raise ProfileError(
                            f"{name} dim {axis} ('{dim}') has no known maximum: {length_source}; pass "
                            f"--shape {name}:MIN:OPT:MAX")
                    r = (1, min(length, OPT_SEQ), length) if dim == "seq" else (
                        0, min(length - 1, OPT_SEQ), length - 1)
                    source = length_source
                bound[dim] = (r, source)
                notes.append(f"{dim}: {r[0]}..{r[2]} (opt {r[1]}) from {source}")
            lo.append(r[0])
            opt.append(r[1])
            hi.append(r[2])
        profile[name] = (tuple(lo), tuple(opt), tuple(hi))
    return profile, notes
