"""``rope-export export --diffusers DIR [--component NAME]``: what the ``export`` command runs for a diffusers
folder (the options: ``rope_export.cli.export``, which imports neither torch nor diffusers).

The denoiser (the default component) is exported by ``export_diffusers``: one rotary node per rotation,
dynamic latent sizes, checked against diffusers at a second latent size. Any other component (the VAE, a
text encoder) is exported as it is by ``export_module`` with its rotations counted: none in a VAE or a
CLIP/T5 encoder (the summary says so), and those of a RoPE text encoder (Lumina 2's Gemma, HunyuanVideo's
Llama) fused like any module's.
"""

from __future__ import annotations

from rope_export.diffusion.folders import DENOISERS, DiffusersFolderError, build_component, find_component


def run_diffusers_export(args) -> int:
    from rich.console import Console

    from rope_export.common.steps import cli_steps
    from rope_export.exporting.core import check_output_writable
    from rope_export.files.onnx_files import output_files

    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise DiffusersFolderError("--diffusers needs diffusers: pip install 'rope-export[diffusers]'") from None
    from pathlib import Path

    check_output_writable(Path(args.output))
    component = find_component(args.diffusers, args.component)
    random = bool(args.random_weights) or component.weights is None
    console = Console()
    with cli_steps(console, f"rope-export export --diffusers: {args.output}", args.summary_json) as progress:
        weights = f"random weights (seed {args.seed}): not a trained model" if random else \
            f"weights from {component.weights}"
        progress(f"building {component.label}, {weights}")
        model = build_component(component, dtype=args.dtype, seed=args.seed, random_weights=random)
        source = {"folder": str(Path(args.diffusers).resolve()), "component": component.name,
                  "weights": None if random else str(component.weights.resolve()), "seed": args.seed}
        if component.library == "diffusers" and (component.name in DENOISERS or not component.name):
            text = _denoiser(model, args, source, progress)
        else:
            text = _plain(model, component, args, progress)
        progress.add_files(output_files(args.output))
    console.print(weights, markup=False, highlight=False)
    console.print(text, markup=False, highlight=False)
    return 0


def _denoiser(model, args, source, progress) -> str:
    from rope_export.diffusion.exporting import export_diffusers
    from rope_export.diffusion.recipes import RecipeError

    try:
        result = export_diffusers(model, args.output, family=args.diffusers_family, seed=args.seed, source=source,
                                  opset=args.opset, allow_decomposed=args.allow_decomposed,
                                  external=args.external_data, progress=progress, verbose=args.verbose)
    except RecipeError as exc:
        raise DiffusersFolderError(str(exc)) from None
    return (f"{result.as_text()}\n{result.rotary_nodes} rotary node(s) for {result.rotations} rotation(s): "
            f"{result.path}")


def _plain(model, component, args, progress) -> str:
    """A VAE or text encoder: exported as it is, its rotations counted (none in most)."""
    from rope_export.diffusion.components import export_component

    result = export_component(model, component, args.output, opset=args.opset, allow_decomposed=args.allow_decomposed,
                              external=args.external_data, progress=progress, verbose=args.verbose)
    return result
