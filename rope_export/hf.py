"""Export Hugging Face transformers models through the rotary op: one custom node per rotated tensor.

A transformers model rotates q and k in a module-level function of its modeling file
(``apply_rotary_pos_emb`` in ``transformers.models.<family>.modeling_<family>``), called by name
from the attention's forward. ``rotary_hooked(model)`` swaps that attribute for a replacement that
calls ``torch.ops.rope_export.rotary_embedding`` once per tensor, and puts the original back when
the ``with`` block ends (also on error). Nothing in transformers is edited and nothing global
outlives the block.

Registered families (``HF_FAMILIES``, one entry each): llama, mistral, qwen2, qwen3, gemma, phi,
phi3, gpt_neox, gptj, llama4 (text) and qwen2_vl. Their functions come in three forms (``FORMS``):
rotate-half ``(q, k, cos, sin)``, GPT-J's interleaved ``(tensor, sin, cos)`` and Llama 4's complex
``(xq, xk, freqs_cis)``. Before swapping, the replacement is checked numerically against the
original, so a transformers version that changed the function fails loudly instead of exporting
something else.

The replacement reuses the cos/sin transformers computes (per token ``[B, S, rd]``, magnitude
factor folded in, any rope_type incl. longrope and Qwen2-VL's multimodal sections): it hands the
op their first half (rotate-half families, whose cos is ``cat(freqs, freqs)``) or takes them as
they are (GPT-J's interleaved pairs) and calls the op without position_ids.

``export_hf`` wraps a causal LM so its forward is ``(input_ids, position_ids, past keys/values
as flat tensors per layer) -> (logits, present keys/values)`` (a DynamicCache is built inside),
exports that with dynamic batch/seq/past dims, and writes the RoPE parameters into the metadata
(``rope_export.*`` keys, ``rope_export.rope`` = ``RopeConfig.to_dict()`` JSON). ``layer=i``
exports one attention layer instead, with the preset blocks' I/O (hidden_states, position_ids,
past_key, past_value) -> (output, present_key, present_value).

transformers is imported lazily: the package imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from torch import nn

from rope_export import __version__, contract, ops
from rope_export.export import (
    DTYPES,
    INPUT_NAMES,
    METADATA_PREFIX,
    OUTPUT_NAMES,
    ExportError,
    _check_opset,
    _check_writable,
    _quiet_exporter,
    count_rotary_nodes,
    custom_translation_table,
    finish_export,
    graph_proto,
    rename_dynamic_dims,
)
from rope_export.meta import patched
from rope_export.rope_types import RopeConfig, RopeConfigError
from rope_export.tolerances import tolerance


class HFExportError(ExportError):
    """A transformers model or config that cannot be exported; the message names the fix."""


# -- the replacements ------------------------------------------------------------------------

def _per_token(cache: torch.Tensor, batch) -> torch.Tensor:
    """[S, n] (no batch axis) -> [B, S, n]; [B, S, n] stays."""
    if cache.dim() == 2:
        return cache.unsqueeze(0).expand(batch, -1, -1)
    if cache.dim() != 3:
        raise HFExportError(f"expected cos/sin of shape [B, S, rd] or [S, rd], got {list(cache.shape)}")
    return cache


def rotate_half_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """transformers' ``(x * cos) + (rotate_half(x) * sin)`` on the first ``cos.shape[-1]`` channels, as one op.

    ``x`` is [B, H, S, D] (``unsqueeze_dim=1``) or [B, S, H, D] (``unsqueeze_dim=2``); ``cos``/``sin``
    are transformers' per-token [B, S, rd] (``cat(freqs, freqs)``, so their first half is what the op
    takes). Channels past rd pass through (Phi-3 / GPT-NeoX partial rotary).
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    cos_h, sin_h = _per_token(cos[..., :half], x.shape[0]), _per_token(sin[..., :half], x.shape[0])
    partial = 0 if rotary_dim == x.shape[-1] else rotary_dim
    if unsqueeze_dim == 1:
        return ops.rotary_embedding(x, cos_h, sin_h, None, False, 0, partial)
    if unsqueeze_dim == 2:
        heads = x.shape[2]
        return ops.rotary_embedding(x.flatten(2), cos_h, sin_h, None, False, heads, partial).view(x.shape)
    raise HFExportError(f"unsqueeze_dim={unsqueeze_dim} is not a layout the hook knows (1: [B,H,S,D], 2: [B,S,H,D])")


def rotate_half_qk(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for transformers' Llama-style ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``."""
    return rotate_half_one(q, cos, sin, unsqueeze_dim), rotate_half_one(k, cos, sin, unsqueeze_dim)


def interleaved_one(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Drop-in for GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)``: pairs (2i, 2i+1), one op.

    ``tensor`` is [B, S, H, rd] (GPT-J rotates before its transpose, and slices the rotated part
    itself); ``sin``/``cos`` are [B, S, rd/2] (GPT-J repeat-interleaves them; the op needs them once).
    """
    heads = tensor.shape[2]
    cos, sin = _per_token(cos, tensor.shape[0]), _per_token(sin, tensor.shape[0])
    return ops.rotary_embedding(tensor.flatten(2), cos, sin, None, True, heads, 0).view(tensor.shape)


@dataclass(frozen=True)
class RotaryForm:
    """How a family's transformers function is called and what replaces it."""

    name: str
    parameters: tuple[str, ...]  # leading parameter names the original must have
    call: Callable  # (bound arguments dict) -> what the original returns
    probe: Callable[[Callable, Callable], float]  # (original, replacement) -> max |difference|
    interleaved: bool
    tensors_per_call: int


def _rotate_half_call(args: dict):
    return rotate_half_qk(args["q"], args["k"], args["cos"], args["sin"], args.get("unsqueeze_dim", 1))


def _interleaved_call(args: dict):
    return interleaved_one(args["tensor"], args["sin"], args["cos"])


def _complex_call(args: dict):
    from rope_export.meta import apply_rotary_emb

    return apply_rotary_emb(args["xq"], args["xk"], args["freqs_cis"])


def _probe_angles(generator, batch, seq, half):
    positions = torch.randint(0, 500, (batch, seq), generator=generator).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    return positions[..., None] * inv_freq


def _probe_rotate_half(original, replacement) -> float:
    """Both functions on random q/k, full and partial rotary, both layouts; max abs difference."""
    generator = torch.Generator().manual_seed(0)
    takes_layout = "unsqueeze_dim" in inspect.signature(original).parameters
    worst = 0.0
    for head_dim, rotary_dim, unsqueeze_dim in ((8, 8, 1), (12, 8, 1), (8, 8, 2)):
        if unsqueeze_dim != 1 and not takes_layout:
            continue
        kwargs = {"unsqueeze_dim": unsqueeze_dim} if takes_layout else {}
        angles = _probe_angles(generator, 2, 3, rotary_dim // 2)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        shape_q = (2, 4, 3, head_dim) if unsqueeze_dim == 1 else (2, 3, 4, head_dim)
        shape_k = (2, 2, 3, head_dim) if unsqueeze_dim == 1 else (2, 3, 2, head_dim)
        q, k = torch.randn(shape_q, generator=generator), torch.randn(shape_k, generator=generator)
        try:
            want = original(q, k, cos, sin, **kwargs)
        except RuntimeError:
            if head_dim == rotary_dim:
                raise
            continue  # a whole-head function (the attention slices q/k itself): shapes do not broadcast
        if want[0].shape != q.shape:
            continue
        got = replacement(q, k, cos, sin, **kwargs)
        worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want, strict=True)))
    return worst


def _probe_interleaved(original, replacement) -> float:
    generator = torch.Generator().manual_seed(0)
    angles = _probe_angles(generator, 2, 3, 4)
    tensor = torch.randn(2, 3, 4, 8, generator=generator)
    want = original(tensor, angles.sin(), angles.cos())
    got = replacement(tensor, angles.sin(), angles.cos())
    return (got - want).abs().max().item()


def _probe_complex(original, replacement) -> float:
    generator = torch.Generator().manual_seed(0)
    angles = _probe_angles(generator, 2, 3, 4)
    freqs_cis = torch.polar(torch.full_like(angles, 0.9), angles)  # magnitude != 1: an attention factor
    xq, xk = torch.randn(2, 3, 4, 8, generator=generator), torch.randn(2, 3, 2, 8, generator=generator)
    want, got = original(xq, xk, freqs_cis), replacement(xq, xk, freqs_cis)
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


FORMS: dict[str, RotaryForm] = {
    "rotate-half": RotaryForm("rotate-half", ("q", "k", "cos", "sin"), _rotate_half_call, _probe_rotate_half,
                              interleaved=False, tensors_per_call=2),
    "interleaved": RotaryForm("interleaved", ("tensor", "sin", "cos"), _interleaved_call, _probe_interleaved,
                              interleaved=True, tensors_per_call=1),
    "complex": RotaryForm("complex", ("xq", "xk", "freqs_cis"), _complex_call, _probe_complex,
                          interleaved=True, tensors_per_call=2),
}


# -- the family registry ---------------------------------------------------------------------

def _rope_parameters_rope(config, head_dim: int) -> tuple[RopeConfig, dict]:
    """RopeConfig from transformers' standardized ``config.rope_parameters`` (+ fields we do not model)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise HFExportError(
            f"{config.model_type}: per-layer-type rope_parameters ({sorted(params)}) are not supported yet"
        )
    known = {f.name for f in dataclasses.fields(RopeConfig)} - {"head_dim", "max_position_embeddings", "interleaved",
                                                                  "rotary_dim"}
    data = {k: v for k, v in params.items() if k in known and v is not None}
    extra = {k: v for k, v in params.items() if k not in known and v is not None}
    data.setdefault("rope_type", "default")
    if data["rope_type"] == "longrope" and "original_max_position_embeddings" not in data:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            data["original_max_position_embeddings"] = int(original)
    for name in ("rope_theta", "partial_rotary_factor", "factor", "attention_factor"):
        if name in data and isinstance(data[name], int) and not isinstance(data[name], bool):
            data[name] = float(data[name])
    data["max_position_embeddings"] = int(config.max_position_embeddings)
    try:
        return RopeConfig.from_dict(data, head_dim=head_dim), extra
    except (RopeConfigError, TypeError) as exc:
        raise HFExportError(f"{config.model_type}: the rope parameters {params} do not map to a RopeConfig: {exc}") \
            from None


def _default_head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _gptj_rope(config, head_dim: int) -> tuple[RopeConfig, dict]:
    rotary_dim = getattr(config, "rotary_dim", None)
    # GPT-J's create_sinusoidal_positions hard-codes base 10000.
    return RopeConfig(head_dim=head_dim, rope_theta=10000.0, max_position_embeddings=int(config.n_positions),
                      rotary_dim=None if rotary_dim is None or rotary_dim == head_dim else int(rotary_dim),
                      interleaved=True), {}


def _interleaved_rope(config, head_dim: int) -> tuple[RopeConfig, dict]:
    rope, extra = _rope_parameters_rope(config, head_dim)
    return dataclasses.replace(rope, interleaved=True), extra


def _all_layers(config) -> list[int]:
    return list(range(config.num_hidden_layers))


def _llama4_rope_layers(config) -> list[int]:
    flags = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
    return [i for i, use_rope in enumerate(flags) if use_rope]  # 0 marks a NoPE layer


@dataclass(frozen=True)
class HFFamily:
    """One transformers family: where its rotary function lives and how it is called."""

    name: str
    module: str  # the modeling module whose attribute is swapped
    form: str  # key of FORMS
    function: str = "apply_rotary_pos_emb"
    auto_class: str = "AutoModelForCausalLM"
    position_rank: int = 2  # 3 for Qwen2-VL's (3, B, S) multimodal positions
    rope: Callable = _rope_parameters_rope  # (text config, head_dim) -> (RopeConfig, extra fields)
    head_dim: Callable = _default_head_dim
    rope_layers: Callable = _all_layers  # (text config) -> indices of the layers that rotate q and k
    notes: str = ""
    model_types: tuple[str, ...] = ()

    @property
    def types(self) -> tuple[str, ...]:
        return self.model_types or (self.name,)


def _family(name, notes, **kw) -> HFFamily:
    module = kw.pop("module", f"transformers.models.{name}.modeling_{name}")
    return HFFamily(name=name, module=module, form=kw.pop("form", "rotate-half"), notes=notes, **kw)


HF_FAMILIES: dict[str, HFFamily] = {
    family.name: family
    for family in (
        _family("llama", "rotate-half, whole head; llama3/yarn/linear/dynamic scaling from rope_parameters"),
        _family("mistral", "rotate-half, whole head (as Llama)"),
        _family("qwen2", "rotate-half, whole head (as Llama)"),
        _family("qwen3", "rotate-half, whole head; q/k RMSNorm before the rotation"),
        _family("gemma", "rotate-half, whole head (head_dim set explicitly)"),
        _family("phi", "rotate-half, partial: the attention slices q/k to rotary_ndims before the call"),
        _family("phi3", "rotate-half, partial inside the function (cos narrower than the head); longrope "
                        "switch computed in-graph by transformers' rotary module"),
        _family("gpt_neox", "rotate-half, partial inside the function (rotary_pct)"),
        _family("gptj", "interleaved pairs (rotate_every_two), one tensor per call, [B, S, H, rd] before the "
                        "transpose; GPT-J slices rotary_dim itself", form="interleaved",
                rope=_gptj_rope, head_dim=lambda c: c.hidden_size // c.num_attention_heads),
        _family("llama4", "Meta-style complex RoPE in transformers (view_as_complex * freqs_cis): interleaved "
                          "pairs; NoPE layers (no_rope_layers) have no rotary node; text model only",
                form="complex", function="apply_rotary_emb", rope=_interleaved_rope, rope_layers=_llama4_rope_layers,
                model_types=("llama4_text",)),
        _family("qwen2_vl", "multimodal RoPE: position_ids (3, B, S); transformers' rotary module composes the "
                            "mrope_section frequency bands, the function is Llama's rotate-half",
                auto_class="AutoModelForImageTextToText", position_rank=3,
                model_types=("qwen2_vl", "qwen2_vl_text")),
    )
}
MODEL_TYPES: dict[str, HFFamily] = {t: f for f in HF_FAMILIES.values() for t in f.types}


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def _modeling_module(model_or_config) -> str | None:
    """The modeling module of a transformers model (e.g. transformers.models.olmo.modeling_olmo)."""
    if isinstance(model_or_config, nn.Module):
        name = type(model_or_config).__module__
        return name if name.startswith("transformers.models.") else None
    return None


def family_of(model_or_config, family: str | HFFamily | None = None) -> HFFamily:
    """The registered family of a transformers model/config; HFExportError if it has none.

    ``family`` forces a registered family's rotary form onto a model of another model_type: the
    hook then swaps the function in *that model's* modeling module (and checks it numerically
    against the original first), e.g. ``family="llama"`` for a model that copies Llama's
    ``apply_rotary_pos_emb``.
    """
    if isinstance(family, HFFamily):
        return family
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if family is not None:
        if family not in HF_FAMILIES:
            raise HFExportError(f"unknown family {family!r}; supported: {', '.join(HF_FAMILIES)}")
        base = HF_FAMILIES[family]
        if model_type is None or model_type in base.types:
            return base
        module = _modeling_module(model_or_config)
        if module is None:
            raise HFExportError(
                f"family={family!r} for model_type {model_type!r}: give the model (not its config) so the hook "
                "knows which modeling module to patch"
            )
        return dataclasses.replace(base, name=f"{model_type} (as {family})", module=module,
                                   model_types=(model_type,), notes=f"{base.notes}; forced with family={family!r}")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise HFExportError(
        f"model_type {model_type!r} is not a family rope-export knows how to hook; supported: "
        f"{', '.join(sorted(MODEL_TYPES))}. If its modeling file uses Llama's apply_rotary_pos_emb(q, k, cos, sin), "
        "pass family='llama' (the hook checks the function numerically first); or export with fallback='fuse' "
        "(plain export, then rope_export.passes.fuse) or fallback='plain' (RoPE stays decomposed)"
    )


# -- the hook --------------------------------------------------------------------------------

@dataclass
class HookState:
    """What ``rotary_hooked`` swapped, and how often the replacement ran (per eager call or trace)."""

    family: HFFamily
    target: str  # "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
    probe_error: float | None = None
    calls: int = 0

    @property
    def description(self) -> str:
        form = FORMS[self.family.form]
        return f"{self.target} -> {contract.DOMAIN}::{contract.OP_TYPE} ({form.name}, {form.tensors_per_call} per call)"


def _make_replacement(original: Callable, form: RotaryForm, state: HookState) -> Callable:
    signature = inspect.signature(original)
    names = list(signature.parameters)
    if tuple(names[: len(form.parameters)]) != form.parameters:
        raise HFExportError(
            f"{state.target} has parameters {names}; the {form.name} hook expects them to start with "
            f"{list(form.parameters)}. This transformers version changed the function; pin transformers or report it"
        )

    def replacement(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        state.calls += 1
        return form.call(bound.arguments)

    replacement.__name__ = original.__name__
    replacement.__doc__ = f"rope_export replacement of {state.target} (active inside rotary_hooked only)"
    replacement.__wrapped_original__ = original
    return replacement


@contextlib.contextmanager
def rotary_hooked(model_or_config, *, family: str | HFFamily | None = None, verify: bool = True
                  ) -> Iterator[HookState]:
    """Route the family's rotary function through the rope_export op inside the block only.

    Before swapping, the replacement is run against transformers' own function on random inputs
    (``verify``): a transformers version whose function no longer matches gives a clear error
    instead of a wrong export. The module attribute is restored on exit, also on error.
    """
    fam = family_of(model_or_config, family)
    form = FORMS[fam.form]
    try:
        module = importlib.import_module(fam.module)
    except ImportError as exc:
        raise HFExportError(f"family {fam.name}: cannot import {fam.module} ({exc}); is transformers installed?") \
            from None
    original = getattr(module, fam.function, None)
    if original is None:
        raise HFExportError(f"{fam.module} has no {fam.function}; this transformers version is not supported")
    original = getattr(original, "__wrapped_original__", original)  # nested hooks: compare with the real one
    state = HookState(fam, f"{fam.module}.{fam.function}")
    replacement = _make_replacement(original, form, state)
    if verify:
        error = form.probe(original, replacement)
        state.probe_error, state.calls = error, 0
        if not tolerance("op", "float32").allclose(error, 0.0):
            raise HFExportError(
                f"the {form.name} hook does not reproduce {state.target} (max difference {error:.3g} on random "
                "inputs): this family's rotation is not what rope-export assumes; please report it"
            )
    with patched([(module, fam.function, replacement)]):
        yield state


@contextlib.contextmanager
def _model_state_kept(model: nn.Module) -> Iterator[None]:
    """Undo what tracing may leave on the modules: new or rebound attributes, buffer values and objects.

    transformers' longrope update, for one, stores tensors on its rotary module during forward; an
    export traces with fake tensors, which must not stay behind in the user's model.
    """
    modules = list(model.modules())
    attrs = [dict(vars(m)) for m in modules]
    buffers = [dict(m._buffers) for m in modules]
    values = [{k: v.detach().clone() for k, v in m._buffers.items() if v is not None} for m in modules]
    try:
        yield
    finally:
        for m, saved_attrs, saved_buffers, saved_values in zip(modules, attrs, buffers, values, strict=True):
            current = vars(m)
            for key in [k for k in current if k not in saved_attrs]:
                del current[key]
            for key, value in saved_attrs.items():
                if current.get(key, None) is not value:
                    current[key] = value
            m._buffers.clear()
            m._buffers.update(saved_buffers)
            for key, value in saved_values.items():
                buf = m._buffers[key]
                if not torch.equal(buf, value):
                    with torch.no_grad():
                        buf.copy_(value)


# -- RoPE parameters and metadata ------------------------------------------------------------

def rope_config_from_hf(model_or_config, family: str | HFFamily | None = None) -> tuple[RopeConfig, dict]:
    """(RopeConfig, fields RopeConfig has no place for, e.g. Qwen2-VL's mrope_section) of a transformers config.

    For a model_type without a registered family, ``family=None`` raises; the generic reading of
    ``rope_parameters`` is tried by ``hf_metadata`` for plain exports.
    """
    fam = family_of(model_or_config, family)
    config = _text_config(getattr(model_or_config, "config", model_or_config))
    return fam.rope(config, fam.head_dim(config))


def hf_metadata(model, family: HFFamily | None, hook: HookState | None, *, dtype: str, kind: str,
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
        "transformers_version": transformers.__version__,
        "rotary_hook": hook.description if hook is not None else "none (plain export: RoPE decomposed)",
    }
    if family is not None:
        rope, extra = rope_config_from_hf(model, family)
        meta["hf_family"] = family.name
        meta["position_ids_rank"] = str(family.position_rank)
    else:  # no registered family: read rope_parameters the common way, if they are there
        text = _text_config(config)
        try:
            rope, extra = _rope_parameters_rope(text, _default_head_dim(text))
        except (HFExportError, AttributeError, TypeError):
            rope, extra = None, {}
        meta["position_ids_rank"] = "2"
    if rope is not None:
        meta["rope"] = json.dumps(rope.to_dict(), sort_keys=True)
        meta["rope_extra"] = json.dumps(extra, sort_keys=True)
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
    out["hf_config"] = json.loads(props["hf_config"])
    out["decode"] = props.get("decode") == "1"
    out["seed"] = int(props.get("seed", "0"))
    if "layer" in props:
        out["layer"] = int(props["layer"])
    return out


# -- loading a model offline -----------------------------------------------------------------

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
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise HFExportError(f"{path}: not a transformers config transformers can read: {exc}") from None


def build_hf_model(config, weights: str | os.PathLike | None = None, *, dtype: str = "fp32", seed: int = 0,
                   progress: Callable[[str], None] | None = None):
    """The causal LM of ``config`` (a config object or a path), random (seeded) or from local ``weights``.

    Attention is transformers' eager implementation, which exports to plain ONNX ops. The weights
    are allocated once in ``dtype`` (``rope_export.checkpoints``: no float32 detour, no transient copy).
    """
    import transformers

    from rope_export.checkpoints import CheckpointError, build_causal_lm

    if not isinstance(config, transformers.PretrainedConfig):
        config = load_hf_config(config)
    if dtype not in DTYPES:
        raise HFExportError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    model_type = config.model_type
    auto_name = MODEL_TYPES[model_type].auto_class if model_type in MODEL_TYPES else "AutoModelForCausalLM"
    auto = getattr(transformers, auto_name)
    torch_dtype = DTYPES[dtype]
    try:
        model, _ = build_causal_lm(auto, config, torch_dtype, weights=weights, seed=seed, progress=progress)
    except CheckpointError as exc:
        raise HFExportError(str(exc)) from None
    except ValueError as exc:
        raise HFExportError(f"cannot build a {auto_name} for model_type {model_type!r}: {exc}") from None
    return model.eval()


# -- the export wrappers ---------------------------------------------------------------------

def _dynamic_cache():
    from transformers.cache_utils import DynamicCache

    return DynamicCache()


class CausalLMWithCache(nn.Module):
    """``forward(input_ids, position_ids, *past) -> (logits, *present)``, past/present flat per layer.

    ``past`` is ``key_0, value_0, key_1, value_1, ...`` each [B, Hkv, P, D] (P = 0 for prefill);
    ``position_ids`` is [B, S] ([3, B, S] for Qwen2-VL). A DynamicCache is filled inside.
    """

    def __init__(self, model: nn.Module, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, position_ids, *past):
        if len(past) != 2 * self.num_layers:
            raise HFExportError(
                f"expected {2 * self.num_layers} past tensors (key and value per layer), got {len(past)}"
            )
        cache = _dynamic_cache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers[: self.num_layers]:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    """The text decoder's self-attention modules, in layer order."""
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
             and "Vision" not in type(m).__name__]
    return sorted(found, key=lambda m: m.layer_idx)


def _rotary_module(model: nn.Module) -> nn.Module | None:
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RotaryEmbedding") and "Vision" not in name:
            return m
    return None


class AttentionWithCache(nn.Module):
    """One transformers attention layer with the preset blocks' I/O.

    ``forward(hidden_states [B,S,hidden], position_ids [B,S] ([3,B,S] for mRoPE), past_key, past_value)
    -> (output, present_key, present_value)``: cos/sin from the model's rotary module, a causal
    mask built here (position p sees keys 0..p), the layer's own projections and attention.
    """

    def __init__(self, model: nn.Module, layer: int):
        super().__init__()
        layers = _attention_layers(model)
        if not 0 <= layer < len(layers):
            raise HFExportError(f"layer {layer} does not exist: the model has {len(layers)} attention layers")
        self.attention = layers[layer]
        self.rotary = _rotary_module(model)
        self.layer = layer
        self._parameters_of = set(inspect.signature(self.attention.forward).parameters)

    def forward(self, hidden_states, position_ids, past_key, past_value):
        cache = _dynamic_cache()
        idx = self.attention.layer_idx
        cache.update(past_key, past_value, idx)
        seq, total = hidden_states.shape[1], past_key.shape[2] + hidden_states.shape[1]
        query_pos = torch.arange(seq, device=hidden_states.device).unsqueeze(1) + (total - seq)
        key_pos = torch.arange(total, device=hidden_states.device).unsqueeze(0)
        blocked = (key_pos > query_pos)[None, None]
        mask = torch.zeros(blocked.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        mask = mask.masked_fill(blocked, torch.finfo(hidden_states.dtype).min)
        mask = mask.expand(hidden_states.shape[0], 1, seq, total)
        kwargs = {"attention_mask": mask}
        names = self._parameters_of
        kwargs["past_key_values" if "past_key_values" in names else "layer_past"] = cache
        if "position_embeddings" in names and self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden_states, position_ids)
        if "position_ids" in names and self.rotary is None:
            kwargs["position_ids"] = position_ids
        output = self.attention(hidden_states, **kwargs)[0]
        layer = cache.layers[idx]
        return output, layer.keys, layer.values


# -- export ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HFExportResult:
    model: onnx.ModelProto
    path: Path | None
    family: HFFamily | None  # None: plain export (unknown family, fallback="plain")
    hook: str  # what was hooked, or why nothing was
    num_layers: int
    kind: str  # "hf-causal-lm" or "hf-attention"
    notes: list[str] = field(default_factory=list)

    @property
    def custom_nodes(self) -> int:
        return count_rotary_nodes(self.model)


def _kv_geometry(model) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of the text decoder, read from one tiny eager forward."""
    with torch.no_grad():
        ids = torch.zeros(1, 2, dtype=torch.long)
        out = model(input_ids=ids, use_cache=True, past_key_values=_dynamic_cache())
    layers = out.past_key_values.layers
    keys = layers[0].keys
    return len(layers), int(keys.shape[1]), int(keys.shape[3])


def hf_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of a causal-LM export (the optimum / onnxruntime-genai convention)."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "position_ids", *past], ["logits", *present]


def hf_example_inputs(model, *, batch: int = 2, seq: int = 4, past: int = 3, seed: int = 0,
                      position_rank: int | None = None) -> tuple[torch.Tensor, ...]:
    """Inputs of ``CausalLMWithCache(model)``: ids, positions past..past+S-1, random past keys/values."""
    if position_rank is None:
        model_type = model.config.model_type
        position_rank = MODEL_TYPES[model_type].position_rank if model_type in MODEL_TYPES else 2
    config = _text_config(model.config)
    layers, kv_heads, head_dim = _kv_geometry(model)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    positions = (torch.arange(seq) + past).expand(batch, seq).contiguous()
    if position_rank == 3:
        positions = positions.expand(3, batch, seq).contiguous()
    dtype = next(model.parameters()).dtype
    kv = [torch.randn(batch, kv_heads, past, head_dim, generator=generator).to(dtype) for _ in range(2 * layers)]
    return (ids, positions, *kv)


def _dims():
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=2**20)
    past = torch.export.Dim("past", min=0, max=2**20)
    return batch, seq, past


def _export(module, inputs, dynamic_shapes, input_names, output_names, opset, verbose, progress=None):
    with torch.no_grad(), _quiet_exporter(verbose, progress):
        return torch.onnx.export(
            module, tuple(inputs), dynamo=True, opset_version=opset, input_names=input_names,
            output_names=output_names, dynamic_shapes=dynamic_shapes,
            custom_translation_table=custom_translation_table(), verbose=True if verbose else None,
        )


def _check_dynamic(model: onnx.ModelProto, position_rank: int) -> None:
    """torch.export silently fixes a dim whose example size is 1; refuse such a file."""
    dims = model.graph.input[1].type.tensor_type.shape.dim
    offset = 1 if position_rank == 3 else 0
    for axis, name in ((offset, "batch"), (offset + 1, "seq")):
        if not dims[axis].dim_param:
            raise HFExportError(
                f"the exported file has a fixed {name} of {dims[axis].dim_value}: torch.export specialised it to the "
                f"example; export with an example whose {name} is at least 2 (example=(batch, seq, past))"
            )


def _name_dims(model: onnx.ModelProto, position_rank: int) -> None:
    """batch/seq/past names for the symbolic dims of the I/O (past+seq for the presents)."""
    # position_ids (input 1) is [B, S], or [3, B, S] for Qwen2-VL's mRoPE.
    past = 2 if len(model.graph.input) > 2 else None
    rename_dynamic_dims(model, batch_seq=(1, 1 if position_rank == 3 else 0), past=past)


FALLBACKS = ("error", "plain", "fuse")


def _standard_rotary_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == contract.OP_TYPE and n.domain in ("", "ai.onnx")]


def _fuse(model: onnx.ModelProto, notes: list[str]) -> onnx.ModelProto:
    """fallback="fuse": rope_export.passes.fuse on decomposed sites, then adopt ai.onnx RotaryEmbedding nodes.

    torch.onnx's own optimizer already rewrites many rotate-half sites into ai.onnx
    RotaryEmbedding-23 (opset >= 23); its semantics are the rope_export op's (the contract only
    adds float32 caches and defined out-of-range positions), so those nodes change domain only.
    """
    try:
        from rope_export.passes import FusionReport, fuse
    except ImportError as exc:
        notes.append(f"fallback 'fuse': rope_export.passes.fuse is not available ({exc})")
    else:
        before = count_rotary_nodes(model)
        model = fuse(model, report=FusionReport())
        notes.append(f"fallback 'fuse': rope_export.passes.fuse fused {count_rotary_nodes(model) - before} "
                     "decomposed site(s)")
    standard = _standard_rotary_nodes(model)
    if standard:
        model_copy = onnx.ModelProto()
        model_copy.CopyFrom(model)
        model = model_copy
        for node in _standard_rotary_nodes(model):
            node.domain = contract.DOMAIN
        if not any(o.domain == contract.DOMAIN for o in model.opset_import):
            model.opset_import.add(domain=contract.DOMAIN, version=contract.OP_VERSION)
        notes.append(f"fallback 'fuse': {len(standard)} ai.onnx RotaryEmbedding node(s) from torch.onnx's optimizer "
                     f"renamed to {contract.DOMAIN}::{contract.OP_TYPE} (same semantics)")
    return model


def export_hf(
    model,
    output: str | os.PathLike | None = None,
    *,
    layer: int | None = None,
    family: str | None = None,
    fallback: str = "error",
    opset: int = 23,
    weights: str | None = None,
    seed: int = 0,
    example: tuple[int, int, int] = (2, 4, 3),
    external: str = "auto",
    progress: Callable[[str], None] | None = None,
    verbose: bool = False,
) -> HFExportResult:
    """Export a transformers causal LM (or attention ``layer``) with one rotary node per rotated tensor.

    ``family``: force a registered family's hook onto another model_type (see ``family_of``).
    ``fallback``: what to do when the family is not registered: ``"error"`` (default) raises
    HFExportError naming the supported families; ``"plain"`` exports without a hook (RoPE is
    what torch.onnx makes of it: primitive ops, or at opset >= 23 often ai.onnx RotaryEmbedding
    from its optimizer; no rope_export node); ``"fuse"`` exports plain, runs
    ``rope_export.passes.fuse`` on the decomposed sites and renames ai.onnx RotaryEmbedding nodes
    to rope_export's (same semantics). The result's ``hook`` and ``notes`` and the metadata's
    ``rotary_hook`` say which happened.
    ``example`` is (batch, seq, past) of the tracing inputs; use seq >= 2 (torch.export fixes a
    dim whose example size is 1; the export then fails with a message saying so).
    """
    say = progress or (lambda message: None)
    if fallback not in FALLBACKS:
        raise HFExportError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    _check_opset(opset)
    if output is not None:
        _check_writable(Path(output))
    notes = []
    try:
        fam = family_of(model, family)
    except HFExportError:
        if fallback == "error":
            raise
        fam = None
        notes.append(f"model_type {model.config.model_type!r} has no rotary hook: plain export")
    dtype_name = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "fp32")
    position_rank = fam.position_rank if fam is not None else 2
    batch, seq, past = example
    with _model_state_kept(model):  # the probe forward may let transformers cache things on its modules
        inputs = hf_example_inputs(model, batch=batch, seq=seq, past=past, seed=seed, position_rank=position_rank)
    num_layers = (len(inputs) - 2) // 2
    b, s, p = _dims()
    pos_shape = {1: b, 2: s} if position_rank == 3 else {0: b, 1: s}
    if layer is None:
        module = CausalLMWithCache(model, num_layers).eval()
        input_names, output_names = hf_io_names(num_layers)
        dynamic_shapes = ({0: b, 1: s}, pos_shape, tuple({0: b, 2: p} for _ in range(2 * num_layers)))
        kind = "hf-causal-lm"
    else:
        module = AttentionWithCache(model, layer).eval()
        config = _text_config(model.config)
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(batch, seq, config.hidden_size, generator=generator).to(inputs[2].dtype)
        inputs = (hidden, inputs[1], inputs[2 + 2 * layer], inputs[3 + 2 * layer])
        input_names, output_names = list(INPUT_NAMES), list(OUTPUT_NAMES)
        dynamic_shapes = ({0: b, 1: s}, pos_shape, {0: b, 2: p}, {0: b, 2: p})
        kind = "hf-attention"
    say(f"exporting {type(model).__name__} ({kind}, {num_layers} layer{'s' * (num_layers != 1)}) with torch.export")
    hook_ctx = rotary_hooked(model, family=fam) if fam is not None else contextlib.nullcontext()
    try:
        with _model_state_kept(model), hook_ctx as hook:
            program = _export(module, inputs, dynamic_shapes, input_names, output_names, opset, verbose, say)
            onnx_model = graph_proto(program)  # the graph; the weights stay in torch until finish_export
            _check_dynamic(onnx_model, position_rank)
    except HFExportError:
        raise
    except Exception as exc:  # torch.export / onnxscript errors: name the model, keep the cause chained
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFExportError(f"exporting {type(model).__name__} failed: {first}") from exc
    _name_dims(onnx_model, position_rank)
    if fam is None:
        standard = len(_standard_rotary_nodes(onnx_model))
        notes[0] += (f" (torch.onnx's optimizer turned {standard} site(s) into ai.onnx RotaryEmbedding)" if standard
                     else " (RoPE decomposed into primitive ops)")
        if fallback == "fuse":
            onnx_model = _fuse(onnx_model, notes)
    description = hook.description if hook is not None else "; ".join(notes)
    metadata = hf_metadata(model, fam, hook, dtype=dtype_name, kind=kind, weights=weights, seed=seed, layer=layer)
    if hook is None:
        metadata[METADATA_PREFIX + "rotary_hook"] = description
    for key, value in metadata.items():
        onnx_model.metadata_props.add(key=key, value=value)
    onnx_model.producer_name, onnx_model.producer_version = "rope-export", __version__
    if fam is not None:
        rope_layers = fam.rope_layers(_text_config(model.config))
        expected = 2 * (int(layer in rope_layers) if layer is not None else len(rope_layers))
        found = count_rotary_nodes(onnx_model)
        if found != expected:
            notes.append(f"expected {expected} rope_export nodes (q and k per layer), found {found}")
    onnx_model = finish_export(onnx_model, program, output, external=external, progress=say)
    return HFExportResult(onnx_model, None if output is None else Path(output), fam, description, num_layers, kind,
                          notes)


# -- CLI -------------------------------------------------------------------------------------

def register_hf_arguments(parser) -> None:
    """Add ``--hf CONFIG_DIR_OR_JSON``, ``--weights DIR``, ``--layer N``, ``--hf-fallback`` to ``export``."""
    group = parser.add_argument_group("Hugging Face transformers models (instead of --preset)")
    group.add_argument("--hf", metavar="CONFIG_DIR_OR_JSON", default=None,
                       help="export a transformers causal LM built from this local config (folder or .json); "
                            f"families: {', '.join(HF_FAMILIES)}. The file always has a KV cache (prefill: past 0)")
    group.add_argument("--weights", metavar="DIR", default=None,
                       help="local folder with the model's weights (default: random weights, --seed); no hub access")
    group.add_argument("--layer", type=int, default=None,
                       help="export only this attention layer (hidden_states, position_ids, past_key, past_value)")
    group.add_argument("--hf-family", choices=sorted(HF_FAMILIES), default=None,
                       help="hook a model of another model_type as this family (checked numerically first)")
    group.add_argument("--hf-fallback", choices=FALLBACKS, default="error",
                       help="for a model_type without a rotary hook: fail (default), export without a hook "
                            "(plain), or export plain and fuse its RoPE sites into the rope_export op (fuse)")


def wants_hf_export(args) -> bool:
    """Whether ``export`` was called with any of the --hf options (then ``run_hf_export`` handles it)."""
    return any(getattr(args, name, None) is not None for name in ("hf", "weights", "layer", "hf_family"))


def run_hf_export(args) -> int:
    """The ``export --hf`` command: build offline, export, print a summary table."""
    from rich.console import Console
    from rich.table import Table

    from rope_export.export import output_files, summarize
    from rope_export.steps import cli_steps

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise HFExportError("--hf needs transformers: pip install 'rope-export[hf]'") from None
    if args.hf is None:
        raise HFExportError("--weights, --layer and --hf-family need --hf CONFIG_DIR_OR_JSON")
    for option, default in (("cache_len", None), ("compare_decomposed", False)):
        if getattr(args, option, default) not in (None, False):
            raise HFExportError(
                f"--{option.replace('_', '-')} does not apply to --hf: transformers computes per-token cos/sin in "
                "the graph and the model is exported as it is"
            )
    _check_writable(Path(args.output))  # before the minutes of building and tracing
    console = Console()
    with cli_steps(console, f"rope-export export --hf: {args.output}", args.summary_json) as progress:
        progress(f"building the model from {args.hf}" + (f" with weights from {args.weights}" if args.weights else
                                                          f" (random weights, seed {args.seed})"))
        model = build_hf_model(args.hf, args.weights, dtype=args.dtype, seed=args.seed, progress=progress)
        result = export_hf(model, args.output, layer=args.layer, family=args.hf_family, fallback=args.hf_fallback,
                           opset=args.opset, external=args.external_data,
                           weights=args.weights, seed=args.seed, progress=progress, verbose=args.verbose)
        progress.add_files(output_files(args.output))
    summary = summarize(result.model)
    table = Table(title=f"{result.path} ({type(model).__name__}, {args.dtype})")
    table.add_column("what")
    table.add_column("value")
    table.add_row("family", result.family.name if result.family else "(none)")
    table.add_row("rotary hook", result.hook)
    table.add_row("nodes", str(summary["nodes"]))
    table.add_row(f"{contract.DOMAIN}::{contract.OP_TYPE} nodes", str(summary["custom_nodes"]))
    for name, dims in list(summary["inputs"].items())[:4]:
        table.add_row(f"input {name}", str(dims))
    if len(summary["inputs"]) > 4:
        table.add_row("inputs", f"{len(summary['inputs'])} in all")
    table.add_row("opsets", str(summary["opsets"]))
    for note in result.notes:
        table.add_row("note", note)
    console.print(table)
    return 0
