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

    def _check_types(self) -> None:
        # A wrong type (say rope_theta = "1e4" or truncate = "false" in a TOML file) must be named
        # here, not fail later in arithmetic or be silently taken as truthy.
        if not isinstance(self.rope_type, str):
            self._fail("rope_type", f"must be a string, got {self.rope_type!r}")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                self._fail(name, f"must be an integer, got {value!r} ({type(value).__name__})")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                self._fail(name, f"must be a number, got {value!r} ({type(value).__name__})")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                self._fail(name, f"must be true or false, got {value!r} ({type(value).__name__})")

    def _validate(self) -> None:
        self._check_types()
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            self._fail("head_dim", f"must be a positive even integer, got {self.head_dim!r}")
        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            self._fail("rope_type", f"unknown type {self.rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
        if not self.rope_theta > 0:
            self._fail("rope_theta", f"must be > 0, got {self.rope_theta!r}")
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1:
            self._fail("max_position_embeddings", f"must be a positive integer, got {self.max_position_embeddings!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            self._fail("partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor!r}")
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
        if self.factor is not None and not self.factor > 0:
            self._fail("factor", f"must be > 0, got {self.factor!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None and len(value) != rd // 2:
                self._fail(name, f"needs rotary_dim/2 = {rd // 2} values, got {len(value)}")
        if self.low_freq_factor is not None and self.high_freq_factor is not None:
            if not self.high_freq_factor > self.low_freq_factor:
                self._fail("high_freq_factor", "must be larger than low_freq_factor")

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


_INT_FIELDS = ("head_dim", "max_position_embeddings", "rotary_dim", "original_max_position_embeddings")
_NUMBER_FIELDS = (
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
)
_BOOL_FIELDS = ("interleaved", "truncate")


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
    return tuple(float(v) for v in items) if all(_is_number(v) for v in items) else None


# -- the registry ----------------------------------------------------------------------------

InitFunction = Callable[[RopeConfig, "int | torch.Tensor | None"], "tuple[torch.Tensor, float]"]


@dataclass(frozen=True)
class RopeScheme:
    init: InitFunction
    required: tuple[str, ...] = ()
    seq_len_dependent: bool = False


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


ROPE_INIT_FUNCTIONS: dict[str, RopeScheme] = {
    "default": RopeScheme(_default),
    "linear": RopeScheme(_linear, required=("factor",)),
    "dynamic": RopeScheme(_dynamic_ntk, required=("factor",), seq_len_dependent=True),
    "yarn": RopeScheme(_yarn, required=("factor",)),
    "longrope": RopeScheme(
        _longrope,
        required=("short_factor", "long_factor", "original_max_position_embeddings"),
        seq_len_dependent=True,
    ),
    "llama3": RopeScheme(
        _llama3, required=("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    ),
}


def inv_freq_and_scaling(cfg: RopeConfig, seq_len=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ([rd/2], float64 for Python ``seq_len``) and the magnitude factor."""
    return ROPE_INIT_FUNCTIONS[cfg.rope_type].init(cfg, seq_len)


def build_caches(cfg: RopeConfig, cache_len: int | None = None, seq_len=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin caches [cache_len, rd/2] in float32, magnitude factor folded in, built in float64.

    ``cache_len`` defaults to max_position_embeddings. For seq-len-dependent schemes these are the
    caches for ``seq_len`` (default: their short/initial setting).
    """
    cache_len = cfg.max_position_embeddings if cache_len is None else int(cache_len)
    if cache_len < 1:
        raise RopeConfigError(f"cache length must be >= 1, got {cache_len}")
    inv_freq, scaling = inv_freq_and_scaling(cfg, seq_len)
    angles = torch.outer(torch.arange(cache_len, dtype=torch.float64), inv_freq.to(torch.float64))
    return (torch.cos(angles) * scaling).float(), (torch.sin(angles) * scaling).float()
