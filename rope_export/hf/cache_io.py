"""The cache as graph inputs and outputs: per-layer geometry, the wrappers torch.export traces.

transformers keeps its cache in a ``DynamicCache`` object; an ONNX file needs flat tensors. The
geometry is read from one tiny eager forward, layer by layer (``cache_layout``): key and value
widths may differ (MLA: DeepSeek V2/V3, MiniCPM3), and so may heads and widths between layers
(Gemma 4's global layers). Layers that keep no cache of their own (KV sharing, MLP-only layers)
have no I/O. Sliding-window layers keep the whole past in the file (the sliding mask makes the
same attention), so every past has one length.

Layers whose cache is not keys and values (recurrent, convolutional, linear-attention states)
are refused in one line naming the layer; so are models that bring a cache class of their own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from rope_export.hf.errors import HFExportError
from rope_export.hf.families import MODEL_TYPES, text_config


@dataclass(frozen=True)
class LayerIO:
    """One cache layer's keys and values: (heads, width) of each, [B, heads, past, width] in the file."""

    index: int
    key: tuple[int, int]
    value: tuple[int, int]


@dataclass(frozen=True)
class CacheLayout:
    """The cache layers that have I/O, in order, and how many cache layers the model has in all."""

    layers: tuple[LayerIO, ...]
    num_cache_layers: int

    @classmethod
    def uniform(cls, num_layers: int, heads: int = 0, width: int = 0) -> CacheLayout:
        return cls(tuple(LayerIO(i, (heads, width), (heads, width)) for i in range(num_layers)), num_layers)

    def input_names(self) -> list[str]:
        return [f"past_key_values.{io.index}.{kv}" for io in self.layers for kv in ("key", "value")]

    def output_names(self) -> list[str]:
        return [f"present.{io.index}.{kv}" for io in self.layers for kv in ("key", "value")]


def _refuse_layer(model, index: int, layer) -> HFExportError:
    config = text_config(model.config)
    layer_types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    kind = f"a {layer_types[index]!r} layer" if index < len(layer_types) else "a layer"
    return HFExportError(
        f"{config.model_type}: layer {index} is {kind} whose cache is {type(layer).__name__} (recurrent/convolution "
        "states, not keys and values): exporting it needs its state as graph I/O, which rope-export does not "
        "write yet; export a model whose layers are all attention layers"
    )


def make_cache(model):
    """The DynamicCache transformers would use for ``model``, with sliding-window layers keeping the whole past."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[index] = DynamicLayer()
    return cache


def _is_kv_layer(layer) -> bool:
    from transformers.cache_utils import DynamicLayer

    return isinstance(layer, DynamicLayer) and not hasattr(layer, "conv_states")


def _is_empty_layer(layer) -> bool:
    return getattr(layer, "keys", None) is None and not hasattr(layer, "conv_states")


def cache_layout(model) -> CacheLayout:
    """Per-layer key/value geometry of the text decoder, read from one tiny eager forward."""
    from transformers.cache_utils import Cache

    cache = make_cache(model)
    with torch.no_grad():
        try:
            out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True, past_key_values=cache)
        except ValueError as exc:  # e.g. "MiniMax uses cache of its own and is not compatible with DynamicCache"
            first = str(exc).strip().splitlines()[0]
            raise HFExportError(f"{model.config.model_type}: its cache is not transformers' DynamicCache ({first}); "
                                "rope-export exports DynamicCache models only") from None
    filled = getattr(out, "past_key_values", None)
    if not isinstance(filled, Cache):
        raise HFExportError(
            f"{model.config.model_type}: {type(model).__name__} returns no transformers Cache "
            f"(past_key_values is {type(filled).__name__}); rope-export exports models with a DynamicCache only"
        )
    layers = []
    for index, layer in enumerate(filled.layers):
        if _is_kv_layer(layer) and layer.keys is not None and layer.keys.numel() > 0:
            keys, values = layer.keys, layer.values
            layers.append(LayerIO(index, (int(keys.shape[1]), int(keys.shape[3])),
                                  (int(values.shape[1]), int(values.shape[3]))))
        elif not _is_empty_layer(layer):
            raise _refuse_layer(model, index, layer)
    if not layers:
        raise HFExportError(f"{model.config.model_type}: no layer keeps keys and values in transformers' cache")
    return CacheLayout(tuple(layers), len(filled.layers))


def hf_io_names(layout: CacheLayout | int) -> tuple[list[str], list[str]]:
    """Graph input and output names of a causal-LM export (the optimum / onnxruntime-genai convention)."""
    if isinstance(layout, int):
        layout = CacheLayout.uniform(layout)
    return ["input_ids", "position_ids", *layout.input_names()], ["logits", *layout.output_names()]


def hf_example_inputs(model, *, batch: int = 2, seq: int = 4, past: int = 3, seed: int = 0,
                      position_rank: int | None = None, layout: CacheLayout | None = None) -> tuple[torch.Tensor, ...]:
    """Inputs of ``CausalLMWithCache(model)``: ids, positions past..past+S-1, random past keys/values."""
    if position_rank is None:
        model_type = model.config.model_type
        position_rank = MODEL_TYPES[model_type].position_rank if model_type in MODEL_TYPES else 2
    layout = layout or cache_layout(model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text_config(model.config).vocab_size, (batch, seq), generator=generator)
    positions = (torch.arange(seq) + past).expand(batch, seq).contiguous()
    if position_rank == 3:
        positions = positions.expand(3, batch, seq).contiguous()
    dtype = next(model.parameters()).dtype
    kv = []
    for io in layout.layers:
        for heads, width in (io.key, io.value):
            kv.append(torch.randn(batch, heads, past, width, generator=generator).to(dtype))
    return (ids, positions, *kv)


class CausalLMWithCache(nn.Module):
    """``forward(input_ids, position_ids, *past) -> (logits, *present)``, past/present flat per cache layer.

    ``past`` is ``key, value`` of each layer of ``layout`` ([B, heads, P, width], P = 0 for prefill);
    ``position_ids`` is [B, S] ([3, B, S] for Qwen2-VL). A DynamicCache is filled inside.
    """

    def __init__(self, model: nn.Module, layout: CacheLayout | int):
        super().__init__()
        self.model = model
        self.layout = CacheLayout.uniform(layout) if isinstance(layout, int) else layout

    def forward(self, input_ids, position_ids, *past):
        expected = 2 * len(self.layout.layers)
        if len(past) != expected:
            raise HFExportError(f"expected {expected} past tensors (key and value per cache layer), got {len(past)}")
        cache = make_cache(self.model)
        for n, io in enumerate(self.layout.layers):
            cache.layers[io.index].update(past[2 * n], past[2 * n + 1])
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        present = []
        for io in self.layout.layers:
            layer = out.past_key_values.layers[io.index]
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's self-attention modules, in layer order."""
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
             and "Vision" not in type(m).__name__]
    return sorted(found, key=lambda m: m.layer_idx)


def rotary_module(model: nn.Module) -> nn.Module | None:
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RotaryEmbedding") and "Vision" not in name:
            return m
    return None


class AttentionWithCache(nn.Module):
    """One transformers attention layer with the preset blocks' I/O.

    ``forward(hidden_states [B,S,hidden], position_ids [B,S] ([3,B,S] for mRoPE), past_key, past_value)
    -> (output, present_key, present_value)``: cos/sin from the model's rotary module, a causal
    mask built here (position p sees keys 0..p), the layer's own projections and attention.
    """

    def __init__(self, model: nn.Module, layer: int):
        super().__init__()
        layers = attention_layers(model)
        if not 0 <= layer < len(layers):
            raise HFExportError(f"layer {layer} does not exist: the model has {len(layers)} attention layers")
        self.attention = layers[layer]
        self.rotary = rotary_module(model)
        self.layer = layer
        self._parameters_of = set(inspect.signature(self.attention.forward).parameters)

    def forward(self, hidden_states, position_ids, past_key, past_value):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        idx = self.attention.layer_idx
        cache.update(past_key, past_value, idx)
        seq, total = hidden_states.shape[1], past_key.shape[2] + hidden_states.shape[1]
        query_pos = torch.arange(seq, device=hidden_states.device).unsqueeze(1) + (total - seq)
        key_pos = torch.arange(total, device=hidden_states.device).unsqueeze(0)
        blocked = (key_pos > query_pos)[None, None]
        mask = torch.zeros(blocked.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        mask = mask.masked_fill(blocked, torch.finfo(hidden_states.dtype).min)
        mask = mask.expand(hidden_states.shape[0], 1, seq, total)
        kwargs = {"attention_mask": mask}
        names = self._parameters_of
        kwargs["past_key_values" if "past_key_values" in names else "layer_past"] = cache
        if "position_embeddings" in names and self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden_states, position_ids)
        if "position_ids" in names and self.rotary is None:
            kwargs["position_ids"] = position_ids
        output = self.attention(hidden_states, **kwargs)[0]
        layer = cache.layers[idx]
        return output, layer.keys, layer.values
