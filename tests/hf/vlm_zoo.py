"""The VLM zoo's harness: every image-text-to-text model type of the installed transformers, tiny, censused, and
exported whole where rope-export has an entry for it.

``check_type(model_type)``:

1. builds a tiny random-weight model of the type (``vlm_configs`` for the five types the issue names; otherwise
   transformers' default config of the type with its text and vision sizes shrunk, ``tiny_config``);
2. counts, in one eager forward each, the rotations of the text tower (a text-only prompt) and of the vision tower
   (an image of the exported size through the type's entry, else a ``[1, channels, image_size, image_size]``
   image through ``get_image_features``): ``rope_export.detect.count_rotations``, by data flow;
3. where rope-export has an entry for the type (``rope_export.hf.vlm.kinds``), exports it whole with default
   flags and checks the folder (``check_folder`` on onnxruntime: every component against its transformers
   submodule, then the pipeline); otherwise the type is refused with the reason and what the census found.

A type whose towers perform no rotation at all is recorded as such (nothing for rope-export to do).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import vlm_configs
from hf_zoo_configs import SHRINK, _latent_attention, _small, _two_layer_types
from transformers import AutoConfig

from rope_export.detect import count_rotations
from rope_export.hf.errors import HFExportError

VISION_SHRINK = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "depth": 2,
                 "num_attention_heads": 2, "num_heads": 2, "embed_dim": 32, "head_dim": 16, "out_hidden_size": 32,
                 "projector_input_dim": 32, "projector_output_dim": 32, "vision_output_dim": 32}
TOKEN_BASE = 150  # special token ids are moved to 150, 151, ... inside the tiny vocabulary


@dataclass
class VLMZooResult:
    model_type: str
    status: str  # "pass", "refused", "no-rope", "fail"
    reason: str = ""
    text_rotations: int | None = None  # None: the tower could not be run
    vision_rotations: int | None = None
    rotary_nodes: str = ""  # "vision+embedding+decoder" node counts of an export
    max_error: float = 0.0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


def _tokens(config_dict: dict, vocab: int, taken: dict) -> dict:
    out = {}
    for name, value in config_dict.items():
        if name.endswith(("token_id", "token_index")) and isinstance(value, int) and not isinstance(value, bool):
            if value >= vocab or value < 0:
                out[name] = taken.setdefault(value, TOKEN_BASE + len(taken))
    return out


def tiny_config(model_type: str):
    """The five named types: ``vlm_configs``; others: the default config with its sizes shrunk."""
    if model_type in vlm_configs.CONFIGS:
        return vlm_configs.tiny_config(model_type)
    default = AutoConfig.for_model(model_type)
    vocab, taken, kwargs = vlm_configs.VOCAB, {}, {}
    text = getattr(default, "text_config", None)
    if text is not None and hasattr(text, "to_dict"):
        shrunk = {**_small(text, SHRINK), **_latent_attention(text), **_two_layer_types(text), "vocab_size": vocab}
        kwargs["text_config"] = {**_own(text), **shrunk, **_tokens(text.to_dict(), vocab, taken), **_mrope(text)}
    vision = getattr(default, "vision_config", None)
    if vision is not None and hasattr(vision, "to_dict"):
        kwargs["vision_config"] = {**_own(vision), **_small(vision, VISION_SHRINK)}
    top = {k: v for k, v in _small(default, SHRINK).items() if k != "vocab_size" or text is None}
    kwargs.update(top)
    kwargs.update(_tokens(default.to_dict(), vocab, taken))
    return AutoConfig.for_model(model_type, **kwargs)


def _mrope(text) -> dict:
    """mRoPE sections that fit the tiny head's rotated pairs (head 8, times the partial rotary factor): half
    temporal, a quarter each height and width ([2, 1, 1] for 4 pairs, [1, 1, 0] for 2)."""
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or not _uses_mrope(text.model_type):
        return {}
    pairs = int(SHRINK["hidden_size"] // SHRINK["num_attention_heads"] * params.get("partial_rotary_factor", 1.0)) // 2
    quarter = max(1, pairs // 4) if pairs > 2 else pairs // 2
    return {"rope_parameters": {**params, "mrope_section": [pairs - 2 * quarter if pairs > 2 else pairs - quarter,
                                                            quarter, quarter if pairs > 2 else 0]}}


def _uses_mrope(model_type: str) -> bool:
    """Whether the type's modeling code reads ``mrope_section`` (its default, for a full-size head, must be set)."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    try:
        name = model_type_to_module_name(model_type)
        source = inspect.getsource(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
    except Exception:  # noqa: BLE001 - a text config of another package (e.g. qwen2 inside a VLM)
        return False
    return "mrope_section" in source


def _own(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in ("transformers_version",)}


def build(model_type: str):
    import transformers

    from rope_export.hf.checkpoints import build_causal_lm
    from rope_export.hf.loading import EXPERTS_IMPLEMENTATION

    model, _ = build_causal_lm(transformers.AutoModelForImageTextToText, tiny_config(model_type), torch.float32,
                               seed=0, options=dict(attn_implementation="eager",
                                                    experts_implementation=EXPERTS_IMPLEMENTATION))
    return model.eval()


class _Text(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        from rope_export.hf.vlm.kinds import MODEL_TYPES

        kind = MODEL_TYPES.get(self.model.config.model_type)
        model = kind.text_model(self.model) if kind is not None else self.model
        return model(input_ids=input_ids).logits


class _Vision(torch.nn.Module):
    """``get_image_features`` of an image: ``[1, channels, side, side]``, or Qwen-style flattened patches with their
    grid (a vision config with a temporal patch size and a spatial merge)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, grid=None):
        extra = {} if grid is None else {"image_grid_thw": grid}
        out = self.model.get_image_features(pixel_values=pixel_values, return_dict=True, **extra)
        return out.last_hidden_state if out.pooler_output is None else out.pooler_output


def _pixels(vision) -> tuple:
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    patch, merge = getattr(vision, "patch_size", None), getattr(vision, "spatial_merge_size", None)
    temporal = getattr(vision, "temporal_patch_size", None)
    if patch and merge and temporal:  # 2 x 2 merged tokens
        side = 2 * merge
        return torch.randn(side * side, channels * temporal * patch * patch), torch.tensor([[1, side, side]])
    side = getattr(vision, "image_size", None) or 32
    side = side[0] if isinstance(side, (list, tuple)) else side
    return (torch.randn(1, channels, side, side),)


def _first_line(exc: BaseException) -> str:
    """The exception's class and message on one line (strict-dataclass errors give their reason on a second)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3] if line.strip())
    return f"{type(exc).__name__}: {text[:240]}"


def text_census(model) -> int:
    ids = torch.arange(6).remainder(vlm_configs.VOCAB)[None] + 1
    with torch.no_grad():
        return len(count_rotations(_Text(model).eval(), (ids,)).plain)


def vision_census(model) -> int:
    from rope_export.hf.vlm.components import VisionEncoder
    from rope_export.hf.vlm.kinds import MODEL_TYPES

    kind = MODEL_TYPES.get(model.config.model_type)
    with torch.no_grad():
        if kind is not None:
            size = vlm_configs.IMAGE_SIZES.get(model.config.model_type)
            from rope_export.hf.vlm import ImageSize

            geometry = kind.geometry(model.config, ImageSize.parse(size) if size else kind.default_size(model.config))
            module = VisionEncoder(model, kind, geometry, precomputed=False)
            pixels = (torch.randn(geometry.pixel_shape),)
        else:
            module, pixels = _Vision(model), _pixels(model.config.vision_config)
        return len(count_rotations(module.eval(), pixels).plain)


def check_type(model_type: str) -> VLMZooResult:
    from rope_export.hf.vlm.kinds import MODEL_TYPES

    start = time.perf_counter()
    result = VLMZooResult(model_type, "fail")
    try:
        model = build(model_type)
    except Exception as exc:  # noqa: BLE001 - the zoo records every outcome
        result.reason = f"the tiny config does not build: {_first_line(exc)}"
        return result
    towers = []
    for name, census in (("text", text_census), ("vision", vision_census)):
        try:
            setattr(result, f"{name}_rotations", census(model))
        except Exception as exc:  # noqa: BLE001
            towers.append(f"{name} tower not run ({_first_line(exc)})")
    text, vision = result.text_rotations, result.vision_rotations
    found = f"text tower {text if text is not None else '?'}, vision tower {vision if vision is not None else '?'}"
    if model_type not in MODEL_TYPES:
        if (text or 0) + (vision or 0) == 0 and not towers:
            result.status, result.reason = "no-rope", "neither tower rotates in an eager forward"
        else:
            result.status = "refused"
            result.reason = (f"rotations in eager transformers: {found}; rope-export has no vision-language entry "
                             "for it (export --hf refuses it, naming the types it covers)")
        result.seconds = time.perf_counter() - start
        return result
    result.reason = found
    try:
        result.max_error, result.rotary_nodes = _export_and_check(model, model_type)
        result.status, result.reason = "pass", ""
    except HFExportError as exc:  # a clear refusal of the export
        result.status, result.reason = "refused", str(exc).splitlines()[0]
    except Exception as exc:  # noqa: BLE001
        result.reason = _first_line(exc)
    result.seconds = time.perf_counter() - start
    return result


def _export_and_check(model, model_type: str) -> tuple[float, str]:
    from rope_export.check.vlm_folder import check_folder
    from rope_export.hf.vlm.exporting import export_vlm

    with tempfile.TemporaryDirectory(prefix="vlm-zoo-") as tmp:
        out = Path(tmp) / "out"
        exported = export_vlm(model, out, image_size=vlm_configs.IMAGE_SIZES.get(model_type))
        counts = [(c.rotations, c.nodes) for c in exported.components.values()]
        assert all(r == n for r, n in counts), f"rotations and rotary nodes differ: {counts}"
        report = check_folder(out, ("onnxruntime-cpu",), sweep=False)
        assert report.passed, report.failure_message()
        return max(report.pipeline.errors.values()), "+".join(str(n) for _, n in counts)
