"""transformers code that torch.export traces into a file that is wrong at other sizes, and what is traced instead.

torch.export checks the guards on a dynamic dim, but not those on a float computed from it: a model
that computes a length as ``int(length / stride + 1)`` gets the example's length baked into the
graph, silently (a file that runs only at the example's size). ``export_task`` runs every traced
program at a second size against transformers (``task_export``), which refuses such a file; the
entries here make the known cases traceable: during the export only, each swaps a method for one
that computes the same integers with integer ops (``//``), which torch.export keeps symbolic. The
swap is an attribute of the model's module, removed afterwards (``model_state_kept``), and
``tests/hf/test_hf_tasks.py`` proves each replacement equal to transformers' own for every length it serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn


def moonshine_output_length(length):
    """Moonshine's ``_get_feat_extract_output_lengths`` with floor divisions: its three convolutions' lengths
    (kernel 127 stride 64, kernel 7 stride 3, kernel 3 stride 2). transformers computes each as
    ``int((n - kernel) / stride + 1)``, the same integer wherever the input is long enough for one frame
    (n >= kernel at every step; shorter audio fails in the convolutions anyway)."""
    length = (length - 127) // 64 + 1
    length = (length - 7) // 3 + 1
    return (length - 3) // 2 + 1


# model_type -> (module class name, method name, replacement, why)
PATCHES: dict[str, tuple[str, str, Callable, str]] = {
    "moonshine": ("MoonshineEncoder", "_get_feat_extract_output_lengths", moonshine_output_length,
                  "its encoder's mask length is int() of a float division, which torch.export fixes to the example's"),
}


@contextlib.contextmanager
def trace_patched(model: nn.Module) -> Iterator[list[str]]:
    """The model's entry of ``PATCHES`` applied to its modules for the block (the notes say what was swapped)."""
    entry = PATCHES.get(model.config.model_type)
    if entry is None:
        yield []
        return
    class_name, method, replacement, why = entry
    patched = [m for m in model.modules() if type(m).__name__ == class_name]
    for module in patched:
        setattr(module, method, replacement)
    try:
        yield [f"{class_name}.{method} traced with integer divisions ({why})"] if patched else []
    finally:
        for module in patched:
            vars(module).pop(method, None)
