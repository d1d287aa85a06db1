"""export_hf(attention_mask=True): a padded batch through the file gives transformers' logits.

transformers' ``generate`` left-pads a batch and passes ``attention_mask`` (0 on the pads) with
positions that skip them; the file must take the same mask, or every row attends to the pads.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from rope_export import cli, hf  # noqa: E402
from rope_export.op.tolerances import tolerance  # noqa: E402
from rope_export.passes import lower  # noqa: E402

TOL = tolerance("block", "float32")


def _model(family: str):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, initializer_range=0.2)
    if family == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=2)
    else:  # GPT-NeoX: partial rotation, its own attention code
        config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=128,
                                            initializer_range=0.2, rotary_pct=0.5)
    return hf.build_hf_model(config, seed=0)


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return names, lambda feeds: session.run(None, feeds)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_padded_prefill_and_decode_match_transformers(family):
    model = _model(family)
    result = hf.export_hf(model, attention_mask=True)
    names, run = _session(result.model)
    assert names[:3] == ["input_ids", "position_ids", "attention_mask"]
    dims = [d.dim_param for d in result.model.graph.input[2].type.tensor_type.shape.dim]
    assert dims == ["batch", "past+seq"]
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])  # row 1 left-padded by 2
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = hf.make_cache(model)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    layout = result.layout
    past = [np.zeros(shape, np.float32) for io in layout.layers for shape in io.shapes(2, 0)]
    feeds = dict(zip(names, [ids.numpy(), pos.numpy(), mask.numpy(), *past], strict=True))
    got = run(feeds)
    real = mask.bool().numpy()
    assert TOL.allclose(got[0][real], want.logits.numpy()[real]), np.abs(got[0][real] - want.logits.numpy()[real]).max()
    # one decode step on the file's own present, the mask grown by one
    nxt = torch.tensor([[20], [21]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1)
    pos2 = pos[:, -1:] + 1
    with torch.no_grad():
        want2 = model(input_ids=nxt, attention_mask=mask2, position_ids=pos2, past_key_values=want.past_key_values,
                      use_cache=True)
    feeds = dict(zip(names, [nxt.numpy(), pos2.numpy(), mask2.numpy(), *got[1:]], strict=True))
    got2 = run(feeds)
    assert TOL.allclose(got2[0], want2.logits.numpy()), np.abs(got2[0] - want2.logits.numpy()).max()
    # without the mask the padded row would differ: the test can tell
    no_mask = dict(feeds, attention_mask=np.ones_like(mask2.numpy()))
    assert not TOL.allclose(run(no_mask)[0][1], want2.logits.numpy()[1])


def test_attention_mask_option_needs_hf_and_refuses_layer(tmp_path, capsys):
    assert cli.main(["export", "--attention-mask", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "--kv-buffer need --hf" in capsys.readouterr().err
    with pytest.raises(hf.HFExportError, match="whole models"):
        hf.export_hf(_model("llama"), layer=0, attention_mask=True)


def test_kv_buffer_export_matches_transformers_and_writes_only_the_new_tokens():
    """export_hf(kv_buffer=True): pasts are [B, KVH, max_length, D] buffers; the step's keys land at past.."""
    model = _model("llama")
    result = hf.export_hf(model, kv_buffer=True)
    ops = {(n.domain, n.op_type) for n in result.model.graph.node}
    assert ("", "TensorScatter") in ops and ("", "Attention") in ops
    assert not any(n.domain == "rope_export.kv" for n in result.model.graph.node)
    assert [d.dim_param for d in result.model.graph.input[3].type.tensor_type.shape.dim][2] == "max_length"
    names, run = _session(result.model)
    length = 12  # the buffers' length, past the tokens used
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    buffers = [np.full((2, 2, length, 8), 7.0, np.float32) for _ in result.layout.layers for _ in range(2)]
    got = run(dict(zip(names, [ids.numpy(), pos.numpy(), mask.numpy(), *buffers], strict=True)))
    cache = hf.make_cache(model)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    real = mask.bool().numpy()
    assert TOL.allclose(got[0][real], want.logits.numpy()[real])
    key0 = got[1]
    assert key0.shape == (2, 2, length, 8)
    assert TOL.allclose(key0[:, :, :5], cache.layers[0].keys.numpy())
    assert (key0[:, :, 5:] == 7.0).all()  # the rest of the buffer is left as it was
    nxt, mask2 = torch.tensor([[20], [21]]), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1)
    pos2 = pos[:, -1:] + 1
    with torch.no_grad():
        want2 = model(input_ids=nxt, attention_mask=mask2, position_ids=pos2, past_key_values=cache, use_cache=True)
    got2 = run(dict(zip(names, [nxt.numpy(), pos2.numpy(), mask2.numpy(), *got[1:]], strict=True)))
    assert TOL.allclose(got2[0], want2.logits.numpy()), np.abs(got2[0] - want2.logits.numpy()).max()
    assert TOL.allclose(got2[1][:, :, :6], cache.layers[0].keys.numpy()) and (got2[1][:, :, 6:] == 7.0).all()
