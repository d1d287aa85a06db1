"""A KV cache kept in preallocated buffers, updated in place: no decode step copies the whole past.

The default ``export --hf`` file grows its cache by Concat: each step reads the past and writes
past+seq, so a decode step copies the whole past of every layer. Here each layer's past is a buffer
``[batch, kv_heads, max_length, head]`` that the runtime hands back as the present
(onnxruntime-genai's ``past_present_share_buffer: true``; the same memory bound as input and output):

* the step's keys and values go into the buffer with ai.onnx ``TensorScatter``-24 at
  ``past = attention_mask length - seq`` (onnxruntime writes in place when the present aliases the
  past);
* attention is ai.onnx ``Attention``-24 over the buffer with ``nonpad_kv_seqlen`` = past+seq, so it
  reads the filled part only; transformers' own mask (causal, padding, sliding windows) is padded
  to the buffer's length with "blocked".

The export routes transformers through this with a cache layer whose ``update`` scatters, and an
attention function registered with transformers (``ATTENTION``) that calls the buffer attention op;
both are torch custom ops exported as nodes of the ``rope_export.kv`` domain, renamed to the ai.onnx
ops (opset 24) afterwards (``to_standard_ops``). Attention logit soft-capping (Gemma-2) is refused:
ONNX Attention caps after adding the mask, transformers before.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import DynamicLayer

from rope_export.hf.errors import HFExportError

DOMAIN = "rope_export.kv"
ATTENTION = "rope_export_kv_buffer"  # the attn_implementation name registered with transformers
OPSET = 24  # TensorScatter and Attention's nonpad_kv_seqlen
SOFTCAP = ("attention logit soft-capping is not expressible with ONNX Attention-24 (it caps after adding the mask, "
           "transformers before); export without a KV buffer")


@torch.library.custom_op("rope_export_kv::scatter", mutates_args=())
def kv_scatter(buffer: torch.Tensor, update: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``buffer`` [B, H, M, D] with ``update`` [B, H, S, D] written at ``start[b]`` .. +S on axis 2."""
    out = buffer.clone()
    seq = update.shape[2]
    index = (start[:, None] + torch.arange(seq, device=start.device))[:, None, :, None].expand_as(update)
    return out.scatter_(2, index, update)


@kv_scatter.register_fake
def _(buffer, update, start):
    return torch.empty_like(buffer)


@torch.library.custom_op("rope_export_kv::attention", mutates_args=())
def buffer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     valid: torch.Tensor, scale: float) -> torch.Tensor:
    """ai.onnx Attention-24: ``query`` [B, H, S, D], ``key``/``value`` [B, KVH, M, D] (H a multiple of KVH),
    additive ``mask`` [B, 1, S, M], keys at or past ``valid[b]`` (nonpad_kv_seqlen) not read."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale + mask.float()
    readable = torch.arange(key.shape[2], device=key.device)[None, :] < valid[:, None]
    scores = scores.masked_fill(~readable[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ value.float()).to(query.dtype)


@buffer_attention.register_fake
def _(query, key, value, mask, valid, scale):
    return torch.empty_like(query)


def _translations() -> dict:
    import onnxscript

    kv = onnxscript.values.Opset(DOMAIN, 1)

    def scatter(buffer, update, start):
        return kv.TensorScatter(buffer, update, start, axis=2)

    def attention(query, key, value, mask, valid, scale=1.0):
        # softmax_precision 1 (float32): transformers' softmax (and buffer_attention's) runs in float32 in a
        # half-precision model; without it ONNX Attention computes the softmax in the query's type
        return kv.Attention(query, key, value, mask, valid, scale=float(scale), softmax_precision=1)

    return {torch.ops.rope_export_kv.scatter.default: scatter, torch.ops.rope_export_kv.attention.default: attention}


def _register_schemas() -> None:
    """onnxscript builds custom-domain nodes only with a schema; output: input 0's type and shape."""
    from onnx import defs

    def infer(ctx):
        ctx.set_output_type(0, ctx.get_input_type(0))

    P = defs.OpSchema.FormalParameter
    for op, inputs in (("TensorScatter", ("past_cache", "update", "write_indices")),
                       ("Attention", ("Q", "K", "V", "attn_mask", "nonpad_kv_seqlen"))):
        try:
            defs.get_schema(op, 1, DOMAIN)
            continue
        except defs.SchemaError:
            pass
        schema = defs.OpSchema(op, DOMAIN, 1, inputs=[P(name, "T") for name in inputs], outputs=[P("Y", "T")],
                               type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)",
                                                        "tensor(int64)"], "any")],
                               attributes=[defs.OpSchema.Attribute(name, defs.OpSchema.AttrType.FLOAT if name ==
                                                                   "scale" else defs.OpSchema.AttrType.INT, "")
                                           for name in (("axis",) if op == "TensorScatter" else
                                                        ("scale", "softmax_precision"))])
        schema.set_type_and_shape_inference_function(infer)
        defs.register_schema(schema)


def custom_translation_table() -> dict:
    _register_schemas()
    return _translations()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' attention interface: ``key``/``value`` are the whole buffers (BufferLayer.update)."""
    if softcap:
        raise HFExportError(SOFTCAP)
    batch, _, seq, _ = query.shape
    length = key.shape[2]
    if attention_mask is None:
        raise HFExportError("the KV buffer export needs transformers' attention mask")
    mask = attention_mask
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
    mask = torch.nn.functional.pad(mask, (0, length - mask.shape[-1]), value=torch.finfo(query.dtype).min)
    valid = torch.full((batch,), attention_mask.shape[-1], dtype=torch.long)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.rope_export_kv.attention(query, key, value, mask.to(query.dtype), valid, float(scale))
    return out.transpose(1, 2).contiguous(), None


class BufferLayer(DynamicLayer):
    """A cache layer whose keys and values are the buffers [B, KVH, M, D]; ``update`` scatters into them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor, past: int):
        super().__init__()
        self.keys, self.values, self.start, self.past = keys, values, start, past
        self.is_initialized = True
        self.device, self.dtype = keys.device, keys.dtype

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = torch.ops.rope_export_kv.scatter(self.keys, key_states, self.start)
        self.values = torch.ops.rope_export_kv.scatter(self.values, value_states, self.start)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0


@contextlib.contextmanager
def buffer_attention_set(model):
    """The model's attention is ``_attention`` (and its mask transformers' eager one) for the block."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    configs = [c for c in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
               if hasattr(c, "_attn_implementation")]
    saved = [c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for config, value in zip(configs, saved, strict=True):
            config._attn_implementation = value


class CausalLMWithKVBuffer(torch.nn.Module):
    """``forward(input_ids, position_ids, attention_mask, *buffers) -> (logits, *buffers updated)``.

    ``buffers``: each layer's key and value buffer [B, KVH, M, D]; ``attention_mask`` [B, past+S]
    says how much of them is filled (past = its length - S) and which tokens are padding.
    """

    def __init__(self, model, layout):
        super().__init__()
        self.model, self.layout = model, layout
        text = model.config.get_text_config(decoder=True)
        if getattr(text, "attn_logit_softcapping", None):
            raise HFExportError(f"{model.config.model_type}: {SOFTCAP}")
        if any(io.names() != ["key", "value"] for io in layout.layers):
            raise HFExportError(f"{model.config.model_type}: a KV buffer export needs plain keys and values in every "
                                "cache layer (this model has other states)")

    def forward(self, input_ids, position_ids, attention_mask, *buffers):
        from rope_export.hf.cache_io import make_cache, with_cache

        past = attention_mask.shape[1] - input_ids.shape[1]
        start = torch.full((input_ids.shape[0],), past, dtype=torch.long)
        cache = make_cache(self.model)
        tensors = iter(buffers)
        for io in self.layout.layers:
            cache.layers[io.index] = BufferLayer(next(tensors), next(tensors), start, past)
        out = with_cache(self.model, cache, input_ids=input_ids, position_ids=position_ids,
                         attention_mask=attention_mask)
        present = [t for io in self.layout.layers for t in (cache.layers[io.index].keys, cache.layers[io.index].values)]
        return (out.logits, *present)


def example_buffers(model, layout, inputs: tuple, room: int = 2) -> tuple:
    """``hf_example_inputs(..., attention_mask=True)`` with each past made a buffer ``room`` longer than past+seq."""
    ids, positions, mask, *past = inputs
    length = mask.shape[1] + room
    buffers = []
    for tensor in past:
        buffer = torch.zeros(tensor.shape[0], tensor.shape[1], length, tensor.shape[3], dtype=tensor.dtype)
        buffer[:, :, : tensor.shape[2]] = tensor
        buffers.append(buffer)
    return (ids, positions, mask, *buffers)


def to_standard_ops(model) -> int:
    """Rename the ``rope_export.kv`` nodes of a ModelProto to ai.onnx TensorScatter / Attention (opset 24)."""
    renamed = 0
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.domain = ""
            if node.op_type == "Attention":  # inputs: Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen
                node.input[:] = [*node.input[:4], "", "", node.input[4]]
            renamed += 1
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET)
    kept = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return renamed


def name_buffer_dims(model) -> None:
    """The buffers' length axis is ``max_length`` on the pasts and the presents (they are the same buffers)."""
    names = {v.name for v in model.graph.input if v.name.startswith("past_key_values.")}
    old = {v.type.tensor_type.shape.dim[2].dim_param for v in model.graph.input if v.name in names}
    for value in [*model.graph.input, *model.graph.output]:
        if value.name.startswith(("past_key_values.", "present.")):
            dim = value.type.tensor_type.shape.dim[2]
            if dim.dim_param in old or value.name.startswith("present."):
                dim.dim_param = "max_length"
