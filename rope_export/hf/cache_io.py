"""The cache as graph inputs and outputs: per-layer geometry, the wrappers torch.export traces.

transformers keeps its cache in a ``DynamicCache`` object; an ONNX file needs flat tensors. The
geometry is read from one tiny eager forward, layer by layer (``cache_layout``): key and value
widths may differ (MLA: DeepSeek V2/V3, MiniCPM3), and so may heads and widths between layers
(Gemma 4's global layers). Layers that keep no cache of their own (KV sharing, MLP-only layers)
have no I/O. Sliding-window layers keep the whole past in the file (the sliding mask makes the
same attention), so every past has one length.

Hybrids' recurrent, convolutional and linear-attention layers keep fixed-size states
(``conv_states``, ``recurrent_states``): they are graph inputs and outputs too (zeros for a
prefill: the same as no state). Models that bring a cache class of their own are refused in one
line.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from rope_export.hf.errors import HFExportError
from rope_export.hf.families import MODEL_TYPES, text_config


@dataclass(frozen=True)
class Slot:
    """One cache tensor of a layer, as a graph input (``past_key_values.{layer}.{name}``) and output."""

    name: str  # "key", "value", "indexer_key", "conv.{j}", "recurrent.{j}"
    shape: tuple[int, ...]  # without the batch axis; the past axis (if any) holds 0
    past_axis: int | None  # the axis (batch counted) that grows with the past; None: a fixed-size state

    def example_shape(self, batch: int, past: int) -> tuple[int, ...]:
        shape = [batch, *self.shape]
        if self.past_axis is not None:
            shape[self.past_axis] = past
        return tuple(shape)


@dataclass(frozen=True)
class LayerIO:
    """One cache layer's tensors: keys and values [B, heads, past, width] (widths may differ), the
    indexer's keys [B, past, width] of DSA models (DeepSeek V3.2, GLM MoE DSA), and the conv and
    recurrent states [B, ...] of recurrent / linear-attention layers (hybrids)."""

    index: int
    slots: tuple[Slot, ...]
    conv_kernel: tuple[tuple[int, int], ...] = ()  # (state index, kernel size) of each conv state

    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def shapes(self, batch: int, past: int) -> list[tuple[int, ...]]:
        return [slot.example_shape(batch, past) for slot in self.slots]

    @property
    def has_states(self) -> bool:
        return any(slot.past_axis is None for slot in self.slots)

    @property
    def has_indexer(self) -> bool:
        return any(slot.name == "indexer_key" for slot in self.slots)


@dataclass(frozen=True)
class CacheLayout:
    """The cache layers that have I/O, in order, and how many cache layers the model has in all."""

    layers: tuple[LayerIO, ...]
    num_cache_layers: int

    @classmethod
    def uniform(cls, num_layers: int, heads: int = 0, width: int = 0) -> CacheLayout:
        kv = (Slot("key", (heads, 0, width), 2), Slot("value", (heads, 0, width), 2))
        return cls(tuple(LayerIO(i, kv) for i in range(num_layers)), num_layers)

    @property
    def has_states(self) -> bool:
        return any(io.has_states for io in self.layers)

    def input_names(self) -> list[str]:
        return [f"past_key_values.{io.index}.{name}" for io in self.layers for name in io.names()]

    def output_names(self) -> list[str]:
        return [f"present.{io.index}.{name}" for io in self.layers for name in io.names()]

    def past_axes(self) -> list[int | None]:
        """The past axis of each past tensor, in input order (None: a fixed-size state)."""
        return [slot.past_axis for io in self.layers for slot in io.slots]

    def fill(self, cache, past: tuple) -> None:
        """Put the flat past tensors into ``cache``'s layers (states as if a previous call had left them)."""
        tensors = iter(past)
        for io in self.layers:
            layer = cache.layers[io.index]
            given = {slot.name: next(tensors) for slot in io.slots}
            if "key" in given:
                layer.update(given["key"], given["value"])
            if "indexer_key" in given:
                layer.update_indexer(given["indexer_key"])
            kernels = dict(io.conv_kernel)
            for name, tensor in given.items():
                kind, _, index = name.partition(".")
                if kind in ("conv", "recurrent"):
                    _set_state(layer, kind, int(index), tensor, kernels.get(int(index)))

    def present(self, cache) -> list:
        """The flat present tensors of ``cache``'s layers."""
        return [_slot_tensor(cache.layers[io.index], slot.name) for io in self.layers for slot in io.slots]


def _slot_tensor(layer, name: str) -> torch.Tensor:
    kind, _, index = name.partition(".")
    if kind in ("conv", "recurrent"):
        return getattr(layer, f"{kind}_states")[int(index)]
    return getattr(layer, {"key": "keys", "value": "values", "indexer_key": "indexer_keys"}[kind])


def _set_state(layer, kind: str, index: int, tensor: torch.Tensor, kernel: int | None) -> None:
    """A conv or recurrent state handed in: the layer holds a copy (transformers updates it in place)."""
    if layer.device is None:
        layer.dtype, layer.device = tensor.dtype, tensor.device
    if kind == "conv":
        layer.conv_states[index] = tensor.clone()
        layer.conv_kernel_size[index] = kernel if kernel is not None else tensor.shape[-1]
        layer.is_conv_states_initialized[index] = True
    else:
        layer.recurrent_states[index] = tensor.clone()
        layer.is_recurrent_states_initialized[index] = True
    layer.has_previous_state[index] = True


def make_cache(model, num_layers: int = 0):
    """The DynamicCache transformers would use for ``model``, with sliding-window layers keeping the whole past.

    ``num_layers``: at least that many layers (``CacheLayout.num_cache_layers``). A model may append
    layers on its first call (Dory keeps each later loop over its looped layers in copies after its
    own layers); a filled cache must already have them, or the past has nowhere to go.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[index] = DynamicLayer()
    cache.layers += [DynamicLayer() for _ in range(num_layers - len(cache.layers))]
    return cache


# The keyword a transformers forward takes its Cache by: ``cache`` since 5.24 (which still accepts the
# deprecated ``past_key_values``), ``past_key_values`` before, ``layer_past`` on GPT-J's attention before 5.24.
CACHE_KEYWORDS = ("cache", "past_key_values", "layer_past")


def cache_keyword(forward) -> str:
    """Which of ``CACHE_KEYWORDS`` the callable (a module or its forward) takes; ``past_key_values`` if none."""
    names = inspect.signature(forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in names), "past_key_values")


def with_cache(model, cache, **inputs):
    """``model(**inputs)`` with ``cache`` handed in under the keyword the model's forward takes, and ``use_cache``."""
    return model(**inputs, **{cache_keyword(model.forward): cache}, use_cache=True)


def returned_cache(output):
    """The Cache a transformers forward returned: ``output.cache`` since 5.24, ``output.past_key_values`` before
    (5.24 keeps that name as a property that logs a deprecation)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


CHECKED_WINDOW = 256  # windows up to this are checked by running past them


def _code_names(code) -> set[str]:
    """The global names a code object reads, its nested functions' included (transformers 5.24's Llama 4
    builds its masks in lambdas inside forward)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _forward_names(model) -> set[str]:
    """The global names the forward methods of the model's classes read."""
    names = set()
    for cls in {type(sub) for sub in model.modules()}:
        forward = getattr(cls, "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
        if code is not None:
            names |= _code_names(code)
    return names


def check_sliding_layers(model) -> None:
    """Refuse, in one line, a model whose sliding-window attention relies on the cache dropping old keys.

    The file keeps a sliding layer's whole past and lets the sliding mask do the windowing; that is
    what transformers computes only if its attention masks by the window. One prefill past the
    window and one decode step, with transformers' own cache and with the file's, must agree.
    """
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    reference = DynamicCache(config=model.config)
    windows = [layer.sliding_window for layer in reference.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    if not windows:
        return
    if max(windows) > CHECKED_WINDOW:  # too long to run past: the code must at least build a sliding mask
        if not any("mask" in name and ("sliding" in name or "chunked" in name) for name in _forward_names(model)):
            raise HFExportError(
                f"{model.config.model_type}: its sliding-window layers (window {max(windows)}) build no sliding "
                "mask (the cache drops old keys instead); the file keeps the whole past, so it would attend to "
                "more keys than transformers does")
        return
    length = max(windows) + 2
    ids = torch.arange(length + 1).remainder(text_config(model.config).vocab_size)[None]
    logits = []
    with torch.no_grad():
        for cache in (reference, make_cache(model)):
            with_cache(model, cache, input_ids=ids[:, :length])
            logits.append(with_cache(model, cache, input_ids=ids[:, length:]).logits)
    if not torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-4):
        raise HFExportError(
            f"{model.config.model_type}: its sliding-window layers (window {max(windows)}) rely on the cache dropping "
            "old keys instead of masking them; the file keeps the whole past, so it would attend to more keys than "
            "transformers does")


def _layer_io(index: int, layer) -> LayerIO | None:
    """The I/O of one filled cache layer (None: it keeps nothing of its own, e.g. KV sharing)."""
    slots, kernels = [], []
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.numel() > 0:
        values = layer.values
        slots += [Slot("key", (int(keys.shape[1]), 0, int(keys.shape[3])), 2),
                  Slot("value", (int(values.shape[1]), 0, int(values.shape[3])), 2)]
        indexer = getattr(layer, "indexer_keys", None)
        if isinstance(indexer, torch.Tensor) and indexer.numel() > 0:
            slots.append(Slot("indexer_key", (0, int(indexer.shape[-1])), 1))
    for kind in ("conv", "recurrent"):
        for state_index, state in sorted((getattr(layer, f"{kind}_states", None) or {}).items()):
            if isinstance(state, torch.Tensor):
                slots.append(Slot(f"{kind}.{state_index}", tuple(int(d) for d in state.shape[1:]), None))
                if kind == "conv":
                    kernels.append((state_index, int(layer.conv_kernel_size[state_index])))
    return LayerIO(index, tuple(slots), tuple(kernels)) if slots else None


def _meta_forward(model):
    """The tiny forward on the meta device (every parameter and buffer swapped for a meta tensor of its shape for
    the call, the model's own left untouched), or None where the model's code cannot run there (it reads a
    tensor's values: routers, data-dependent branches). Shapes are all a cache geometry is, and the forward
    then costs nothing: the real one reads every weight (6 s and the whole model's pages for a 1B fp32 model
    mapped from its checkpoint)."""
    from torch.nn.utils.stateless import _reparametrize_module

    from rope_export.hf.hooking import model_state_kept

    state = {name: torch.empty_like(t, device="meta") for name, t in
             (*model.named_parameters(), *model.named_buffers())}
    try:
        with torch.no_grad(), model_state_kept(model), _reparametrize_module(model, state, tie_weights=True):
            return with_cache(model, make_cache(model), input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:  # noqa: BLE001 - whatever fails on meta is asked of the real weights
        return None


def cache_layout(model) -> CacheLayout:
    """Per-layer cache geometry of the text decoder, read from one tiny forward (on the meta device where the
    model's code runs there, else eager on its weights)."""

    out = _meta_forward(model)
    if out is not None:
        try:
            return _layout_of(model, out)
        except HFExportError:
            pass  # said again by the real forward, or not
    cache = make_cache(model)
    with torch.no_grad():
        try:
            out = with_cache(model, cache, input_ids=torch.zeros(1, 2, dtype=torch.long))
        except ValueError as exc:  # e.g. "MiniMax uses cache of its own and is not compatible with DynamicCache"
            first = str(exc).strip().splitlines()[0]
            raise HFExportError(f"{model.config.model_type}: its cache is not transformers' DynamicCache ({first}); "
                                "rope-export exports DynamicCache models only") from None
    return _layout_of(model, out)


def _layout_of(model, out) -> CacheLayout:
    from transformers.cache_utils import Cache

    filled = returned_cache(out)
    if not isinstance(filled, Cache):
        raise HFExportError(
            f"{model.config.model_type}: {type(model).__name__} returns no transformers Cache "
            f"(its cache is {type(filled).__name__}); rope-export exports models with a DynamicCache only"
        )
    layers = [io for index, layer in enumerate(filled.layers) if (io := _layer_io(index, layer)) is not None]
    if not any("key" in io.names() for io in layers):
        raise HFExportError(f"{model.config.model_type}: no layer keeps keys and values in transformers' cache")
    return CacheLayout(tuple(layers), len(filled.layers))


def hf_io_names(layout: CacheLayout | int, *, attention_mask: bool = False) -> tuple[list[str], list[str]]:
    """Graph input and output names of a causal-LM export (the optimum / onnxruntime-genai convention);
    ``attention_mask`` [B, past+S] (1: a real token, 0: padding) follows ``position_ids`` when asked for."""
    if isinstance(layout, int):
        layout = CacheLayout.uniform(layout)
    mask = ["attention_mask"] if attention_mask else []
    return ["input_ids", "position_ids", *mask, *layout.input_names()], ["logits", *layout.output_names()]


def hf_example_inputs(model, *, batch: int = 2, seq: int = 4, past: int = 3, seed: int = 0,
                      position_rank: int | None = None, layout: CacheLayout | None = None,
                      attention_mask: bool = False) -> tuple[torch.Tensor, ...]:
    """Inputs of ``CausalLMWithCache(model)``: ids, positions past..past+S-1, (an all-ones attention mask
    [B, past+S] when asked for,) random past cache tensors."""
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
    tensors = [torch.randn(shape, generator=generator).to(dtype) for io in layout.layers
               for shape in io.shapes(batch, past)]
    mask = (torch.ones(batch, past + seq, dtype=torch.long),) if attention_mask else ()
    return (ids, positions, *mask, *tensors)


class CausalLMWithCache(nn.Module):
    """``forward(input_ids, position_ids, *past) -> (logits, *present)``, past/present flat per cache layer.

    ``past`` holds each layer's tensors of ``layout`` in order (keys and values [B, heads, P, width],
    P = 0 for prefill; a hybrid's conv/recurrent states, zeros for prefill); ``position_ids`` is
    [B, S] ([3, B, S] for Qwen2-VL). A DynamicCache is filled inside. With ``attention_mask``, the
    first tensor after ``position_ids`` is the [B, P+S] padding mask transformers' ``generate``
    passes (0: a padding token no query may attend to); without, every key is a real token.
    """

    def __init__(self, model: nn.Module, layout: CacheLayout | int, *, attention_mask: bool = False):
        super().__init__()
        self.model = model
        self.layout = CacheLayout.uniform(layout) if isinstance(layout, int) else layout
        self.attention_mask = attention_mask

    def forward(self, input_ids, position_ids, *past):
        mask = None
        if self.attention_mask:
            if not past:
                raise HFExportError("expected an attention_mask after position_ids")
            mask, past = past[0], past[1:]
        expected = len(self.layout.input_names())
        if len(past) != expected:
            raise HFExportError(f"expected {expected} past tensors ({', '.join(self.layout.input_names())}), "
                                f"got {len(past)}")
        cache = make_cache(self.model, self.layout.num_cache_layers)
        self.layout.fill(cache, past)
        out = with_cache(self.model, cache, input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
        return (out.logits, *self.layout.present(returned_cache(out)))


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's self-attention modules, in layer order."""
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
             and "Vision" not in type(m).__name__]
    return sorted(found, key=lambda m: m.layer_idx)


def rotary_module(model: nn.Module) -> nn.Module | None:
    """The text decoder's rotary module (``*RotaryEmbedding``); None when its attention computes its own angles."""
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RotaryEmbedding") and "Vision" not in name:
            return m
    return None


def position_embeddings(model: nn.Module, hidden_states: torch.Tensor, position_ids: torch.Tensor):
    """What the decoder hands its attention layers as ``position_embeddings``: its rotary module's output
    for these positions (``(cos, sin)`` mostly; ``(sin, cos)`` for GPT-J since transformers 5.24, which
    moved GPT-J's sin|cos table from its attention into ``GPTJRotaryEmbedding``; Llama 4's complex
    freqs_cis). None when the model has no rotary module (the attention takes ``position_ids``)."""
    rotary = rotary_module(model)
    return None if rotary is None else rotary(hidden_states, position_ids)


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
        self._cache_keyword = cache_keyword(self.attention.forward)

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
        kwargs = {"attention_mask": mask, self._cache_keyword: cache}
        names = self._parameters_of
        if "position_embeddings" in names and self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden_states, position_ids)
        if "position_ids" in names and self.rotary is None:
            kwargs["position_ids"] = position_ids
        output = self.attention(hidden_states, **kwargs)[0]
        layer = cache.layers[idx]
        return output, layer.keys, layer.values
