"""onnxruntime-genai folders: a lowered ``export --hf`` file, its ``genai_config.json`` and the tokenizer.

onnxruntime-genai (``og.Model(folder)``) reads ``genai_config.json`` for the model's geometry, its
ONNX I/O names and the search defaults. The config is generated, never hand-written:

* I/O names are the file's own (``input_ids``, ``position_ids``, ``attention_mask``,
  ``past_key_values.%d.key/value``, ``logits``, ``present.%d.key/value``), checked against it;
* heads, kv heads and head size come from the file's past inputs (what the graph really takes),
  layers from how many there are, hidden size / context length / token ids from the transformers
  config (``generation_config.json`` beside it wins for token ids and search defaults);
* ``past_present_share_buffer`` is false when the file's present cache grows by Concat (past+seq):
  genai hands each step's present back as the next past; true for a KV buffer file
  (``export_hf(kv_buffer=True)``, ``rope_export.hf.kv_buffer``), whose presents are its past
  buffers [batch, kv_heads, max_length, head] updated in place;
* the model type is genai's generic ``decoder``: the graph is self-contained, genai needs nothing
  model-specific (its own builder's types would only matter for graphs it built).

Padded batches: genai marks padding by ``pad_token_id`` and passes an ``attention_mask`` (0 on pads)
with position ids that skip them, so the file must take ``attention_mask`` (``export_hf(...,
attention_mask=True)``; ``package_genai`` exports that way). 0.18 pads on the right and keeps the
gap masked while decoding; RoPE depends on positions only, so that computes what transformers'
left-padded ``generate`` does (sliding-window layers count the gap: equal while prompts are shorter
than the window).

The folder is built in a staging folder beside the output and moved into place at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rope_export.serve.errors import ServeError

GENAI_CONFIG = "genai_config.json"
MODEL_FILE = "model.onnx"
TARGETS = ("onnx", "ort")  # lowerings onnxruntime (and so genai) runs
# What a tokenizer is made of in a transformers folder (onnxruntime-extensions reads these).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
_PAST = re.compile(r"past_key_values\.(\d+)\.(\w+)$")
_PRESENT = re.compile(r"present\.(\d+)\.(\w+)$")


@dataclass
class GenaiPackage:
    """What ``package_genai`` wrote."""

    folder: Path
    config: dict
    files: list[Path]
    notes: list[str] = field(default_factory=list)


def _static_dims(value, name: str) -> list:
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]
    if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in (dims[1], dims[3])):
        raise ServeError(f"{name}: expected [batch, kv_heads, past, head_size] with fixed heads and head size, "
                         f"got {dims}")
    return dims


def cache_geometry(graph) -> tuple[int, int, int]:
    """(layers, kv heads, head size) from the file's past inputs; one line why genai cannot take them."""
    layers: dict[int, set[str]] = {}
    shapes = set()
    for value in graph.input:
        match = _PAST.match(value.name)
        if not match:
            continue
        index, slot = int(match.group(1)), match.group(2)
        if slot not in ("key", "value"):
            raise ServeError(f"input {value.name}: onnxruntime-genai's decoder keeps keys and values only "
                             f"(this model's layer {index} has a {slot!r} cache)")
        layers.setdefault(index, set()).add(slot)
        dims = _static_dims(value, value.name)
        shapes.add((dims[1], dims[3]))
    if not layers:
        raise ServeError("the file has no past_key_values.N.key/value inputs: export the whole model with its KV "
                         "cache (`rope-export export --hf`, not --layer)")
    if sorted(layers) != list(range(len(layers))) or any(s != {"key", "value"} for s in layers.values()):
        raise ServeError(f"onnxruntime-genai needs keys and values for layers 0..N-1; the file has them for layers "
                         f"{sorted(layers)} (shared or cache-less layers)")
    if len(shapes) != 1:
        raise ServeError(f"onnxruntime-genai needs one kv-heads/head-size for every layer; the file has "
                         f"{sorted(shapes)} (kv_heads, head_size)")
    heads, size = shapes.pop()
    return len(layers), heads, size


def _names(graph) -> tuple[set[str], set[str]]:
    return {v.name for v in graph.input}, {v.name for v in graph.output}


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def _attr(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def genai_config(graph, hf_config, *, generation: dict | None = None, filename: str = MODEL_FILE,
                 share_buffer: bool = False) -> dict:
    """``genai_config.json`` for the ONNX ``graph`` (a GraphProto, weights not needed) of ``hf_config``.

    ``hf_config``: the transformers config (a ``PretrainedConfig``: its attribute map reads GPT-J's
    ``n_embd`` as ``hidden_size``; a multimodal config's text config is used). ``generation``:
    ``generation_config.json`` as a dict (token ids and search defaults), or None.
    """
    text = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    generation = generation or {}
    inputs, outputs = _names(graph)
    tokens = "inputs_embeds" if "inputs_embeds" in inputs else "input_ids"  # a VLM's decoder takes embeddings
    for needed in (tokens, "position_ids"):
        if needed not in inputs:
            raise ServeError(f"the file has no {needed!r} input; onnxruntime-genai feeds input_ids and position_ids "
                             "(export it with `rope-export export --hf`)")
    if "logits" not in outputs:
        raise ServeError("the file has no 'logits' output; export the whole causal LM (`rope-export export --hf`)")
    layers, kv_heads, head_size = cache_geometry(graph)
    missing = [f"present.{i}.{s}" for i in range(layers) for s in ("key", "value") if f"present.{i}.{s}" not in outputs]
    if missing:
        raise ServeError(f"the file lacks the outputs {', '.join(missing[:4])}: every past needs its present")
    heads, hidden = _attr(text, "num_attention_heads"), _attr(text, "hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int):
        raise ServeError("the transformers config has no num_attention_heads/hidden_size")
    context = _attr(text, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    if not isinstance(context, int) or context <= 0:
        raise ServeError("the transformers config names no context length (max_position_embeddings)")
    eos, bos, pad = (generation[name] if generation.get(name) is not None else _attr(text, name)
                     if _attr(text, name) is not None else _attr(hf_config, name)
                     for name in ("eos_token_id", "bos_token_id", "pad_token_id"))
    if eos is None:
        raise ServeError("the transformers config has no eos_token_id; genai stops generating on it")
    if pad is None:  # what transformers' generate does without one: pad with the end-of-sequence token
        pad = _first(eos)
    names_in = {tokens: tokens, "position_ids": "position_ids",
                "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if "attention_mask" in inputs:
        names_in["attention_mask"] = "attention_mask"
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": head_size,
        "hidden_size": hidden,
        "inputs": names_in,
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value"},
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
    }
    model = {"type": "decoder", "bos_token_id": _first(bos) if bos is not None else _first(eos),
             "eos_token_id": eos, "pad_token_id": pad, "context_length": context,
             "vocab_size": _attr(text, "vocab_size"), "decoder": decoder}
    do_sample = bool(generation.get("do_sample", False))
    search = {
        "do_sample": do_sample,
        "num_beams": 1,
        "num_return_sequences": 1,
        "min_length": 0,
        "max_length": context,
        "past_present_share_buffer": share_buffer,
        "repetition_penalty": float(generation.get("repetition_penalty", 1.0)),
        "temperature": float(generation.get("temperature", 1.0)),
        "top_k": int(generation.get("top_k", 50 if do_sample else 1) or 1),
        "top_p": float(generation.get("top_p", 1.0)),
        "length_penalty": 1.0,
        "early_stopping": True,
        "no_repeat_ngram_size": 0,
        "diversity_penalty": 0.0,
    }
    return {"model": model, "search": search}


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ServeError(f"{path}: not readable JSON ({exc})") from None


def _hf_folder(path) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    return path if path.is_dir() else path.parent


def _check_output(out: Path) -> None:
    """A new or empty folder, or one genai_config.json marks as an earlier package (it is replaced)."""
    if out.exists() and not out.is_dir():
        raise ServeError(f"{out} exists and is not a folder; give a folder for the package")
    if out.is_dir() and any(out.iterdir()) and not (out / GENAI_CONFIG).is_file():
        raise ServeError(f"{out} is a folder with other files in it; give a new or empty folder (a folder holding "
                         f"{GENAI_CONFIG} is replaced)")


def package_genai(out: str | os.PathLike, *, model: str | os.PathLike | None = None,
                  hf: str | os.PathLike | None = None, weights: str | os.PathLike | None = None,
                  random_weights: bool = False, tokenizer: str | os.PathLike | None = None,
                  target: str = "onnx", dtype: str = "fp32", seed: int = 0, external: str = "auto",
                  kv_buffer: bool = False, progress: Callable[[str], None] | None = None) -> GenaiPackage:
    """Write an onnxruntime-genai folder ``out``: ``model.onnx`` lowered to ``target``, ``genai_config.json``
    and the tokenizer files.

    Either ``model``: an ``export --hf`` file (its transformers config is read from its metadata), or
    ``hf``: a transformers folder or config.json, exported here with an ``attention_mask`` input
    (``kv_buffer``: with preallocated KV buffers updated in place, ``past_present_share_buffer: true``)
    (``weights``: the folder with its weights; default the ``hf`` folder when it holds weights, else
    random weights, ``seed``; ``random_weights``: random ones even where the folder holds weights).
    ``tokenizer``: the folder to copy tokenizer files and ``generation_config.json``'s defaults from
    (default: the ``hf`` folder). A vision-language model: ``rope_export.serve.genai_vlm.package_genai_vlm``.
    """
    from rope_export.common.fileio import check_writable, commit_moves, staging_dir
    from rope_export.files import onnx_files
    from rope_export.passes import LoweringLog, lower

    say = progress or (lambda message: None)
    if (model is None) == (hf is None):
        raise ServeError("give either an exported MODEL.onnx or --hf MODEL_DIR")
    if target not in TARGETS:
        raise ServeError(f"target {target!r}: onnxruntime-genai runs {' or '.join(TARGETS)}")
    out = Path(out)
    _check_output(out)
    beside = out.with_name(out.name + ".package")  # check_writable and staging_dir take a file's path, not a folder's
    check_writable(beside)
    hf_dir = _hf_folder(hf)
    source = _hf_folder(tokenizer) if tokenizer is not None else hf_dir
    notes: list[str] = []
    with staging_dir(beside) as stage:
        folder = stage / "package"
        folder.mkdir()
        if hf is not None:
            exported = stage / "exported.onnx"
            if random_weights and weights is not None:
                raise ServeError("--random-weights and --weights exclude each other: give one")
            if weights is None and not random_weights:  # export --hf's rule: the folder's own checkpoint if any
                from rope_export.hf.loading import weights_beside

                weights = weights_beside(hf)
            _export(hf, exported, weights=weights, dtype=dtype, seed=seed, kv_buffer=kv_buffer, progress=say)
            if weights is None:
                why = "--random-weights" if random_weights else f"{hf} holds no weights and no --weights was given"
                notes.append(f"random weights (seed {seed}): {why}")
            model = exported
        say(f"loading {model} (the graph; weights stay on disk)")
        ir_model = onnx_files.load(model)
        hf_config = _file_config(ir_model, model)
        log = LoweringLog()
        say(f"lowering the RotaryEmbedding nodes to {target}")
        ir_model = lower(ir_model, target, log=log)
        notes += log.notes
        written = onnx_files.write(ir_model, folder / MODEL_FILE, external=external, progress=say)
        import onnx

        graph = onnx.load(str(written.path), load_external_data=False).graph
        if "attention_mask" not in _names(graph)[0]:
            notes.append("the file takes no attention_mask: batches with padding attend to the pad tokens; "
                         "re-export with `rope-export export --hf ... --attention-mask`")
        generation = _read_json(source / "generation_config.json") if source is not None else None
        # a file whose presents are its pasts updated in place (export_hf(kv_buffer=True)) shares the buffers
        share = any(node.op_type == "TensorScatter" for node in graph.node)
        config = genai_config(graph, hf_config, generation=generation, share_buffer=share)
        (folder / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        copied = []
        if source is not None:
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, folder / name)
                    copied.append(name)
        if not copied:
            notes.append("no tokenizer files copied (none found): feed token ids (Generator.append_tokens), or copy "
                         "tokenizer.json and tokenizer_config.json into the folder")
        say(f"moving the package into {out}")
        commit_moves([(folder, out)], trash=stage / ".replaced")
    files = sorted(p for p in out.iterdir() if p.is_file())
    return GenaiPackage(out, config, files, notes)


def _file_config(ir_model, path):
    """The transformers config an ``export --hf`` file carries in its metadata (its difference from the
    type's defaults, so the defaults are added back by transformers)."""
    from transformers import AutoConfig

    from rope_export.exporting.core import METADATA_PREFIX

    text = ir_model.metadata_props.get(METADATA_PREFIX + "hf_config")
    if not text:
        raise ServeError(f"{path} carries no transformers config (rope_export.hf_config); package a file from "
                         "`rope-export export --hf`, or give --hf MODEL_DIR")
    diff = json.loads(text)
    model_type = ir_model.metadata_props.get(METADATA_PREFIX + "hf_model_type") or diff.pop("model_type", None)
    diff.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **diff)
    except (ValueError, KeyError, TypeError) as exc:
        raise ServeError(f"{path}: transformers cannot rebuild its {model_type!r} config: {exc}") from None


def _export(hf, output: Path, *, weights, dtype: str, seed: int, kv_buffer: bool, progress) -> None:
    """``export_hf`` with an attention_mask input, so that padded batches are served right."""
    from rope_export.hf import build_hf_model, export_hf

    progress(f"building the model from {hf}" + (f" with weights from {weights}" if weights else
                                                 f" (random weights, seed {seed})"))
    model = build_hf_model(hf, weights, dtype=dtype, seed=seed, random_weights=weights is None, progress=progress)
    export_hf(model, output, attention_mask=True, kv_buffer=kv_buffer,
              weights=None if weights is None else str(weights), seed=seed, progress=progress)
