"""The files a task model is exported to: each component's wrapper, example inputs, names and dynamic axes.

A component is one ONNX file: a module that calls transformers' own forward with the graph's inputs
as keywords and returns the output fields the task has (``ModelCall``), or for an encoder-decoder
the decoder step with its self-attention cache as flat tensors (``DecoderWithCache``). Run eagerly,
the same module is what ``rope-export check`` compares the file with (``rope_export.check.task_reference``).

The example inputs follow the model's ``main_input_name``: token ids ``[batch, seq]``, raw audio
``input_values [batch, samples]``, audio features ``input_features`` (``[batch, frames, bins]`` or
``[batch, bins, frames]``, whichever the model runs), images ``pixel_values [batch, channels, H, W]``;
an ``attention_mask`` over the same tokens, samples or frames where the forward takes one, with
padding in the example (its last row shorter), since masks are what an encoder serves batches with.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from rope_export.hf.cache_io import CacheLayout, _layer_io, cache_keyword, make_cache, returned_cache
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import text_config

# The sizes of the example a component is traced with (and check's cases start from).
EXAMPLE_DIMS = {"batch": 2, "seq": 8, "past": 3, "samples": 3200, "frames": 64, "encoder_seq": 8}
MAX_DIM = 2**20
# the audio features' size per frame, by the config field that holds it (wav2vec2-bert stacks two frames of its
# feature_size: feature_projection_input_dim is what its input has), in the config or a sub-config (Parakeet's)
AUDIO_BINS = ("feature_projection_input_dim", "num_mel_bins", "feature_size", "input_feat_per_channel",
              "num_mel_filters", "n_mels")


@dataclass
class Component:
    """One file of a task export: the module torch.export traces (run eagerly: check's reference), its
    example inputs, I/O names, dynamic axes (``{input: {axis: dim name}}``) and the example's sizes."""

    name: str  # "model" for a one-file task; "encoder", "decoder", ...
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    axes: dict[str, dict[int, str]]
    dims: dict[str, int] = field(default_factory=dict)
    layout: CacheLayout | None = None  # a decoder's self-attention cache

    def dynamic_shapes(self) -> tuple:
        """torch.export's dynamic shapes, one named Dim per dim name (shared between inputs); every wrapper takes
        its inputs as ``*inputs``, so they are one tuple."""
        made = {}
        shapes = []
        for name in self.input_names:
            axes = {}
            for axis, dim in self.axes.get(name, {}).items():
                if dim not in made:
                    low = 0 if dim == "past" else 2 if dim in ("samples", "frames") else 1
                    made[dim] = torch.export.Dim(dim, min=low, max=MAX_DIM)
                axes[axis] = made[dim]
            shapes.append(axes)
        return (tuple(shapes),)


class ModelCall(nn.Module):
    """``forward(*inputs) -> outputs``: ``model(**dict(zip(input_names, inputs)))`` and the named output fields,
    exactly what transformers computes for the task (its own masks, bidirectional where it is)."""

    def __init__(self, model: nn.Module, input_names: list[str], output_fields: list[str]):
        super().__init__()
        self.model, self.input_names, self.output_fields = model, list(input_names), list(output_fields)

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.input_names, inputs, strict=True)))
        return tuple(out[name] for name in self.output_fields)


def forward_takes(module: nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def _bins(config) -> int:
    from transformers import PretrainedConfig

    configs = [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]
    for name in AUDIO_BINS:
        for one in configs:
            value = getattr(one, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise HFExportError(f"{config.model_type}: the config names no feature size ({', '.join(AUDIO_BINS)}), so the "
                        "audio features' shape is unknown")


def _image_size(config) -> tuple[int, int, int]:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None) or getattr(vision, "img_size", None) or 224
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return int(getattr(vision, "num_channels", 3)), int(height), int(width)


def padded_mask(batch: int, length: int) -> torch.Tensor:
    """An attention mask of ones whose last row is padded on the right to half its length (a batch with padding)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[-1, max(1, length // 2):] = 0
    return mask


def main_inputs(model: nn.Module, dims: dict[str, int], generator: torch.Generator):
    """(names, tensors, axes) of the model's main input and its mask, per its ``main_input_name``."""
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    batch = dims["batch"]
    dtype = next(model.parameters()).dtype
    if main == "input_ids":
        vocab = text_config(config).vocab_size
        tensors, axes, length = [torch.randint(0, vocab, (batch, dims["seq"]), generator=generator)], {1: "seq"}, "seq"
    elif main == "input_values":
        tensors, axes, length = [torch.randn(batch, dims["samples"], generator=generator).to(dtype)], {1: "samples"}, \
            "samples"
    elif main == "input_features":
        shape, axis = _feature_layout(model, dims)
        tensors, axes, length = [torch.randn(shape, generator=generator).to(dtype)], {axis: "frames"}, "frames"
    elif main == "pixel_values":
        channels, height, width = _image_size(config)
        tensors, axes, length = [torch.randn(batch, channels, height, width, generator=generator).to(dtype)], {}, None
    else:
        raise HFExportError(f"{type(model).__name__} takes {main!r} as its main input, which rope-export cannot make "
                            "an example of (token ids, input_values, input_features or pixel_values)")
    names, all_axes = [main], {main: {0: "batch", **axes}}
    if length is not None and forward_takes(model, "attention_mask"):
        names.append("attention_mask")
        tensors.append(padded_mask(batch, dims[length]))
        all_axes["attention_mask"] = {0: "batch", 1: length}
    if main == "input_ids" and forward_takes(model, "token_type_ids") and \
            (getattr(config, "type_vocab_size", 0) or 0) > 1:
        names.append("token_type_ids")
        tensors.append(torch.zeros(batch, dims["seq"], dtype=torch.long))
        all_axes["token_type_ids"] = {0: "batch", 1: "seq"}
    return names, tensors, all_axes


def _feature_layout(model, dims) -> tuple[tuple[int, int, int], int]:
    """The shape of ``input_features`` the model runs, frames second or last (tried in that order), and the
    frames axis: models differ (Parakeet takes [batch, frames, bins], Whisper [batch, bins, frames])."""
    bins, batch, frames = _bins(model.config), dims["batch"], dims["frames"]
    # an encoder-decoder's encoder takes the features (its whole forward also wants decoder inputs)
    runs = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    errors = []
    for shape, axis in (((batch, frames, bins), 1), ((batch, bins, frames), 2)):
        try:
            with torch.no_grad():
                runs(input_features=torch.zeros(shape, dtype=next(model.parameters()).dtype))
            return shape, axis
        except Exception as exc:  # noqa: BLE001 - the other layout is tried; both failing is said below
            errors.append(f"{list(shape)}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
    raise HFExportError(f"{type(model).__name__} runs on neither audio feature layout ({'; '.join(errors)})")


def output_fields(module: nn.Module, names: list[str], tensors: list, wanted: tuple[str, ...]) -> list[str]:
    """The fields of ``wanted`` the model's output really holds (a base model without pooler has no pooler_output)."""
    with torch.no_grad():
        out = module(**dict(zip(names, tensors, strict=True)))
    fields = [name for name in wanted if isinstance(out.get(name) if hasattr(out, "get") else None, torch.Tensor)]
    if not fields:
        raise HFExportError(f"{type(module).__name__} returns none of {', '.join(wanted)}: its output holds "
                            f"{', '.join(k for k in out.keys())}")
    return fields


def single_file(model: nn.Module, outputs: tuple[str, ...], dims: dict[str, int] | None = None,
                seed: int = 0) -> list[Component]:
    """The one file of an encoder-only task: the model's main input (and mask) in, the task's outputs out."""
    dims = {**EXAMPLE_DIMS, **(dims or {})}
    generator = torch.Generator().manual_seed(seed)
    names, tensors, axes = main_inputs(model, dims, generator)
    fields = output_fields(model, names, tensors, outputs)
    return [Component("model", ModelCall(model, names, fields).eval(), tuple(tensors), names, fields, axes,
                      _used(dims, axes))]


def _used(dims: dict[str, int], axes: dict[str, dict[int, str]]) -> dict[str, int]:
    used = {dim for per_input in axes.values() for dim in per_input.values()}
    return {name: size for name, size in dims.items() if name in used}


# -- encoder-decoder models: the encoder, and the decoder step with its cache ---------------------------------------

class DecoderWithCache(nn.Module):
    """``forward(input_ids, [position_ids,] encoder_hidden_states, encoder_attention_mask, *past) -> (logits,
    *present)``: one decoder step of the encoder-decoder model, its self-attention cache flat per layer
    (``past_key_values.{i}.key/value``, 0 long for the first step), the cross-attention computed from the
    encoder's states on every step (nothing cached for it)."""

    def __init__(self, model: nn.Module, layout: CacheLayout, encoder_output: type, mask_in_output: bool,
                 positions: bool):
        super().__init__()
        self.model, self.layout = model, layout
        self.encoder_output, self.mask_in_output, self.positions = encoder_output, mask_in_output, positions

    def forward(self, *inputs):
        input_ids, inputs = inputs[0], inputs[1:]
        position_ids, inputs = (inputs[0], inputs[1:]) if self.positions else (None, inputs)
        hidden, mask, past = inputs[0], inputs[1], inputs[2:]
        cache = make_cache(self.model, self.layout.num_cache_layers)
        self.layout.fill(cache, past)
        out = self.step(input_ids, position_ids, hidden, mask, cache)
        return (out.logits, *self.layout.present(returned_cache(out).self_attention_cache))

    def step(self, input_ids, position_ids, hidden, mask, self_cache):
        """transformers' forward for one decoder step on the encoder's ``hidden`` states and ``mask``, the
        self-attention cache ``self_cache`` (filled in place), an empty cross-attention cache."""
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        kwargs = {"decoder_position_ids": position_ids} if self.positions else {}
        if self.mask_in_output:
            encoder_outputs = self.encoder_output(last_hidden_state=hidden, attention_mask=mask)
        else:
            encoder_outputs, kwargs["attention_mask"] = self.encoder_output(last_hidden_state=hidden), mask
        kwargs[cache_keyword(self.model.forward)] = EncoderDecoderCache(self_cache, DynamicCache())
        return self.model(decoder_input_ids=input_ids, encoder_outputs=encoder_outputs, use_cache=True, **kwargs)


def encoder_decoder(model: nn.Module, outputs: tuple[str, ...], dims: dict[str, int] | None = None,
                    seed: int = 0) -> list[Component]:
    """The two files an encoder-decoder stack loads: the encoder (main input and mask in, its states and the
    mask over them out) and one decoder step with its self-attention cache (``DecoderWithCache``)."""
    dims = {**EXAMPLE_DIMS, **(dims or {})}
    generator = torch.Generator().manual_seed(seed)
    encoder = model.get_encoder()
    names, tensors, axes = main_inputs(encoder, dims, generator)  # the encoder's own main input (and mask)
    names, tensors = names[:2], tensors[:2]
    if len(names) < 2:
        raise HFExportError(f"{type(encoder).__name__}'s forward takes no attention_mask: its output cannot be "
                            "masked in the decoder's cross-attention")
    with torch.no_grad():
        encoded = encoder(**dict(zip(names, tensors, strict=True)))
    encoder_mask = getattr(encoded, "attention_mask", None)
    mask_in_output = isinstance(encoder_mask, torch.Tensor)
    encoder_part = Component("encoder", _EncoderCall(encoder, names, mask_in_output).eval(), tuple(tensors),
                             names, ["encoder_hidden_states", "encoder_attention_mask"],
                             {n: axes[n] for n in names}, _used(dims, {n: axes[n] for n in names}))
    hidden = encoded.last_hidden_state
    mask = encoder_mask.to(torch.long) if mask_in_output else tensors[1]
    positions = forward_takes(model, "decoder_position_ids")
    decoder = _decoder_component(model, type(encoded), mask_in_output, positions, hidden, mask, dims, generator)
    return [encoder_part, decoder]


class _EncoderCall(nn.Module):
    """The encoder: ``(states, mask over them)``; the mask is the encoder's own (Moonshine's is downsampled) or the
    input mask, so a pipeline feeds both outputs to the decoder by name."""

    def __init__(self, encoder: nn.Module, input_names: list[str], mask_in_output: bool):
        super().__init__()
        self.encoder, self.input_names, self.mask_in_output = encoder, input_names, mask_in_output

    def forward(self, *inputs):
        out = self.encoder(**dict(zip(self.input_names, inputs, strict=True)))
        mask = out.attention_mask.to(torch.long) if self.mask_in_output else inputs[1]
        return out.last_hidden_state, mask


def _decoder_component(model, encoder_output, mask_in_output, positions, hidden, mask, dims, generator) -> Component:
    batch, seq, past = dims["batch"], dims["seq"], dims["past"]
    vocab = text_config(model.config).vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    empty = DecoderWithCache(model, CacheLayout((), 0), encoder_output, mask_in_output, positions)
    layout = _decoder_layout(model, empty, ids, hidden, mask)
    module = DecoderWithCache(model, layout, encoder_output, mask_in_output, positions).eval()
    dtype = next(model.parameters()).dtype
    past_tensors = [torch.randn(shape, generator=generator).to(dtype) for io in layout.layers
                    for shape in io.shapes(batch, past)]
    position_ids = [(torch.arange(seq) + past).expand(batch, seq).contiguous()] if positions else []
    names = ["input_ids", *(["position_ids"] if positions else []), "encoder_hidden_states", "encoder_attention_mask",
             *layout.input_names()]
    axes = {"input_ids": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"},
            "encoder_hidden_states": {0: "batch", 1: "encoder_seq"}, "encoder_attention_mask": {0: "batch",
                                                                                                 1: "encoder_seq"}}
    axes |= {name: {0: "batch", 2: "past"} for name in layout.input_names()}
    sizes = {"batch": batch, "seq": seq, "past": past, "encoder_seq": int(hidden.shape[1])}
    return Component("decoder", module, (ids, *position_ids, hidden, mask, *past_tensors), names,
                     ["logits", *layout.output_names()], {n: axes[n] for n in names}, sizes, layout)


def _decoder_layout(model, empty: DecoderWithCache, ids, hidden, mask) -> CacheLayout:
    """The decoder's self-attention cache per layer, read from one eager first step."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape).contiguous() if empty.positions else None
    with torch.no_grad():
        out = empty.step(ids, positions, hidden, mask, make_cache(model))
    filled = returned_cache(out).self_attention_cache
    layers = [io for index, layer in enumerate(filled.layers) if (io := _layer_io(index, layer)) is not None]
    if not layers:
        raise HFExportError(f"{model.config.model_type}: the decoder keeps no keys and values in transformers' cache")
    return CacheLayout(tuple(layers), len(filled.layers))
