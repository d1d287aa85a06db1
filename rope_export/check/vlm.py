"""``check`` of a vision-language export: each component against the same transformers submodule, and the whole
pipeline (image + text -> logits, then a decode step) against transformers' model.

* A component file (``rope_export.vlm`` in its metadata) is checked as any file with a PyTorch module as its
  reference (``module_reference.ModuleReference``, every runner, every rotary node swept): the module is the
  component of the transformers model rebuilt from the file's config, weights and seed (``check.weights``'s
  rule), run as transformers runs it (the vision tower computes its positions from the grid itself). The
  embedding merge (and Qwen3-VL's decoder, whose extras must agree with each other) get prompts that hold the
  image's tokens instead of the generated stress cases.
* ``check OUT_DIR/`` checks the three components so, then runs the pipeline on onnxruntime (each component
  lowered to the ``onnx`` target): the vision encoder on an image, the merge into a prompt's embeddings, the
  decoder with the positions a serving stack computes (``hf.vlm.pipeline``), then one greedy decode step fed
  the returned cache; its logits against transformers' forward on the same image and prompt, by the decoder's
  tolerance (one block's, times sqrt(layers)).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rope_export.check.model_file import CheckError, ModelFile

RECORD = "vlm"  # rope_export.vlm: {"component", "kind", "image"}
WHY_OWN_CASES = {"vision": "two images of the exported size (pixels of unit and of 4x the scale)",
                 "embedding": "two prompts, one holding the image's tokens (its feature rows must match them)",
                 "decoder": "a prompt whose image tokens carry deepstack features, then a decode step"}


def vlm_record(mf: ModelFile) -> dict | None:
    raw = mf.metadata.get(RECORD)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        if record["component"] not in ("vision", "embedding", "decoder") or not isinstance(record["image"], dict):
            raise ValueError(record["component"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"{mf.label}: metadata rope_export.{RECORD} is damaged ({exc}); re-export the "
                         "folder") from None
    return record


@dataclass
class Rebuilt:
    """The transformers model a component file records, and what its components need."""

    model: object
    kind: object
    geometry: object
    layout: object
    notes: list[str] = field(default_factory=list)
    weights: dict = field(default_factory=dict)


def rebuild(mf: ModelFile, *, weights=None, seed: int | None = None, random_weights: bool = False) -> Rebuilt:
    from rope_export.check.metadata import read_hf_info
    from rope_export.check.references import _config_from
    from rope_export.check.weights import choose_weights
    from rope_export.hf.cache_io import cache_layout
    from rope_export.hf.errors import HFExportError
    from rope_export.hf.vlm import Geometry, build_vlm, kind_of

    record = vlm_record(mf)
    info = read_hf_info(mf, mf_memory_limit())
    choice = choose_weights(recorded=info.weights, recorded_seed=info.seed, weights=weights,
                            random_weights=random_weights, seed=seed)
    config = _config_from(info.config)
    try:
        model = build_vlm(config, choice.folder, dtype=info.dtype, seed=choice.seed,
                          random_weights=choice.folder is None)
        kind = kind_of(config)
        geometry = Geometry.from_dict(record["image"])
        layout = cache_layout(kind.text_model(model))
    except (HFExportError, ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"{mf.label}: the transformers model it records cannot be rebuilt: {exc}") from None
    return Rebuilt(model, kind, geometry, layout, [choice.note] if choice.note else [], choice.to_dict())


def mf_memory_limit() -> int | None:
    from rope_export.check.model_file import memory_limit_bytes

    return memory_limit_bytes(None)


def component_module(rebuilt: Rebuilt, name: str):
    from rope_export.hf.vlm.components import DecoderWithCache, EmbeddingMerge, VisionEncoder

    model, kind = rebuilt.model, rebuilt.kind
    if name == "vision":  # transformers computes the grid's positions, windows and segments itself
        return VisionEncoder(model, kind, rebuilt.geometry, precomputed=False).eval()
    if name == "embedding":
        return EmbeddingMerge(model, kind).eval()
    return DecoderWithCache(model, kind, rebuilt.layout).eval()


def _check_names(mf: ModelFile, rebuilt: Rebuilt, name: str) -> None:
    from rope_export.hf.vlm.components import io_names

    want_in, want_out = io_names(rebuilt.kind, rebuilt.layout)[name]
    have_in, have_out = [s.name for s in mf.inputs], [s.name for s in mf.outputs]
    if (have_in, have_out) != (want_in, want_out):
        raise CheckError(f"{mf.label}: inputs {have_in} and outputs {have_out} are not the {name} component's "
                         f"{want_in} and {want_out}; the file was changed after export: re-export the folder")


def component_feeds(rebuilt: Rebuilt, name: str, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """The component's own cases: two images (pixels of unit and of 4x the scale) for the vision encoder; the
    embedding merge of two prompts (one with the image's tokens, one without); Qwen3-VL's decoder on a prompt
    whose image rows carry deepstack features and a decode step after it."""
    import torch

    from rope_export.hf.vlm.exporting import example_inputs

    example = example_inputs(rebuilt.model, rebuilt.kind, rebuilt.geometry, rebuilt.layout, seed)
    if name == "vision":
        (pixels,) = example["vision"]
        return [{"pixel_values": _np(pixels)}, {"pixel_values": _np(4 * pixels)}]
    if name == "embedding":
        ids, features = example["embedding"]
        text_only = ids.clone()
        text_only[text_only == ids[0, 2]] = ids[0, 0]
        return [{"input_ids": ids.numpy(), "image_features": _np(features)},
                {"input_ids": text_only[:, :5].numpy(), "image_features": _np(features[:0])}]
    from rope_export.hf.vlm.components import io_names

    names = io_names(rebuilt.kind, rebuilt.layout)["decoder"][0]
    prefill = list(example["decoder"])
    first_past = len(names) - len(rebuilt.layout.input_names())
    prefill[first_past:] = [t[:, :, :0] if t.dim() == 4 else t for t in prefill[first_past:]]
    prefill[2] = torch.ones(prefill[0].shape[0], prefill[0].shape[1], dtype=torch.long)
    return [dict(zip(names, map(_np, tensors), strict=True)) for tensors in (prefill, example["decoder"])]


def _np(tensor) -> np.ndarray:
    import torch

    return tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


class _Scratch:
    """npz feeds for ``check``'s --inputs, in a folder removed with this object."""

    def __init__(self, feeds: list[dict[str, np.ndarray]], name: str):
        self._dir = tempfile.TemporaryDirectory(prefix="rope-export-vlm-")
        self.paths = []
        for i, feed in enumerate(feeds):
            path = Path(self._dir.name) / f"{name}-prompt{i}.npz"
            np.savez(path, **feed)
            self.paths.append(str(path))


def component_reference(mf: ModelFile, *, weights=None, seed=None, random_weights=False,
                        rebuilt: Rebuilt | None = None):
    """(the transformers module to compare with, notes, --inputs feeds or None, a scratch folder to keep alive)."""
    name = vlm_record(mf)["component"]
    rebuilt = rebuilt or rebuild(mf, weights=weights, seed=seed, random_weights=random_weights)
    _check_names(mf, rebuilt, name)
    notes = list(rebuilt.notes)
    scratch = None
    if name != "decoder" or rebuilt.kind.decoder_extras:
        scratch = _Scratch(component_feeds(rebuilt, name), name)
        notes.append(f"{name}: compared on {WHY_OWN_CASES[name]}, not on the generated stress cases")
    return component_module(rebuilt, name), notes, scratch


# -- the folder: every component, then the pipeline ---------------------------------------------------------------

@dataclass
class PipelineReport:
    status: str  # "pass", "FAIL", "skipped"
    errors: dict[str, float] = field(default_factory=dict)  # step -> max |logits - transformers'|
    tolerance: str = ""
    tokens: list[int] = field(default_factory=list)  # greedy tokens (the file's)
    reference_tokens: list[int] = field(default_factory=list)
    reason: str = ""


@dataclass
class VLMCheckReport:
    folder: str
    components: dict  # name -> CheckReport
    pipeline: PipelineReport

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.components.values()) and self.pipeline.status == "pass"

    def failure_message(self) -> str:
        lines = [f"{name}: {r.failure_message()}" for name, r in self.components.items() if not r.passed]
        if self.pipeline.status != "pass":
            lines.append(f"pipeline: {self.pipeline.reason}")
        return "; ".join(lines)


def read_manifest(folder: Path) -> dict:
    from rope_export.hf.vlm.exporting import MANIFEST

    path = folder / MANIFEST
    if not path.is_file():
        raise CheckError(f"{folder} is a folder without {MANIFEST}: give an ONNX file, or a folder `rope-export export "
                         "--hf VLM_DIR -o OUT_DIR/` wrote")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = {name: folder / entry["file"] for name, entry in manifest["components"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckError(f"{path} is damaged ({exc}); re-export the folder") from None
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise CheckError(f"{folder}: components missing: {', '.join(missing)}; re-export the folder")
    manifest["paths"] = files
    return manifest


def check_folder(folder, runners, *, weights=None, seed=None, random_weights: bool = False, sweep: bool = True,
                 plugin_library=None, progress=None) -> VLMCheckReport:
    from rope_export.check.core import check

    say = progress or (lambda message: None)
    folder = Path(folder)
    manifest = read_manifest(folder)
    paths = manifest["paths"]
    say(f"rebuilding the transformers model {manifest.get('model_type', '')} the folder records")
    rebuilt = rebuild(ModelFile.open(paths["decoder"]), weights=weights, seed=seed, random_weights=random_weights)
    reports = {}
    for name, path in paths.items():
        say(f"checking the {name} component ({path.name})")
        module, notes, scratch = component_reference(ModelFile.open(path), rebuilt=rebuilt)
        reports[name] = check(path, runners, sweep=sweep, plugin_library=plugin_library, progress=say, module=module,
                              inputs=scratch.paths if scratch is not None else None)
        reports[name].notes[:0] = notes
        del scratch
    say("running the pipeline: image + prompt -> logits, then a decode step, against transformers")
    return VLMCheckReport(str(folder), reports, pipeline_check(paths, rebuilt))


def _session(path: Path):
    import onnx
    import onnxruntime as ort

    from rope_export.passes import lower

    options = ort.SessionOptions()
    options.log_severity_level = 3
    model = lower(onnx.load(str(path)), "onnx")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def pipeline_check(paths: dict[str, Path], rebuilt: Rebuilt, steps: int = 1) -> PipelineReport:
    """The components run in order on onnxruntime against transformers' forward on the same image and prompt."""

    from rope_export.exporting.core import DTYPES
    from rope_export.hf.vlm import pipeline
    from rope_export.hf.vlm.components import io_names
    from rope_export.op.tolerances import for_layers, tolerance

    model, kind, layout = rebuilt.model, rebuilt.kind, rebuilt.layout
    dtype = {v: k for k, v in DTYPES.items()}[next(model.parameters()).dtype]
    layers = len(layout.layers)
    tol = for_layers(tolerance("block", DTYPES[dtype]), layers)
    try:
        sessions = {name: _session(path) for name, path in paths.items()}
    except Exception as exc:  # noqa: BLE001 - a component onnxruntime cannot load fails the pipeline, named
        return PipelineReport("FAIL", reason=f"onnxruntime cannot load the components: {str(exc).splitlines()[0]}")
    prompt = pipeline.image_prompt(model, kind, rebuilt.geometry)
    want, want_tokens = pipeline.transformers_run(model, kind, prompt, steps)
    names = io_names(kind, layout)
    features = sessions["vision"].run(None, {"pixel_values": _np(prompt.pixel_values)})
    ids = prompt.input_ids.numpy()
    positions, deltas = pipeline.positions(model, kind, prompt)
    batch = 1
    past = [np.zeros(shape, np.float32 if dtype == "fp32" else np.float16) for io in layout.layers
            for shape in io.shapes(batch, 0)]
    report = PipelineReport("pass", tolerance=f"atol {tol.atol:g}, rtol {tol.rtol:g} (decoder: one block's x "
                                              f"sqrt({layers}))", reference_tokens=want_tokens)
    step_features = features
    for step in range(steps + 1):
        merged = sessions["embedding"].run(None, {"input_ids": ids, "image_features": step_features[0]})
        total = ids.shape[1] + (past[0].shape[2] if past else 0)
        feeds = [merged[0], positions.numpy(), np.ones((batch, total), np.int64), *merged[1:], *step_features[1:],
                 *past]
        out = sessions["decoder"].run(None, dict(zip(names["decoder"][0], feeds, strict=True)))
        error = float(np.abs(out[0].astype(np.float64) - want[step].float().numpy()).max())
        report.errors["prefill" if step == 0 else f"decode step {step}"] = error
        if not tol.allclose(out[0], want[step].float().numpy()):
            report.status = "FAIL"
        token = int(out[0][0, -1].argmax())
        report.tokens.append(token)
        past = out[1:]
        ids = np.array([[want_tokens[step]]], dtype=np.int64)  # transformers' token: both sides see the same prompt
        positions = pipeline.step_positions(kind, deltas, total)
        step_features = [features[0][:0], *(f[:, :0] for f in features[1:])]  # no image rows after the prompt
    if report.status == "FAIL":
        worst = max(report.errors, key=report.errors.get)
        report.reason = (f"logits differ from transformers' by {report.errors[worst]:.3g} at the {worst} "
                         f"(tolerance {report.tolerance})")
    return report


def print_folder_report(report: VLMCheckReport, console) -> None:
    from rope_export.check.report import print_report
    from rope_export.common.tables import print_table
    from rope_export.common.tables import table as make_table

    for name, component in report.components.items():
        console.print(f"[bold]{name}[/bold]")
        print_report(component, console)
    table = make_table("pipeline: image + prompt -> logits, then a decode step, against transformers",
                       ["step", "max |logits error|", "verdict"])
    for step, error in report.pipeline.errors.items():
        table.add_row(step, f"{error:.3g}", report.pipeline.status)
    print_table(console, table)
    console.print(f"pipeline: {report.pipeline.status}; tolerance {report.pipeline.tolerance}; greedy tokens "
                  f"{report.pipeline.tokens} (transformers {report.pipeline.reference_tokens})")
    verdicts = ", ".join(f"{name} {'PASS' if r.passed else 'FAIL'}" for name, r in report.components.items())
    console.print(f"{verdicts}, pipeline {report.pipeline.status.upper()}")


FOLDER_OPTIONS = ("reference", "hf", "module", "inputs", "batch", "seq", "past", "long_seq", "memory_limit",
                  "max_in_memory", "piece_limit")


def run_folder_check(args, runners, console) -> int:
    """``rope-export check OUT_DIR/``: exit 0 when every component and the pipeline pass, 1 otherwise."""
    import sys

    from rope_export.check.report import write_reports
    from rope_export.common.steps import cli_steps

    given = [name for name in FOLDER_OPTIONS if getattr(args, name, None) not in (None, False)]
    if given:
        raise CheckError(f"--{given[0].replace('_', '-')} is for one file; check a component file of the folder "
                         "with it")
    with cli_steps(console, "check: time and peak RSS per step", args.summary_json) as progress:
        report = check_folder(args.model, runners, weights=args.weights, seed=args.seed,
                              random_weights=args.random_weights, sweep=not args.no_sweep, plugin_library=args.plugin,
                              progress=progress)
    print_folder_report(report, console)
    if args.report:
        for name, component in report.components.items():
            for path in write_reports(component, Path(args.report) / name):
                console.print(f"wrote {path}")
    if not report.passed:
        print(f"rope-export check: FAIL: {report.failure_message()}", file=sys.stderr)
        return 1
    return 0
