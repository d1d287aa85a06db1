"""Hostile input at the C level: the CPU twin's C ABI and its ctypes binding (issue 16).

Misaligned tensors (each in turn, 16-byte and element misalignment), null pointers into every C
ABI function, Python ints that ctypes would wrap, field types and values that do not fit, field
counts past the bound and shapes that overstate their buffers (C API 3 carries each buffer's
size). The sanitizer driver (ASan + UBSan) runs the same null, misaligned and size cases in C.
"""

from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch

from rope_export.kernels import cpu_twin
from rope_export.kernels.build import ensure_built
from rope_export.kernels.cpu_twin import PluginField, PluginFieldError
from rope_export.op import reference
from rope_export.op.contract import RotaryAttrs, RotaryContractError

TENSORS = ("x", "cos", "sin", "position_ids", "out")


@pytest.fixture(scope="module", autouse=True)
def built_dir():
    return ensure_built()


def _at_offset(values: torch.Tensor, byte_offset: int, keep: list) -> torch.Tensor:
    """A copy of ``values`` whose data starts ``byte_offset`` bytes past a 64-byte boundary."""
    nbytes = values.numel() * values.element_size()
    raw = torch.zeros(nbytes + 128, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 64 + byte_offset
    keep.append(raw)  # the storage must outlive the view
    view = torch.frombuffer(memoryview(raw.numpy()), dtype=values.dtype, offset=start, count=values.numel())
    view = view.view(values.shape)
    view.copy_(values)
    assert view.data_ptr() % 64 == byte_offset
    return view


def _inputs(dtype, interleaved: bool, gen):
    b, h, s, d, max_pos = 2, 3, 5, 32, 7
    x = torch.randn(b, h, s, d, generator=gen).to(dtype)
    x[0, :, 1] = float("inf")  # out-of-range tokens below must come through bit for bit
    x[1, :, 3] = float("nan")
    cos = torch.randn(max_pos, d // 2, generator=gen)
    sin = torch.randn(max_pos, d // 2, generator=gen)
    pos = torch.tensor([[0, -1, 6, 3, 2], [1, 5, 4, 99, 0]])
    return dict(x=x, cos=cos, sin=sin, position_ids=pos), interleaved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("which", TENSORS)
@pytest.mark.parametrize("misalign", ["one element", "sub-element"])
def test_every_tensor_misaligned_in_turn_gives_the_reference_result(dtype, which, misalign):
    """16-byte misaligned (one element in): scalar path; not even element-aligned: copied first.

    Before the fix a float32 tensor at byte offset 2 aborted the process (SIGABRT)."""
    gen = torch.Generator().manual_seed(7)
    t, interleaved = _inputs(dtype, False, gen)
    want = reference.rotary_embedding(t["x"], t["cos"], t["sin"], t["position_ids"], interleaved=interleaved)
    keep: list = []
    element = (torch.empty((), dtype=dtype) if which in ("x", "out") else t.get(which, t["x"])).element_size()
    offset = element if misalign == "one element" else max(element // 2, 1)
    if which == "position_ids" and misalign == "sub-element":
        offset = 4
    out = None
    if which == "out":
        out = _at_offset(torch.zeros_like(t["x"]), offset, keep)
    else:
        t[which] = _at_offset(t[which], offset, keep)
    got, plan = cpu_twin.run(t["x"], t["cos"], t["sin"], t["position_ids"], interleaved=interleaved, out=out)
    # bit for bit: the rotated tokens and the pass-through inf/nan tokens alike
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if which == "out":
        assert got.data_ptr() == out.data_ptr()  # written in place, through an aligned buffer
    if misalign == "one element" and which != "position_ids":
        assert not plan.vectorized  # the address, not the sizes, ruled out the vector path
    if which == "position_ids":
        assert plan.vectorized  # positions are read one int64 at a time on both paths


def test_aligned_inputs_take_the_vector_path():
    gen = torch.Generator().manual_seed(3)
    t, _ = _inputs(torch.float16, False, gen)
    keep: list = []
    t = {k: _at_offset(v, 0, keep) for k, v in t.items()}
    _, plan = cpu_twin.run(t["x"], t["cos"], t["sin"], t["position_ids"])
    assert plan.vectorized


def test_the_c_abi_refuses_an_element_misaligned_pointer():
    """Straight through ctypes (the binding would copy): a message naming the tensor, nothing written."""
    x = torch.randn(1, 2, 3, 8)
    raw = torch.zeros(4 * 48 + 8, dtype=torch.uint8)
    out_raw = torch.full((4 * 48 + 8,), 0xAB, dtype=torch.uint8)
    cos = torch.randn(5, 4)
    args = cpu_twin._TwinArgs()
    base = raw.data_ptr() + (-raw.data_ptr()) % 4 + 2  # float32 X at an address that is 2 mod 4
    ctypes.memmove(base, x.data_ptr(), 4 * x.numel())
    args.x, args.cos_cache, args.sin_cache = base, cos.data_ptr(), cos.data_ptr()
    args.out = out_raw.data_ptr() + (-out_raw.data_ptr()) % 4
    args.x_dtype = args.cos_dtype = args.sin_dtype = b"float32"
    args.x_shape, args.x_rank = cpu_twin._dims(x.shape)
    args.cos_shape, args.cos_rank = cpu_twin._dims(cos.shape)
    args.sin_shape, args.sin_rank = cpu_twin._dims(cos.shape)
    args.cos_shape, args.cos_rank = cpu_twin._dims((1, 3, 4))
    args.sin_shape, args.sin_rank = cpu_twin._dims((1, 3, 4))
    args.position_ids_rank = -1
    args.block_end = -1
    err = ctypes.create_string_buffer(256)
    assert cpu_twin.twin().rope_twin_run(ctypes.byref(args), None, err, 256) != 0
    assert err.value.decode().startswith("X's data pointer is not aligned to its 4-byte elements")
    assert bool((out_raw == 0xAB).all())


def test_null_pointers_into_the_c_abi_are_refused_not_dereferenced():
    lib = cpu_twin.twin()
    err = ctypes.create_string_buffer(256)
    dims, _ = cpu_twin._dims((2, 4))
    geo = cpu_twin._Geometry()
    assert lib.rope_resolve_shape(None, 4, dims, 2, dims, 2, dims, 2, 0, 0, 0, ctypes.byref(geo), err, 256) != 0
    assert "null" in err.value.decode()
    field = (cpu_twin._Field * 1)(cpu_twin._Field(b"num_heads", None, 5, 1))
    assert lib.rope_parse_fields(field, 1, 0, None, err, 256) != 0
    assert lib.rope_serialize_fields(0, 4, 0, None, None, err, 256) != 0
    assert lib.rope_twin_run(None, None, err, 256) != 0
    assert lib.rope_output_dtype(None, 3, 1, None, 0, err, 256) != 0
    assert lib.rope_supports_combination(0, None, None, 3, 1) == 0


def test_a_field_count_past_the_bound_is_refused_before_any_field_is_read():
    """A count of 1e9 over a one-field array: a 32 GB reserve and a read past the array (a segfault)
    before the bound; now one message, the one core parse_fields gives the TensorRT glue too."""
    lib = cpu_twin.twin()
    err = ctypes.create_string_buffer(256)
    out = (ctypes.c_int64 * 3)()
    one = ctypes.c_int32(4)
    field = (cpu_twin._Field * 1)(cpu_twin._Field(b"num_heads", ctypes.cast(ctypes.byref(one), ctypes.c_void_p), 5, 1))
    for count in (10**9, 17, 2**31 - 1):
        assert lib.rope_parse_fields(field, count, 0, out, err, 256) != 0
        assert f"malformed field collection ({count} fields; at most 16" in err.value.decode()
    assert lib.rope_parse_fields(field, 1, 0, out, err, 256) == 0 and list(out) == [0, 4, 0]


def _huge_view(shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` over one element (stride 0): what a caller's shapes claim, not what it holds."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def test_shapes_that_overstate_their_buffers_are_refused_even_for_one_block():
    """X [1, 2^20, 1, 2^20] over 4 bytes, run for the first grid block only: that block alone reads
    2^40 elements, a segfault before the buffer sizes were checked."""
    lib = cpu_twin.twin()
    x = _huge_view((1, 2**20, 1, 2**20))
    cos = torch.zeros(4, 2**19)
    pos = torch.zeros(1, 1, dtype=torch.long)
    out = torch.zeros(64)
    args = cpu_twin.make_args(x, cos, cos, pos, out, blocks=(0, 1))
    assert args.x_bytes == 4 and args.cos_bytes == 4 * 4 * 2**19
    err = ctypes.create_string_buffer(256)
    assert lib.rope_twin_run(ctypes.byref(args), None, err, 256) != 0
    assert err.value.decode() == ("X [1, 1048576, 1, 1048576] needs 4398046511104 bytes but its buffer holds 4 "
                                  "(RopeTwinArgs.x_bytes); pass shapes that match the buffers")
    assert not out.any()


@pytest.mark.parametrize(("which", "field", "label"), [
    ("x", "x_bytes", "X"), ("cos", "cos_bytes", "cos_cache"), ("sin", "sin_bytes", "sin_cache"),
    ("position_ids", "position_ids_bytes", "position_ids"), ("out", "out_bytes", "the output")])
def test_each_buffer_one_byte_short_is_refused_naming_it(which, field, label):
    gen = torch.Generator().manual_seed(5)
    t, _ = _inputs(torch.float32, False, gen)
    out = torch.full_like(t["x"], 7.0)
    args = cpu_twin.make_args(t["x"], t["cos"], t["sin"], t["position_ids"], out)
    err = ctypes.create_string_buffer(256)
    assert cpu_twin.twin().rope_twin_run(ctypes.byref(args), None, err, 256) == 0  # exactly their sizes: runs
    out.fill_(7.0)
    setattr(args, field, getattr(args, field) - 1)
    assert cpu_twin.twin().rope_twin_run(ctypes.byref(args), None, err, 256) != 0
    assert err.value.decode().startswith(f"{label} [") and f"(RopeTwinArgs.{field})" in err.value.decode()
    assert bool((out == 7.0).all())  # refused before anything was written


def test_a_byte_count_past_64_bits_is_refused():
    lib = cpu_twin.twin()
    x, cos = torch.zeros(1, 2, 1, 8), torch.zeros(4, 4)
    args = cpu_twin.make_args(x, cos, cos, torch.zeros(1, 1, dtype=torch.long), torch.zeros_like(x))
    args.cos_shape[0] = args.sin_shape[0] = 2**62  # more rows than torch itself can describe
    err = ctypes.create_string_buffer(256)
    assert lib.rope_twin_run(ctypes.byref(args), None, err, 256) != 0
    assert err.value.decode() == "cos_cache [4611686018427387904, 4] has more bytes than a 64-bit size holds"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=2**64 + 4), "num_heads = 18446744073709551620 does not fit a 64-bit integer"),
        (dict(rotary_embedding_dim=-(2**63) - 1), "rotary_embedding_dim = .* does not fit a 64-bit integer"),
        (dict(num_heads=True), "num_heads must be an integer, got True"),
        (dict(interleaved=2**64 + 1), "interleaved = .* does not fit"),
        (dict(num_heads=4.0), "num_heads must be an integer, got 4.0"),
    ],
)
def test_ints_that_ctypes_would_wrap_are_refused(kwargs, message):
    """Before the fix, num_heads = 2**64 + 4 reached the C rules as 4 and ran."""
    x = torch.randn(1, 2, 4 * 8)
    cos = torch.randn(6, 4)
    with pytest.raises(RotaryContractError, match=message):
        cpu_twin.rotary_embedding(x, cos, cos, torch.zeros(1, 2, dtype=torch.long), **{"num_heads": 4, **kwargs})


def test_huge_dimensions_are_refused_not_wrapped():
    with pytest.raises(RotaryContractError, match="does not fit a 64-bit integer"):
        cpu_twin.resolve_shape((1, 2, 3, 2**64 + 8), (5, 4), (5, 4), (1, 3), RotaryAttrs())
    with pytest.raises(RotaryContractError, match="does not fit a 64-bit integer"):
        cpu_twin.serialize_fields(RotaryAttrs(False, 2**64 + 1, 0))


@pytest.mark.parametrize(
    "attrs, message",
    [
        (RotaryAttrs(False, 2**31, 0), "cannot serialize field 'num_heads': must be in \\[0, 2147483647\\]"),
        (RotaryAttrs(False, 2**40 + 8, 0), "cannot serialize field 'num_heads'"),
        (RotaryAttrs(False, 8, 2**32 + 64), "cannot serialize field 'rotary_embedding_dim'"),
        (RotaryAttrs(False, -1, 0), "cannot serialize field 'num_heads'"),
        (RotaryAttrs(False, 8, 7), "must be even"),
    ],
)
def test_the_field_serializer_refuses_what_int32_cannot_hold(attrs, message):
    """Before the fix 2**32 + 64 was serialized as 64 (a silent static_cast to int32)."""
    with pytest.raises(PluginFieldError, match=message):
        cpu_twin.serialize_fields(attrs)


def test_the_largest_int32_values_still_serialize_and_parse_back():
    attrs = RotaryAttrs(True, 2**31 - 1, 2**31 - 2)
    assert cpu_twin.parse_fields(cpu_twin.serialize_fields(attrs), cpu_twin.RUNTIME) == attrs


@pytest.mark.parametrize(
    "field, message",
    [
        (PluginField("num_heads", "INT128", b"\0" * 16, 1), "unknown plugin field type 'INT128'; the types are"),
        (PluginField("num_heads", 2**40, b"\0" * 4, 1), "does not fit a 32-bit integer"),
        (PluginField("num_heads", "INT32", b"\0" * 4, 2**33), "a field length = 8589934592 does not fit"),
    ],
)
def test_field_types_and_lengths_that_do_not_exist_are_refused(field, message):
    """An unknown type name raised KeyError (a traceback) before the fix."""
    with pytest.raises((PluginFieldError, RotaryContractError), match=message):
        cpu_twin.parse_fields([field])


def test_field_constructors_refuse_values_their_type_cannot_hold():
    with pytest.raises(RotaryContractError, match="INT32 field 'num_heads'.*does not fit a 32-bit integer"):
        PluginField.int32("num_heads", 2**31)


def test_sanitizer_driver_covers_null_and_misaligned_pointers(built_dir):
    driver = built_dir / "rope_export_twin_sanitize"
    if not driver.is_file():
        pytest.skip("sanitizer driver not built (see build/plugins/summary.txt)")
    env = dict(os.environ, ASAN_OPTIONS="halt_on_error=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    proc = subprocess.run([str(driver)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = dict(line.rsplit(": ", 1) for line in proc.stdout.splitlines()[1:])
    assert int(counts["null pointers refused"]) >= 20
    assert int(counts["element-misaligned pointers refused"]) >= 25
    assert int(counts["misaligned by one element, run on the scalar path"]) > 1000
    assert int(counts["counts and sizes past the memory refused"]) >= 10
