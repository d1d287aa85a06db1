"""diffusers' transformer as the reference of an ``export --diffusers`` file.

The file records the transformer's class, config, family and where its weights came from (the folder's
checkpoint, or random weights from a seed); the reference rebuilds it offline with diffusers and runs it on
its own cases: the latent size the file was traced at and ``recipes.OTHER``, which no axis of was traced
(a decoder's stress cases mean nothing to a denoiser). A half-precision file is held to PyTorch's own
error: the reference runs in float32 on the file's (rounded) weights, and the same transformer in the
file's precision gives the error PyTorch itself makes (``op.tolerances.against_pytorch``).
"""

from __future__ import annotations

import json

import numpy as np

from rope_export.check.inputs import Case
from rope_export.check.model_file import CheckError, ModelFile, free_memory
from rope_export.check.references import Reference
from rope_export.exporting.core import DTYPES

SOURCE = "diffusers"


def _json(mf: ModelFile, key: str, default=None):
    raw = mf.metadata.get(key)
    if raw is None:
        if default is not None:
            return default
        raise CheckError(f"{mf.label}: metadata rope_export.{key} is missing; re-export the file with "
                         "rope-export export --diffusers")
    try:
        return json.loads(raw)
    except ValueError:
        raise CheckError(f"{mf.label}: metadata rope_export.{key} is not JSON; the file's metadata is damaged: "
                         "re-export it") from None


class DiffusersReference(Reference):
    """The diffusers transformer the file records, on the traced latent size and one never traced."""

    short = "diffusers"
    # check's sweep runs each rotary node alone over positions 0..4095 with every symbolic axis at that length;
    # a denoiser's caches are computed in the graph from its position ids over text + image tokens (Flux: 8192
    # rows for 4096 of each), which such a slice cannot size. The two latent sizes cover the nodes instead.
    sweep_note = ("rotary nodes not run alone over positions: a diffusers denoiser's caches are computed in the graph "
                  "from its position ids (text and image tokens together); the two latent sizes run them")

    def __init__(self, mf: ModelFile):
        try:
            import diffusers
        except ImportError:
            raise CheckError("comparing with diffusers needs it installed: pip install 'rope-export[diffusers]'; or "
                             "compare with --reference OTHER.onnx") from None
        from rope_export.diffusion.recipes import OTHER, RECIPES, LatentSize

        self.class_name = mf.metadata.get("diffusers_class", "")
        self.cls = getattr(diffusers, self.class_name, None)
        if self.cls is None:
            raise CheckError(f"{mf.label}: diffusers {diffusers.__version__} has no class {self.class_name!r} (the "
                             "file's metadata rope_export.diffusers_class)")
        family = mf.metadata.get("diffusers_family")
        if family not in RECIPES:
            raise CheckError(f"{mf.label}: metadata rope_export.diffusers_family {family!r} is not one of "
                             f"{', '.join(RECIPES)}")
        self.recipe = RECIPES[family]
        self.config = _json(mf, "diffusers_config")
        self.source = _json(mf, "diffusers_source", {})
        self.dtype = mf.metadata.get("dtype", "fp32")
        if self.dtype not in DTYPES:
            raise CheckError(f"{mf.label}: metadata rope_export.dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            self.traced = LatentSize(**_json(mf, "traced_latent"))
            self.other = LatentSize(**_json(mf, "other_latent", vars(OTHER)))  # axes the export made static kept
        except TypeError:
            raise CheckError(f"{mf.label}: metadata rope_export.traced_latent is not a latent size; re-export "
                             "it") from None
        self.weights = self.source.get("weights")
        self.seed = int(self.source.get("seed", 0))
        where = f"weights {self.weights}" if self.weights else f"random weights, seed {self.seed}"
        self.label = f"diffusers {self.class_name} ({self.dtype}, {where})"
        self.input_names = [s.name for s in mf.inputs]
        self.output_names = [s.name for s in mf.outputs]
        self.half = self.dtype in ("fp16", "bf16")
        if self.half:
            self.label += f", run in float32 and in {self.dtype}"

    def streams(self) -> bool:
        """A half-precision file is judged against PyTorch's own error (check's ``measured`` rule)."""
        return self.half

    pytorch_outputs: list[dict[str, np.ndarray]] | None = None
    reference_states = None

    def _model(self):
        import torch

        from rope_export.diffusion.folders import DiffusersFolderError, build_component, find_component

        if self.weights:
            try:
                component = find_component(self.weights)
            except DiffusersFolderError as exc:
                raise CheckError(f"the weights the file records cannot be read: {exc}") from None
            model = build_component(component, dtype=self.dtype)
        else:
            torch.manual_seed(self.seed)
            model = self.cls.from_config(self.config).to(DTYPES[self.dtype]).eval()
        return model

    def own_cases(self, mf: ModelFile, plan) -> tuple[list[Case], list[str], str]:
        """The traced latent size and one never traced, in the file's input names; no notes; their description.
        (The plan's batch and seed do not apply: the recipe's inputs are the denoiser's own.)"""
        from rope_export.diffusion.recipes import inputs_at

        model = self._build_skeleton()
        cases = []
        for label, size, seed in (("traced-latent", self.traced, 1), ("other-latent", self.other, 2)):
            inputs = inputs_at(model, self.recipe, size, seed)
            if list(inputs.tensors) != self.input_names:
                raise CheckError(f"{mf.label}: inputs {self.input_names} are not what the {self.recipe.name} recipe "
                                 f"feeds ({list(inputs.tensors)}): the file was changed after export; re-export it")
            feeds = {}
            for name, tensor in inputs.tensors.items():
                if tensor.is_floating_point() and name not in self.recipe.float32_inputs:
                    tensor = tensor.to(DTYPES[self.dtype])
                feeds[name] = tensor.numpy()
            cases.append(Case(label, feeds, None))
        return cases, [], f"two latent sizes: {self.traced.describe()} (traced) and {self.other.describe()}"

    def _build_skeleton(self):
        """The model the recipe reads its config from (the config only: random init is cheap at check sizes)."""
        from rope_export.diffusion.folders import DiffusersFolderError

        try:
            return self.cls.from_config(self.config)
        except (ValueError, TypeError, DiffusersFolderError) as exc:
            raise CheckError(f"diffusers cannot build {self.class_name} from the recorded config: {exc}") from None

    def outputs(self, cases, say):
        import torch

        from rope_export.diffusion.recipes import Denoiser
        from rope_export.runtimes.contract_runners import to_numpy, to_torch

        say(f"building {self.label}")
        model = self._model()
        runs = [("float32", model.float()), (self.dtype, None)] if self.half else [(self.dtype, model)]
        results: list[list[dict[str, np.ndarray]]] = []
        for dtype, built in runs:
            built = built if built is not None else model.to(DTYPES[dtype])
            wrapper = Denoiser(built, self.recipe, self.input_names)
            say(f"running diffusers {self.class_name} in {dtype} on {len(cases)} cases")
            per_case = []
            with torch.no_grad():
                for case in cases:
                    args = []
                    for name in self.input_names:
                        tensor = to_torch(case.feeds[name])
                        if tensor.is_floating_point() and name not in self.recipe.float32_inputs:
                            tensor = tensor.to(next(built.parameters()).dtype)
                        args.append(tensor)
                    out = wrapper(*args)
                    per_case.append({self.output_names[0]: to_numpy(out.float() if dtype == "float32" else out)})
            results.append(per_case)
        if self.half:
            self.pytorch_outputs = results[1]
        del model
        free_memory(self.weight_bytes)
        return results[0]
