"""Export Hugging Face transformers models through the rotary op: one rotary node per rotation.

Any RoPE causal LM of transformers exports by default: the rotary function(s) its attention calls
are found by reading the code the model runs and verified numerically against the op contract's
forms (``rope_export.detect``), then routed through ``torch.ops.rope_export.rotary_embedding``
during the export and restored afterwards; when none verifies, the plain export is fused. Every
export compares the rotations transformers performs in one eager forward with the rotary nodes of
the file. The modules:

* ``families``: what detection cannot see about some model types (Auto class, position rank, how
  to read the RoPE parameters, the form ``--hf-family`` insists on);
* ``loading``: building a model offline from a local config and weights;
* ``hooking``: the rotary hook on the model's own functions, and the guard that keeps the model
  unchanged;
* ``cache_io``: per-layer cache geometry, the wrappers with flat past/present tensors (and an
  optional attention_mask input), and the few places that know transformers' calling conventions
  (the cache keyword, the attention layers, the rotary module and its position embeddings);
* ``kv_buffer``: the cache as preallocated buffers updated in place (``export_hf(kv_buffer=True)``);
* ``counting``: the eager rotation count against the file;
* ``metadata``: the ``rope_export.*`` metadata, and reading it back;
* ``checkpoint_files``, ``checkpoints``: checkpoint folders read tensor by tensor, models built with their
  weights in memory once;
* ``export``: ``export_hf`` (the command: ``rope_export.cli.export_hf``);
* ``tasks``, ``task_io``, ``task_export``, ``task_patches``: other tasks than the causal LM (encoders, embedders,
  speech, encoder-decoders): the registry ``TASKS`` and ``select_task``, each task's files, ``export_task``
  (the command: ``rope_export.cli.export_task``; docs/tasks.md).

transformers is imported lazily: the package imports without it.
"""

from rope_export.detect.forms import FORMS, rotate_half_qk
from rope_export.hf.cache_io import (
    AttentionWithCache,
    CacheLayout,
    CausalLMWithCache,
    LayerIO,
    attention_layers,
    cache_keyword,
    cache_layout,
    hf_example_inputs,
    hf_io_names,
    make_cache,
    position_embeddings,
    returned_cache,
    rotary_module,
    with_cache,
)
from rope_export.hf.errors import HFExportError
from rope_export.hf.export import FALLBACKS, HFExportResult, export_hf
from rope_export.hf.families import HF_FAMILIES, MODEL_TYPES, HFFamily, family_of, rope_config_from_hf, text_config
from rope_export.hf.hooking import HookState, model_state_kept, rotary_hooked
from rope_export.hf.loading import build_hf_model, load_hf_config
from rope_export.hf.metadata import hf_metadata, read_hf_metadata
from rope_export.hf.task_export import TaskExportResult, export_task
from rope_export.hf.tasks import TASKS, Task, TaskChoice, select_task

__all__ = [
    "FALLBACKS",
    "FORMS",
    "HF_FAMILIES",
    "MODEL_TYPES",
    "AttentionWithCache",
    "CacheLayout",
    "CausalLMWithCache",
    "HFExportError",
    "HFExportResult",
    "HFFamily",
    "HookState",
    "TASKS",
    "Task",
    "TaskChoice",
    "TaskExportResult",
    "LayerIO",
    "attention_layers",
    "build_hf_model",
    "cache_keyword",
    "cache_layout",
    "export_hf",
    "export_task",
    "family_of",
    "hf_example_inputs",
    "hf_io_names",
    "hf_metadata",
    "load_hf_config",
    "make_cache",
    "model_state_kept",
    "position_embeddings",
    "read_hf_metadata",
    "returned_cache",
    "rope_config_from_hf",
    "rotary_hooked",
    "rotary_module",
    "rotate_half_qk",
    "select_task",
    "text_config",
    "with_cache",
]
