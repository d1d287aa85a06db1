"""Local diffusers folders: a pipeline (``model_index.json`` naming its components) or one component's own
folder as ``save_pretrained`` writes it (``config.json`` with ``_class_name``, weights beside it).

``find_component(DIR, component)`` says which component is meant (the pipeline's denoiser by default:
``transformer``, else the first component whose class is a diffusers transformer) and where its config and
weights are; ``build_component`` builds it offline from that config, with the folder's weights
(``diffusion_pytorch_model*.safetensors``/``.bin``, sharded or not, through diffusers' own loader with
``local_files_only``) or random weights from a seed when the folder holds none (or when asked). Nothing
is fetched from a hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rope_export.common.errors import CLIError

DENOISERS = ("transformer", "transformer_2", "prior", "unet")  # a pipeline's denoiser, in this order of preference
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class DiffusersFolderError(CLIError):
    """A folder or component that cannot be exported; the message says why and what to give instead."""


@dataclass(frozen=True)
class Component:
    """One component of a diffusers folder."""

    name: str  # "transformer", "vae", "text_encoder", ... ("" for a component's own folder)
    library: str  # "diffusers" or "transformers"
    class_name: str
    folder: Path  # where its config.json is
    config: dict

    @property
    def weights(self) -> Path | None:
        """The folder when it holds a checkpoint, else None (random weights)."""
        return self.folder if any(any(self.folder.glob(p)) for p in WEIGHT_PATTERNS) else None

    @property
    def label(self) -> str:
        return f"{self.name or 'component'} {self.class_name} ({self.folder})"


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DiffusersFolderError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise DiffusersFolderError(f"{path} is not a JSON object")
    return value


def pipeline_components(folder: Path) -> dict[str, tuple[str, str]]:
    """A pipeline folder's components: name -> (library, class name), from its model_index.json."""
    index = _read_json(folder / "model_index.json")
    return {name: (value[0], value[1]) for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and all(value)}


def find_component(path, component: str | None = None) -> Component:
    """The component of a pipeline folder (``component``, default: its denoiser), or the component whose own
    folder ``path`` is."""
    folder = Path(path)
    if not folder.is_dir():
        raise DiffusersFolderError(f"--diffusers {folder}: no such folder (give a pipeline folder with "
                                   "model_index.json, or a model's save_pretrained folder with config.json)")
    if (folder / "model_index.json").is_file():
        components = pipeline_components(folder)
        if component is None:
            component = next((c for c in DENOISERS if c in components), None)
            if component is None:
                raise DiffusersFolderError(f"{folder}: no denoiser among its components ({', '.join(components)}); "
                                           "name one with --component")
        if component not in components:
            raise DiffusersFolderError(f"{folder} has no component {component!r}; its components: "
                                       f"{', '.join(components)}")
        library, class_name = components[component]
        sub = folder / component
        if not (sub / "config.json").is_file():
            raise DiffusersFolderError(f"{sub}/config.json is missing: the pipeline folder is incomplete")
        return Component(component, library, class_name, sub, _read_json(sub / "config.json"))
    if not (folder / "config.json").is_file():
        raise DiffusersFolderError(f"{folder} has neither model_index.json (a pipeline) nor config.json (one model)")
    config = _read_json(folder / "config.json")
    if component is not None:
        raise DiffusersFolderError(f"--component {component!r}: {folder} is one model's folder, not a pipeline's")
    if "_class_name" in config:
        return Component("", "diffusers", config["_class_name"], folder, config)
    architectures = config.get("architectures") or []
    if architectures:
        return Component("", "transformers", architectures[0], folder, config)
    raise DiffusersFolderError(f"{folder}/config.json names no class (_class_name or architectures): not a diffusers "
                               "or transformers model folder")


def model_class(component: Component):
    """The class that builds the component (diffusers' or transformers')."""
    import importlib

    try:
        library = importlib.import_module(component.library)
    except ImportError:
        extra = "diffusers" if component.library == "diffusers" else "hf"
        raise DiffusersFolderError(f"{component.label} needs {component.library}: pip install "
                                   f"'rope-export[{extra}]'") from None
    cls = getattr(library, component.class_name, None)
    if cls is None:
        raise DiffusersFolderError(f"{component.library} {getattr(library, '__version__', '')} has no class "
                                   f"{component.class_name} ({component.label}); upgrade it or export another "
                                   "component")
    return cls


def build_component(component: Component, *, dtype: str = "fp32", seed: int = 0, random_weights: bool = False):
    """The component's model, in eval mode: the folder's weights, or random weights drawn from ``seed``."""
    import torch

    from rope_export.exporting.core import DTYPES

    cls = model_class(component)
    torch_dtype = DTYPES[dtype]
    try:
        if component.weights is not None and not random_weights:
            model = cls.from_pretrained(component.folder, local_files_only=True, torch_dtype=torch_dtype)
        elif component.library == "diffusers":
            torch.manual_seed(seed)
            model = cls.from_config(component.config).to(torch_dtype)
        else:
            torch.manual_seed(seed)
            config = cls.config_class.from_pretrained(component.folder, local_files_only=True)
            model = cls(config).to(torch_dtype)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise DiffusersFolderError(f"{component.label} cannot be built: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:300]}") from None
    return model.eval()
