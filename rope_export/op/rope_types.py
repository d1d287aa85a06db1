"""RoPE configurations and the rope-type registry.

Every scaling scheme reduces to "which inverse frequencies, which magnitude factor". Each scheme
is one function ``(config, seq_len) -> (inv_freq, attention_scaling)`` in ``ROPE_INIT_FUNCTIONS``
(the transformers ``ROPE_INIT_FUNCTIONS`` idea); adding a scheme is adding an entry. The math
follows transformers' ``modeling_rope_utils`` but runs in float64, and the cos/sin caches are
built in float64 and stored as float32 whatever the model dtype.

Schemes whose frequencies depend on the runtime sequence length (``dynamic``, ``longrope``) are
written with torch ops that also accept ``seq_len`` as a 0-d tensor, so the same function runs
inside an exported graph (in float32 there, since TensorRT has no float64).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rope_export.common import bounds


class RopeConfigError(ValueError):
    """A RoPE configuration that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, named as in transformers' ``rope_parameters`` (plus layout fields)."""

    head_dim: int
    rope_type: str = "default"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    partial_rotary_factor: float = 1.0
    rotary_dim: int | None = None  # explicit rotated width (GPT-J); wins over partial_rotary_factor
    interleaved: bool = False  # GPT-J / Meta pairs (2i, 2i+1) instead of rotate-half (i, i+rd/2)
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                items = _number_list(value)
                if items is None:
                    self._fail(name, f"must be a list of numbers, got {value!r}")
                object.__setattr__(self, name, items)
        self._validate()

    # -- validation -------------------------------------------------------------------------
    def _fail(self, field: str, problem: str) -> None:
        raise RopeConfigError(f"rope field '{field}': {problem}")

    def _validate(self) -> None:
        # Type, range and finiteness of every field first (rope_export.common.bounds): a wrong type (say
        # rope_theta = "1e4" or truncate = "false" in a TOML file), inf (factor = inf turns RoPE
        # off) or a bool for a number is named here, not taken as truthy or failing in arithmetic.
        if not isinstance(self.rope_type, str):
            self._fail("rope_type", f"must be a string, got {self.rope_type!r}")
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            self._fail("rope_type", f"unknown type {self.rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
        for name, (kind, low, high, low_open) in _FIELD_BOUNDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            if kind is bool:
                bounds.check_bool(name, value, fail=self._fail)
            elif kind is int:
                bounds.check_int(name, value, low, high, fail=self._fail)
            else:
                bounds.check_number(name, value, low, high, low_open=low_open, fail=self._fail)
        if self.head_dim % 2:
            self._fail("head_dim", f"must be a positive even integer, got {self.head_dim!r}")
        rd = self.rotary_embedding_dim
        source = "rotary_dim" if self.rotary_dim is not None else "partial_rotary_factor"
        if rd <= 0 or rd > self.head_dim:
            self._fail(source, f"gives a rotated width of {rd}, outside 1..head_dim={self.head_dim}")
        if rd % 2:
            self._fail(source, f"gives an odd rotated width {rd}; channels rotate in pairs, use an even width")
        scheme = ROPE_INIT_FUNCTIONS[self.rope_type]
        for field in scheme.required:
            if getattr(self, field) is None:
                self._fail(field, f"is required by rope_type {self.rope_type!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                if len(value) != rd // 2:
                    self._fail(name, f"needs rotary_dim/2 = {rd // 2} values, got {len(value)}")
                for k, item in enumerate(value):
                    bounds.check_number(f"{name}[{k}]", item, 0.0, low_open=True, fail=self._fail)
        if scheme.check is not None:
            scheme.check(self)
        self._check_frequencies()

    def _check_frequencies(self) -> None:
        """The scheme's math must give finite, positive frequencies and magnitude factor, at the
        initial length and past the trained one (where dynamic/longrope switch): the catch-all for
        field combinations no single-field rule sees (a division by zero, a log of a negative)."""
        lengths = [None]
        if self.seq_len_dependent:
            lengths.append(2 * max(self.max_position_embeddings, self.original_max_positions))
        for seq_len in lengths:
            try:
                inv_freq, scaling = inv_freq_and_scaling(self, seq_len)
            except (ArithmeticError, ValueError) as exc:
                raise RopeConfigError(
                    f"rope_type {self.rope_type!r} cannot compute its frequencies from these fields "
                    f"({type(exc).__name__}: {exc}); check {', '.join(self._scheme_fields())}"
                ) from None
            usable = bool(torch.isfinite(inv_freq).all()) and bool((inv_freq > 0).all())
            if not usable or not (math.isfinite(scaling) and scaling > 0):
                raise RopeConfigError(
                    f"rope_type {self.rope_type!r} gives frequencies or a magnitude factor ({scaling!r}) that are not "
                    f"finite and positive from these fields; check {', '.join(self._scheme_fields())}"
                )

    def _scheme_fields(self) -> list[str]:
        fields = ["rope_theta", *ROPE_INIT_FUNCTIONS[self.rope_type].required]
        return fields + [f for f in _SCHEME_EXTRAS.get(self.rope_type, ()) if getattr(self, f) is not None]

    # -- derived values ---------------------------------------------------------------------
    @property
    def rotary_embedding_dim(self) -> int:
        if self.rotary_dim is not None:
            return int(self.rotary_dim)
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def seq_len_dependent(self) -> bool:
        """Whether the frequencies change with the runtime sequence length (caches built in-graph)."""
        return ROPE_INIT_FUNCTIONS[self.rope_type].seq_len_dependent

    @property
    def original_max_positions(self) -> int:
        return self.original_max_position_embeddings or self.max_position_embeddings

    # -- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, **overrides) -> RopeConfig:
        data = {**data, **overrides}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RopeConfigError(f"unknown rope field(s) {unknown}; known fields: {sorted(known)}")
        if "head_dim" not in data:
            raise RopeConfigError("rope field 'head_dim': is required")
        return cls(**data)

    def to_dict(self) -> dict:
        """The fields that differ from their defaults, plus head_dim and rope_type (JSON-able)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("head_dim", "rope_type") or value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


# Every scalar field: (type, low, high, low bound open) for rope_export.common.bounds. None-able fields
# are skipped while None. Ints are bounded by what the kernels and caches can address.
_FIELD_BOUNDS: dict[str, tuple[type, float | None, float | None, bool]] = {
    "head_dim": (int, 1, bounds.MAX_HEAD_DIM, False),
    "max_position_embeddings": (int, 1, bounds.INT32_MAX, False),
    "rotary_dim": (int, 1, bounds.MAX_HEAD_DIM, False),
    "original_max_position_embeddings": (int, 1, bounds.INT32_MAX, False),
    "rope_theta": (float, 0.0, None, True),
    "partial_rotary_factor": (float, 0.0, 1.0, True),
    "factor": (float, 0.0, None, True),
    "attention_factor": (float, 0.0, None, True),
    "beta_fast": (float, 0.0, None, True),
    "beta_slow": (float, 0.0, None, True),
    "mscale": (float, None, None, False),
    "mscale_all_dim": (float, None, None, False),
    "low_freq_factor": (float, 0.0, None, True),
    "high_freq_factor": (float, 0.0, None, True),
    "interleaved": (bool, None, None, False),
    "truncate": (bool, None, None, False),
}
_OPTIONAL_FIELDS = {"rotary_dim", "original_max_position_embeddings", "factor", "attention_factor", "beta_fast",
                    "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"}
# Optional fields a scheme reads besides its required ones (named when its math fails).
_SCHEME_EXTRAS = {
    "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim"),
    "longrope": ("factor", "attention_factor"),
}


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _number_list(value) -> tuple[float, ...] | None:
    """``value`` as a tuple of floats, or None when it is not a list of numbers."""
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        items = list(value)
    except TypeError:
        return None
    return tuple(_as_float(v) for v in items) if all(_is_number(v) for v in items) else None


def _as_float(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int past float's range; the bounds check then names it as not finite
        return math.inf if value > 0 else -math.inf


# -- the registry ----------------------------------------------------------------------------

InitFunction = Callable[[RopeConfig, "int | torch.Tensor | None"], "tuple[torch.Tensor, float]"]


@dataclass(frozen=True)
class RopeScheme:
    init: InitFunction
    required: tuple[str, ...] = ()
    seq_len_dependent: bool = False
    check: Callable[[RopeConfig], None] | None = None  # rules beyond single fields (raise RopeConfigError)


def _exponents(cfg: RopeConfig, dtype: torch.dtype) -> torch.Tensor:
    """(0, 2, 4, ..., rd-2) / rd: the exponent of the base for each rotated pair."""
    dim = cfg.rotary_embedding_dim
    return torch.arange(0, dim, 2, dtype=dtype) / dim


def _seq_len_tensor(seq_len, default: int) -> torch.Tensor:
    """A 0-d tensor: float64 for Python numbers, float32 for an in-graph tensor."""
    if isinstance(seq_len, torch.Tensor):
        return seq_len.to(torch.float32)
    return torch.tensor(float(default if seq_len is None else seq_len), dtype=torch.float64)


def _default(cfg, seq_len=None):
    return 1.0 / cfg.rope_theta ** _exponents(cfg, torch.float64), 1.0


def _linear(cfg, seq_len=None):
    inv_freq, _ = _default(cfg)
    return inv_freq / cfg.factor, 1.0


def _dynamic_ntk(cfg, seq_len=None):
    # The base grows once the sequence is longer than max_position_embeddings. Stateless: the
    # frequencies depend only on this call's length (transformers also keeps a grown cache).
    max_pos = cfg.max_position_embeddings
    dim = cfg.rotary_embedding_dim
    seq = torch.clamp(_seq_len_tensor(seq_len, max_pos), min=max_pos)
    base = cfg.rope_theta * ((cfg.factor * seq / max_pos) - (cfg.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** _exponents(cfg, seq.dtype), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg, seq_len=None):
    dim, base, factor = cfg.rotary_embedding_dim, cfg.rope_theta, cfg.factor
    original = cfg.original_max_positions
    attention = cfg.attention_factor
    if attention is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = cfg.beta_fast or 32.0
    beta_slow = cfg.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 for high-frequency pairs (kept), 0 for low-frequency (interpolated)
    pos_freqs = base ** _exponents(cfg, torch.float64)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(cfg, seq_len=None):
    original = cfg.original_max_position_embeddings
    factor = cfg.factor or cfg.max_position_embeddings / original
    attention = cfg.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    seq = _seq_len_tensor(seq_len, original)
    # Both sets are constants computed in float64; only the switch between them happens at run
    # time (in-graph when exported), once for the whole batch like transformers.
    base = cfg.rope_theta ** _exponents(cfg, torch.float64)
    short = 1.0 / (torch.tensor(cfg.short_factor, dtype=torch.float64) * base)
    long = 1.0 / (torch.tensor(cfg.long_factor, dtype=torch.float64) * base)
    return torch.where(seq > original, long.to(seq.dtype), short.to(seq.dtype)), float(attention)


def _llama3(cfg, seq_len=None):
    inv_freq, _ = _default(cfg)
    factor, low, high = cfg.factor, cfg.low_freq_factor, cfg.high_freq_factor
    old_context = cfg.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _check_dynamic(cfg: RopeConfig) -> None:
    if cfg.rotary_embedding_dim < 4:  # the base grows as (...) ** (dim / (dim - 2))
        cfg._fail("rotary_dim", f"rope_type 'dynamic' needs a rotated width of at least 4, got "
                  f"{cfg.rotary_embedding_dim}")


def _check_yarn(cfg: RopeConfig) -> None:
    if not cfg.rope_theta > 1:  # the correction range divides by log(rope_theta)
        cfg._fail("rope_theta", f"rope_type 'yarn' needs rope_theta > 1, got {cfg.rope_theta!r}")


def _check_longrope(cfg: RopeConfig) -> None:
    factor = cfg.factor or cfg.max_position_embeddings / cfg.original_max_position_embeddings
    if factor > 1 and cfg.attention_factor is None and cfg.original_max_position_embeddings < 2:
        # the magnitude factor is sqrt(1 + log(factor) / log(original))
        cfg._fail("original_max_position_embeddings", "rope_type 'longrope' needs it >= 2 to derive the magnitude "
                  f"factor (or give attention_factor), got {cfg.original_max_position_embeddings}")


def _check_llama3(cfg: RopeConfig) -> None:
    if not cfg.high_freq_factor > cfg.low_freq_factor:
        cfg._fail("high_freq_factor", "must be larger than low_freq_factor")


ROPE_INIT_FUNCTIONS: dict[str, RopeScheme] = {
    "default": RopeScheme(_default),
    "linear": RopeScheme(_linear, required=("factor",)),
    "dynamic": RopeScheme(_dynamic_ntk, required=("factor",), seq_len_dependent=True, check=_check_dynamic),
    "yarn": RopeScheme(_yarn, required=("factor",), check=_check_yarn),
    "longrope": RopeScheme(
        _longrope,
        required=("short_factor", "long_factor", "original_max_position_embeddings"),
        seq_len_dependent=True,
        check=_check_longrope,
    ),
    "llama3": RopeScheme(
        _llama3,
        required=("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        check=_check_llama3,
    ),
}


def inv_freq_and_scaling(cfg: RopeConfig, seq_len=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ([rd/2], float64 for Python ``seq_len``) and the magnitude factor."""
    return ROPE_INIT_FUNCTIONS[cfg.rope_type].init(cfg, seq_len)


def cache_rows(cfg: RopeConfig, cache_len=None) -> int:
    """The cache length to build: ``cache_len`` checked, or the config's max_position_embeddings."""
    if cache_len is None:
        return cfg.max_position_embeddings
    def fail(_field, problem):
        raise RopeConfigError(f"cache length (rows of the cos/sin caches, --cache-len) {problem}")

    return bounds.check_int("cache_len", cache_len, 1, bounds.INT32_MAX, fail=fail)


def cache_build_bytes(cfg: RopeConfig, cache_len: int) -> int:
    """Peak bytes of build_caches: float64 angles, cos and sin, then the two float32 caches."""
    return cache_len * (cfg.rotary_embedding_dim // 2) * (3 * 8 + 2 * 4)


def build_caches(cfg: RopeConfig, cache_len: int | None = None, seq_len=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin caches [cache_len, rd/2] in float32, magnitude factor folded in, built in float64.

    ``cache_len`` defaults to max_position_embeddings. For seq-len-dependent schemes these are the
    caches for ``seq_len`` (default: their short/initial setting).
    """
    cache_len = cache_rows(cfg, cache_len)
    bounds.check_allocation("the cos/sin caches", {"caches": cache_build_bytes(cfg, cache_len)},
                            "use a smaller cache length (--cache-len)")
    inv_freq, scaling = inv_freq_and_scaling(cfg, seq_len)
    angles = torch.outer(torch.arange(cache_len, dtype=torch.float64), inv_freq.to(torch.float64))
    return (torch.cos(angles) * scaling).float(), (torch.sin(angles) * scaling).float()
