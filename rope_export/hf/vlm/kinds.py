"""What a vision-language model's components compute, per kind of model: one entry per kind, as transformers'
``ROPE_INIT_FUNCTIONS`` holds one function per scheme.

A kind says, for the model types it covers:

* the image geometry the vision encoder is exported for (``ImageSize``: height and width in pixels, a multiple
  of the pixels one merged token covers), the pixel tensor the model's image processor makes for it, and the
  processor's other outputs (Qwen's ``image_grid_thw``, Pixtral's ``image_sizes``) as constants of that size;
* ``features``: what transformers' forward computes from the pixels up to the tensor it scatters into the token
  embeddings (``get_image_features`` and whatever the forward does after it: the Mistral 3 / Qwen split-and-cat,
  Llama 4's projector), and the extra tensors the decoder reads (Qwen3-VL's deepstack features);
* the rank of the decoder's ``position_ids`` (3 for mRoPE: temporal, height, width rows), and how the decoder
  takes the extras;
and ``GENAI_TYPES`` the model type onnxruntime-genai 0.18 runs such a folder as, where it has a pipeline for it.

The vision encoder is exported for one image size: the positions its rotations use come from the image grid,
so its cos/sin are per-token tables computed at export (the ``--image-size`` a deployment feeds; genai's
processor config resizes every image to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rope_export.hf.errors import HFExportError


@dataclass(frozen=True)
class ImageSize:
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"

    @classmethod
    def parse(cls, text: str) -> ImageSize:
        parts = text.lower().replace(",", "x").split("x")
        try:
            height, width = (int(p) for p in parts) if len(parts) == 2 else (int(parts[0]),) * 2
        except ValueError:
            raise HFExportError(f"--image-size {text!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448") from None
        if not (0 < height <= 16384 and 0 < width <= 16384):
            raise HFExportError(f"--image-size {text!r}: height and width must be in [1, 16384] pixels")
        return cls(height, width)


@dataclass(frozen=True)
class Geometry:
    """One image of ``size`` as the model's processor hands it over: the pixel tensor's shape and the constants
    (python lists) of its other outputs, e.g. ``{"image_grid_thw": [[1, 32, 32]]}``."""

    size: ImageSize
    pixel_shape: tuple[int, ...]
    constants: dict = field(default_factory=dict)
    tokens: int = 0  # image tokens the prompt holds for one image (rows of image_features)

    def constant_tensors(self) -> dict[str, torch.Tensor]:
        """Made inside forward from python lists: torch.export keeps them constants whose values the model's
        code may read (``.tolist()``), where an input or a module attribute would be data-dependent."""
        return {name: torch.tensor(value) for name, value in self.constants.items()}

    def to_dict(self) -> dict:
        return {"height": self.size.height, "width": self.size.width, "pixel_shape": list(self.pixel_shape),
                "constants": self.constants, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, data: dict) -> Geometry:
        return cls(ImageSize(int(data["height"]), int(data["width"])), tuple(int(d) for d in data["pixel_shape"]),
                   dict(data.get("constants") or {}), int(data.get("tokens", 0)))


def _vision(config):
    return config.vision_config


# -- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: flattened patches, grid_thw, mRoPE decoder ----------------------------------

def _qwen_unit(config) -> int:
    vision = _vision(config)
    return int(vision.patch_size) * int(vision.spatial_merge_size)


def _qwen_geometry(config, size: ImageSize) -> Geometry:
    vision = _vision(config)
    patch, temporal = int(vision.patch_size), int(vision.temporal_patch_size)
    grid_h, grid_w = size.height // patch, size.width // patch
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3))
    merge = int(vision.spatial_merge_size)
    return Geometry(size, (grid_h * grid_w, channels * temporal * patch * patch),
                    {"image_grid_thw": [[1, grid_h, grid_w]]}, grid_h * grid_w // merge**2)


def _qwen_precomputed(model, grid: torch.Tensor) -> dict:
    """The grid's vision positions, attention segments and windows, computed by transformers' own helpers
    (``transformers.vision_utils``) and handed in as its precomputed kwargs, as python lists (made tensors in
    forward; see ``Geometry.constant_tensors``)."""
    from transformers import vision_utils

    visual = _visual(model)
    merge = visual.spatial_merge_size
    out = {"position_ids": vision_utils.get_vision_position_ids(grid, merge).tolist(),
           "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid).tolist()}
    if getattr(visual, "window_size", None):  # Qwen2.5-VL's windowed blocks
        index, cu_window = vision_utils.get_vision_window_index(grid, merge, visual.window_size, visual.patch_size)
        out |= {"window_index": index.tolist(), "cu_window_seqlens": cu_window.tolist()}
    if hasattr(visual, "num_grid_per_side"):  # Qwen3-VL's learned positions, resampled to the grid
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            grid, visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.spatial_merge_size)
        out |= {"interp_indices": indices.tolist(), "interp_weights": weights.tolist()}
    return out


_INT32 = ("cu_seqlens", "cu_window_seqlens")


def base_model(model):
    """The module holding ``get_image_features`` and ``get_placeholder_mask``: ``model.model`` for most types, the
    conditional-generation model itself for Llama 4."""
    inner = getattr(model, "model", None)
    return inner if hasattr(inner, "get_placeholder_mask") else model


def _visual(model):
    return base_model(model).visual


def _qwen_features(model, pixel_values, geometry: Geometry, precomputed: dict) -> tuple[torch.Tensor, ...]:
    grid = torch.tensor(geometry.constants["image_grid_thw"])
    kwargs = {name: torch.tensor(value, dtype=torch.int32 if name in _INT32 else None)
              for name, value in precomputed.items()}
    out = base_model(model).get_image_features(pixel_values, grid, return_dict=True, **kwargs)
    features = torch.cat(out.pooler_output, dim=0)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: one [tokens, hidden] per deepstack layer, added to the decoder's first layers
        return features, torch.stack([torch.cat(layer, dim=0) for layer in deepstack])
    return (features,)


# -- Mistral 3 (Pixtral vision tower) ----------------------------------------------------------------------------

def _mistral3_unit(config) -> int:
    return int(_vision(config).patch_size) * int(config.spatial_merge_size)


def _mistral3_geometry(config, size: ImageSize) -> Geometry:
    vision = _vision(config)
    unit = _mistral3_unit(config)
    return Geometry(size, (1, int(vision.num_channels), size.height, size.width),
                    {"image_sizes": [[size.height, size.width]]}, (size.height // unit) * (size.width // unit))


def _mistral3_features(model, pixel_values, geometry: Geometry, precomputed: dict) -> tuple[torch.Tensor, ...]:
    # python ints, not a tensor: Pixtral slices each image's patches by them (a tensor's values would be
    # data-dependent bounds for torch.export)
    sizes = [tuple(size) for size in geometry.constants["image_sizes"]]
    out = base_model(model).get_image_features(pixel_values, sizes, return_dict=True,
                                               vision_feature_layer=model.config.vision_feature_layer)
    return (torch.cat(out.pooler_output, dim=0),)


# -- Llama 4: fixed-size tiles, pixel shuffle, a projector after the vision model --------------------------------

def _llama4_unit(config) -> int:
    return int(_vision(config).image_size)


def _llama4_geometry(config, size: ImageSize) -> Geometry:
    vision = _vision(config)
    side = int(vision.image_size)
    if (size.height, size.width) != (side, side):
        raise HFExportError(f"llama4: its vision model takes tiles of {side}x{side} pixels (vision_config.image_size); "
                            f"--image-size {size} is not one")
    patches = (side // int(vision.patch_size)) ** 2
    tokens = int(patches * float(vision.pixel_shuffle_ratio) ** 2)
    return Geometry(size, (1, int(vision.num_channels), side, side), {}, tokens)


def _llama4_features(model, pixel_values, geometry: Geometry, precomputed: dict) -> tuple[torch.Tensor, ...]:
    base = base_model(model)
    hidden = base.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
    return (base.multi_modal_projector(hidden.view(-1, hidden.size(-1))),)


def _no_precomputed(model, grid) -> dict:
    return {}


# -- the decoder: transformers' forward from the token embeddings, with a cache -----------------------------------

def _decode(model, cache, inputs_embeds, position_ids, attention_mask, extras):
    """(logits, the cache) of the whole model's forward from ``inputs_embeds`` (no pixels: the vision tower is
    skipped, as in transformers' decode steps)."""
    from rope_export.hf.cache_io import returned_cache, with_cache

    out = with_cache(model, cache, inputs_embeds=inputs_embeds, position_ids=position_ids,
                     attention_mask=attention_mask)
    return out.logits, returned_cache(out)


def _decode_language_model(model, cache, inputs_embeds, position_ids, attention_mask, extras):
    """Llama 4: transformers 5.24's ``Llama4ForConditionalGeneration.forward`` raises on its return
    (``'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'``) whatever it is given; the logits it
    would return are its language model's (``Llama4ForCausalLM``), called here."""
    from rope_export.hf.cache_io import returned_cache, with_cache

    out = with_cache(model.language_model, cache, inputs_embeds=inputs_embeds, position_ids=position_ids,
                     attention_mask=attention_mask)
    return out.logits, returned_cache(out)


def _llama4_forward(model, cache, input_ids, pixel_values=None):
    """transformers' Llama 4 forward up to its broken return (see ``_decode_language_model``): the token
    embeddings, the projected image features scattered into them, the language model."""
    from rope_export.hf.cache_io import with_cache

    embeds = model.get_input_embeddings()(input_ids)
    if pixel_values is not None:
        (features,) = _llama4_features(model, pixel_values, None, {})
        mask = model.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
        embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
    return with_cache(model.language_model, cache, inputs_embeds=embeds)


def _decode_deepstack(model, cache, inputs_embeds, position_ids, attention_mask, extras):
    """Qwen3-VL: its language model adds the deepstack features at the image tokens (``image_mask``) of its first
    layers; the top-level forward computes them from pixels only, so the language model is called here."""
    from rope_export.hf.cache_io import returned_cache, with_cache

    image_mask, deepstack = extras
    out = with_cache(base_model(model).language_model, cache, inputs_embeds=inputs_embeds, position_ids=position_ids,
                     attention_mask=attention_mask, visual_pos_masks=image_mask,
                     deepstack_visual_embeds=list(deepstack.unbind(0)))
    return model.lm_head(out.last_hidden_state), returned_cache(out)


# -- the registry ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VLMKind:
    name: str
    model_types: tuple[str, ...]
    unit: Callable  # config -> pixels one merged token covers (image sides must be multiples of it)
    geometry: Callable  # (config, ImageSize) -> Geometry
    features: Callable  # (model, pixel_values, Geometry, precomputed) -> (image_features, *extras)
    precomputed: Callable = _no_precomputed  # (model, grid tensor) -> precomputed vision kwargs (python lists)
    position_rank: int = 2
    feature_names: tuple[str, ...] = ("image_features",)
    decode: Callable = _decode  # (model, cache, inputs_embeds, position_ids, attention_mask, extras) -> logits, cache
    decoder_extras: tuple[str, ...] = ()  # decoder inputs after attention_mask: the embedding's and vision's extras
    forward: Callable | None = None  # (model, cache, **inputs) -> output: transformers' forward where it is broken
    text_model: Callable = lambda model: model  # the module whose forward from input_ids fills a cache (cache_layout)
    notes: str = ""

    def default_size(self, config) -> ImageSize:
        if self.name == "llama4":
            side = self.unit(config)
            return ImageSize(side, side)
        unit = self.unit(config)
        side = max(unit, (448 // unit) * unit)  # a common serving size, on the merged-token grid
        return ImageSize(side, side)

    def check_size(self, config, size: ImageSize) -> None:
        unit = self.unit(config)
        if size.height % unit or size.width % unit:
            raise HFExportError(f"{config.model_type}: --image-size {size} is not a multiple of {unit} pixels (patch "
                                f"size x spatial merge) in both sides; e.g. {self.fitted(config, size)}")

    def fitted(self, config, size: ImageSize) -> ImageSize:
        """The nearest size below ``size`` on the merged-token grid (one unit at least)."""
        unit = self.unit(config)
        return ImageSize(max(unit, size.height // unit * unit), max(unit, size.width // unit * unit))


KINDS: dict[str, VLMKind] = {kind.name: kind for kind in (
    VLMKind("qwen_vl", ("qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga",
                        "cosmos3_omni"), _qwen_unit, _qwen_geometry, _qwen_features, _qwen_precomputed,
            position_rank=3,
            notes="Qwen2-VL-style towers (Qwen2-VL, Qwen2.5-VL, the GLM-4V family, Cosmos3-Omni): mRoPE decoder (3 "
                  "position rows); 2-D vision rotation (and Qwen2.5-VL's windows) from the grid"),
    VLMKind("qwen3_vl", ("qwen3_vl", "qwen3_vl_moe"), _qwen_unit, _qwen_geometry, _qwen_features, _qwen_precomputed,
            position_rank=3, feature_names=("image_features", "deepstack_features"), decode=_decode_deepstack,
            decoder_extras=("image_mask", "deepstack_features"),
            notes="interleaved mRoPE decoder; deepstack features added to the first decoder layers"),
    VLMKind("mistral3", ("mistral3",), _mistral3_unit, _mistral3_geometry, _mistral3_features,
            notes="Pixtral vision tower: 2-D RoPE over the patch grid; patch merger in the projector"),
    VLMKind("llama4", ("llama4",), _llama4_unit, _llama4_geometry, _llama4_features, decode=_decode_language_model,
            forward=_llama4_forward, text_model=lambda model: model.language_model,
            notes="vision tiles with 2-D complex RoPE; complex RoPE and NoPE layers in the decoder"),
)}
# model_type -> the type onnxruntime-genai 0.18 runs such a folder as (its Qwen3-VL pipeline has no deepstack)
GENAI_TYPES = {"qwen2_5_vl": "qwen2_5_vl", "mistral3": "mistral3"}
MODEL_TYPES: dict[str, VLMKind] = {t: kind for kind in KINDS.values() for t in kind.model_types}


def kind_of(config) -> VLMKind:
    kind = MODEL_TYPES.get(getattr(config, "model_type", None))
    if kind is None:
        raise HFExportError(f"{config.model_type}: rope-export exports these vision-language types whole: "
                            f"{', '.join(sorted(MODEL_TYPES))}; this one has no entry (rope_export.hf.vlm.kinds), "
                            "export its text model type alone (docs/transformers.md's zoo)")
    return kind
