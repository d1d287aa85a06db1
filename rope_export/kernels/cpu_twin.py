"""Python binding (ctypes) of the CPU twin library built from ``plugins/``.

The twin runs the CUDA kernels' own code on the CPU (docs/tensorrt.md, "The kernels and their CPU twin"),
and exports the TensorRT-free half of the plugin: shape rules, dtype/format rules, plugin-field
parsing and serialization. This module calls them with torch tensors so pytest can hold them
against ``rope_export.op.reference`` and ``rope_export.op.contract``.

The library is looked up in ``$ROPE_EXPORT_PLUGIN_DIR`` if set, else in ``build/plugins`` of the
source tree (``kernels.libraries``); build it with ``make plugin`` or ``rope-export build-plugin``.
"""

from __future__ import annotations

import ctypes
import functools
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rope_export.kernels.libraries import TWIN_LIBRARY, PluginNotBuiltError, library_path
from rope_export.op.contract import RotaryAttrs, RotaryContractError, RotaryShape

if TYPE_CHECKING:  # torch is imported by the functions that take tensors: build-plugin and build run without it
    import torch

C_API_VERSION = 3
MAX_RANK = 8

# nvinfer1::PluginFieldType codes (the twin's RopeField uses the same numbers).
FIELD_TYPES = {
    "FLOAT16": 0, "FLOAT32": 1, "FLOAT64": 2, "INT8": 3, "INT16": 4, "INT32": 5, "CHAR": 6,
    "DIMS": 7, "UNKNOWN": 8, "BF16": 9, "INT64": 10, "FP8": 11, "INT4": 12, "FP4": 13,
}  # fmt: skip
BUILD, RUNTIME = 0, 1  # nvinfer1::TensorRTPhase


class PluginFieldError(ValueError):
    """A plugin field the TensorRT plugin would reject; the message is the plugin's own."""


# --- C ABI mirror (plugins/twin/rope_c_api.h) ------------------------------------------------------

_I64x8 = ctypes.c_int64 * MAX_RANK


class _Geometry(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64), ("seq", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("rotary_dim", ctypes.c_int64), ("max_pos", ctypes.c_int64),
        ("layout_bhsd", ctypes.c_int32),
    ]  # fmt: skip


class _Field(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("type", ctypes.c_int32), ("length", ctypes.c_int32),
    ]  # fmt: skip


class _TwinArgs(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("cos_cache", ctypes.c_void_p), ("sin_cache", ctypes.c_void_p),
        ("position_ids", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("x_dtype", ctypes.c_char_p), ("cos_dtype", ctypes.c_char_p), ("sin_dtype", ctypes.c_char_p),
        ("position_ids_dtype", ctypes.c_char_p),
        ("x_shape", _I64x8), ("cos_shape", _I64x8), ("sin_shape", _I64x8), ("position_ids_shape", _I64x8),
        ("x_rank", ctypes.c_int32), ("cos_rank", ctypes.c_int32), ("sin_rank", ctypes.c_int32),
        ("position_ids_rank", ctypes.c_int32),
        ("interleaved", ctypes.c_int64), ("num_heads", ctypes.c_int64), ("rotary_embedding_dim", ctypes.c_int64),
        ("force_scalar", ctypes.c_int32),
        ("block_begin", ctypes.c_int64), ("block_end", ctypes.c_int64),
        ("x_bytes", ctypes.c_int64), ("cos_bytes", ctypes.c_int64), ("sin_bytes", ctypes.c_int64),
        ("position_ids_bytes", ctypes.c_int64), ("out_bytes", ctypes.c_int64),
    ]  # fmt: skip


class _TwinPlan(ctypes.Structure):
    _fields_ = [
        ("vectorized", ctypes.c_int32), ("pairs_per_unit", ctypes.c_int32), ("tail_elems", ctypes.c_int32),
        ("rot_units", ctypes.c_int32), ("units", ctypes.c_int32),
        ("block_x", ctypes.c_int32), ("block_y", ctypes.c_int32), ("grid_y", ctypes.c_int32),
        ("grid_x", ctypes.c_int64), ("tokens", ctypes.c_int64),
    ]  # fmt: skip


@dataclass(frozen=True)
class TwinPlan:
    """The launch the twin walked (and the GPU would launch): vector or scalar path, grid, block."""

    vectorized: bool
    pairs_per_unit: int
    tail_elems: int
    rot_units: int
    units: int
    block: tuple[int, int]
    grid: tuple[int, int]
    tokens: int


_ERR_LEN = 1024
_p = ctypes.POINTER


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    sigs = {
        "rope_c_api_version": ([], ctypes.c_int32),
        "rope_plugin_name": ([], ctypes.c_char_p),
        "rope_plugin_version": ([], ctypes.c_char_p),
        "rope_plugin_namespace": ([], ctypes.c_char_p),
        "rope_resolve_shape": (
            [_p(ctypes.c_int64), ctypes.c_int32] * 4
            + [ctypes.c_int64] * 3
            + [_p(_Geometry), ctypes.c_char_p, ctypes.c_int64],
            ctypes.c_int32,
        ),
        "rope_check_ranks": (
            [ctypes.c_int32] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_char_p, ctypes.c_int64],
            ctypes.c_int32,
        ),
        "rope_check_dtypes": ([ctypes.c_char_p] * 4 + [ctypes.c_int64], ctypes.c_int32),
        "rope_parse_fields": (
            [_p(_Field), ctypes.c_int32, ctypes.c_int32, _p(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int64],
            ctypes.c_int32,
        ),
        "rope_serialize_fields": (
            [ctypes.c_int64] * 3 + [_p(_Field), _p(ctypes.c_int32), ctypes.c_char_p, ctypes.c_int64],
            ctypes.c_int32,
        ),
        "rope_metadata_string": ([ctypes.c_int64] * 3 + [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int32),
        "rope_supports_combination": (
            [ctypes.c_int32, _p(ctypes.c_char_p), _p(ctypes.c_int32), ctypes.c_int32, ctypes.c_int32],
            ctypes.c_int32,
        ),
        "rope_output_dtype": (
            [
                _p(ctypes.c_char_p),
                ctypes.c_int32,
                ctypes.c_int32,
                ctypes.c_char_p,
                ctypes.c_int64,
                ctypes.c_char_p,
                ctypes.c_int64,
            ],
            ctypes.c_int32,
        ),  # fmt: skip
        "rope_twin_run": ([_p(_TwinArgs), _p(_TwinPlan), ctypes.c_char_p, ctypes.c_int64], ctypes.c_int32),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    version = lib.rope_c_api_version()
    if version != C_API_VERSION:
        raise PluginNotBuiltError(
            f"{path} has C API version {version}, this package expects {C_API_VERSION}; "
            "rebuild it with `make plugin` or `rope-export build-plugin`"
        )
    return lib


def twin() -> ctypes.CDLL:
    """The loaded twin library (PluginNotBuiltError if it is not built)."""
    return _load(str(library_path(TWIN_LIBRARY)))


def plugin_identity() -> tuple[str, str, str]:
    """(name, version, namespace) the C++ plugin registers under."""
    lib = twin()
    return tuple(f().decode() for f in (lib.rope_plugin_name, lib.rope_plugin_version, lib.rope_plugin_namespace))


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _c_int(value, what: str, bits: int = 64) -> int:
    """``value`` as a Python int that fits a C int of ``bits`` bits.

    ctypes wraps an int that does not fit (2**64 + 1 becomes 1) and takes True for 1; both would
    reach the C rules as some other, valid-looking value, so they are refused here.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RotaryContractError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    low, high = (_INT64_MIN, _INT64_MAX) if bits == 64 else (_INT32_MIN, _INT32_MAX)
    if not low <= value <= high:
        raise RotaryContractError(f"{what} = {value} does not fit a {bits}-bit integer ([{low}, {high}])")
    return value


def _dims(shape) -> tuple[ctypes.Array, int]:
    shape = [_c_int(d, "a dimension") for d in shape]
    if len(shape) > MAX_RANK:
        raise RotaryContractError(f"tensor rank {len(shape)} is outside [0, {MAX_RANK}]")
    return (ctypes.c_int64 * MAX_RANK)(*shape), len(shape)


def _attr_ints(interleaved, num_heads, rotary_embedding_dim) -> tuple[int, int, int]:
    """The three attributes as C int64s; ``interleaved`` may be a bool."""
    flag = int(interleaved) if isinstance(interleaved, bool) else _c_int(interleaved, "interleaved")
    return flag, _c_int(num_heads, "num_heads"), _c_int(rotary_embedding_dim, "rotary_embedding_dim")


def _enc(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def resolve_shape(x_shape, cos_shape, sin_shape, position_ids_shape, attrs: RotaryAttrs) -> RotaryShape:
    """The C++ shape rules (plugins/core), with rope_export.op.contract.resolve_shape's signature."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    geo = _Geometry()
    x, xr = _dims(x_shape)
    c, cr = _dims(cos_shape)
    s, sr = _dims(sin_shape)
    p, pr = _dims(position_ids_shape) if position_ids_shape is not None else (_I64x8(), -1)
    rc = twin().rope_resolve_shape(
        x, xr, c, cr, s, sr, p, pr,
        *_attr_ints(attrs.interleaved, attrs.num_heads, attrs.rotary_embedding_dim),
        ctypes.byref(geo), err, _ERR_LEN,
    )  # fmt: skip
    if rc:
        raise RotaryContractError(err.value.decode())
    return RotaryShape(
        geo.batch, geo.seq, geo.heads, geo.head_dim, geo.rotary_dim,
        "bhsd" if geo.layout_bhsd else "bsd", geo.max_pos if geo.max_pos >= 0 else None,
    )  # fmt: skip


def check_ranks(x_rank: int, cos_rank: int, sin_rank: int, position_ids_rank: int | None, attrs: RotaryAttrs) -> None:
    """The rank-only shape rules the plugin applies before TensorRT knows the sizes."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    pos = -1 if position_ids_rank is None else position_ids_rank
    ranks = [_c_int(r, "a rank", 32) for r in (x_rank, cos_rank, sin_rank, pos)]
    _, num_heads, rotary_dim = _attr_ints(0, attrs.num_heads, attrs.rotary_embedding_dim)
    if twin().rope_check_ranks(*ranks, num_heads, rotary_dim, err, _ERR_LEN):
        raise RotaryContractError(err.value.decode())


def check_dtypes(x_dtype: str, cache_dtype: str, position_ids_dtype: str | None) -> None:
    """The C++ dtype rules, with rope_export.op.contract.check_dtypes's signature."""
    err = ctypes.create_string_buffer(_ERR_LEN)
    if twin().rope_check_dtypes(_enc(x_dtype), _enc(cache_dtype), _enc(position_ids_dtype), err, _ERR_LEN):
        raise RotaryContractError(err.value.decode())


@dataclass(frozen=True)
class PluginField:
    """One nvinfer1::PluginField: ``data`` is the raw bytes, ``length`` the element count it claims."""

    name: str | bytes | None
    type: str
    data: bytes | None
    length: int

    @classmethod
    def int32(cls, name: str, *values: int) -> PluginField:
        data = b"".join(_c_int(v, f"INT32 field {name!r}", 32).to_bytes(4, "little", signed=True) for v in values)
        return cls(name, "INT32", data, len(values))

    @classmethod
    def int64(cls, name: str, *values: int) -> PluginField:
        data = b"".join(_c_int(v, f"INT64 field {name!r}").to_bytes(8, "little", signed=True) for v in values)
        return cls(name, "INT64", data, len(values))

    @classmethod
    def string(cls, name: str, text: str) -> PluginField:
        data = text.encode()
        return cls(name, "CHAR", data, len(data))


def parse_fields(fields: list[PluginField], phase: int = BUILD) -> RotaryAttrs:
    """What the plugin creator makes of ``fields`` (PluginFieldError with its message if it refuses).

    Each field's data is passed in a buffer of exactly its bytes, so the sanitizer build would
    catch a read past it.
    """
    arr = (_Field * max(len(fields), 1))()
    keep = []  # the buffers must outlive the call
    for i, f in enumerate(fields):
        name = f.name.encode() if isinstance(f.name, str) else f.name
        data = None
        if f.data is not None:
            buf = ctypes.create_string_buffer(f.data, len(f.data)) if f.data else None
            keep.append(buf)
            data = ctypes.cast(buf, ctypes.c_void_p) if buf is not None else None
        arr[i] = _Field(name, data, _field_type_code(f.type), _c_int(f.length, "a field length", 32))
    out = (ctypes.c_int64 * 3)()
    err = ctypes.create_string_buffer(_ERR_LEN)
    if twin().rope_parse_fields(arr, len(fields), int(phase), out, err, _ERR_LEN):
        raise PluginFieldError(err.value.decode())
    return RotaryAttrs(bool(out[0]), int(out[1]), int(out[2]))


def _field_type_code(type_) -> int:
    """An nvinfer1::PluginFieldType code from its name ("INT32") or its number."""
    if isinstance(type_, str):
        if type_ not in FIELD_TYPES:
            raise PluginFieldError(f"unknown plugin field type {type_!r}; the types are {', '.join(FIELD_TYPES)}")
        return FIELD_TYPES[type_]
    try:
        return _c_int(type_, "a plugin field type code", 32)
    except RotaryContractError as exc:
        raise PluginFieldError(str(exc)) from None


def serialize_fields(attrs: RotaryAttrs) -> list[PluginField]:
    """The fields getFieldsToSerialize hands TensorRT for ``attrs`` (PluginFieldError if it refuses)."""
    arr = (_Field * 3)()
    values = (ctypes.c_int32 * 3)()
    err = ctypes.create_string_buffer(_ERR_LEN)
    ints = _attr_ints(attrs.interleaved, attrs.num_heads, attrs.rotary_embedding_dim)
    if twin().rope_serialize_fields(*ints, arr, values, err, _ERR_LEN):
        raise PluginFieldError(err.value.decode())
    type_names = {v: k for k, v in FIELD_TYPES.items()}
    return [
        PluginField(f.name.decode(), type_names[f.type], ctypes.string_at(f.data, 4 * f.length), f.length) for f in arr
    ]


def metadata_string(attrs: RotaryAttrs) -> str:
    out = ctypes.create_string_buffer(256)
    twin().rope_metadata_string(*_attr_ints(attrs.interleaved, attrs.num_heads, attrs.rotary_embedding_dim), out, 256)
    return out.value.decode()


def supports_combination(pos: int, dtypes: list[str], linear: list[bool], nb_inputs: int, nb_outputs: int) -> bool:
    """supportsFormatCombination for I/O ``pos`` (inputs first, then the output)."""
    names = (ctypes.c_char_p * max(len(dtypes), 1))(*[_enc(d) for d in dtypes])
    lin = (ctypes.c_int32 * max(len(linear), 1))(*[int(bool(v)) for v in linear])
    # The C side reads nb_inputs + nb_outputs entries of each array: never more than were given.
    pos, nb_inputs, nb_outputs = (_c_int(n, "an I/O index or count", 32) for n in (pos, nb_inputs, nb_outputs))
    if nb_inputs + nb_outputs > min(len(dtypes), len(linear)):
        return False
    return bool(twin().rope_supports_combination(pos, names, lin, nb_inputs, nb_outputs))


def output_dtype(input_dtypes: list[str], nb_outputs: int = 1) -> str:
    """getOutputDataTypes: the output's dtype, or RotaryContractError."""
    names = (ctypes.c_char_p * max(len(input_dtypes), 1))(*[_enc(d) for d in input_dtypes])
    out = ctypes.create_string_buffer(64)
    err = ctypes.create_string_buffer(_ERR_LEN)
    if twin().rope_output_dtype(names, len(input_dtypes), _c_int(nb_outputs, "nb_outputs", 32), out, 64, err, _ERR_LEN):
        raise RotaryContractError(err.value.decode())
    return out.value.decode()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _element_aligned(t: torch.Tensor) -> bool:
    # torch.frombuffer(..., offset=2) makes a float32 tensor at an odd address; the kernels (like a
    # GPU) need every pointer aligned to its element.
    return t.data_ptr() % t.element_size() == 0


def make_args(x, cos_cache, sin_cache, position_ids, out, *, interleaved=False, num_heads=0, rotary_embedding_dim=0,
              force_scalar=False, blocks=None) -> _TwinArgs:
    """The C ABI's description of one call (RopeTwinArgs) over contiguous tensors, on any device."""
    from rope_export.op.reference import dtype_name

    interleaved, num_heads, rotary_embedding_dim = _attr_ints(interleaved, num_heads, rotary_embedding_dim)
    block_range = (0, -1) if blocks is None else tuple(_c_int(b, "a grid block index") for b in blocks)
    args = _TwinArgs()
    args.x, args.cos_cache, args.sin_cache = _ptr(x), _ptr(cos_cache), _ptr(sin_cache)
    args.position_ids, args.out = _ptr(position_ids), _ptr(out)
    args.x_dtype, args.cos_dtype, args.sin_dtype = (_enc(dtype_name(t.dtype)) for t in (x, cos_cache, sin_cache))
    args.x_shape, args.x_rank = _dims(x.shape)
    args.cos_shape, args.cos_rank = _dims(cos_cache.shape)
    args.sin_shape, args.sin_rank = _dims(sin_cache.shape)
    if position_ids is not None:
        args.position_ids_dtype = _enc(dtype_name(position_ids.dtype))
        args.position_ids_shape, args.position_ids_rank = _dims(position_ids.shape)
    else:
        args.position_ids_rank = -1
    args.interleaved, args.num_heads, args.rotary_embedding_dim = interleaved, num_heads, rotary_embedding_dim
    args.force_scalar = int(bool(force_scalar))
    args.block_begin, args.block_end = block_range
    # C API 3: each storage's bytes from the data pointer on, what the C side may touch
    args.x_bytes, args.cos_bytes, args.sin_bytes, args.position_ids_bytes, args.out_bytes = (
        0 if t is None else t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        for t in (x, cos_cache, sin_cache, position_ids, out))
    return args


def to_plan(plan: _TwinPlan) -> TwinPlan:
    return TwinPlan(
        bool(plan.vectorized), plan.pairs_per_unit, plan.tail_elems, plan.rot_units, plan.units,
        (plan.block_x, plan.block_y), (plan.grid_x, plan.grid_y), plan.tokens,
    )  # fmt: skip


def rotary_embedding(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> torch.Tensor:
    """The op on the CPU twin: a drop-in for rope_export.op.reference.rotary_embedding."""
    out, _ = run(
        x,
        cos_cache,
        sin_cache,
        position_ids,
        interleaved=interleaved,
        num_heads=num_heads,
        rotary_embedding_dim=rotary_embedding_dim,
    )
    return out


def run(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
    force_scalar: bool = False,
    out: torch.Tensor | None = None,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, TwinPlan]:
    """Run the kernels' code on the CPU twin; same arguments as rope_export.op.reference.rotary_embedding.

    CPU tensors only: CUDA tensors run on the CUDA kernels themselves through
    ``rope_export.kernels.cuda.rotary_embedding`` (same arguments and result; ``rope_export.kernels.backend.run``
    picks by device). Returns the output and the
    launch plan (vector or scalar path, grid). ``force_scalar`` takes the scalar path where the
    vector one could run; ``blocks=(begin, end)`` (CPU twin only) runs only those grid blocks along
    x (tests of huge shapes); ``out`` is written in place when given. Non-contiguous tensors are
    made contiguous (a contiguous view keeps its address, so a view
    that is not 16-byte aligned takes the scalar path). On the CPU twin, a tensor not even aligned to
    its element size (``torch.frombuffer(buf, offset=2)`` of float32) is copied to aligned memory
    first, the output included (the kernels, like a GPU, refuse such pointers).
    """
    import torch

    tensors = [x, cos_cache, sin_cache] + ([position_ids] if position_ids is not None else [])
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the CPU twin takes CPU tensors, got one on {t.device}; move it with .cpu() "
                             "(CUDA tensors run on the CUDA kernels: rope_export.kernels.cuda.rotary_embedding)")
    x, cos_cache, sin_cache = (t.contiguous() if _element_aligned(t) else t.clone() for t in (x, cos_cache, sin_cache))
    if position_ids is not None:
        position_ids = position_ids.contiguous() if _element_aligned(position_ids) else position_ids.clone()
    target = None  # a misaligned ``out`` given by the caller: written through an aligned buffer
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous CPU tensor of shape {list(x.shape)} and dtype {x.dtype}")
    elif not _element_aligned(out):
        target, out = out, torch.empty_like(x, memory_format=torch.contiguous_format)
    args = make_args(x, cos_cache, sin_cache, position_ids, out, interleaved=interleaved, num_heads=num_heads,
                     rotary_embedding_dim=rotary_embedding_dim, force_scalar=force_scalar, blocks=blocks)
    plan = _TwinPlan()
    err = ctypes.create_string_buffer(_ERR_LEN)
    if twin().rope_twin_run(ctypes.byref(args), ctypes.byref(plan), err, _ERR_LEN):
        raise RotaryContractError(err.value.decode())
    if target is not None:
        out = target.copy_(out)
    return out, to_plan(plan)
