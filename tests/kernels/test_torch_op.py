"""The torch custom op: eager runs the reference, export sees a shape-only fake."""

import pytest
import torch

from rope_export.kernels import torch_op as ops
from rope_export.op import reference


@pytest.mark.parametrize("interleaved", [False, True])
def test_eager_op_is_the_reference(interleaved):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3 * 8)
    cos, sin = torch.randn(10, 3), torch.randn(10, 3)
    pos = torch.tensor([[0, 1, 2, 9, 10], [-1, 4, 5, 6, 7]])
    got = torch.ops.rope_export.rotary_embedding(x, cos, sin, pos, interleaved, 3, 6)
    want = reference.rotary_embedding(x, cos, sin, pos, interleaved=interleaved, num_heads=3, rotary_embedding_dim=6)
    assert torch.equal(got, want)
    # The token at position 10 (past the 10-row cache) and at -1 pass through unchanged.
    assert torch.equal(got[0, 4], x[0, 4]) and torch.equal(got[1, 0], x[1, 0])
    assert not torch.equal(got[0, 1], x[0, 1])


def test_fake_gives_shape_and_dtype_under_export():
    class Rotate(torch.nn.Module):
        def forward(self, x, cos, sin, pos):
            return ops.rotary_embedding(x, cos, sin, pos, False, 2, 0)

    x = torch.randn(1, 3, 8, dtype=torch.float16)
    caches = (torch.randn(4, 2), torch.randn(4, 2))
    program = torch.export.export(Rotate(), (x, *caches, torch.zeros(1, 3, dtype=torch.long)))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.rope_export.rotary_embedding.default in targets
    out = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["val"].shape) == (1, 3, 8) and out.meta["val"].dtype == torch.float16
