"""The tasks ``export --hf`` exports: one registry, ``TASKS``, one entry per task (as transformers'
``ROPE_INIT_FUNCTIONS``), and the choice of task for a folder.

An entry names the task's Auto class and the transformers mapping its model classes come from
(``MODEL_FOR_*_MAPPING_NAMES``: model_type -> class), the output fields the file returns, and the
function that makes its files (``components``: the wrapper of each file, its example inputs, I/O
names and dynamic axes, ``rope_export.hf.task_io``); run eagerly, each wrapper is the reference
``rope-export check`` compares that file with. Adding a task is adding an entry; a task of several
files (an encoder and a decoder step, a vision tower and a decoder) is an entry whose ``components``
returns several. ``causal-lm`` has no ``components``: it is ``export_hf``'s path, as it always was.

The task of a folder (``select_task``): ``--task`` when given; else the class its ``architectures``
names (what ``save_pretrained`` recorded), found in one task's mapping; else what the config implies:
a causal LM where transformers has one for the type (rope-export's default, unchanged), else the
type's speech-to-text or text-to-text model, else its base model (feature extraction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rope_export.hf.errors import HFExportError
from rope_export.hf.families import MODEL_TYPES

CAUSAL_LM = "causal-lm"
TASK_KIND = "hf-task"  # the files' rope_export.kind (check picks its reference by it)


@dataclass(frozen=True)
class Task:
    name: str
    auto_class: str  # transformers' Auto class of the task
    mapping: str  # transformers.models.auto.modeling_auto's MODEL_*_MAPPING_NAMES: model_type -> class name(s)
    outputs: tuple[str, ...]  # the output fields the file returns, in order (those the model's output holds)
    components: Callable | None  # (model, outputs, dims, seed) -> [task_io.Component]; None: export_hf's causal LM
    summary: str
    parts: tuple[str, ...] = ("model",)  # the components' names: more than one is a folder of NAME.onnx files


def _single_file(model, outputs, dims=None, seed=0):
    from rope_export.hf.task_io import single_file

    return single_file(model, outputs, dims, seed)


def _encoder_decoder(model, outputs, dims=None, seed=0):
    from rope_export.hf.task_io import encoder_decoder

    return encoder_decoder(model, outputs, dims, seed)


def _task(name, auto_class, mapping, outputs, summary, components=_single_file) -> Task:
    parts = ("encoder", "decoder") if components is _encoder_decoder else ("model",)
    return Task(name, auto_class, f"MODEL_{mapping}MAPPING_NAMES", tuple(outputs), components, summary, parts)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        _task(CAUSAL_LM, "AutoModelForCausalLM", "FOR_CAUSAL_LM_", ["logits"],
              "the causal LM with its KV cache (the default wherever transformers has one)", components=None),
        _task("feature-extraction", "AutoModel", "", ["last_hidden_state", "pooler_output"],
              "the base model: token ids, audio or pixels (and mask) in, hidden states (and pooled output) out"),
        _task("fill-mask", "AutoModelForMaskedLM", "FOR_MASKED_LM_", ["logits"], "masked-LM logits"),
        _task("text-classification", "AutoModelForSequenceClassification", "FOR_SEQUENCE_CLASSIFICATION_",
              ["logits"], "one row of class logits per sequence (also rerankers)"),
        _task("token-classification", "AutoModelForTokenClassification", "FOR_TOKEN_CLASSIFICATION_", ["logits"],
              "class logits per token"),
        _task("question-answering", "AutoModelForQuestionAnswering", "FOR_QUESTION_ANSWERING_",
              ["start_logits", "end_logits"], "extractive QA: start and end logits per token"),
        _task("text-encoding", "AutoModelForTextEncoding", "FOR_TEXT_ENCODING_", ["last_hidden_state"],
              "the encoder of an encoder-decoder model alone"),
        _task("ctc", "AutoModelForCTC", "FOR_CTC_", ["logits"], "speech recognition by CTC: logits per audio frame"),
        _task("audio-classification", "AutoModelForAudioClassification", "FOR_AUDIO_CLASSIFICATION_", ["logits"],
              "class logits per clip"),
        _task("audio-frame-classification", "AutoModelForAudioFrameClassification",
              "FOR_AUDIO_FRAME_CLASSIFICATION_", ["logits"], "class logits per audio frame"),
        _task("speech-to-text", "AutoModelForSpeechSeq2Seq", "FOR_SPEECH_SEQ_2_SEQ_", ["logits"],
              "speech encoder-decoder: encoder.onnx (audio in) and decoder.onnx (one step with its cache)",
              components=_encoder_decoder),
        _task("text2text-generation", "AutoModelForSeq2SeqLM", "FOR_SEQ_TO_SEQ_CAUSAL_LM_", ["logits"],
              "text encoder-decoder: encoder.onnx and decoder.onnx (one step with its cache)",
              components=_encoder_decoder),
    )
}

# what a config without (known) architectures implies, in this order after the causal LM
IMPLIED = ("speech-to-text", "text2text-generation", "feature-extraction")


@dataclass(frozen=True)
class TaskChoice:
    task: Task
    model_class: str | None  # the transformers class to build (None: export_hf's own choice, for causal-lm)
    reason: str  # how it was chosen, for the summary

    @property
    def build_class(self) -> str | None:
        return self.model_class if self.task.name != CAUSAL_LM else None


def classes(task: Task, model_type: str) -> tuple[str, ...]:
    """The transformers classes of ``task`` for ``model_type`` (empty when transformers has none)."""
    from transformers.models.auto import modeling_auto

    value = getattr(modeling_auto, task.mapping, {}).get(model_type)
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def tasks_of(model_type: str) -> list[str]:
    """The tasks transformers has a class of ``model_type`` for."""
    return [name for name, task in TASKS.items() if classes(task, model_type)]


def task_of_class(class_name: str, model_type: str) -> Task | None:
    """The task whose mapping holds ``class_name`` for ``model_type``, a head's task before the base model's
    (transformers' AutoModel maps some types to a head class: parakeet_ctc to ParakeetForCTC)."""
    order = [t for t in TASKS.values() if t.name != "feature-extraction"] + [TASKS["feature-extraction"]]
    return next((task for task in order if class_name in classes(task, model_type)), None)


def _has_causal_lm(model_type: str) -> bool:
    return model_type in MODEL_TYPES or bool(classes(TASKS[CAUSAL_LM], model_type))


def select_task(config, task: str | None = None) -> TaskChoice:
    """The task and model class to export ``config``'s model as (see the module's doc)."""
    import transformers

    model_type = config.model_type
    architecture = next(iter(getattr(config, "architectures", None) or []), None)
    if task is not None:
        if task not in TASKS:
            raise HFExportError(f"unknown --task {task!r}; known: {', '.join(TASKS)}")
        found = classes(TASKS[task], model_type)
        if not found:
            raise HFExportError(f"transformers {transformers.__version__} has no {task} model for model_type "
                                f"{model_type!r}; its tasks: {', '.join(tasks_of(model_type)) or 'none'}")
        chosen = architecture if architecture in found else found[0]
        return TaskChoice(TASKS[task], chosen, f"--task {task}")
    if architecture is not None:
        found = task_of_class(architecture, model_type)
        if found is not None:
            return TaskChoice(found, architecture, f"architectures: {architecture}")
        if hasattr(transformers, architecture) and not _has_causal_lm(model_type):
            raise HFExportError(
                f"the config's architectures names {architecture}, which no task of rope-export builds (tasks: "
                f"{', '.join(TASKS)}); pass --task with one of {model_type!r}'s: "
                f"{', '.join(tasks_of(model_type)) or 'none'}")
    if _has_causal_lm(model_type):
        return TaskChoice(TASKS[CAUSAL_LM], None, "a causal LM (the default)")
    for name in IMPLIED:
        found = classes(TASKS[name], model_type)
        if found:
            why = f"architectures {architecture} is not a transformers class" if architecture else "no architectures"
            return TaskChoice(task_of_class(found[0], model_type), found[0],
                              f"implied by model_type {model_type!r} ({why})")
    raise HFExportError(f"model_type {model_type!r}: transformers {transformers.__version__} has no class for any "
                        f"task rope-export exports ({', '.join(TASKS)})")
