"""What the file's ``rope_export.*`` metadata says, validated field by field before anything is built.

Every field is checked for type and range here, so damaged metadata (dtype "fp64", seed "abc", a
cache of 10^9 rows, a preset of a million heads) ends in one line naming the field, never in a
traceback or an allocation of tens of GB.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from rope_export.check.model_file import CheckError, ModelFile, require_memory
from rope_export.exporting.core import DTYPES
from rope_export.op.rope_types import RopeConfig
from rope_export.presets import Preset

MAX_SEED = 2**63 - 1
MAX_POSITIONS = 2**31 - 1


@dataclass
class PresetInfo:
    preset: Preset
    dtype: str
    seed: int
    cache_len: int | None
    decode: bool

    @property
    def rope(self) -> RopeConfig:
        return self.preset.rope

    @property
    def position_limit(self) -> int:
        return self.cache_len or self.preset.rope.max_position_embeddings


@dataclass
class HFInfo:
    dtype: str
    seed: int
    kind: str  # "hf-causal-lm" or "hf-attention"
    config: dict  # transformers' config (to_json_string(use_diff=True))
    weights: str | None  # None: random weights (seed)
    rope: RopeConfig | None
    rope_extra: dict = field(default_factory=dict)
    layer: int | None = None
    rope_by_layer_type: dict[str, RopeConfig] = field(default_factory=dict)  # Gemma 3: sliding vs global
    layer_types: list[str] = field(default_factory=list)  # each layer's type, in order

    @property
    def position_limit(self) -> int | None:
        if self.rope is not None:
            return self.rope.max_position_embeddings
        text = self.config.get("text_config", self.config)
        value = text.get("max_position_embeddings", text.get("n_positions"))
        return value if isinstance(value, int) and value > 0 else None


def file_source(mf: ModelFile) -> str | None:
    """"preset", "transformers", "diffusers" or None (no rope_export metadata)."""
    if mf.metadata.get("source") in ("transformers", "diffusers"):
        return mf.metadata["source"]
    if "preset" in mf.metadata:
        return "preset"
    return None


def _fail(mf: ModelFile, key: str, problem: str):
    raise CheckError(f"{mf.label}: metadata rope_export.{key} {problem}; the file's metadata is damaged: "
                     "re-export it, or check it against another reference (--reference, --hf)")


def _dtype(mf: ModelFile) -> str:
    value = mf.metadata.get("dtype", "fp32")
    if value not in DTYPES:
        _fail(mf, "dtype", f"is {value!r}, not one of {', '.join(DTYPES)}")
    return value


def _int(mf: ModelFile, key: str, default, low: int, high: int) -> int | None:
    raw = mf.metadata.get(key, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        _fail(mf, key, f"is {raw[:40]!r}, not an integer")
    if not low <= value <= high:
        _fail(mf, key, f"is {value}, outside [{low}, {high}]")
    return value


def _json(mf: ModelFile, key: str):
    try:
        return json.loads(mf.metadata[key])
    except (KeyError, ValueError):
        _fail(mf, key, "is not valid JSON")


def read_preset_info(mf: ModelFile, memory_limit: int) -> PresetInfo:
    data = _json(mf, "preset")
    if not isinstance(data, dict):
        _fail(mf, "preset", "is not a preset table")
    try:
        preset = Preset.from_dict(data, origin=f"{mf.label} metadata")
    except (ValueError, TypeError) as exc:
        raise CheckError(f"{exc}; the file's metadata is damaged: re-export it") from None
    info = PresetInfo(preset, _dtype(mf), _int(mf, "seed", 0, 0, MAX_SEED),
                      _int(mf, "cache_len", None, 1, MAX_POSITIONS), mf.metadata.get("decode") == "1")
    a, rope = preset.attention, preset.rope
    weights = 4 * a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)  # float32 at build
    require_memory(f"the preset block of the metadata (hidden {a.hidden_size}, {a.num_heads} heads of "
                   f"{a.head_dim})", weights, memory_limit)
    if not rope.seq_len_dependent:
        require_memory(f"the cos/sin caches of the metadata ({info.position_limit} rows)",
                       2 * 4 * info.position_limit * rope.rotary_embedding_dim, memory_limit)
    return info


def read_hf_info(mf: ModelFile, memory_limit: int) -> HFInfo:
    from rope_export import hf

    try:
        meta = hf.read_hf_metadata(mf.proto)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckError(f"{mf.label}: the transformers metadata cannot be read ({exc}); re-export the file, or give "
                         "the config with --hf CONFIG") from None
    if not isinstance(meta.get("hf_config"), dict):
        _fail(mf, "hf_config", "is not a config table")
    weights = meta.get("hf_weights") or "random"
    layer = meta.get("layer")
    info = HFInfo(_dtype(mf), _int(mf, "seed", 0, 0, MAX_SEED), meta.get("kind", "hf-causal-lm"), meta["hf_config"],
                  None if weights == "random" else weights, meta.get("rope"), meta.get("rope_extra") or {},
                  layer if isinstance(layer, int) else None)
    info.rope_by_layer_type, info.layer_types = _layer_ropes(mf, meta)
    require_memory("the transformers model of the metadata", transformers_bytes(info.config, info.dtype), memory_limit)
    return info


def _layer_ropes(mf: ModelFile, meta: dict) -> tuple[dict[str, RopeConfig], list[str]]:
    """Every layer type's RopeConfig and each layer's type (the metadata's own record, else the config's)."""
    by_type = (meta.get("rope_extra") or {}).get("rope_by_layer_type") or {}
    if not isinstance(by_type, dict):
        _fail(mf, "rope_extra", "has a rope_by_layer_type that is not a table")
    try:
        ropes = {str(k): RopeConfig.from_dict(v) for k, v in by_type.items()}
    except (ValueError, TypeError) as exc:
        _fail(mf, "rope_extra", f"has a rope_by_layer_type entry that is no RoPE configuration ({exc})")
    config = meta.get("hf_config") or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types = meta.get("layer_types") or text.get("layer_types") or []
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        _fail(mf, "layer_types", "is not a list of layer type names")
    return ropes, types


def transformers_bytes(config: dict, dtype: str) -> float:
    """About what building the config's model allocates: embeddings, layers (attention + MLP), head."""
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config

    def number(*names, default=0):
        for name in names:
            value = text.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
                return value
        return default

    hidden = number("hidden_size", "n_embd", "d_model")
    vocab = number("vocab_size")
    layers = number("num_hidden_layers", "n_layer", "num_layers", default=1)
    inner = number("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    experts = number("num_local_experts", "num_experts", "n_routed_experts", default=1)
    params = vocab * hidden * 2 + layers * (4 * hidden * hidden + 3 * hidden * inner * experts)
    return params * DTYPES[dtype].itemsize
