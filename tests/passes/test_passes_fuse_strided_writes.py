"""fuse_strided_writes: pairs rotated one by one and written into a buffer by strided slices (Wan's spelling),
which torch.onnx writes as two ScatterNDs between Transposes that its optimizer merges with their neighbours."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import rope_blocks as rb
import torch

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.passes import FusionReport, fuse, lower


def _nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def test_the_writes_become_one_node_each_transposed_as_they_were_written():
    report = FusionReport()
    original = rb.plain_export("strided_writes", 18)
    assert sum(n.op_type == "ScatterND" for n in original.graph.node) == 4  # two writes per rotated tensor
    fused = fuse(original, report=report)
    assert [r.form for r in report.rows()] == ["interleaved pairs written by strided slices"] * 2, report.as_text()
    assert (report.found, report.left) == (2, 0)
    assert not any(n.op_type == "ScatterND" for n in fused.graph.node)
    # the writes were into the buffer with its channel axis first (the Transposes back merged with the attention's
    # own): the node's output (reshaped back to [B, S, H, D]) is transposed as the writes were
    consumers = {i: n for n in fused.graph.node for i in n.input}
    after = [consumers[consumers[n.output[0]].output[0]] for n in _nodes(fused)]
    assert [n.op_type for n in after] == ["Transpose"] * 2 and all(n.attribute[0].ints[0] == 3 for n in after)
    session = ort.InferenceSession(lower(fused, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    block = rb.block("strided_writes")
    for offset, seq in ((0, rb.S), (9, 3)):  # a sequence length and positions never traced
        x, pos = rb.example(seq=seq, offset=offset, seed=offset + 2)
        with torch.no_grad():
            want = block(x, pos)
        for got, w in zip(session.run(None, {"x": x.numpy(), "pos": pos.numpy()}), want, strict=True):
            np.testing.assert_allclose(got, w.numpy(), rtol=1e-5, atol=1e-5)


class SameChannelsTwice(torch.nn.Module):
    """A look-alike: both members written to the even channels, the odd ones left zero."""

    def forward(self, x, pos):
        a = rb.angles(pos)[:, :, None, :]
        c, s = a.cos(), a.sin()
        q = x.view(*x.shape[:2], rb.H, rb.D)
        x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.zeros_like(q)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 0::2] = x1 * s + x2 * c
        return out


def test_writes_that_do_not_fill_the_pairs_are_left_alone_with_the_reason():
    report = FusionReport()
    fused = fuse(rb.export_plain(SameChannelsTwice(), rb.example()), report=report)
    assert not _nodes(fused)
    (row,) = report.rows()
    assert row.status == "left alone" and "not a rotation" in row.detail, report.as_text()
    assert onnx.checker.check_model(fused) is None
