"""The diffusers zoo: every transformer class of the installed diffusers, counted and, where it rotates, exported.

``zoo_classes()`` lists the ``ModelMixin`` classes defined in ``diffusers.models.transformers`` (what the installed
diffusers has, not a hand list). For each, ``census(name)`` builds it from its tiny config
(``tiny_configs.config``), calls it through the recipe that fits it (``rope_export.diffusion.recipes``) and counts
the rotations of that eager forward; ``exported(name)`` then runs ``export_diffusers`` on a rotating class (the
count against the file's rotary nodes, the file against diffusers at the traced latent size and at one never
traced). Each step that cannot run says why in the result (no tiny config, the build fails, no recipe fits the
forward, the recipe's call fails), so the table (``diffusers_zoo_table.py``) shows where the coverage ends.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from dataclasses import asdict, dataclass, field

STATUSES = ("exports", "export fails", "rotates", "no rotation", "recipe fails", "no recipe", "build fails",
            "no tiny config")


@dataclass
class ZooResult:
    class_name: str
    status: str  # one of STATUSES
    family: str = ""
    rotations: int = 0
    forms: list[str] = field(default_factory=list)  # census forms: "real", "complex"
    rotary_nodes: int = 0
    reason: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def zoo_classes() -> list[str]:
    """The transformer model classes of the installed diffusers (defined in diffusers.models.transformers)."""
    import diffusers
    import diffusers.models.transformers as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception:  # noqa: BLE001, S112 - a module the installed extras cannot import holds no zoo class
            continue
        found |= {name for name, value in vars(module).items() if inspect.isclass(value)
                  and value.__module__ == module.__name__ and issubclass(value, diffusers.ModelMixin)}
    return sorted(found)


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:160]}"


def _built(name: str):
    """(the tiny model, None) or (None, the ZooResult saying why not)."""
    from tiny_configs import config, tiny

    if config(name) is None:
        return None, ZooResult(name, "no tiny config", reason="diffusers' model tests have no config of it")
    try:
        return tiny(name), None
    except Exception as exc:  # noqa: BLE001 - the installed diffusers refuses its own test config
        return None, ZooResult(name, "build fails", reason=_first_line(exc))


def census(name: str) -> ZooResult:
    """Build the class from its tiny config and count the rotations of one forward through its recipe."""
    from rope_export.detect import count_rotations
    from rope_export.diffusion.recipes import TRACED, Denoiser, RecipeError, inputs_at, recipe_for

    start = time.perf_counter()
    model, failed = _built(name)
    if failed is not None:
        return failed
    try:
        recipe = recipe_for(model)
    except RecipeError:
        params = [p for p in inspect.signature(model.forward).parameters if p not in ("self", "return_dict")]
        return ZooResult(name, "no recipe", reason="no recipe makes its inputs (" + ", ".join(params[:6])
                         + (", ..." if len(params) > 6 else "") + ")")
    try:
        inputs = inputs_at(model, recipe, TRACED)
        counted = count_rotations(Denoiser(model, recipe, list(inputs.tensors)), tuple(inputs.tensors.values()))
    except Exception as exc:  # noqa: BLE001 - the recipe's call of this class fails: recorded with the reason
        return ZooResult(name, "recipe fails", recipe.name, reason=_first_line(exc))
    plain = counted.plain
    return ZooResult(name, "rotates" if plain else "no rotation", recipe.name, len(plain),
                     sorted({s.form for s in plain}), seconds=round(time.perf_counter() - start, 1))


def exported(name: str) -> ZooResult:
    """``census``, then, for a class that rotates, ``export_diffusers`` (count = rotary nodes; the file equals
    diffusers on onnxruntime at the traced latent size and at one never traced)."""
    from rope_export.diffusion.exporting import export_diffusers

    result = census(name)
    if result.status != "rotates":
        return result
    start = time.perf_counter()
    model, _ = _built(name)
    try:
        done = export_diffusers(model)
    except Exception as exc:  # noqa: BLE001 - recorded with the reason
        result.status, result.reason = "export fails", _first_line(exc)
        return result
    result.status, result.rotary_nodes = "exports", done.rotary_nodes
    if len(done.verified) != 2:
        result.reason = "; ".join(done.notes)
    elif done.static:
        result.reason = f"static: {', '.join(done.static)} (diffusers' code specialises it)"
    result.seconds = round(result.seconds + time.perf_counter() - start, 1)
    return result
