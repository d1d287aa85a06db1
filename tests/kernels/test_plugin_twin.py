"""The CPU twin (the CUDA kernels' own code on the CPU) against rope_export.op.reference.

Covers every variant of the op contract over hypothesis-generated cases, both the vector and the
scalar path (forced, and taken because of misaligned buffers or odd sizes), positions outside the
cache (negative too), 64-bit offsets past 2^31 elements, and the ASan/UBSan driver.
"""

from __future__ import annotations

import mmap
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_export.kernels import cpu_twin, libraries
from rope_export.kernels.build import ensure_built
from rope_export.op import reference
from rope_export.op.contract import RotaryContractError
from rope_export.op.tolerances import tolerance

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def built_dir():
    return ensure_built()


def _offset_tensor(shape, dtype, gen, misalign: bool) -> torch.Tensor:
    """Random data; with ``misalign`` it starts one element into its storage (no 16-byte alignment)."""
    n = 1
    for d in shape:
        n *= d
    flat = torch.randn(n + int(misalign), generator=gen).to(dtype)
    return flat[int(misalign) :].view(shape)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    cache_dtype = draw(st.sampled_from(["float32", dtype])) if dtype != "float32" else "float32"
    b, s, h = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    d = draw(st.sampled_from([2, 4, 6, 8, 10, 12, 16, 24, 32, 40, 48, 64, 72, 80, 96, 128]))
    rd_attr = draw(st.sampled_from([0, 0, 2 * draw(st.integers(1, d // 2))]))
    return dict(
        dtype=dtype,
        cache_dtype=cache_dtype,
        b=b, s=s, h=h, d=d,
        rd_attr=rd_attr,
        four_d=draw(st.booleans()),
        interleaved=draw(st.booleans()),
        with_pos=draw(st.booleans()),
        max_pos=draw(st.integers(1, 12)),
        force_scalar=draw(st.booleans()),
        misalign_x=draw(st.integers(0, 4)) == 0,
        misalign_cache=draw(st.integers(0, 4)) == 0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def _inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    dtype, cache_dtype = DTYPES[c["dtype"]], DTYPES[c["cache_dtype"]]
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    half = (c["rd_attr"] or d) // 2
    x_shape = (b, h, s, d) if c["four_d"] else (b, s, h * d)
    x = _offset_tensor(x_shape, dtype, gen, c["misalign_x"])
    rows = c["max_pos"] if c["with_pos"] else None
    cache_shape = (rows, half) if c["with_pos"] else (b, s, half)
    cos = _offset_tensor(cache_shape, cache_dtype, gen, c["misalign_cache"])
    sin = _offset_tensor(cache_shape, cache_dtype, gen, c["misalign_cache"])
    pos = None
    if c["with_pos"]:
        # In range, on both edges, and outside on both sides.
        pos = torch.randint(-3, c["max_pos"] + 3, (b, s), generator=gen, dtype=torch.int64)
    kwargs = dict(interleaved=c["interleaved"], num_heads=0 if c["four_d"] else h, rotary_embedding_dim=c["rd_attr"])
    return x, cos, sin, pos, kwargs


def _vector_path_possible(c) -> bool:
    vec = 16 // DTYPES[c["dtype"]].itemsize
    half = (c["rd_attr"] or c["d"]) // 2
    pairs = vec // 2 if c["interleaved"] else vec
    return not (c["force_scalar"] or c["misalign_x"] or c["misalign_cache"]) and c["d"] % vec == 0 and half % pairs == 0


@settings(max_examples=100, deadline=None)
@given(cases())
def test_twin_matches_reference(c):
    x, cos, sin, pos, kwargs = _inputs(c)
    expected = reference.rotary_embedding(x, cos, sin, pos, **kwargs)
    got, plan = cpu_twin.run(x, cos, sin, pos, force_scalar=c["force_scalar"], **kwargs)
    assert plan.vectorized == _vector_path_possible(c)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert tolerance("op", c["dtype"]).allclose(got.float(), expected.float())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("interleaved", [False, True])
def test_vector_and_scalar_paths_agree_bit_for_bit(dtype, interleaved):
    # A Llama-like head (D=128) on a partial rotary dim (Phi-2-like, rd=64) with a tail to copy.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 5, 128, generator=gen).to(DTYPES[dtype])
    cos, sin = torch.randn(2, 64, 32, generator=gen), torch.randn(2, 64, 32, generator=gen)
    pos = torch.tensor([[0, 5, 63, 64, -1], [7, 7, 1000, 2, 3]])
    kw = dict(interleaved=interleaved, rotary_embedding_dim=64)
    vec, vplan = cpu_twin.run(x, cos[0], sin[0], pos, **kw)
    sca, splan = cpu_twin.run(x, cos[0], sin[0], pos, force_scalar=True, **kw)
    assert vplan.vectorized and not splan.vectorized
    bits = torch.int16 if vec.element_size() == 2 else torch.int32
    assert torch.equal(vec.view(bits), sca.view(bits))
    expected = reference.rotary_embedding(x, cos[0], sin[0], pos, **kw)
    assert tolerance("op", dtype).allclose(vec.float(), expected.float())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_out_of_range_tokens_are_copied_unchanged(dtype):
    # Pass-through copies bits, so even inf and nan come out as they went in (cos=1/sin=0 would not).
    x = torch.randn(1, 4, 3 * 16).to(DTYPES[dtype])
    x[0, 1, 0] = float("inf")
    x[0, 3, 5] = float("nan")
    cos = sin = torch.randn(4, 8).to(DTYPES[dtype])
    pos = torch.tensor([[0, -1, 2, 4]])
    out, _ = cpu_twin.run(x, cos, sin, pos, num_heads=3)
    bits = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(out[0, 1].view(bits), x[0, 1].view(bits))
    assert torch.equal(out[0, 3].view(bits), x[0, 3].view(bits))
    assert not torch.equal(out[0, 0], x[0, 0])


@pytest.mark.parametrize("four_d", [False, True])
@pytest.mark.parametrize("force_scalar", [False, True])
def test_offsets_past_2_to_the_31_elements(four_d, force_scalar):
    """X of 2^31 + 131072 fp16 elements (4 GiB, over 2^32 bytes): only the last grid block runs.

    X and out are lazily allocated anonymous mappings, so only the pages that the last tokens touch
    get memory; a 32-bit offset anywhere would address the wrong token and fail the comparison.
    """
    b, s, h, d = 1, 65540, 32, 1024
    n = b * s * h * d
    assert n > 2**31
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    x_map, out_map = mmap.mmap(-1, 2 * n, flags=flags), mmap.mmap(-1, 2 * n, flags=flags)
    shape = (b, h, s, d) if four_d else (b, s, h * d)
    x = torch.frombuffer(x_map, dtype=torch.float16).view(shape)
    out = torch.frombuffer(out_map, dtype=torch.float16).view(shape)
    gen = torch.Generator().manual_seed(3)
    cos, sin = torch.randn(100, 512, generator=gen), torch.randn(100, 512, generator=gen)
    pos = torch.randint(-2, 102, (b, s), generator=gen)
    kw = dict(num_heads=0 if four_d else h, force_scalar=force_scalar)
    _, plan = cpu_twin.run(x, cos, sin, pos, out=out, blocks=(0, 0), **kw)  # plan only
    first = (plan.grid[0] - 1) * plan.block[1]  # first token of the last block
    assert first * h * d >= 2**31  # int32 offsets would already wrap here
    tok = (slice(None), slice(None), slice(first, None)) if four_d else (slice(None), slice(first, None))
    x[tok] = torch.randn(x[tok].shape, generator=gen).half()
    before = (slice(None), slice(None), first - 1) if four_d else (slice(None), first - 1)
    cpu_twin.run(x, cos, sin, pos, out=out, blocks=(plan.grid[0] - 1, plan.grid[0]), **kw)
    kwr = dict(num_heads=kw["num_heads"])
    expected = reference.rotary_embedding(x[tok].clone(), cos, sin, pos[:, first:].clone(), **kwr)
    assert tolerance("op", "float16").allclose(out[tok].float(), expected.float())
    assert torch.count_nonzero(out[before]) == 0  # earlier tokens belong to other blocks: untouched


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("four_d", [False, True])
@pytest.mark.parametrize("with_pos", [False, True])
def test_twin_matches_onnx_reference_evaluator(interleaved, four_d, with_pos):
    """An implementation someone else wrote: onnx.reference's RotaryEmbedding-23 (fp32, in-range
    positions, since the standard leaves others undefined), partial rotary dim included."""
    import numpy as np
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    gen = torch.Generator().manual_seed(5)
    b, h, s, d, rd = 2, 3, 5, 16, 8
    x = torch.randn(*((b, h, s, d) if four_d else (b, s, h * d)), generator=gen)
    rows = (11,) if with_pos else (b, s)
    cos, sin = torch.randn(*rows, rd // 2, generator=gen), torch.randn(*rows, rd // 2, generator=gen)
    pos = torch.randint(0, 11, (b, s), generator=gen) if with_pos else None
    attrs = dict(interleaved=int(interleaved), rotary_embedding_dim=rd, num_heads=0 if four_d else h)
    names = ["x", "cos", "sin"] + (["pos"] if with_pos else [])
    node = helper.make_node("RotaryEmbedding", names, ["y"], **attrs)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names[:3]]
    if with_pos:
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, None))
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {"x": x.numpy(), "cos": cos.numpy(), "sin": sin.numpy()}
    if with_pos:
        feeds["pos"] = pos.numpy()
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    got = cpu_twin.rotary_embedding(x, cos, sin, pos, **attrs)
    assert tolerance("op", "float32").allclose(got.numpy(), np.asarray(expected))


def test_contract_errors_come_from_the_cpp_rules():
    x = torch.randn(1, 2, 8).half()
    cos = sin = torch.randn(1, 2, 2).half()
    with pytest.raises(RotaryContractError, match="3-D X \\[B, S, H\\*D\\] needs the num_heads attribute"):
        cpu_twin.run(x, cos, sin)
    with pytest.raises(RotaryContractError, match="the caches must have X's dtype \\(float16\\) or float32"):
        cpu_twin.run(x, cos.bfloat16(), sin.bfloat16(), num_heads=2)
    with pytest.raises(RotaryContractError, match="position_ids must be int64, got int32"):
        cpu_twin.run(x, cos[0], sin[0], torch.zeros(1, 2, dtype=torch.int32), num_heads=2)
    with pytest.raises(RotaryContractError, match="must have the same dtype"):
        cpu_twin.run(x, cos, sin.float(), num_heads=2)


def test_tensors_off_the_cpu_are_refused_with_the_binding_that_takes_them():
    x = torch.randn(1, 2, 2, 4, device="meta")
    cos = sin = torch.randn(2, 2)
    with pytest.raises(ValueError, match="CPU tensors, got one on meta.*rope_export.kernels.cuda.rotary_embedding"):
        cpu_twin.run(x, cos, sin)


def test_kernels_run_takes_cpu_tensors_to_the_twin():
    from rope_export.kernels import backend as kernels

    x, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(16, 4), torch.randn(16, 4)
    pos = torch.tensor([[0, 1, 2, 3, 15], [4, 5, 6, 7, 16]])  # 16: outside the cache, passed through
    got, plan = kernels.run(x, cos, sin, pos)
    want, want_plan = cpu_twin.run(x, cos, sin, pos)
    assert torch.equal(got, want) and plan == want_plan
    assert torch.equal(got[1, :, 4], x[1, :, 4]) and not torch.equal(got[0, :, 1], x[0, :, 1])


def test_empty_tensors_are_fine():
    x = torch.randn(0, 3, 16)
    out, plan = cpu_twin.run(x, torch.randn(0, 3, 4), torch.randn(0, 3, 4), num_heads=2)
    assert out.shape == x.shape and plan.tokens == 0


def test_missing_library_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(libraries.PLUGIN_DIR_ENV, str(tmp_path))
    match = "make plugin.*rope-export build-plugin.*ROPE_EXPORT_PLUGIN_DIR"
    with pytest.raises(libraries.PluginNotBuiltError, match=match):
        cpu_twin.twin()


def test_twin_under_address_and_undefined_behaviour_sanitizers(built_dir):
    driver = built_dir / "rope_export_twin_sanitize"
    if not driver.is_file():
        summary = (built_dir / "summary.txt").read_text() if (built_dir / "summary.txt").is_file() else ""
        pytest.skip("sanitizer driver not built: " + (summary.split("sanitizer driver:")[-1].strip() or "see summary"))
    env = dict(os.environ, ASAN_OPTIONS="halt_on_error=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    proc = subprocess.run([str(driver)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cases ok" in proc.stdout
    vector_cases = int(proc.stdout.split("(")[1].split()[0])
    assert vector_cases > 100  # both paths ran under the sanitizers
