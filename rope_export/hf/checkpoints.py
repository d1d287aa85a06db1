"""Build transformers models with their weights in memory once, in the requested dtype.

``build_causal_lm(auto_class, config, dtype, weights=DIR or None, seed=...)``:

* The model is constructed with its parameters on the meta device (no memory; buffers such as
  the rotary ``inv_freq`` are computed for real), then every parameter is allocated once, in
  ``dtype``, with tied parameters kept tied. ``from_config`` instead allocates an untied
  ``lm_head`` that tying then drops: half a gigabyte of transient memory for a 1B Llama.
* Random weights (no ``weights``): transformers' own ``init_weights`` under ``seed``.
* A checkpoint folder as ``save_pretrained`` writes it (``model.safetensors``, or shards listed in
  ``model.safetensors.index.json``) is read tensor by tensor straight into the parameters: a
  tensor stored in ``dtype`` is read into the parameter's memory, another dtype (bf16 weights
  exported as fp16, or fp32 ones) is converted in chunks of ``CHUNK_BYTES``. A .safetensors tensor
  already in ``dtype`` is not read at all: the parameter is a view of the file, memory-mapped
  copy-on-write (``rope_export.hf.checkpoint_map``; the writer copies it from the file,
  ``rope_export.files.mapped``).
  Nothing goes through float32 and no tensor exists twice. PyTorch ``pytorch_model.bin`` files
  (sharded or not) are memory-mapped one file at a time and copied into the parameters (the mapped
  pages are the file's, dropped after it).
  A checkpoint whose names or shapes do not match the model one to one (renamed keys, fused
  experts, quantized weights) is loaded by transformers' ``from_pretrained`` instead, and
  ``LoadReport.loader`` says so; what even transformers cannot place (tensors missing, unexpected
  or of other shapes: the checkpoint of another model) is a ``CheckpointMismatchError`` naming
  them, never a model with freshly initialized weights. That is decided from the headers' names and
  shapes (``rope_export.hf.checkpoint_fit``, transformers' own renaming rules) before any tensor data is
  read; so is a tensor whose bytes lie past the end of its file.

transformers is imported by the caller (``rope_export.hf``) or lazily (``checkpoint_fit``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from rope_export.common.bounds import check_allocation, format_bytes
from rope_export.common.steps import detail
from rope_export.hf.checkpoint_files import (
    CheckpointError,
    Entry,
    bytes_of,
    check_extents,
    checkpoint_plan,
    first_line,
    mismatch,
    open_bin,
    read_converted,
    read_into,
    state_targets,
    without_ignored,
)
from rope_export.hf.checkpoint_fit import predicted_loading_info
from rope_export.hf.checkpoint_map import map_safetensors

NAMED = 3  # tensors named per kind in a mismatch message


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit the config (tensors missing, unexpected or of other shapes)."""


@dataclass
class LoadReport:
    """How the weights came in: ``loader`` is "random", "safetensors" or "pytorch" (ours), or "transformers"."""

    loader: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0
    mapped: int = 0  # tensors used in place from the memory-mapped file (stored in the dtype asked for)
    converted: dict[str, int] = field(default_factory=dict)  # "bf16->fp16": tensors converted
    reason: str = ""  # why transformers' loader was used


# -- construction without the weights ----------------------------------------------------

@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside the block, every parameter a module registers is moved to the meta device (buffers stay real)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        param = module._parameters.get(name)
        if param is not None and param.device.type != "meta":
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype inside the block (transformers builds and initializes under it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else old)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def materialize(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Allocate every meta parameter on the CPU (uninitialized), tied ones once; returns bytes allocated.

    ``dtype``: for floating-point parameters (others keep theirs)."""
    made: dict[int, nn.Parameter] = {}
    total = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                kind = dtype if dtype is not None and param.dtype.is_floating_point else param.dtype
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=kind), requires_grad=param.requires_grad)
                total += made[id(param)].nbytes
            module._parameters[name] = made[id(param)]
    return total


def build_causal_lm(auto_class, config, dtype: torch.dtype, *, weights: str | os.PathLike | None = None,
                    seed: int = 0, options: dict | None = None,
                    progress: Callable[[str], None] | None = None) -> tuple[nn.Module, LoadReport]:
    """``auto_class``'s model of ``config`` in ``dtype``: random (``seed``) or from the folder ``weights``.

    ``options``: keyword arguments of ``from_config``/``from_pretrained`` (default: eager attention)."""
    options = {"attn_implementation": "eager", **(options or {}), "dtype": dtype}
    if weights is not None:
        plan = checkpoint_plan(Path(weights))
    # Sized first with everything on the meta device: a module may allocate a parameter on the CPU before
    # registering it (nn.Embedding does), so a vocab_size of 1e10 must be refused before the build below.
    with torch.device("meta"):
        sizing = auto_class.from_config(config, **options)
    check_allocation(f"the {config.model_type} model",
                     {"parameters and buffers": sum(t.numel() * t.element_size()
                                                    for t in (*sizing.parameters(), *sizing.buffers()))},
                     "check the config's sizes (vocab_size, hidden_size, num_hidden_layers, ...)")
    del sizing
    with parameters_on_meta():
        model = auto_class.from_config(config, **options)
    if weights is None:
        allocated = materialize(model, dtype)
        detail(progress, f"initializing {format_bytes(allocated)} of random weights")
        for part in (*model.modules(), *model.parameters()):  # from_config marked them done while on meta
            part.__dict__.pop("_is_hf_initialized", None)
        torch.manual_seed(seed)
        with default_dtype(dtype):  # as from_config: buffers such as GPT-J's sin/cos table come out the same
            model.init_weights()  # transformers' own initialization; also recomputes rotary buffers, re-ties
        return model.eval(), LoadReport("random")
    plan = without_ignored(model, plan)
    why = mismatch(model, plan)
    if why:
        # names and shapes decide before any tensor data is read: another model's checkpoint is refused now,
        # not after from_pretrained has loaded all of it
        predicted = predicted_loading_info(model, {name: entry.shape for name, entry in plan.items()})
        misfit = describe_misfit(predicted or {})
        del model
        if misfit:
            raise _misfit_error(Path(weights), misfit)
        check_extents(plan)
        detail(progress, f"loading with transformers' from_pretrained ({why})")
        model = _from_pretrained(auto_class, Path(weights), config, options)
        return model.eval(), LoadReport("transformers", reason=why)
    check_extents(plan)
    mapped = map_safetensors(model, plan, dtype)
    materialize(model, dtype)
    report = load_checkpoint(model, plan, progress, placed=mapped)
    return model.eval(), report


def _from_pretrained(auto_class, folder: Path, config, options: dict) -> nn.Module:
    """transformers' loader, for a checkpoint ours cannot read name by name (renamed or fused keys): it
    knows the renames; what even it cannot place is refused, never initialized at random."""
    with _quiet_transformers():
        try:
            model, info = auto_class.from_pretrained(str(folder), config=config, local_files_only=True,
                                                     output_loading_info=True, ignore_mismatched_sizes=True, **options)
        except (RuntimeError, OSError) as exc:  # its conversion errors and unreadable files
            raise CheckpointError(f"checkpoint {folder}: transformers cannot load it: {first_line(exc)}") from None
    misfit = describe_misfit(info)
    if misfit:
        raise _misfit_error(folder, misfit)
    return model


def _misfit_error(folder: Path, misfit: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(f"checkpoint {folder} does not fit the config: {misfit}; is it this model's "
                                   "checkpoint?")


def describe_misfit(info: dict) -> str:
    """from_pretrained's loading info as one clause ("" when every tensor found its place)."""

    def names(keys: list[str]) -> str:
        return ", ".join(keys[:NAMED]) + (", ..." if len(keys) > NAMED else "")

    parts = []
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())  # (name, checkpoint shape, model shape)
    if missing:
        parts.append(f"{len(missing)} tensor(s) missing ({names(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({names(unexpected)})")
    if mismatched:
        shapes = "; ".join(f"{name} is {list(ckpt)} in the checkpoint, {list(want)} in the model"
                           for name, ckpt, want in mismatched[:NAMED])
        parts.append(f"{len(mismatched)} of other shapes ({shapes}{', ...' if len(mismatched) > NAMED else ''})")
    return ", ".join(parts)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No load report (a table of every tensor) and no progress bar from from_pretrained: a checkpoint that
    does not fit becomes one line of ours."""
    import logging

    from transformers.utils import logging as hf_logging

    # tensor_parallel too: transformers 5.24 checks its TP plan (and warns) when modeling_utils' level is >= WARNING
    loggers = [logging.getLogger(f"transformers.{name}") for name in ("modeling_utils", "distributed.tensor_parallel")]
    levels, bars = [logger.level for logger in loggers], hf_logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_checkpoint(model: nn.Module, plan: dict[str, Entry] | str | os.PathLike,
                    progress: Callable[[str], None] | None = None, *, placed: set[str] = frozenset()) -> LoadReport:
    """Read the checkpoint's tensors into ``model``'s allocated parameters and buffers, in their dtypes
    (``placed``: names ``map_safetensors`` already mapped)."""
    if not isinstance(plan, dict):
        plan = checkpoint_plan(Path(plan))
    check_extents(plan)
    targets = state_targets(model)
    pytorch = any(e.start < 0 for e in plan.values())
    report = LoadReport("pytorch" if pytorch else "safetensors", files=sorted({str(e.file) for e in plan.values()}),
                        tensors=len(placed), mapped=len(placed))
    count = len(plan)
    plan = {name: entry for name, entry in plan.items() if name not in placed}
    total = sum(e.length for e in plan.values())
    buffer = bytearray()
    by_file: dict[Path, list[tuple[str, Entry]]] = {}
    for name, entry in plan.items():
        by_file.setdefault(entry.file, []).append((name, entry))
    for path, entries in by_file.items():
        # a .bin is mapped one file at a time: its pages are the file's, unmapped once it is copied
        mapped = open_bin(path) if entries[0][1].start < 0 else None
        with open(path, "rb", buffering=0) if mapped is None else contextlib.nullcontext() as f:
            for name, entry in sorted(entries, key=lambda item: item[1].start):
                target = targets[name]
                with torch.no_grad():
                    if mapped is not None:
                        target.copy_(mapped[name])  # converted elementwise into the parameter, no temporary
                    elif target.dtype == entry.dtype:
                        read_into(f, entry.start, bytes_of(target), path)
                    else:
                        buffer = read_converted(f, entry, target, buffer, path)
                    if target.dtype != entry.dtype:
                        key = f"{_short(entry.dtype)}->{_short(target.dtype)}"
                        report.converted[key] = report.converted.get(key, 0) + 1
                report.tensors += 1
                report.bytes_read += entry.length
                detail(progress, f"loading weights: {report.tensors} of {count} tensors, "
                                 f"{format_bytes(report.bytes_read)} of {format_bytes(total)}")
        del mapped
    return report


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).split(".")[-1])


def weights_fact(folder: str | os.PathLike | None, seed: int) -> dict:
    """Where a model's weights came from, as --summary-json records it (export --hf and check alike)."""
    if folder is None:
        return {"source": "random", "seed": seed}
    return {"source": "folder", "path": str(Path(folder).resolve())}
