"""Building a transformers model offline: from a local config (folder or .json) and optional local weights.

The model is built the way it exports: eager attention (plain ONNX ops) and, for mixture-of-experts
models, transformers' ``batched_mm`` experts implementation (its default, ``grouped_mm``, emits
``torch.ops.transformers.grouped_mm_fallback``, which torch.onnx cannot translate).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from rope_export.exporting.core import DTYPES
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import MODEL_TYPES, text_config

EXPERTS_IMPLEMENTATION = "batched_mm"  # plain bmm/index ops: exportable


def load_hf_config(path: str | os.PathLike):
    """A transformers config from a local folder (with config.json) or a .json file; never the hub."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HFExportError(f"{path} has no config.json; give a folder with config.json or the .json file")
    elif not path.is_file():
        raise HFExportError(f"{path}: no such file or folder (give a config.json or the folder holding it)")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers' config validation raises several kinds: say its reason
        raise HFExportError(f"{path}: not a config transformers accepts: {_reason(exc)}") from None


def weights_beside(config: str | os.PathLike) -> Path | None:
    """The folder of the ``--hf`` config (the folder itself, or the one holding the .json) when it holds a
    checkpoint save_pretrained wrote; None when it holds no weights (a config only).

    Weights there in a form rope-export does not read are refused: exporting random weights instead of
    them would give a file that runs and means nothing."""
    from rope_export.hf.checkpoint_files import (
        CHECKPOINT_FILES,
        CheckpointError,
        checkpoint_files,
        other_weight_files,
    )

    path = Path(config)
    if not path.exists():
        return None  # load_hf_config says what is wrong
    folder = path if path.is_dir() else path.parent
    try:
        if checkpoint_files(folder):
            return folder
    except CheckpointError as exc:
        raise HFExportError(str(exc)) from None
    others = other_weight_files(folder)
    if others:
        raise HFExportError(
            f"{folder} holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} but none of "
            f"{', '.join(CHECKPOINT_FILES)}: rope-export reads only what save_pretrained writes; re-save the model "
            "with save_pretrained, or pass --random-weights to export random weights")
    return None


def chosen_weights(hf, weights, random_weights: bool, seed: int) -> tuple[str | os.PathLike | None, str]:
    """(the weights ``export --hf`` builds with, the summary's first line saying which): ``weights`` when given,
    none with ``random_weights``, else the checkpoint in the ``hf`` folder (``weights_beside``)."""
    weights = weights if weights is not None or random_weights else weights_beside(hf)
    if weights is not None:
        return weights, f"weights from {weights}"
    why = "--random-weights" if random_weights else f"{hf} holds no checkpoint; give --weights DIR"
    return None, f"random weights (seed {seed}): not a trained model ({why})"


def _reason(exc: BaseException) -> str:
    """The innermost cause's message, on one line (strict-dataclass validation wraps the real ValueError)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text[:300] or type(exc).__name__


def check_config(config) -> None:
    """Refuse, in one line, a config whose shapes cannot make a model (before building anything)."""
    text = text_config(config)
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    if isinstance(heads, int) and isinstance(hidden, int):
        if heads <= 0:
            raise HFExportError(f"{text.model_type}: num_attention_heads must be positive, got {heads}")
        if hidden % heads and not getattr(text, "head_dim", None):
            raise HFExportError(
                f"{text.model_type}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and the "
                "config sets no head_dim; fix one of them in the config"
            )


def build_hf_model(config, weights: str | os.PathLike | None = None, *, dtype: str = "fp32", seed: int = 0,
                   random_weights: bool = False, progress: Callable[[str], None] | None = None,
                   model_class: str | None = None):
    """The causal LM of ``config`` (a config object or a path) with the weights ``export --hf`` would use;
    ``model_class``: another transformers class (an Auto class or a model class, by name) to build instead
    (``rope_export.hf.tasks`` picks it for a task).

    ``weights``: a local checkpoint folder. Without it, a path ``config`` uses the checkpoint beside it
    (``weights_beside``: the folder itself, or the one holding the .json), as the CLI does; random
    weights (seeded) come only from a config-only folder, a config object (it has no folder), or
    ``random_weights=True``. Attention is transformers' eager implementation and experts use
    ``batched_mm``: both export to plain ONNX ops. The weights are allocated once in ``dtype``
    (``rope_export.hf.checkpoints``: no float32 detour, no transient copy).
    """
    import transformers

    from rope_export.hf.checkpoints import CheckpointError, build_causal_lm

    if random_weights and weights is not None:
        raise HFExportError("random_weights=True and weights exclude each other: give one")
    if not isinstance(config, transformers.PretrainedConfig):
        if weights is None and not random_weights:
            weights = weights_beside(config)  # a folder with a checkpoint never builds random weights silently
        config = load_hf_config(config)
    if dtype not in DTYPES:
        raise HFExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    check_config(config)
    model_type = config.model_type
    auto_name = model_class or (MODEL_TYPES[model_type].auto_class if model_type in MODEL_TYPES else
                                "AutoModelForCausalLM")
    auto = getattr(transformers, auto_name)
    if not auto_name.startswith("Auto"):  # a model class: built as from_config/from_pretrained of an Auto class
        auto = _AsAutoClass(auto)
    options = dict(attn_implementation="eager", experts_implementation=EXPERTS_IMPLEMENTATION)
    try:
        model, _ = build_causal_lm(auto, config, DTYPES[dtype], weights=weights, seed=seed, options=options,
                                   progress=progress)
    except CheckpointError as exc:
        raise HFExportError(str(exc)) from None
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFExportError(f"cannot build a {auto_name} for model_type {model_type!r}: {first}") from None
    return model.eval()


class _AsAutoClass:
    """A transformers model class with an Auto class's ``from_config`` (``build_causal_lm`` calls that)."""

    def __init__(self, cls):
        self.cls = cls

    def from_config(self, config, **options):
        return self.cls._from_config(config, **options)

    def from_pretrained(self, *args, **options):
        return self.cls.from_pretrained(*args, **options)
