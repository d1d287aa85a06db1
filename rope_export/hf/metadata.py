"""The ``rope_export.*`` metadata of an exported transformers model, and reading it back.

Keys are shared with the preset files where they fit (version, dtype, seed, decode, rope, ...);
``hf_config`` holds the config, ``rotary_hook`` what was hooked or fused, ``rotations_eager`` and
``rotary_nodes`` the two counts the export compared.
"""

from __future__ import annotations

import json

import onnx

from rope_export import __version__
from rope_export.exporting.core import METADATA_PREFIX
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import HFFamily, rope_config_from_hf
from rope_export.op import contract
from rope_export.op.rope_types import RopeConfig


def hf_metadata(model, family: HFFamily, *, hook_description: str, interleaved: bool, dtype: str, kind: str,
                weights: str | None, seed: int, layer: int | None) -> dict[str, str]:
    """The ``rope_export.*`` metadata of an exported transformers model (keys shared with presets where they fit)."""
    import transformers

    config = model.config
    meta = {
        "version": __version__,
        "source": "transformers",
        "kind": kind,
        "dtype": dtype,
        "seed": str(seed),
        "cache_len": "",  # the caches are per token, computed in-graph by transformers' rotary code
        "decode": "1",
        "out_of_range_positions": contract.OUT_OF_RANGE,
        "hf_model_type": str(config.model_type),
        "hf_architecture": type(model).__name__,
        "hf_config": config.to_json_string(use_diff=True),
        "hf_weights": weights or "random",
        "hf_family": family.name,
        "position_ids_rank": str(family.position_rank),
        "transformers_version": transformers.__version__,
        "rotary_hook": hook_description,
    }
    try:
        rope, extra = rope_config_from_hf(model, family, interleaved=interleaved)
    except Exception as exc:  # noqa: BLE001 - best effort: per-layer configs (Gemma 4) refuse a global head_dim
        meta["rope_note"] = f"RoPE parameters not recorded: {str(exc).splitlines()[0]}"
    else:
        meta["rope"] = json.dumps(rope.to_dict(), sort_keys=True)
        meta["rope_extra"] = json.dumps(extra, sort_keys=True)
    # which layer runs which type's RoPE (rope_by_layer_type), whatever the config leaves to its defaults
    layer_types = getattr(config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config,
                          "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and all(isinstance(t, str) for t in layer_types):
        meta["layer_types"] = json.dumps(list(layer_types))
    if layer is not None:
        meta["layer"] = str(layer)
    return {METADATA_PREFIX + k: v for k, v in meta.items()}


def read_hf_metadata(model: onnx.ModelProto) -> dict:
    """What ``hf_metadata`` wrote: rope (a RopeConfig or None), rope_extra, hf_config (dict), kind, ..."""
    props = {p.key.removeprefix(METADATA_PREFIX): p.value for p in model.metadata_props
             if p.key.startswith(METADATA_PREFIX)}
    if props.get("source") != "transformers":
        raise HFExportError("the file has no transformers metadata; was it written by `rope-export export --hf`?")
    out = dict(props)
    out["rope"] = RopeConfig.from_dict(json.loads(props["rope"])) if props.get("rope") else None
    out["rope_extra"] = json.loads(props.get("rope_extra") or "{}")
    out["layer_types"] = json.loads(props.get("layer_types") or "null")
    out["hf_config"] = json.loads(props["hf_config"])
    out["decode"] = props.get("decode") == "1"
    out["seed"] = int(props.get("seed", "0"))
    for key in ("layer", "rotations_eager", "rotary_nodes"):
        if key in props:
            out[key] = int(props[key])
    return out
