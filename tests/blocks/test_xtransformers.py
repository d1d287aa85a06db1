"""lucidrains' x-transformers (the ``dev`` extra pins it): its attention layers with rotary embeddings, built
the way the library's models build them (``Decoder``/``Encoder(rotary_pos_emb=True)``, inside a
``TransformerWrapper`` language model), tiny and fp32.

Its rotation: ``RotaryEmbedding`` makes angles ``[1, S, rd]`` (each frequency twice, interleaved), and
``apply_rotary_pos_emb`` rotates the first ``rd`` channels of ``[B, H, S, D]`` with GPT-J pairs
(``t * freqs.cos() * scale + rotate_half(t) * freqs.sin() * scale``, ``scale = 1.``), partial by default
(``rd = dim_head // 2``). Through export_module and through ``fuse`` of its plain ``torch.onnx.export``:
one rotary node per rotated tensor (2 per attention layer), the ``onnx`` lowering equal to the eager
model on onnxruntime within 1e-5 at another batch and sequence length. Its xPos variant (``rotary_xpos``:
a per-position scale) is counted, refused and left decomposed. rotary-embedding-torch's cache
(``cache_if_possible``, warmed by a longer call first) is read in the forward: exported and fused too.
"""

from __future__ import annotations

import pytest
import torch
import vision_blocks as vb
from test_module_export_vision import assert_equal_to_eager, n_rotary, plain_export

import rope_export
from rope_export.detect import count_rotations
from rope_export.passes import FusionReport, fuse

x_transformers = pytest.importorskip("x_transformers")

DIM, HEADS, DIM_HEAD, TOKENS = 64, 4, 16, 50


def layers(kind: str = "Decoder", depth: int = 2, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    make = getattr(x_transformers, kind)
    return make(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, **options).eval()


def hidden(batch: int = 2, seq: int = 7, seed: int = 1) -> tuple[torch.Tensor]:
    return (torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed)),)


def language_model(depth: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    decoder = x_transformers.Decoder(dim=DIM, depth=depth, heads=HEADS, attn_dim_head=DIM_HEAD, rotary_pos_emb=True)
    return x_transformers.TransformerWrapper(num_tokens=TOKENS, max_seq_len=32, attn_layers=decoder).eval()


def token_ids(batch: int = 2, seq: int = 7, seed: int = 1) -> tuple[torch.Tensor]:
    return (torch.randint(0, TOKENS, (batch, seq), generator=torch.Generator().manual_seed(seed)),)


def rotary_attributes(model) -> list[dict]:
    import onnx

    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node
            if n.op_type == "RotaryEmbedding"]


@pytest.mark.parametrize(("kind", "rotary_dim"), [("Decoder", None), ("Encoder", DIM_HEAD)],
                         ids=["decoder-partial", "encoder-full"])
def test_export_module_gives_two_nodes_per_attention_layer(kind, rotary_dim):
    block = layers(kind, rotary_pos_emb=True, rotary_emb_dim=rotary_dim)
    result = rope_export.export_module(block, hidden())
    assert result.rotary_nodes == 4 and result.count.ok, result.as_text()
    assert result.count.layers == {0: (2, 2), 2: (2, 2)}  # layers 1 and 3 are the feed-forwards
    attrs = rotary_attributes(result.model)
    assert {a["interleaved"] for a in attrs} == {1}
    assert {a["rotary_embedding_dim"] for a in attrs} == ({DIM_HEAD // 2} if rotary_dim is None else {0})
    assert_equal_to_eager(result.model, block, hidden(batch=3, seq=9, seed=2))  # dynamic batch and sequence


def test_fuse_of_the_plain_export_of_a_language_model_fuses_every_rotation():
    """TransformerWrapper + Decoder(depth=3): 6 rotations, all fused from torch.onnx.export's own file."""
    model = language_model(depth=3)
    assert len(count_rotations(model, token_ids()).plain) == 6
    report = FusionReport()
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=32)},)
    fused = fuse(plain_export(model, token_ids(), dims), report=report, validate=True)
    assert n_rotary(fused) == 6 and (report.found, report.num_fused, report.left) == (6, 6, 0), report.as_text()
    assert_equal_to_eager(fused, model, token_ids(batch=3, seq=9, seed=2))


def test_export_module_of_a_language_model():
    model = language_model(depth=1)
    result = rope_export.export_module(model, token_ids())
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert_equal_to_eager(result.model, model, token_ids(batch=3, seq=9, seed=2))


def test_xpos_is_counted_and_refused():
    """rotary_xpos: cos/sin times a per-position scale: not plain RoPE, nothing fused, the file is exact."""
    block = layers("Decoder", depth=1, rotary_xpos=True)
    census = count_rotations(block, hidden())
    assert (len(census.plain), len(census.scaled)) == (0, 2), census.as_text()
    result = rope_export.export_module(block, hidden(), dynamic_shapes=None)
    assert result.rotary_nodes == 0 and len(result.count.refused) == 2, result.as_text()
    assert_equal_to_eager(result.model, block, hidden(seed=3))


def test_rotary_embedding_torch_with_a_warmed_cache():
    """rotary-embedding-torch caches its angles (``cache_if_possible``, the default) in ``rotate_queries_or_keys``;
    warmed by a longer call, the counted forward reads the cache: still 2 rotations, fused by export_module
    and by fuse of the plain export, exact."""
    block = vb.lucidrains()
    block.rope.rotate_queries_or_keys(torch.zeros(1, vb.HEADS, 24, vb.HEAD_DIM))  # warm-up: 24 positions
    assert block.rope.cache_if_possible and block.rope.cached_freqs_seq_len == 24
    inputs = (torch.randn(2, vb.N, vb.HIDDEN, generator=torch.Generator().manual_seed(3)),)
    other = (torch.randn(3, vb.N, vb.HIDDEN, generator=torch.Generator().manual_seed(4)),)
    result = rope_export.export_module(block, inputs)
    assert result.rotary_nodes == 2 and result.count.ok, result.as_text()
    assert_equal_to_eager(result.model, block, other)
    report = FusionReport()
    fused = fuse(plain_export(block, inputs, ({0: torch.export.Dim("batch")},)), report=report, validate=True)
    assert n_rotary(fused) == 2 and (report.found, report.num_fused, report.left) == (2, 2, 0), report.as_text()
    assert_equal_to_eager(fused, block, other)


def torchscript_export(model, inputs, dynamic_axes=None):
    import io
    import warnings

    import onnx

    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, buffer, dynamo=False, opset_version=18, input_names=["x"],
                          dynamic_axes=dynamic_axes)
    return onnx.load_from_string(buffer.getvalue())


def test_fuse_of_a_static_torchscript_export():
    """TorchScript keeps x-transformers' ``* scale`` (1.0) after each product: fuse bypasses the Mul by one
    (exact) and fuses all 6 rotations (it found none before)."""
    block = layers("Decoder", depth=3, rotary_pos_emb=True)  # 3 attention layers
    report = FusionReport()
    fused = fuse(torchscript_export(block, hidden()), report=report, validate=True)
    assert n_rotary(fused) == 6 and (report.found, report.num_fused, report.left) == (6, 6, 0), report.as_text()
    assert_equal_to_eager(fused, block, hidden(seed=2))


@pytest.mark.parametrize("axes", [{0: "batch"}, {0: "batch", 1: "seq"}], ids=["batch", "batch-seq"])
def test_fuse_of_a_dynamic_torchscript_export_counts_them_and_says_why_not(axes):
    """Not fused yet: with dynamic axes the TorchScript graph slices the rotated channels with an end read from
    the angles' shape, which shape inference leaves unknown, so the sites cannot be evaluated on probe sizes.
    The 6 rotations are counted (none were before) and each is left alone with the reason; nothing is rewritten."""
    block = layers("Decoder", depth=3, rotary_pos_emb=True)
    report = FusionReport()
    fused = fuse(torchscript_export(block, hidden(), {"x": axes}), report=report)
    assert (report.found, report.num_fused, report.left) == (6, 0, 6) and n_rotary(fused) == 0, report.as_text()
    assert all("could not be evaluated" in r.detail for r in report.rows() if r.status == "left alone")
