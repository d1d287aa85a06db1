"""Parameters as views of a memory-mapped .safetensors checkpoint (``rope_export.hf.checkpoints``
builds with it).

Reading 5 GB into freshly allocated memory took 10 s of a 1B fp32 export on this machine; mapping the
file takes none. The mapping is copy-on-write: a parameter changed in place changes the process's
copy of that page, never the file. Each mapping is remembered by ``rope_export.files.mapped``, so that the
writer copies an unchanged tensor from the file itself (no page of it faulted in) and gives back the
pages the export did touch once their tensor is written.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

from rope_export.files.mapped import remember


def map_safetensors(model: nn.Module, plan: dict, dtype: torch.dtype) -> set[str]:
    """Each meta parameter whose .safetensors tensor (``plan``: name -> entry with ``file``, ``dtype``,
    ``shape``, absolute ``start``; a .bin entry has ``start`` < 0) is stored in the dtype it takes becomes a
    view of the mapped file; tied parameters stay one. Returns the checkpoint names so placed; the caller
    reads the rest (converted dtypes, misaligned tensors, .bin files)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    maps: dict[Path, mmap.mmap] = {}
    made: dict[int, nn.Parameter] = {}
    names: set[str] = set()
    for name, entry in plan.items():
        param = params.get(name)
        count = math.prod(entry.shape)
        if param is None or param.device.type != "meta" or entry.start < 0 or not count:
            continue
        want = dtype if param.dtype.is_floating_point else param.dtype
        if want != entry.dtype or entry.start % entry.dtype.itemsize:
            continue  # converted, or misaligned for its dtype: read
        if id(param) not in made:
            if entry.file not in maps:
                with open(entry.file, "rb") as f:
                    maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                remember(maps[entry.file], entry.file)
            view = torch.frombuffer(maps[entry.file], dtype=entry.dtype, count=count,
                                    offset=entry.start).view(entry.shape)
            made[id(param)] = nn.Parameter(view, requires_grad=param.requires_grad)
        names.add(name)
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in made:
                module._parameters[key] = made[id(param)]
    return names
