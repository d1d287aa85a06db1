"""The three components a serving stack runs, as modules torch.export traces and ``check`` runs as references.

* ``VisionEncoder``: ``pixel_values`` (one image of the exported size) -> ``image_features [tokens, hidden]``
  (Qwen3-VL also ``deepstack_features [layers, tokens, hidden]``): what transformers' forward scatters into the
  token embeddings;
* ``EmbeddingMerge``: ``input_ids [batch, seq]``, ``image_features [tokens, hidden]`` -> ``inputs_embeds``: the
  token embeddings with the image tokens' rows replaced by the features, in order (transformers'
  ``get_placeholder_mask`` and ``masked_scatter``; Qwen3-VL also returns the ``image_mask`` its decoder reads);
* ``DecoderWithCache``: ``inputs_embeds``, ``position_ids`` ([3, batch, seq] for mRoPE), ``attention_mask
  [batch, past+seq]``, the kind's extras, ``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.*``.

Each calls the model's own code; nothing of the model is copied.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from rope_export.hf.cache_io import CacheLayout, make_cache
from rope_export.hf.vlm.kinds import Geometry, VLMKind, base_model

COMPONENTS = ("vision", "embedding", "decoder")


class VisionEncoder(nn.Module):
    """``precomputed``: the grid's positions, segments and windows handed to transformers as its precomputed
    kwargs (for tracing); without, transformers computes them itself from the grid (the reference)."""

    def __init__(self, model: nn.Module, kind: VLMKind, geometry: Geometry, *, precomputed: bool = True):
        super().__init__()
        self.model, self.kind, self.geometry = model, kind, geometry
        grid = geometry.constants.get("image_grid_thw")
        self.precomputed = kind.precomputed(model, torch.tensor(grid)) if precomputed and grid else {}

    def forward(self, pixel_values):
        return self.kind.features(self.model, pixel_values, self.geometry, self.precomputed)


class EmbeddingMerge(nn.Module):
    def __init__(self, model: nn.Module, kind: VLMKind):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, input_ids, image_features):
        base = base_model(self.model)
        embeds = base.get_input_embeddings()(input_ids)
        mask = base.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=image_features)
        mask = mask[0] if isinstance(mask, tuple) else mask  # (image, video) masks for the Qwen types
        merged = embeds.masked_scatter(mask, image_features.to(embeds.dtype))
        if "image_mask" in self.kind.decoder_extras:
            return merged, mask[..., 0]
        return merged


class DecoderWithCache(nn.Module):
    def __init__(self, model: nn.Module, kind: VLMKind, layout: CacheLayout):
        super().__init__()
        self.model, self.kind, self.layout = model, kind, layout

    def forward(self, inputs_embeds, position_ids, attention_mask, *rest):
        count = len(self.kind.decoder_extras)
        extras, past = rest[:count], rest[count:]
        cache = make_cache(self.kind.text_model(self.model), self.layout.num_cache_layers)
        self.layout.fill(cache, past)
        logits, cache = self.kind.decode(self.model, cache, inputs_embeds, position_ids, attention_mask, extras)
        return (logits, *self.layout.present(cache))


def io_names(kind: VLMKind, layout: CacheLayout) -> dict[str, tuple[list[str], list[str]]]:
    """Each component's graph input and output names (the decoder's follow onnxruntime-genai's defaults)."""
    embedding_out = ["inputs_embeds", *(["image_mask"] if "image_mask" in kind.decoder_extras else [])]
    return {
        "vision": (["pixel_values"], list(kind.feature_names)),
        "embedding": (["input_ids", "image_features"], embedding_out),
        "decoder": (["inputs_embeds", "position_ids", "attention_mask", *kind.decoder_extras, *layout.input_names()],
                    ["logits", *layout.output_names()]),
    }


@contextlib.contextmanager
def placeholder_checks_off() -> Iterator[None]:
    """transformers' placeholder check (image tokens == feature rows) is a runtime assertion torch.onnx has no
    translation for (``aten._is_all_true``); it is switched off while tracing with transformers' own switch
    (``TRANSFORMERS_DISABLE_TORCH_CHECK``). The file assumes what the serving stack guarantees: one feature row per
    image token."""
    saved = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = saved
