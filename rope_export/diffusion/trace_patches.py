"""diffusers forwards that torch.export cannot trace, and the forward traced in their place.

diffusers' ``Lumina2Transformer2DModel.forward`` (and its ``Lumina2RotaryPosEmbed.forward``) read each
caption's length as a Python int (``encoder_attention_mask.sum(dim=1).tolist()``), pack caption and image
tokens per sample in Python loops into a sequence as long as the longest sample, and mask only when the
lengths differ (``len(set(seq_lengths)) > 1``). A length read from a tensor cannot be hashed or looped over
by torch.export ("unhashable type: non-nested SymInt"), and the packed length depends on the mask's values.

``lumina2_forward`` computes the same values with tensor ops only, for any 0/1 mask of the caption:

* the caption lengths are ``mask.sum(1)``, a tensor; as diffusers does, the first ``sum(mask)`` caption tokens
  are the caption (the pipeline pads at the end, so these are the valid ones);
* the joint sequence has the static length ``text + image`` tokens (diffusers': the longest sample's): slot
  ``j`` of a sample with ``n`` caption tokens holds caption token ``j`` (``j < n``), image token ``j - n``
  (``j < n + image``), else zeros; one ``gather`` from ``cat(caption, image)`` fills it, a ``where`` zeroes the
  rest. The joint attention always masks the slots past ``n + image`` (diffusers masks only when lengths
  differ, and has no such slots otherwise): a valid token attends to exactly the keys it attends to in
  diffusers, so its values are unchanged;
* position ids as diffusers makes them: caption token ``j`` at ``(j, 0, 0)``, image token ``(row, col)`` at
  ``(n, row, col)``, padding slots at ``(0, 0, 0)``; the rotary tables are read from them by the model's own
  ``rope_embedder._get_freqs_cis``; the caption refiner's table is zero past ``n``, as diffusers' is (which
  matters only for a mask with holes: a masked-in token there is not rotated);
* the image tokens are read back per sample with a ``gather`` at ``n + k`` and unpatchified batched.

``traceable(model)`` swaps the forward in (an attribute of the model, removed on exit) for the duration of
an export only; the file is compared with diffusers' own forward afterwards (``export_diffusers``), and
``tests/diffusion/test_lumina2_traceable.py`` proves the replacement equal to diffusers' forward for caption
masks of different lengths in one batch, all ones, and masks with holes.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch


def _patches(hidden_states: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/p * W/p, p*p*C], as Lumina2RotaryPosEmbed.forward patchifies."""
    b, c, h, w = hidden_states.shape
    return hidden_states.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)


def _image_ids(lengths: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, height*width, 3] int64: (caption length, row, column) of every image token."""
    token = torch.arange(height * width, device=lengths.device)
    rows = token // width
    cols = token - rows * width
    batch = lengths.shape[0]
    return torch.stack([lengths[:, None].expand(batch, height * width), rows.expand(batch, -1),
                        cols.expand(batch, -1)], dim=-1)


def _joint_slots(lengths: torch.Tensor, text: int, image: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample's ``text + image`` joint slots: the index into ``cat(caption, image)`` and whether the
    slot holds a token (``[B, text + image]`` each)."""
    slot = torch.arange(text + image, device=lengths.device)[None, :]
    n = lengths[:, None]
    index = torch.where(slot < n, slot, slot - n + text).clamp(max=text + image - 1)
    return index, slot < n + image


def _gather_tokens(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tokens [B, S, D] at index [B, N] -> [B, N, D]."""
    return torch.gather(tokens, 1, index[..., None].expand(*index.shape, tokens.shape[-1]))


def lumina2_forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    encoder_attention_mask: torch.Tensor, attention_kwargs: dict | None = None,
                    return_dict: bool = True):
    """``Lumina2Transformer2DModel.forward`` with the caption lengths as tensors (see the module doc)."""
    if attention_kwargs:
        raise ValueError("the traceable Lumina 2 forward takes no attention_kwargs (LoRA scale): export without")
    p = self.config.patch_size
    batch, _, height, width = hidden_states.shape
    h, w = height // p, width // p
    text, image = encoder_attention_mask.shape[1], h * w
    temb, captions = self.time_caption_embed(hidden_states, timestep, encoder_hidden_states)
    lengths = encoder_attention_mask.to(torch.int64).sum(dim=1)

    zeros = torch.zeros(batch, text, dtype=torch.int64, device=lengths.device)
    caption_ids = torch.stack([torch.arange(text, device=lengths.device).expand(batch, text), zeros, zeros], -1)
    image_ids = _image_ids(lengths, h, w)
    index, valid = _joint_slots(lengths, text, image)
    joint_ids = torch.where(valid[..., None], _gather_tokens(torch.cat([caption_ids, image_ids], 1), index), 0)
    embedder = self.rope_embedder
    # complex64: the rotary op's caches are float32 (diffusers multiplies by complex128 tables on the CPU)
    caption_freqs, image_freqs, joint_freqs = (embedder._get_freqs_cis(ids).to(torch.complex64)
                                               for ids in (caption_ids, image_ids, joint_ids))
    # diffusers' caption table is zero past the caption's length (a masked-in token there is not rotated)
    caption_freqs = torch.where((caption_ids[..., 0] < lengths[:, None])[..., None], caption_freqs, 0)

    image_tokens = self.x_embedder(_patches(hidden_states, p))
    for layer in self.context_refiner:
        captions = layer(captions, encoder_attention_mask, caption_freqs)
    for layer in self.noise_refiner:
        image_tokens = layer(image_tokens, None, image_freqs, temb)

    joint = _gather_tokens(torch.cat([captions, image_tokens], 1), index)
    joint = torch.where(valid[..., None], joint, torch.zeros((), dtype=joint.dtype, device=joint.device))
    for layer in self.layers:
        joint = layer(joint, valid, joint_freqs, temb)
    joint = self.norm_out(joint, temb)

    first = lengths[:, None] + torch.arange(image, device=lengths.device)[None, :]
    out = _gather_tokens(joint, first).view(batch, h, w, p, p, self.out_channels)
    output = out.permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)
    if not return_dict:
        return (output,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output)


# diffusers class name -> (the forward traced in place of its own, why)
PATCHES: dict[str, tuple[Callable, str]] = {
    "Lumina2Transformer2DModel": (
        lumina2_forward,
        "diffusers' forward reads the caption lengths as Python ints (attention_mask.sum(dim=1).tolist()), packs "
        "per sample to the longest length and hashes the lengths (len(set(...))), which torch.export cannot trace: "
        "traced with the same values computed by tensor ops, the joint sequence packed to text + image tokens "
        "with the padding slots masked (docs/diffusers.md)"),
}


@contextlib.contextmanager
def traceable(model: torch.nn.Module) -> Iterator[list[str]]:
    """Inside, the model's entry of ``PATCHES`` replaces its forward (the notes say so); removed on exit."""
    from rope_export.exporting.meta import patched

    entry = PATCHES.get(type(model).__name__)
    if entry is None:
        yield []
        return
    replacement, why = entry
    with patched([(model, "forward", types.MethodType(replacement, model))]):
        yield [f"{type(model).__name__}.forward traced as rope_export.diffusion.trace_patches."
               f"{replacement.__name__}: {why}"]
