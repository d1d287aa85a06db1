"""How each diffusers denoising transformer is called: its inputs at a latent size, which of their axes are
dynamic, and the module the file is traced from.

A ``Recipe`` turns a ``LatentSize`` (batch, frames, height and width of the latent, before patching; text
tokens) into the transformer's keyword inputs, in the order the file takes them, and names every dynamic
axis (``batch``, ``frames``, ``height``, ``width``, ``image_seq``, ``text_seq``). Position inputs (Flux's
``img_ids``/``txt_ids``, LTX-Video's ``video_coords``) are float, as diffusers' pipelines pass them (LTX's
frame coordinates are fractional); ``Denoiser`` names them to the rotation census
(``rope_export.detect.POSITION_INPUTS``), which otherwise takes a float input for an activation. A model
that builds its grid from the latent's shape (Wan, HunyuanVideo, Lumina 2) takes none; CogVideoX's transformer
takes the rotary tables its pipeline computes (``image_rotary_emb``), and so does the file (``Recipe.tuples``).

``RECIPES`` maps a family to its recipe and ``recipe_for(model)`` picks the first that fits the model (its
identifying parameters are the forward's, and it makes every input the forward requires), so a class rope-export
never named (a Flux derivative) is served by the recipe of its family; adding a family is adding an entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LatentSize:
    """A latent of ``batch`` x ``frames`` x ``height`` x ``width`` (latent pixels, before patching) and
    ``text`` tokens of prompt embedding."""

    batch: int = 2
    frames: int = 2  # not 1: torch.export takes an axis of size 1 for a constant
    height: int = 8
    width: int = 8
    text: int = 5

    def describe(self) -> str:
        frames = f"{self.frames} frame(s) x " if self.frames > 1 else ""
        return f"batch {self.batch}, {frames}{self.height} x {self.width} latent, {self.text} text tokens"


TRACED = LatentSize()
# the second size every export is verified at: no axis of it was traced (batch, frames, height, width, text)
OTHER = LatentSize(batch=1, frames=3, height=12, width=4, text=7)


@dataclass
class Inputs:
    """The transformer's tensor inputs in the file's order, their dynamic axes, and keyword arguments the
    wrapper passes as constants."""

    tensors: dict[str, torch.Tensor]
    axes: dict[str, dict[int, str]]
    constants: dict = field(default_factory=dict)


class RecipeError(ValueError):
    """The model cannot be called by any recipe, or not at this size; the message says why."""


def _config(model, name: str, default=None):
    return getattr(model.config, name, default)


def _pair(value) -> tuple[int, int, int]:
    """A patch size as (frames, height, width)."""
    if isinstance(value, (tuple, list)):
        return (1, *value) if len(value) == 2 else tuple(value)
    return (1, int(value), int(value))


def _text(model, names=("joint_attention_dim", "text_dim", "text_embed_dim", "caption_channels", "cap_feat_dim")):
    for name in names:
        value = _config(model, name)
        if isinstance(value, int):
            return value
    raise RecipeError(f"{type(model).__name__}: no text embedding width in its config (looked for {', '.join(names)})")


def _grid_ids(frames: int, height: int, width: int, first_axis: int = 0) -> torch.Tensor:
    """Flux's image ids: [h*w, 3] rows (axis 0, row, column) as FluxPipeline._prepare_latent_image_ids makes."""
    ids = torch.zeros(height, width, 3)
    ids[..., 0] = first_axis
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(height * width, 3)


def _flux(model, size: LatentSize, generator: torch.Generator) -> Inputs:
    h, w = size.height // 2, size.width // 2  # the pipeline packs 2x2 latent pixels into one token
    hidden = _config(model, "in_channels")
    tensors = {
        "hidden_states": torch.randn(size.batch, h * w, hidden, generator=generator),
        "encoder_hidden_states": torch.randn(size.batch, size.text, _text(model), generator=generator),
    }
    axes = {"hidden_states": {0: "batch", 1: "image_seq"}, "encoder_hidden_states": {0: "batch", 1: "text_seq"}}
    if "pooled_projections" in _parameters(model) and _config(model, "pooled_projection_dim"):
        tensors["pooled_projections"] = torch.randn(size.batch, _config(model, "pooled_projection_dim"),
                                                    generator=generator)
        axes["pooled_projections"] = {0: "batch"}
    tensors["timestep"] = torch.rand(size.batch, generator=generator)
    axes["timestep"] = {0: "batch"}
    tensors["img_ids"] = _grid_ids(1, h, w)
    tensors["txt_ids"] = torch.zeros(size.text, 3)
    axes.update(img_ids={0: "image_seq"}, txt_ids={0: "text_seq"})
    if _config(model, "guidance_embeds"):
        tensors["guidance"] = torch.full((size.batch,), 3.5)
        axes["guidance"] = {0: "batch"}
    return Inputs(tensors, axes)


def _video_latent(model, size: LatentSize, generator, layout: str = "bcfhw") -> tuple[torch.Tensor, dict[int, str]]:
    """A [B, C, F, H, W] (or [B, F, C, H, W]) latent; an image model's [B, C, H, W]."""
    channels = _config(model, "in_channels")
    if layout == "bchw":
        return torch.randn(size.batch, channels, size.height, size.width, generator=generator), \
            {0: "batch", 2: "height", 3: "width"}
    shape = (size.batch, channels, size.frames, size.height, size.width)
    axes = {0: "batch", 2: "frames", 3: "height", 4: "width"}
    if layout == "bfchw":
        shape, axes = (size.batch, size.frames, channels, size.height, size.width), \
            {0: "batch", 1: "frames", 3: "height", 4: "width"}
    return torch.randn(*shape, generator=generator), axes


def _text_inputs(model, size, generator, mask: str | None = None) -> tuple[dict, dict]:
    tensors = {"encoder_hidden_states": torch.randn(size.batch, size.text, _text(model), generator=generator)}
    axes = {"encoder_hidden_states": {0: "batch", 1: "text_seq"}}
    if mask is not None:  # the last third of the caption is padding, as a tokenizer pads a short prompt
        dtype = torch.bool if mask == "bool" else torch.int64
        tensors["encoder_attention_mask"] = (torch.arange(size.text) < size.text - size.text // 3).to(dtype).expand(
            size.batch, size.text).contiguous()
        axes["encoder_attention_mask"] = {0: "batch", 1: "text_seq"}
    return tensors, axes


def _timestep(size: LatentSize, generator) -> tuple[dict, dict]:
    return {"timestep": (torch.rand(size.batch, generator=generator) * 1000)}, {"timestep": {0: "batch"}}


def _ordered(model, *parts: tuple[dict, dict]) -> Inputs:
    """The parts' tensors in the order of the forward's parameters."""
    tensors, axes = {}, {}
    for t, a in parts:
        tensors.update(t)
        axes.update(a)
    order = _parameters(model)
    names = sorted(tensors, key=lambda n: order.index(n) if n in order else len(order))
    return Inputs({n: tensors[n] for n in names}, {n: axes[n] for n in names if n in axes})


def _wan(model, size, generator) -> Inputs:
    latent, axes = _video_latent(model, size, generator)
    return _ordered(model, ({"hidden_states": latent}, {"hidden_states": axes}), _timestep(size, generator),
                    _text_inputs(model, size, generator))


def _hunyuan_video(model, size, generator) -> Inputs:
    latent, axes = _video_latent(model, size, generator)
    parts = [({"hidden_states": latent}, {"hidden_states": axes}), _timestep(size, generator),
             _text_inputs(model, size, generator, mask="int")]
    pooled = _config(model, "pooled_projection_dim")
    parts.append(({"pooled_projections": torch.randn(size.batch, pooled, generator=generator)},
                  {"pooled_projections": {0: "batch"}}))
    if _config(model, "guidance_embeds"):
        parts.append(({"guidance": torch.full((size.batch,), 6.0) * 1000}, {"guidance": {0: "batch"}}))
    return _ordered(model, *parts)


def _video(model, size, generator) -> Inputs:
    """A video transformer of the common signature (Mochi, SanaVideo, ...): the latent, timestep, caption, mask."""
    latent, axes = _video_latent(model, size, generator)
    return _ordered(model, ({"hidden_states": latent}, {"hidden_states": axes}), _timestep(size, generator),
                    _text_inputs(model, size, generator, mask="int"))


def _lumina2(model, size, generator) -> Inputs:
    latent, axes = _video_latent(model, size, generator, layout="bchw")
    text, text_axes = _text_inputs(model, size, generator, mask="bool")
    # captions of different lengths in one batch (every odd sample's is whole): Lumina 2 packs each sample's caption
    # and image tokens by its length (rope_export.diffusion.trace_patches), which equal lengths would not exercise
    text["encoder_attention_mask"][1::2] = True
    return _ordered(model, ({"hidden_states": latent}, {"hidden_states": axes}),
                    ({"timestep": torch.rand(size.batch, generator=generator)}, {"timestep": {0: "batch"}}),
                    (text, text_axes))


def _ltx(model, size, generator) -> Inputs:
    tokens = size.frames * size.height * size.width  # patch size 1: one token per latent pixel
    hidden = torch.randn(size.batch, tokens, _config(model, "in_channels"), generator=generator)
    grid = torch.stack(torch.meshgrid(torch.arange(size.frames), torch.arange(size.height), torch.arange(size.width),
                                      indexing="ij")).reshape(3, tokens)
    # LTXPipeline's rope_interpolation_scale: the VAE's 8 frames / 25 fps and 32 x 32 pixels per latent pixel
    coords = (grid * torch.tensor([8 / 25, 32, 32])[:, None]).expand(size.batch, 3, tokens).contiguous()
    return _ordered(model, ({"hidden_states": hidden}, {"hidden_states": {0: "batch", 1: "image_seq"}}),
                    _timestep(size, generator), _text_inputs(model, size, generator, mask="int"),
                    ({"video_coords": coords}, {"video_coords": {0: "batch", 2: "image_seq"}}))


def _cogvideox(model, size, generator) -> Inputs:
    latent, axes = _video_latent(model, size, generator, layout="bfchw")
    tables = {}
    if _config(model, "use_rotary_positional_embeddings"):  # else the pipeline passes none
        tables = dict(zip(("image_rotary_cos", "image_rotary_sin"), _cogvideox_tables(model, size), strict=True))
    return _ordered(model, ({"hidden_states": latent}, {"hidden_states": axes}),
                    _text_inputs(model, size, generator), _timestep(size, generator),
                    (tables, {name: {0: "image_seq"} for name in tables}))


def _cogvideox_tables(model, size: LatentSize) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables CogVideoXPipeline passes its transformer as ``image_rotary_emb`` for this latent: the
    pipeline's own ``_prepare_rotary_positional_embeddings`` (its pixel size is the latent's times the VAE's
    spatial factor, 8), [frames * height/p * width/p, head_dim] each, float32."""
    import types

    from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

    pipeline = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(pipeline, size.height * 8, size.width * 8,
                                                                   size.frames, torch.device("cpu"))


@dataclass(frozen=True)
class Recipe:
    """One family's way of calling its transformer."""

    name: str
    signature: tuple[str, ...]  # forward parameters that identify the family (all of them present)
    make: Callable[[torch.nn.Module, LatentSize, torch.Generator], Inputs]
    positions: tuple[str, ...] = ()  # float position inputs (not activations: the census is told)
    multiple: tuple[int, int, int] = (1, 2, 2)  # latent frames/height/width must be multiples of these
    # inputs the forward takes as one tuple argument: argument -> the file's inputs, in order (CogVideoX's
    # image_rotary_emb = (cos, sin), the tables its pipeline computes); they stay float32 as the pipeline's are
    tuples: dict[str, tuple[str, ...]] = field(default_factory=dict)
    video: bool | None = None  # fits only video (3-D) transformers, or only image ones; None: either

    @property
    def float32_inputs(self) -> tuple[str, ...]:
        """Inputs kept in float32 whatever the file's precision: positions and rotary tables, as pipelines pass
        them."""
        return self.positions + tuple(n for names in self.tuples.values() for n in names)


RECIPES = {
    "flux": Recipe("flux", ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"), _flux,
                   positions=("img_ids", "txt_ids")),
    "ltx-video": Recipe("ltx-video", ("hidden_states", "encoder_hidden_states", "video_coords"), _ltx,
                        positions=("video_coords",), multiple=(1, 1, 1)),
    "hunyuan-video": Recipe("hunyuan-video", ("hidden_states", "timestep", "encoder_hidden_states",
                                              "encoder_attention_mask", "pooled_projections"), _hunyuan_video),
    "cogvideox": Recipe("cogvideox", ("hidden_states", "encoder_hidden_states", "timestep", "image_rotary_emb"),
                        _cogvideox, tuples={"image_rotary_emb": ("image_rotary_cos", "image_rotary_sin")}),
    "lumina2": Recipe("lumina2", ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
                      _lumina2, video=False),
    "video": Recipe("video", ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"), _video,
                    video=True),
    "wan": Recipe("wan", ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"), _wan),
}


def _parameters(model) -> list[str]:
    return [p for p in inspect.signature(model.forward).parameters if p != "self"]


def recipe_for(model: torch.nn.Module, family: str | None = None) -> Recipe:
    """The recipe of ``family``, else the first that fits the model: its identifying parameters are the forward's,
    and it makes every input the forward requires."""
    if family is not None:
        if family not in RECIPES:
            raise RecipeError(f"unknown diffusers family {family!r}; choose from {', '.join(RECIPES)}")
        return RECIPES[family]
    for recipe in RECIPES.values():
        if _fits(model, recipe):
            return recipe
    raise RecipeError(f"{type(model).__name__}: rope-export has no recipe for calling it (its forward takes "
                      f"{', '.join(_parameters(model))}); the families it knows: {', '.join(RECIPES)}")


def _fits(model, recipe: Recipe) -> bool:
    parameters = inspect.signature(model.forward).parameters
    if not set(recipe.signature) <= set(parameters):
        return False
    if recipe.video is not None and recipe.video != ("3D" in type(model).__name__):  # diffusers' class naming
        return False
    required = {n for n, p in parameters.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "self"}
    try:
        made = set(recipe.make(model, TRACED, torch.Generator().manual_seed(0)).tensors)
    except (RecipeError, AttributeError, TypeError, ValueError, KeyError, AssertionError):  # a config it cannot read
        return False
    made = {n for n in made if not any(n in names for names in recipe.tuples.values())} | set(recipe.tuples)
    return required <= made


def inputs_at(model, recipe: Recipe, size: LatentSize, seed: int = 0) -> Inputs:
    """The recipe's inputs at ``size`` (drawn from ``seed``), checked against its multiples."""
    for axis, value, multiple in zip(("frames", "height", "width"), (size.frames, size.height, size.width),
                                     recipe.multiple, strict=True):
        if value % multiple:
            raise RecipeError(f"{recipe.name}: the latent's {axis} must be a multiple of {multiple}, got {value}")
    return recipe.make(model, size, torch.Generator().manual_seed(seed))


class Denoiser(torch.nn.Module):
    """The transformer called with the file's inputs, in order; returns its sample (the noise prediction)."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, names: list[str], constants: dict | None = None):
        from rope_export.detect import POSITION_INPUTS

        super().__init__()
        self.model, self.recipe, self.names, self.constants = model, recipe, list(names), dict(constants or {})
        setattr(self, POSITION_INPUTS, tuple(i for i, n in enumerate(self.names) if n in recipe.positions))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.names, inputs, strict=True))
        for argument, names in self.recipe.tuples.items():
            if all(n in kwargs for n in names):
                kwargs[argument] = tuple(kwargs.pop(n) for n in names)
        return self.model(**kwargs, **self.constants, return_dict=False)[0]
