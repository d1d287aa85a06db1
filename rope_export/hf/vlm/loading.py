"""Building a vision-language model offline, as ``export --hf`` builds a causal LM (``rope_export.hf.loading``):
the config from a local folder, the folder's own checkpoint (or ``--weights``, or seeded random weights), eager
attention, ``batched_mm`` experts; the class is transformers' ``AutoModelForImageTextToText``."""

from __future__ import annotations

import os
from collections.abc import Callable

from rope_export.exporting.core import DTYPES
from rope_export.hf.errors import HFExportError
from rope_export.hf.loading import EXPERTS_IMPLEMENTATION, check_config, load_hf_config, weights_beside
from rope_export.hf.vlm.kinds import MODEL_TYPES

AUTO_CLASS = "AutoModelForImageTextToText"


def is_vlm(config) -> bool:
    """Whether ``config`` (a transformers config) is a vision-language model rope-export exports whole."""
    return getattr(config, "model_type", None) in MODEL_TYPES


def build_vlm(config, weights: str | os.PathLike | None = None, *, dtype: str = "fp32", seed: int = 0,
              random_weights: bool = False, progress: Callable[[str], None] | None = None):
    """The image-text-to-text model of ``config`` (a config object or a path) with the weights ``export --hf``
    would use (see ``rope_export.hf.build_hf_model``)."""
    import transformers

    from rope_export.hf.checkpoints import CheckpointError, build_causal_lm

    if random_weights and weights is not None:
        raise HFExportError("random_weights=True and weights exclude each other: give one")
    if not isinstance(config, transformers.PretrainedConfig):
        if weights is None and not random_weights:
            weights = weights_beside(config)
        config = load_hf_config(config)
    if dtype not in DTYPES:
        raise HFExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if not is_vlm(config):
        raise HFExportError(f"{config.model_type} is not a vision-language type rope-export exports whole "
                            f"(covered: {', '.join(sorted(MODEL_TYPES))})")
    check_config(config)
    options = dict(attn_implementation="eager", experts_implementation=EXPERTS_IMPLEMENTATION)
    try:
        model, _ = build_causal_lm(getattr(transformers, AUTO_CLASS), config, DTYPES[dtype], weights=weights,
                                   seed=seed, options=options, progress=progress)
    except CheckpointError as exc:
        raise HFExportError(str(exc)) from None
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFExportError(f"cannot build a {AUTO_CLASS} for model_type {config.model_type!r}: {first}") from None
    return model.eval()
