"""``check OUT_DIR/``: a vision-language export folder, each component (``check.vlm``'s reference, every runner),
then the whole pipeline on onnxruntime (each component lowered to the ``onnx`` target): the vision encoder on an
image, the merge into a prompt's embeddings, the decoder with the positions a serving stack computes
(``hf.vlm.pipeline``), then one greedy decode step fed the returned cache; its logits against transformers'
forward on the same image and prompt, by the decoder's tolerance (one block's, times sqrt(layers)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rope_export.check.model_file import CheckError, ModelFile
from rope_export.check.vlm import Rebuilt, _np, component_reference, rebuild


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


def folder_verdict_line(report: VLMCheckReport) -> str:
    """The one line that ends ``check OUT_DIR/``: each component's verdict (``check.report.verdict_line`` without its
    PASS/FAIL) and the pipeline's; on FAIL only what failed, and how many components pass."""
    from rope_export.check.report import verdict_line

    def body(component) -> str:
        return verdict_line(component).split(": ", 1)[1]

    pipeline = report.pipeline
    if report.passed:
        parts = [f"{name}: {body(r)}" for name, r in report.components.items()]
        parts.append(f"pipeline: logits match transformers' at the {', '.join(pipeline.errors)}")
        return "PASS: " + "; ".join(parts)
    failing = [(name, r) for name, r in report.components.items() if not r.passed]
    parts = [f"{name}: {body(r)}" for name, r in failing]
    if pipeline.status != "pass":
        parts.append(f"pipeline {pipeline.status}: {pipeline.reason}")
    passing = len(report.components) - len(failing)
    return f"FAIL: {'; '.join(parts)}; {passing} of {len(report.components)} components pass"
