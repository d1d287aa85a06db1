"""The blocks and files users reported check wrongly failed, built here the way they built them.

* ``RotateHalfBlock``: rotate-half written from scratch, [MAX_POS, D] cos/sin buffers indexed by an
  input called ``pos`` (not ``position_ids``);
* ``MetaBlock``: Meta's reference ``apply_rotary_emb`` (view_as_complex times freqs_cis), its 512-row
  freqs_cis cut per token; ``meta_factory`` for ``rope-export export --module``;
* ``GPTJGatherBlock``: GPT-J's rotation as transformers < 4.58 wrote it (``torch.gather`` over
  ``embed_positions``, what optimum's GPT-J files hold): a GatherElements over 256 positions;
* ``static_one_node_file``: one rotary node, every dim fixed, written with onnx.helper;
* ``swap_weights``: a file with two weight matrices exchanged (the other direction: must FAIL).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.rope_types import RopeConfig, build_caches

MAX_POS, H, D = 512, 2, 16


def _init(module: nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.2


class RotateHalfBlock(nn.Module):
    """A user's own attention block: rotate-half, [MAX_POS, D] cos/sin buffers indexed by ``pos``."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H * D, H * D) for _ in range(4))
        _init(self)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq
        self.register_buffer("cos_cached", torch.cat((freqs, freqs), -1).cos(), persistent=False)
        self.register_buffer("sin_cached", torch.cat((freqs, freqs), -1).sin(), persistent=False)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, H, D).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = self.cos_cached[pos][:, None], self.sin_cached[pos][:, None]

        def rotate_half(t):
            return torch.cat((-t[..., D // 2:], t[..., : D // 2]), dim=-1)

        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return self.wo((weights @ v).transpose(1, 2).reshape(b, s, H * D))


class MetaBlock(nn.Module):
    """Meta's reference rotation (llama_models' own functions) with a 512-row freqs_cis, rows from ``pos``."""

    def __init__(self):
        super().__init__()
        from rope_blocks import meta_reference

        self.wq, self.wk = nn.Linear(H * D, H * D, bias=False), nn.Linear(H * D, H * D, bias=False)
        _init(self)
        self.ref = meta_reference()
        self.freqs_cis = self.ref.precompute_freqs_cis(D, MAX_POS)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k = self.wq(x).view(b, s, H, D), self.wk(x).view(b, s, H, D)
        rows = pos[0, 0] + torch.arange(s)  # Meta slices freqs_cis[start_pos : start_pos + seqlen]
        freqs_cis = torch.view_as_complex(torch.view_as_real(self.freqs_cis)[rows])
        return self.ref.apply_rotary_emb(q, k, freqs_cis)


class GPTJGatherBlock(nn.Module):
    """GPT-J's partial interleaved rotation, its sin|cos table read by torch.gather (transformers < 4.58)."""

    def __init__(self, positions: int = 256, rotary_dim: int = 8):
        super().__init__()
        self.q, self.k = nn.Linear(H * D, H * D, bias=False), nn.Linear(H * D, H * D, bias=False)
        _init(self)
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.arange(positions).float()[:, None] * inv_freq
        self.register_buffer("embed_positions", torch.cat((freqs.sin(), freqs.cos()), 1), persistent=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q, k = self.q(x).view(b, s, H, D), self.k(x).view(b, s, H, D)
        table = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        sincos = torch.gather(table, 1, position_ids.unsqueeze(-1).repeat(1, 1, table.shape[-1]))
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        sin, cos = (torch.repeat_interleave(t[:, :, None, :], 2, 3) for t in (sin, cos))

        def rotate_every_two(t):
            return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)

        def rotate(t):
            rot, rest = t[..., : self.rotary_dim], t[..., self.rotary_dim:]
            return torch.cat([rot * cos + rotate_every_two(rot) * sin, rest], dim=-1)

        return rotate(q), rotate(k)


def example(seq: int = 5, offset: int = 0):
    x = torch.randn(2, seq, H * D, generator=torch.Generator().manual_seed(1))
    return x, (torch.arange(seq) + offset).expand(2, seq).contiguous()


def meta_factory():
    """For ``rope-export export --module tests/check/user_blocks.py:meta_factory``."""
    return {"module": MetaBlock().eval(), "args": example(), "input_names": ["x", "pos"]}


def static_one_node_file(rows: int = 64) -> onnx.ModelProto:
    """X [1, 1, 3, 4], position_ids [1, 3], caches [rows, 2]: every dim fixed, as some tools write them."""
    cos, sin = build_caches(RopeConfig(head_dim=4, rope_theta=500.0, max_position_embeddings=rows))
    node = helper.make_node(OP_TYPE, ["x", "cos", "sin", "position_ids"], ["y"], domain=DOMAIN)
    graph = helper.make_graph(
        [node], "static", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 4]),
                           helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 3, 4])],
        initializer=[numpy_helper.from_array(cos.numpy(), "cos"), numpy_helper.from_array(sin.numpy(), "sin")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def swap_weights(model: onnx.ModelProto, min_size: int = 16) -> onnx.ModelProto:
    """The first two square weight matrices exchanged (q and k projections, say)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    first, second = [i for i in out.graph.initializer if len(i.dims) == 2 and i.dims[0] == i.dims[1] >= min_size][:2]
    a, b = numpy_helper.to_array(first).copy(), numpy_helper.to_array(second).copy()
    first.CopyFrom(numpy_helper.from_array(b, first.name))
    second.CopyFrom(numpy_helper.from_array(a, second.name))
    return out


class ImplicitPositionsBlock(RotateHalfBlock):
    """The same block with no positions input: it rotates token i by position i (arange over the sequence)."""

    def forward(self, x):
        return super().forward(x, torch.arange(x.shape[1]).expand(x.shape[0], -1))


def rotate_half_factory():
    """For ``rope-export export --module`` and ``rope-export check --module``."""
    return {"module": RotateHalfBlock().eval(), "args": example(), "input_names": ["x", "pos"]}


def rotate_half_other_weights_factory():
    """The same block with one query weight changed: not the module the file came from."""
    block = RotateHalfBlock().eval()
    block.wq.weight.data[0, 0] += 0.1
    return {"module": block, "args": example(), "input_names": ["x", "pos"]}


def sliced_table_file(rows: int = MAX_POS, heads: int = 2, head_dim: int = 16) -> onnx.ModelProto:
    """One rotary node without position_ids whose per-token caches are ``table[:seq]`` (Meta's
    ``freqs_cis[:seqlen]``): the first S rows of [rows, D/2] tables, S read from X's shape."""
    cos, sin = build_caches(RopeConfig(head_dim=head_dim, rope_theta=10000.0, max_position_embeddings=rows))
    const = [numpy_helper.from_array(np.array(v), n)
             for n, v in (("zero", [0]), ("two", [2]), ("half", [head_dim // 2]))]
    nodes = [helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("Gather", ["x_shape", "zero"], ["batch"], axis=0),
             helper.make_node("Gather", ["x_shape", "two"], ["seq"], axis=0),
             helper.make_node("Concat", ["batch", "seq", "half"], ["cache_shape"], axis=0)]
    for role in ("cos", "sin"):  # [B, S, D/2] = expand(table[:S][None])
        nodes += [helper.make_node("Slice", [f"{role}_table", "zero", "seq", "zero"], [f"{role}_rows"]),
                  helper.make_node("Unsqueeze", [f"{role}_rows", "zero"], [f"{role}_one"]),
                  helper.make_node("Expand", [f"{role}_one", "cache_shape"], [f"{role}_cache"])]
    nodes.append(helper.make_node(OP_TYPE, ["x", "cos_cache", "sin_cache"], ["y"], domain=DOMAIN))
    x_type = ["batch", heads, "seq", head_dim]
    graph = helper.make_graph(
        nodes, "sliced table", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_type)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_type)],
        initializer=[*const, numpy_helper.from_array(cos.numpy(), "cos_table"),
                     numpy_helper.from_array(sin.numpy(), "sin_table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
