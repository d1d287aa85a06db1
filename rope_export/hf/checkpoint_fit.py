"""Whether a checkpoint fits a model, from the names and shapes of its headers: no tensor data is read.

A checkpoint whose names do not match the model one to one goes to transformers' ``from_pretrained``,
which renames keys (legacy names, a base model's missing ``model.`` prefix) and fuses some (experts).
Whether that would leave tensors missing, unexpected or of other shapes is predicted here first, with
transformers' own renaming applied to the header names, so the checkpoint of another model is refused
in a second instead of after minutes of loading an 8B. The prediction errs on the side of loading:
what it cannot tell (a converter's output shape, a buffer the checkpoint lacks) is left to
``from_pretrained``, whose report still refuses it afterwards.

transformers is imported lazily; without its renaming machinery (another version), or for a quantized
checkpoint (its quantizer reshapes the model's tensors), nothing is predicted and loading decides.
"""

from __future__ import annotations

import re

from torch import nn

# what transformers drops from the unexpected keys beyond the class's own patterns (modeling_utils'
# _adjust_missing_and_unexpected_keys): old per-layer rotary buffers and position_ids buffers
EXTRA_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def predicted_loading_info(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """What ``from_pretrained(..., output_loading_info=True)`` would report for a checkpoint of these tensor
    names and shapes, as missing/unexpected/mismatched keys; None when this transformers cannot be asked.

    ``model`` is the config's model with its parameters on the meta device (its state dict costs nothing)."""
    if getattr(getattr(model, "config", None), "quantization_config", None):
        return None  # a quantizer changes the model's tensors (scales, packed weights): only loading can tell
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    try:
        mapping = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - a model transformers cannot map here is left to from_pretrained
        return None
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", None) or None
    missing = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # buffers: left to loading
    unexpected, mismatched = set(), set()
    for key in sorted(shapes):
        # as convert_and_load_state_dict_in_model renames a checkpoint key
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = rename_source_key(key, [], [], prefix, state)
        if renamed not in state:
            unexpected.add(key)
            continue
        missing.discard(renamed)
        want = tuple(state[renamed].shape)
        if pattern is None and tuple(shapes[key]) != want:  # a converter's output shape is not known here
            mismatched.add((renamed, tuple(shapes[key]), want))
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    missing -= tied | {name for name, _, _ in mismatched}
    missing = _drop(missing, getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    unexpected = _drop(unexpected, (*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
                                    *EXTRA_UNEXPECTED))
    return {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched}


def _drop(keys: set[str], patterns) -> set[str]:
    compiled = [re.compile(p) for p in patterns]
    return {k for k in keys if not any(p.search(k) for p in compiled)}
