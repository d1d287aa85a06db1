"""What rope-export knows about particular transformers model types: overrides, never a gate.

Every model type exports through detection by code (``rope_export.detect``): the rotary function
its attention calls is found and verified whatever the type is called. ``HF_FAMILIES`` only holds
what detection cannot see: the Auto class that builds a type (Qwen2-VL), the rank of its
position_ids (mRoPE's ``(3, B, S)``), how to read its RoPE parameters for the metadata (GPT-J
hard-codes its base), and the form to insist on when a user forces one with ``--hf-family``.
``family_of`` returns the registered family of a type, or a generic one for every other type.

``rope_config_from_hf`` reads a config's RoPE parameters into ``RopeConfig``s (one per layer type
when the config has per-layer-type parameters, as Gemma 3 and ModernBERT do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from rope_export.detect.forms import FORMS
from rope_export.hf.errors import HFExportError
from rope_export.op.rope_types import RopeConfig, RopeConfigError


def text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def default_head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    heads = int(config.num_attention_heads)
    if config.hidden_size % heads:
        raise HFExportError(
            f"{config.model_type}: hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
            f"{heads}; set head_dim in the config or fix one of the two"
        )
    return config.hidden_size // heads


_ROPE_FIELDS = {f.name for f in dataclasses.fields(RopeConfig)} - {"head_dim", "max_position_embeddings", "interleaved",
                                                                     "rotary_dim"}


def _one_rope(config, params: dict, head_dim: int, interleaved: bool) -> tuple[RopeConfig, dict]:
    data = {k: v for k, v in params.items() if k in _ROPE_FIELDS and v is not None}
    extra = {k: v for k, v in params.items() if k not in _ROPE_FIELDS and v is not None}
    data.setdefault("rope_type", "default")
    if data["rope_type"] == "longrope" and "original_max_position_embeddings" not in data:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            data["original_max_position_embeddings"] = int(original)
    for name in ("rope_theta", "partial_rotary_factor", "factor", "attention_factor"):
        if isinstance(data.get(name), int) and not isinstance(data[name], bool):
            data[name] = float(data[name])
    data["max_position_embeddings"] = int(config.max_position_embeddings)
    data["interleaved"] = interleaved
    try:
        return RopeConfig.from_dict(data, head_dim=head_dim), extra
    except (RopeConfigError, TypeError) as exc:
        raise HFExportError(f"{config.model_type}: the rope parameters {params} do not map to a RopeConfig: {exc}") \
            from None


def rope_parameters_rope(config, head_dim: int, interleaved: bool = False) -> tuple[RopeConfig, dict]:
    """RopeConfig from transformers' ``config.rope_parameters`` (+ fields RopeConfig has no place for).

    Per-layer-type parameters (``{"full_attention": {...}, "sliding_attention": {...}}``) give the
    global layers' RopeConfig, and every type's in ``extra["rope_by_layer_type"]``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        by_type = {name: _one_rope(config, p, head_dim, interleaved)[0].to_dict() for name, p in params.items()}
        main = "full_attention" if "full_attention" in params else sorted(params)[0]
        rope, extra = _one_rope(config, params[main], head_dim, interleaved)
        return rope, {**extra, "rope_by_layer_type": by_type}
    return _one_rope(config, params, head_dim, interleaved)


def _gptj_rope(config, head_dim: int, interleaved: bool = True) -> tuple[RopeConfig, dict]:
    rotary_dim = getattr(config, "rotary_dim", None)
    # GPT-J's create_sinusoidal_positions hard-codes base 10000.
    return RopeConfig(head_dim=head_dim, rope_theta=10000.0, max_position_embeddings=int(config.n_positions),
                      rotary_dim=None if rotary_dim is None or rotary_dim == head_dim else int(rotary_dim),
                      interleaved=True), {}


@dataclass(frozen=True)
class HFFamily:
    """What rope-export knows about some model types beyond what detection finds."""

    name: str
    form: str | None = None  # key of FORMS that --hf-family insists on (None: any form detection verifies)
    function: str | None = None  # the function name --hf-family insists on
    auto_class: str = "AutoModelForCausalLM"
    position_rank: int = 2  # 3 for Qwen2-VL's (3, B, S) multimodal positions
    rope: Callable = rope_parameters_rope  # (text config, head_dim, interleaved) -> (RopeConfig, extra fields)
    head_dim: Callable = default_head_dim
    notes: str = ""
    model_types: tuple[str, ...] = ()
    forced: bool = False  # named by the user (--hf-family): detection accepts only its form and function

    @property
    def types(self) -> tuple[str, ...]:
        return self.model_types or (self.name,)


def _family(name, notes, **kw) -> HFFamily:
    return HFFamily(name=name, form=kw.pop("form", "rotate-half"), function=kw.pop("function", "apply_rotary_pos_emb"),
                    notes=notes, **kw)


HF_FAMILIES: dict[str, HFFamily] = {
    family.name: family
    for family in (
        _family("llama", "rotate-half, whole head; llama3/yarn/linear/dynamic scaling from rope_parameters"),
        _family("mistral", "rotate-half, whole head (as Llama)"),
        _family("qwen2", "rotate-half, whole head (as Llama)"),
        _family("qwen3", "rotate-half, whole head; q/k RMSNorm before the rotation"),
        _family("gemma", "rotate-half, whole head (head_dim set explicitly)"),
        _family("phi", "rotate-half, partial: the attention slices q/k to rotary_ndims before the call"),
        _family("phi3", "rotate-half, partial inside the function; longrope switch computed in-graph"),
        _family("gpt_neox", "rotate-half, partial inside the function (rotary_pct)"),
        _family("gptj", "interleaved pairs, one [B, S, H, rd] tensor per call, before the transpose",
                form="interleaved-one", rope=_gptj_rope, head_dim=lambda c: c.hidden_size // c.num_attention_heads),
        _family("llama4", "Meta-style complex RoPE (view_as_complex * freqs_cis); NoPE layers have no node",
                form="complex", function="apply_rotary_emb", model_types=("llama4_text",)),
        _family("qwen2_vl", "multimodal RoPE: position_ids (3, B, S); the rotary module composes the mrope_section "
                            "bands, the function is Llama's rotate-half",
                auto_class="AutoModelForImageTextToText", position_rank=3, model_types=("qwen2_vl", "qwen2_vl_text")),
    )
}
MODEL_TYPES: dict[str, HFFamily] = {t: f for f in HF_FAMILIES.values() for t in f.types}


def family_of(model_or_config, family: str | HFFamily | None = None) -> HFFamily:
    """The family of a transformers model/config: registered, forced with ``family``, or generic.

    ``family`` forces a registered family's form and function name onto a model of another
    model_type (detection then only accepts that form, and still verifies it numerically).
    """
    if isinstance(family, HFFamily):
        return family
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if family is not None:
        if family not in HF_FAMILIES:
            raise HFExportError(f"unknown family {family!r}; known: {', '.join(HF_FAMILIES)}")
        base = HF_FAMILIES[family]
        if model_type is None or model_type in base.types:
            return dataclasses.replace(base, forced=True)
        if not isinstance(model_or_config, nn.Module):
            raise HFExportError(
                f"family={family!r} for model_type {model_type!r}: give the model (not its config) so the hook "
                "knows which code to search"
            )
        return dataclasses.replace(base, name=f"{model_type} (as {family})", model_types=(model_type,),
                                   notes=f"{base.notes}; forced with family={family!r}", forced=True)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    return HFFamily(name=str(model_type), notes="detected by code")


def forced_forms(family: HFFamily) -> list | None:
    """The forms detection may accept for this family: its own when it has one, else all."""
    return None if family.form is None else [FORMS[family.form]]


def rope_config_from_hf(model_or_config, family: str | HFFamily | None = None, *,
                        interleaved: bool | None = None) -> tuple[RopeConfig, dict]:
    """(RopeConfig, fields RopeConfig has no place for, e.g. Qwen2-VL's mrope_section) of a transformers config.

    ``interleaved`` (what detection found) defaults to the family's form.
    """
    fam = family_of(model_or_config, family)
    config = text_config(getattr(model_or_config, "config", model_or_config))
    if interleaved is None:
        interleaved = fam.form is not None and FORMS[fam.form].node_interleaved
    return fam.rope(config, fam.head_dim(config), interleaved)
