"""The whole pipeline as a serving stack runs it, and transformers' answer for it.

``image_prompt`` makes one prompt with one image of the exported size: a few text tokens, the image's tokens
(between Qwen's vision start and end tokens where the type has them), more text; the pixels are random (both
sides get the same ones: the image processor is not part of the model). ``positions`` gives the decoder's
``position_ids`` as the serving stack computes them outside the graph (mRoPE: transformers' ``get_rope_index``,
and for the steps after it the past length plus its deltas). ``transformers_run`` is the reference: transformers'
forward on the prompt (pixels in), then greedy decode steps with its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rope_export.hf.families import text_config
from rope_export.hf.vlm.kinds import Geometry, VLMKind, base_model


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [1, seq]
    pixel_values: torch.Tensor
    image_inputs: dict  # what the model's forward takes with the pixels: image_grid_thw, image_sizes, token types

    def reference_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "pixel_values": self.pixel_values, **self.image_inputs}


def _token(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def image_prompt(model, kind: VLMKind, geometry: Geometry, *, seed: int = 0, before: int = 3,
                 after: int = 4) -> Prompt:
    from rope_export.hf.vlm.exporting import image_token_id

    generator = torch.Generator().manual_seed(seed)
    config = base_model(model).config
    image = image_token_id(model)
    start = _token(config, "vision_start_token_id")
    end = _token(config, "vision_end_token_id")
    special = {t for t in (image, start, end, _token(config, "video_token_id")) if t is not None}
    vocab = int(text_config(model.config).vocab_size)
    plain = torch.tensor([t for t in range(vocab) if t not in special])

    def text(n):
        return plain[torch.randint(0, len(plain), (n,), generator=generator)]

    middle = [*([start] if start is not None else []), *([image] * geometry.tokens),
              *([end] if end is not None else [])]
    ids = torch.cat([text(before), torch.tensor(middle, dtype=torch.long), text(after)])[None]
    dtype = next(model.parameters()).dtype
    pixels = torch.randn(geometry.pixel_shape, generator=generator).to(dtype)
    inputs = geometry.constant_tensors()
    if kind.position_rank == 3:  # Qwen: the forward computes mRoPE positions from the token types
        inputs["mm_token_type_ids"] = (ids == image).int()
    return Prompt(ids, pixels, inputs)


def positions(model, kind: VLMKind, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids of the prompt, the offset of every later token's position from its index) as the serving
    stack computes them: ``[3, 1, seq]`` from transformers' ``get_rope_index`` for mRoPE, else ``0..seq-1``."""
    seq = prompt.input_ids.shape[1]
    if kind.position_rank != 3:
        return torch.arange(seq)[None], torch.zeros(1, 1, dtype=torch.long)
    return base_model(model).get_rope_index(prompt.input_ids,
                                            mm_token_type_ids=prompt.image_inputs["mm_token_type_ids"],
                                            image_grid_thw=prompt.image_inputs["image_grid_thw"])


def step_positions(kind: VLMKind, deltas: torch.Tensor, past: int) -> torch.Tensor:
    """The position_ids of one decoded token after ``past`` tokens."""
    index = (torch.tensor([[past]]) + deltas).long()
    return index.expand(3, 1, 1).contiguous() if kind.position_rank == 3 else index


def transformers_run(model, kind: VLMKind, prompt: Prompt, steps: int = 1) -> tuple[list[torch.Tensor], list[int]]:
    """transformers' logits for the prompt (pixels in) and ``steps`` greedy decode steps (its own cache and
    positions), and the tokens it chose."""
    from transformers.cache_utils import DynamicCache

    from rope_export.hf.cache_io import with_cache

    base = base_model(model)
    if hasattr(base, "rope_deltas"):
        base.rope_deltas = None  # a previous run's deltas must not leak into this prompt
    cache = DynamicCache(config=model.config)
    logits, tokens = [], []
    inputs = prompt.reference_inputs()
    with torch.no_grad():  # no attention mask (no padding): the decode steps' mRoPE positions are past + deltas
        for _ in range(steps + 1):
            out = kind.forward(model, cache, **inputs) if kind.forward else with_cache(model, cache, **inputs)
            logits.append(out.logits)
            tokens.append(int(out.logits[0, -1].argmax()))
            inputs = {"input_ids": torch.tensor([[tokens[-1]]])}
    return logits, tokens
