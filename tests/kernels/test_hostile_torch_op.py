"""The op's implementations and lowerings under hostile inputs (issue 16).

Inf and nan at out-of-range positions pass through bit for bit in every implementation; empty
batches and sequences run through every lowered file.

The contract says such a token "passes through unchanged". Before the fix the PyTorch reference,
the NumPy op and the onnx/ort/decomposed lowerings rotated it by the identity (x*1 - y*0), which
turns inf into nan; the kernel and its twin copied it. Each implementation runs on the same
inputs here: the reference, the NumPy op in onnx.reference, the CPU twin, and every lowered file
in onnxruntime and onnx.reference.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from rope_export.kernels import cpu_twin
from rope_export.kernels.build import ensure_built
from rope_export.op import reference
from rope_export.op.contract import DOMAIN, RotaryAttrs
from rope_export.op.onnx_op import RotaryEmbedding as RopeOpRun
from rope_export.op.onnx_op import make_rotary_node
from rope_export.passes import lower

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ONNX = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
# A nan with a payload, a negative nan, both infinities: a copy keeps each bit pattern.
SPECIAL_BITS = {
    "float32": [0x7FC01234, 0xFFC00001, 0x7F800000, 0xFF800000],
    "float16": [0x7E12, 0xFE01, 0x7C00, 0xFC00],
    "bfloat16": [0x7FC1, 0xFFC1, 0x7F80, 0xFF80],
}
MAX_POS = 6
POSITIONS = np.array([[0, -1, 5, 6, 2], [2**62, 3, -(2**63), 1, 4]], dtype=np.int64)  # out: -1, 6, 2**62, -2**63


def _case(layout: str, dtype: str, interleaved: bool, rd: int, seed: int = 0, static: bool = True):
    rng = np.random.default_rng(seed)
    b, s, h, d = 2, 5, 3, 16
    half = (rd or d) // 2
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)  # [B, S, H, D] first
    out_of_range = (POSITIONS < 0) | (POSITIONS >= MAX_POS)
    bits = x.astype(NP[dtype]).view(BITS[dtype])
    specials = np.array(SPECIAL_BITS[dtype], dtype=BITS[dtype])
    for bi, si in zip(*np.nonzero(out_of_range), strict=True):
        bits[bi, si] = np.resize(specials, (h, d))  # whole token: inf/nan in rotated and tail channels
    x = bits.view(NP[dtype])
    x = np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bhsd" else x.reshape(b, s, h * d)
    cos = rng.uniform(-1, 1, (MAX_POS, half)).astype(np.float32)
    sin = rng.uniform(-1, 1, (MAX_POS, half)).astype(np.float32)
    attrs = RotaryAttrs(interleaved, h if layout == "bsd" else 0, rd)
    xshape = list(x.shape) if static else ["b", h, "s", d] if layout == "bhsd" else ["b", "s", h * d]
    graph = helper.make_graph(
        [make_rotary_node("x", "cos", "sin", "pos", "y", attrs, name="rope")],
        "passthrough",
        [helper.make_tensor_value_info("x", ONNX[dtype], xshape),
         helper.make_tensor_value_info("pos", TensorProto.INT64, [b, s] if static else ["b", "s"])],
        [helper.make_tensor_value_info("y", ONNX[dtype], xshape)],
        initializer=[numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return model, x, cos, sin, attrs, out_of_range


def _tokens(y: np.ndarray, layout: str, mask: np.ndarray, heads: int = 3) -> np.ndarray:
    """The [N, H, D] tokens of ``y`` where ``mask`` [B, S] holds."""
    if layout == "bhsd":
        y = y.transpose(0, 2, 1, 3)
    else:
        y = y.reshape(y.shape[0], y.shape[1], heads, -1)
    return y[mask]


def _check(y, x, dtype, layout, out_of_range, expected, what):
    y = np.asarray(y)
    assert y.dtype == x.dtype, what
    got_bits = _tokens(y, layout, out_of_range).view(BITS[dtype])
    want_bits = _tokens(x, layout, out_of_range).view(BITS[dtype])
    np.testing.assert_array_equal(got_bits, want_bits, err_msg=f"{what}: out-of-range tokens are not copied")
    inside = ~out_of_range
    got = _tokens(y, layout, inside).astype(np.float32)
    want = _tokens(expected, layout, inside).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"{what}: in-range tokens")


def _to_torch(a: np.ndarray) -> torch.Tensor:
    """Bit-exact (runners.to_torch goes through float32, which makes bfloat16 nans canonical)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _ort(model, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


CASES = [
    ("bhsd", "float32", False, 0),
    ("bsd", "float32", True, 8),
    ("bsd", "float16", False, 8),
    ("bhsd", "float16", True, 0),
    ("bsd", "bfloat16", False, 0),
]


@pytest.mark.parametrize("layout, dtype, interleaved, rd", CASES)
def test_python_implementations_copy_out_of_range_tokens_bit_for_bit(layout, dtype, interleaved, rd):
    model, x, cos, sin, attrs, out_of_range = _case(layout, dtype, interleaved, rd)
    kwargs = dict(interleaved=attrs.interleaved, num_heads=attrs.num_heads,
                  rotary_embedding_dim=attrs.rotary_embedding_dim)
    torch_y = _to_numpy(reference.rotary_embedding(_to_torch(x), torch.from_numpy(cos), torch.from_numpy(sin),
                                                  torch.from_numpy(POSITIONS), **kwargs))
    _check(torch_y, x, dtype, layout, out_of_range, torch_y, "PyTorch reference")
    numpy_y = ReferenceEvaluator(model, new_ops=[RopeOpRun]).run(None, {"x": x, "pos": POSITIONS})[0]
    _check(numpy_y, x, dtype, layout, out_of_range, torch_y, "NumPy op in onnx.reference")
    ensure_built()
    twin_y = _to_numpy(cpu_twin.rotary_embedding(_to_torch(x), torch.from_numpy(cos), torch.from_numpy(sin),
                                              torch.from_numpy(POSITIONS), **kwargs))
    _check(twin_y, x, dtype, layout, out_of_range, torch_y, "CPU twin")


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
@pytest.mark.parametrize("layout, dtype, interleaved, rd", CASES)
def test_lowered_files_copy_out_of_range_tokens_bit_for_bit(target, layout, dtype, interleaved, rd):
    model, x, cos, sin, attrs, out_of_range = _case(layout, dtype, interleaved, rd)
    expected = _to_numpy(reference.rotary_embedding(
        _to_torch(x), torch.from_numpy(cos), torch.from_numpy(sin), torch.from_numpy(POSITIONS),
        interleaved=attrs.interleaved, num_heads=attrs.num_heads, rotary_embedding_dim=attrs.rotary_embedding_dim))
    lowered = lower(model, target)
    onnx.checker.check_model(lowered, full_check=True)
    feeds = {"x": x, "pos": POSITIONS}
    if target == "ort" and dtype == "bfloat16":
        pytest.skip("onnxruntime's CPU provider has no bfloat16 kernels (Where, Add, MatMul) and onnx.reference "
                    "no com.microsoft op: no runner here for a bfloat16 ort file")
    if dtype != "bfloat16":  # onnxruntime CPU: no bfloat16 Where (nor Add, MatMul)
        _check(_ort(lowered, feeds), x, dtype, layout, out_of_range, expected, f"{target} in onnxruntime")
    if target != "ort":  # onnx.reference has no com.microsoft RotaryEmbedding
        y = ReferenceEvaluator(lowered).run(None, feeds)[0]
        _check(y, x, dtype, layout, out_of_range, expected, f"{target} in onnx.reference")


@pytest.mark.parametrize("target", ["onnx", "ort", "decomposed"])
@pytest.mark.parametrize("layout", ["bhsd", "bsd"])
@pytest.mark.parametrize("batch, seq", [(0, 5), (2, 0), (0, 0)])
def test_lowered_files_run_an_empty_batch_or_sequence(target, layout, batch, seq):
    """The ort lowering reshaped to [B, S] / [-1, rd/2], which fails at batch 0 or seq 0 (no
    allowzero), and then onnxruntime's kernel refused a cache with fewer rows than tokens."""
    model, x, _, _, _, _ = _case(layout, "float32", False, 8, static=False)
    shape = [batch, 3, seq, 16] if layout == "bhsd" else [batch, seq, 48]
    feeds = {"x": np.zeros(shape, np.float32), "pos": np.zeros((batch, seq), np.int64)}
    lowered = lower(model, target)
    assert _ort(lowered, feeds).shape == tuple(shape)
    if target != "ort":
        assert ReferenceEvaluator(lowered).run(None, feeds)[0].shape == tuple(shape)


@pytest.mark.parametrize("rope", [
    dict(rope_type="dynamic", factor=2.0, max_position_embeddings=8),
    dict(rope_type="longrope", original_max_position_embeddings=8, max_position_embeddings=32,
         short_factor=[1.0] * 8, long_factor=[2.0] * 8),
])
def test_seq_len_dependent_blocks_run_an_empty_batch(rope):
    """max(position_ids) of an empty batch raised "Expected reduction dim" (a traceback)."""
    from rope_export.op.rope_types import RopeConfig
    from rope_export.presets.modules import AttentionConfig, RoPEAttention

    block = RoPEAttention(AttentionConfig(64, 4, 2, 16), RopeConfig(head_dim=16, **rope)).eval()
    with torch.no_grad():
        out, key, _ = block(torch.randn(0, 3, 64), torch.zeros(0, 3, dtype=torch.long))
        assert out.shape == (0, 3, 64) and key.shape == (0, 2, 3, 16)
        # the guard (a 0 among the positions) leaves the frequencies of a non-empty batch as they were
        from rope_export.op.rope_types import inv_freq_and_scaling

        positions = torch.tensor([[0, 5, 20], [1, 2, 3]])  # past the switch length of both schemes
        cos, sin, pos = block.rotary.cos_sin(positions)
        inv_freq, scaling = inv_freq_and_scaling(block.rotary.config, torch.tensor(21))
        angles = positions.float().unsqueeze(-1) * inv_freq.float()
        assert pos is None
        torch.testing.assert_close(cos, torch.cos(angles) * scaling)
        torch.testing.assert_close(sin, torch.sin(angles) * scaling)
