"""``check`` of a vision-language export: each component against the same transformers submodule, and the whole
pipeline (image + text -> logits, then a decode step) against transformers' model.

* A component file (``rope_export.vlm`` in its metadata) is checked as any file with a PyTorch module as its
  reference (``module_reference.ModuleReference``, every runner, every rotary node swept): the module is the
  component of the transformers model rebuilt from the file's config, weights and seed (``check.weights``'s
  rule), run as transformers runs it (the vision tower computes its positions from the grid itself). The
  embedding merge (and Qwen3-VL's decoder, whose extras must agree with each other) get prompts that hold the
  image's tokens instead of the generated stress cases.
* ``check OUT_DIR/`` checks the three components so, then the whole pipeline (``check.vlm_folder``).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rope_export.check.model_file import CheckError, ModelFile

RECORD = "vlm"  # rope_export.vlm: {"component", "kind", "image"}
WHY_OWN_CASES = {"vision": "two images of the exported size (pixels of unit and of 4x the scale)",
                 "embedding": "two prompts, one holding the image's tokens (its feature rows must match them)",
                 "decoder": "a prompt whose image tokens carry deepstack features, then a decode step"}


def vlm_record(mf: ModelFile) -> dict | None:
    raw = mf.metadata.get(RECORD)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        if record["component"] not in ("vision", "embedding", "decoder") or not isinstance(record["image"], dict):
            raise ValueError(record["component"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"{mf.label}: metadata rope_export.{RECORD} is damaged ({exc}); re-export the "
                         "folder") from None
    return record


@dataclass
class Rebuilt:
    """The transformers model a component file records, and what its components need."""

    model: object
    kind: object
    geometry: object
    layout: object
    notes: list[str] = field(default_factory=list)
    weights: dict = field(default_factory=dict)


def rebuild(mf: ModelFile, *, weights=None, seed: int | None = None, random_weights: bool = False) -> Rebuilt:
    from rope_export.check.metadata import MAX_SEED, _dtype, _int, _json, transformers_bytes
    from rope_export.check.model_file import memory_limit_bytes, require_memory
    from rope_export.check.references import _config_from
    from rope_export.check.weights import choose_weights
    from rope_export.hf.cache_io import cache_layout
    from rope_export.hf.errors import HFExportError
    from rope_export.hf.vlm import Geometry, build_vlm, kind_of

    record = vlm_record(mf)
    config_dict, dtype = _json(mf, "hf_config"), _dtype(mf)  # every component records them (the decoder's RoPE too)
    if not isinstance(config_dict, dict):
        raise CheckError(f"{mf.label}: metadata rope_export.hf_config is not a config table; re-export the folder")
    require_memory("the transformers model of the metadata", transformers_bytes(config_dict, dtype),
                   memory_limit_bytes(None))
    recorded = mf.metadata.get("hf_weights") or "random"
    choice = choose_weights(recorded=None if recorded == "random" else recorded,
                            recorded_seed=_int(mf, "seed", 0, 0, MAX_SEED), weights=weights,
                            random_weights=random_weights, seed=seed)
    config = _config_from(config_dict)
    try:
        model = build_vlm(config, choice.folder, dtype=dtype, seed=choice.seed, random_weights=choice.folder is None)
        kind = kind_of(config)
        geometry = Geometry.from_dict(record["image"])
        layout = cache_layout(kind.text_model(model))
    except (HFExportError, ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"{mf.label}: the transformers model it records cannot be rebuilt: {exc}") from None
    return Rebuilt(model, kind, geometry, layout, [choice.note] if choice.note else [], choice.to_dict())


def component_module(rebuilt: Rebuilt, name: str):
    from rope_export.hf.vlm.components import DecoderWithCache, EmbeddingMerge, VisionEncoder

    model, kind = rebuilt.model, rebuilt.kind
    if name == "vision":  # transformers computes the grid's positions, windows and segments itself
        return VisionEncoder(model, kind, rebuilt.geometry, precomputed=False).eval()
    if name == "embedding":
        return EmbeddingMerge(model, kind).eval()
    return DecoderWithCache(model, kind, rebuilt.layout).eval()


def _check_names(mf: ModelFile, rebuilt: Rebuilt, name: str) -> None:
    from rope_export.hf.vlm.components import io_names

    want_in, want_out = io_names(rebuilt.kind, rebuilt.layout)[name]
    have_in, have_out = [s.name for s in mf.inputs], [s.name for s in mf.outputs]
    if (have_in, have_out) != (want_in, want_out):
        raise CheckError(f"{mf.label}: inputs {have_in} and outputs {have_out} are not the {name} component's "
                         f"{want_in} and {want_out}; the file was changed after export: re-export the folder")


def component_feeds(rebuilt: Rebuilt, name: str, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """The component's own cases: two images (pixels of unit and of 4x the scale) for the vision encoder; the
    embedding merge of two prompts (one with the image's tokens, one without); Qwen3-VL's decoder on a prompt
    whose image rows carry deepstack features and a decode step after it."""
    import torch

    from rope_export.hf.vlm.exporting import example_inputs

    example = example_inputs(rebuilt.model, rebuilt.kind, rebuilt.geometry, rebuilt.layout, seed)
    if name == "vision":
        (pixels,) = example["vision"]
        return [{"pixel_values": _np(pixels)}, {"pixel_values": _np(4 * pixels)}]
    if name == "embedding":
        ids, features = example["embedding"]
        text_only = ids.clone()
        text_only[text_only == ids[0, 2]] = ids[0, 0]
        return [{"input_ids": ids.numpy(), "image_features": _np(features)},
                {"input_ids": text_only[:, :5].numpy(), "image_features": _np(features[:0])}]
    from rope_export.hf.vlm.components import io_names

    names = io_names(rebuilt.kind, rebuilt.layout)["decoder"][0]
    prefill = list(example["decoder"])
    first_past = len(names) - len(rebuilt.layout.input_names())
    prefill[first_past:] = [t[:, :, :0] if t.dim() == 4 else t for t in prefill[first_past:]]
    prefill[2] = torch.ones(prefill[0].shape[0], prefill[0].shape[1], dtype=torch.long)
    return [dict(zip(names, map(_np, tensors), strict=True)) for tensors in (prefill, example["decoder"])]


def _np(tensor) -> np.ndarray:
    import torch

    return tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


class _Scratch:
    """npz feeds for ``check``'s --inputs, in a folder removed with this object."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], name: str):
        self._dir = tempfile.TemporaryDirectory(prefix="rope-export-vlm-")
        self.paths = []
        for i, feed in enumerate(feeds):
            path = Path(self._dir.name) / f"{name}-prompt{i}.npz"
            np.savez(path, **feed)
            self.paths.append(str(path))


def component_reference(mf: ModelFile, *, weights=None, seed=None, random_weights=False,
                        rebuilt: Rebuilt | None = None):
    """(the transformers module to compare with, notes, --inputs feeds or None, a scratch folder to keep alive)."""
    name = vlm_record(mf)["component"]
    rebuilt = rebuilt or rebuild(mf, weights=weights, seed=seed, random_weights=random_weights)
    _check_names(mf, rebuilt, name)
    fact = rebuilt.weights
    weights = (f"weights {fact['path']}" if fact.get("source") == "folder" else
               f"random weights, seed {fact.get('seed')}")
    notes = [f"reference: the {name} component of transformers' {type(rebuilt.model).__name__} rebuilt from the "
             f"file's config ({weights})", *rebuilt.notes]
    scratch = None
    if name != "decoder" or rebuilt.kind.decoder_extras:
        scratch = _Scratch(component_feeds(rebuilt, name), name)
        notes.append(f"{name}: compared on {WHY_OWN_CASES[name]}, not on the generated stress cases")
    return component_module(rebuilt, name), notes, scratch
