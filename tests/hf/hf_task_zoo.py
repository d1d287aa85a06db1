"""The task zoo's harness: every RoPE model type of transformers that is not a causal LM, exported by default.

``candidates()`` are the model types whose modeling file has rotary code (the causal-LM zoo's test,
``test_hf_zoo._rope_source``) and that the causal-LM zoo does not hold; ``excluded()`` says, by rule
and each with its reason, which of them this zoo leaves to another (a causal LM, a vision-language
model) or cannot build. Whether a candidate rotates at all is the eager census's call:
``export_task`` counts the rotations of one eager forward and refuses a model that performs none.

``check_type(model_type)`` builds the type's tiny config (``hf_zoo_configs``' shrink, applied to every
sub-config too), picks the task as ``export --hf`` would for a config without architectures, exports
it with default flags and runs ``rope-export check`` on every file (onnxruntime on the ``onnx``
lowering, against transformers' forward rebuilt from the file's metadata, on padded batches).
"""

from __future__ import annotations

import functools
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hf_zoo_configs import SHRINK, VOCAB, ZOO_TYPES, _token_ids, rotary_source
from transformers import AutoConfig

from rope_export import hf
from rope_export.hf.task_export import export_task
from rope_export.hf.tasks import CAUSAL_LM, IMPLIED, TASKS, TaskChoice, classes, task_of_class

# fields of encoders, decoders, audio and vision towers, shrunk where a (sub-)config has them
TASK_SHRINK = {
    **SHRINK,
    "encoder_num_hidden_layers": 2, "decoder_num_hidden_layers": 2, "encoder_num_attention_heads": 4,
    "decoder_num_attention_heads": 4, "encoder_num_key_value_heads": 4, "decoder_num_key_value_heads": 2,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_layers": 2, "depth": 2, "num_heads": 4,
    "image_size": 32, "patch_size": 8, "num_key_value_heads": 4,
}

# model_type -> overrides (constructor keywords), for what the shrink cannot know
OVERRIDES: dict[str, dict] = {
    "esm": dict(position_embedding_type="rotary", pad_token_id=1, mask_token_id=2),
    "moonshine": dict(partial_rotary_factor=0.5, pad_token_id=0),
    "wav2vec2-conformer": dict(position_embeddings_type="rotary"),
    "wav2vec2-bert": dict(position_embeddings_type="rotary"),
    "seamless_m4t": dict(position_embeddings_type="rotary"),
    "neomme": dict(head_dim=16),  # its global layers rotate a quarter of the head: 4 channels
    "glm_image_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
    "modernbert": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
}

# types whose rotations the eager census does not see, so the export's "performs no RoPE" is not the truth: recorded
# as expected failures with the reason (a gap of rope_export.detect, left for it)
CENSUS_MISSES = {
    "roformer": "the eager census counts none of RoFormer's q/k rotations (a static method that builds interleaved "
                "pairs with torch.stack(...).reshape_as, a spelling rope_export.detect does not follow)",
}

MULTIMODAL = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")


def _shrunk(values: dict) -> dict:
    """``values`` (a config's to_dict) with every size of TASK_SHRINK it has made tiny, sub-configs included."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = {"model_type": value["model_type"], **_shrunk(value)}
        elif key in TASK_SHRINK:
            out[key] = TASK_SHRINK[key]
    tokens = {k: min(v, VOCAB - 1) if isinstance(v, int) and not isinstance(v, bool) else v
              for k, v in values.items() if k.endswith("token_id") and v is not None and "vocab_size" in values}
    return {**out, **tokens}


def tiny_config(model_type: str, **extra):
    default = AutoConfig.for_model(model_type)
    values = {k: v for k, v in default.to_dict().items() if k != "model_type"}
    kwargs = {**_shrunk(values), **_token_ids(default, VOCAB), **OVERRIDES.get(model_type, {}), **extra}
    return AutoConfig.for_model(model_type, **kwargs)


# -- which types --------------------------------------------------------------------------------

# a causal-LM class that is not what the type is: the causal-LM zoo leaves these out, this zoo holds them
ENCODERS_WITH_A_CAUSAL_HEAD = {"roformer": "an encoder; RoFormerForCausalLM is its decoder head for seq2seq"}


@functools.cache
def candidates() -> frozenset[str]:
    """Model types outside the causal-LM zoo with a class (of any task) whose modeling file has rotary code."""
    from transformers.models.auto import modeling_auto

    names: dict[str, set[str]] = {}
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            for model_type, value in mapping.items():
                names.setdefault(model_type, set()).update([value] if isinstance(value, str) else value)
    return frozenset(t for t, found in names.items()
                     if t not in ZOO_TYPES and any(rotary_source(c) for c in sorted(found)))


def excluded_by_rule(model_type: str) -> str | None:
    """Why the task zoo does not hold a candidate type (None: it does)."""

    if classes(TASKS[CAUSAL_LM], model_type) and model_type not in ENCODERS_WITH_A_CAUSAL_HEAD:
        return "a causal LM: export --hf's default path; the causal-LM zoo holds it or says why not"
    if zoo_task(model_type) is None:
        return "no transformers class of a task rope-export exports (its classes are for other heads)"
    if _vision_language(model_type):
        return "a vision-language model (image-text-to-text): the multi-component VLM export (issue 37)"
    wrapper = _towers().get(model_type)
    if wrapper is not None:
        return f"a tower of the vision-language model {wrapper}: the multi-component VLM export (issue 37)"
    return None


def _vision_language(model_type: str) -> bool:
    from transformers.models.auto import modeling_auto

    seq2seq = any(classes(TASKS[name], model_type) for name in ("speech-to-text", "text2text-generation"))
    return not seq2seq and any(model_type in getattr(modeling_auto, m) for m in MULTIMODAL)


@functools.cache
def _towers() -> dict[str, str]:
    """Sub-config model types (vision, text, audio towers) of the vision-language models -> that model."""
    from transformers.models.auto import modeling_auto

    found = {}
    for mapping in MULTIMODAL:
        for wrapper in getattr(modeling_auto, mapping):
            if not _vision_language(wrapper):
                continue
            try:
                values = AutoConfig.for_model(wrapper).to_dict()
            except Exception:  # noqa: BLE001, S112 - a wrapper whose default config does not build names no tower
                continue
            for value in values.values():
                if isinstance(value, dict) and isinstance(value.get("model_type"), str):
                    found.setdefault(value["model_type"], wrapper)
    return found


def zoo_types() -> list[str]:
    return sorted(t for t in candidates() if excluded_by_rule(t) is None)


def excluded() -> dict[str, str]:
    """Every candidate the zoo leaves out -> why."""
    return {t: why for t in sorted(candidates()) if (why := excluded_by_rule(t)) is not None}


def zoo_task(model_type: str) -> str | None:
    """The task a config of the type without architectures exports as (``tasks.select_task``), the causal LM aside:
    speech-to-text, text-to-text, the base model (or the head AutoModel maps it to), else the first task
    transformers has a class of it for."""
    order = [*IMPLIED, *(name for name in TASKS if name not in IMPLIED and name != CAUSAL_LM)]
    found = next((classes(TASKS[name], model_type)[0] for name in order if classes(TASKS[name], model_type)), None)
    return None if found is None else task_of_class(found, model_type).name


# -- one type -----------------------------------------------------------------------------------

@dataclass
class TaskZooResult:
    model_type: str
    status: str  # "pass", "refused" (a clear HFExportError), "fail" (anything else)
    task: str = ""
    files: str = ""  # the components written
    reason: str = ""
    rotations: int = 0
    rotary_nodes: int = 0
    how: str = ""
    max_error: float = 0.0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


def _how(hooks: list[str]) -> str:
    """"hook: FORM, ..." from the files' hook descriptions ("... -> rope_export::RotaryEmbedding (FORM, ...)"), or
    "fuse" where no hook ran."""
    forms = sorted({m.group(1) for hook in hooks for m in re.finditer(r"RotaryEmbedding \(([\w-]+)", hook)})
    return ("hook: " + ", ".join(forms)) if forms else "fuse"


def check_files(result, folder: Path) -> float:
    """``rope-export check`` on every file (onnxruntime on the onnx lowering, no sweep): every case passes."""
    from rope_export.check import check

    worst = 0.0
    for file in result.files:
        report = check(file.path, runners=("onnxruntime-cpu",), sweep=False)
        runner = report.runners[0]
        assert runner.status == "pass", f"{file.component}: check {runner.status}: {runner.note or report.notes}"
        worst = max([worst, *(s.max_abs for stats in runner.cases.values() for s in stats)])
    return worst


def check_type(model_type: str, folder: Path | None = None) -> TaskZooResult:
    """Build, export with default flags, check every file; the result says what happened."""
    start = time.perf_counter()
    result = TaskZooResult(model_type, "fail")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        try:
            config = tiny_config(model_type)
            task = TASKS[zoo_task(model_type)]
            found = [c for name in (*IMPLIED, task.name) for c in classes(TASKS[name], model_type)]
            choice = TaskChoice(task, next(c for c in found if c in classes(task, model_type)), "the task zoo")
            result.task = task.name
            model = hf.build_hf_model(config, random_weights=True, model_class=choice.build_class)
        except Exception as exc:  # noqa: BLE001 - the zoo records every outcome
            result.reason = f"the tiny config does not build: {type(exc).__name__}: {_first(exc)}"
            return result
        output = Path(tmp) / ("out" if len(choice.task.parts) > 1 else "model.onnx")
        try:
            exported = export_task(model, choice.task, output)
        except hf.HFExportError as exc:
            result.status, result.reason = "refused", _first(exc)
            if model_type in CENSUS_MISSES and "performs no rotary position embedding" in result.reason:
                result.status, result.reason = "fail", f"{CENSUS_MISSES[model_type]}: refused as {result.reason}"
            result.seconds = time.perf_counter() - start
            return result
        except Exception as exc:  # noqa: BLE001
            result.reason = f"{type(exc).__name__}: {_first(exc)}"
            result.seconds = time.perf_counter() - start
            return result
        result.files = ", ".join(f.component for f in exported.files)
        result.rotations, result.rotary_nodes = exported.rotations, exported.rotary_nodes
        result.how = _how([f.hook for f in exported.files])
        try:
            assert result.rotary_nodes == result.rotations > 0, \
                f"{result.rotations} eager rotations but {result.rotary_nodes} rotary nodes"
            result.max_error = check_files(exported, Path(tmp))
            result.status = "pass"
        except AssertionError as exc:
            result.reason = _first(exc)
        except Exception as exc:  # noqa: BLE001
            result.reason = f"{type(exc).__name__}: {_first(exc)}"
    result.seconds = time.perf_counter() - start
    return result


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
