"""Model presets: one TOML file per real family's attention block, shipped as rope_export.models.

A preset names the block's shape (``[attention]``) and its RoPE parameters (``[rope]``, field
names as in transformers' ``rope_parameters``). ``load_preset`` accepts a preset name or a path
to a TOML file of the same form; a bad file raises ``PresetError`` naming the file and field.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from rope_export.common import bounds

if TYPE_CHECKING:  # imported where used: `rope-export presets --help` runs without torch
    import torch

    from rope_export.op.rope_types import RopeConfig
    from rope_export.presets.modules import AttentionConfig, RoPEAttention

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_PRESET = "tiny"


class PresetError(ValueError):
    """A preset that cannot be loaded; the message names the file and the field."""


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    source: str
    attention: AttentionConfig
    rope: RopeConfig

    def build_block(
        self, dtype: torch.dtype | None = None, seed: int = 0, cache_len: int | None = None
    ) -> RoPEAttention:
        """The attention block with seeded random weights (float32 unless ``dtype``), in eval mode."""
        import torch

        from rope_export.presets.modules import RoPEAttention

        dtype = torch.float32 if dtype is None else dtype
        torch.manual_seed(bounds.check_seed(seed))  # --seed 2**80 overflowed inside torch
        block = RoPEAttention(self.attention, self.rope, cache_len=cache_len)
        return block.to(dtype).eval()

    def scaled_down(self, num_heads: int = 4, hidden_size: int = 64) -> Preset:
        """Same head_dim and RoPE, fewer heads (keeping the q:kv ratio where it fits): for tests."""
        a = self.attention
        group = a.num_heads // a.num_kv_heads
        kv_heads = max(1, min(a.num_kv_heads, num_heads // group))
        heads = min(a.num_heads, kv_heads * group, num_heads)
        attention = dataclasses.replace(a, hidden_size=hidden_size, num_heads=heads, num_kv_heads=kv_heads)
        return dataclasses.replace(self, attention=attention)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "source": self.source,
            "attention": dataclasses.asdict(self.attention),
            "rope": self.rope.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict, origin: str = "<dict>") -> Preset:
        from rope_export.op.rope_types import RopeConfig
        from rope_export.presets.modules import AttentionConfig, AttentionConfigError

        def fail(field: str, problem: str):
            raise PresetError(f"{origin}: field '{field}': {problem}")

        for key in ("name", "attention", "rope"):
            if key not in data:
                fail(key, "is missing")
        unknown = sorted(set(data) - {"name", "family", "source", "attention", "rope"})
        if unknown:
            fail(unknown[0], "is not a preset field (known: name, family, source, attention, rope)")
        for key in ("attention", "rope"):
            if not isinstance(data[key], dict):
                fail(key, f"must be a table ([{key}] section), got {data[key]!r}")
        att = dict(data["attention"])
        known = {f.name for f in dataclasses.fields(AttentionConfig)}
        for key in sorted(set(att) - known):
            fail(f"attention.{key}", f"is not an attention field (known: {sorted(known)})")
        for key in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if key not in att:
                fail(f"attention.{key}", "is missing")
        try:  # types, ranges and finiteness: AttentionConfig checks them (rope_export.common.bounds)
            attention = AttentionConfig(**att)
        except AttentionConfigError as exc:
            if exc.field is None:
                raise PresetError(f"{origin}: {exc}") from None
            fail(f"attention.{exc.field}", exc.problem)
        rope = dict(data["rope"])
        rope.setdefault("head_dim", attention.head_dim)
        try:
            rope_config = RopeConfig.from_dict(rope)
        except (ValueError, TypeError) as exc:
            raise PresetError(f"{origin}: {exc}") from None
        if rope_config.head_dim != attention.head_dim:
            fail("rope.head_dim", f"{rope_config.head_dim} differs from attention.head_dim {attention.head_dim}")
        return cls(
            name=str(data["name"]),
            family=str(data.get("family", "")),
            source=str(data.get("source", "")),
            attention=attention,
            rope=rope_config,
        )


def _preset_files() -> dict[str, resources.abc.Traversable]:
    root = resources.files("rope_export.models")
    return {entry.name.removesuffix(".toml"): entry for entry in root.iterdir() if entry.name.endswith(".toml")}


def preset_names() -> list[str]:
    return sorted(_preset_files())


def load_preset(name_or_path: str | Path) -> Preset:
    text_source = str(name_or_path)
    files = _preset_files()
    if text_source in files:
        entry, origin = files[text_source], f"models/{text_source}.toml"
    elif text_source.endswith(".toml") and Path(text_source).is_file():
        entry, origin = Path(text_source), text_source
    else:
        raise PresetError(
            f"unknown preset {text_source!r}; known presets: {', '.join(preset_names())} "
            "(or give the path of a .toml file)"
        )
    try:
        data = tomllib.loads(entry.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{origin}: not valid TOML: {exc}") from None
    return Preset.from_dict(data, origin)
