"""onnxruntime-genai folders of vision-language models: the three components, ``genai_config.json`` and the
image processor's ``processor_config.json``, generated, never hand-written.

onnxruntime-genai 0.18 runs a multimodal folder as its model type (``qwen2_5_vl``, ``mistral3``: the types of
``rope_export.hf.vlm.kinds.GENAI_TYPES``): its processor turns an image and a prompt into ``pixel_values`` (and
``image_grid_thw`` / ``image_sizes``) and the prompt's token ids with the image's tokens expanded; then it runs
``vision.onnx`` (``pixel_values`` -> ``image_features``) once, ``embedding.onnx`` (``input_ids``,
``image_features`` -> ``inputs_embeds``) at every step, and ``decoder.onnx`` with the cache. For Qwen2.5-VL genai
computes the decoder's mRoPE ``position_ids [3, batch, seq]`` itself from the prompt and the grid; for Mistral 3
they are 0..n-1.

* ``genai_config.json``: the decoder section from ``serve.genai.genai_config`` (its geometry read from the file's
  past inputs), ``inputs_embeds`` in place of ``input_ids``; the embedding and vision sections with the files'
  own I/O names; the image token ids (and Qwen's vision start token) from the transformers config; the vision
  tower's patch size and spatial merge.
* ``processor_config.json``: onnxruntime-extensions' image pipeline: decode, RGB, a resize to the image size the
  vision encoder was exported for (no smart resize: the encoder takes that one grid), rescale, normalize (mean,
  std and rescale factor from the folder's ``preprocessor_config.json``, else the type's transformers
  processor's defaults), then Qwen's patching or Pixtral's channel-first layout and image sizes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rope_export.serve.errors import ServeError

PROCESSOR_CONFIG = "processor_config.json"


def _processor_defaults(model_type: str) -> dict:
    """mean, std and rescale factor of the type's transformers image processor (the PIL one: no torchvision)."""
    if model_type.startswith("qwen"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as processor
    else:
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil as processor
    made = processor()
    return {"image_mean": list(made.image_mean), "image_std": list(made.image_std),
            "rescale_factor": float(made.rescale_factor)}


def processor_config(model_type: str, manifest: dict, vision_config, preprocessor: dict | None) -> dict:
    """onnxruntime-extensions' pipeline for images of the exported size."""
    values = _processor_defaults(model_type)
    for key in values:
        if preprocessor and preprocessor.get(key) is not None:
            values[key] = preprocessor[key]
    height, width = manifest["image"]["height"], manifest["image"]["width"]
    patch = int(vision_config.patch_size)
    merge = int(getattr(vision_config, "spatial_merge_size", None) or manifest.get("spatial_merge_size", 1))
    resize = {"height": height, "width": width, "smart_resize": 0, "patch_size": patch, "merge_size": merge}
    normalize = {"mean": [float(v) for v in values["image_mean"]], "std": [float(v) for v in values["image_std"]]}

    def op(name, kind, attrs=None):
        return {"operation": {"name": name, "type": kind, **({"attrs": attrs} if attrs is not None else {})}}

    # the color space DecodeImage is told, measured against transformers' processor (tests/serve/test_genai_vlm.py:
    # the pixel values are equal): with genai 0.18's Qwen pipeline "RGB", as its own Qwen2.5-VL configs say; with its
    # Pixtral pipeline "BGR", which ConvertRGB turns into RGB (onnxruntime-extensions' own examples; "RGB" there
    # swaps the red and blue channels)
    qwen = model_type.startswith("qwen")
    decode = {"color_space": "RGB" if qwen else "BGR"}
    transforms = [op("decode_image", "DecodeImage", decode), op("convert_to_rgb", "ConvertRGB"),
                  op("resize", "Resize", resize), op("rescale", "Rescale",
                                                     {"rescale_factor": float(values["rescale_factor"])})]
    if qwen:
        temporal = int(vision_config.temporal_patch_size)
        transforms += [op("normalize", "Normalize", {**normalize, "qwen2_5_vl": 1}),
                       op("patch_image", "PatchImage", {"patch_size": patch, "merge_size": merge,
                                                         "temporal_patch_size": temporal})]
        name = "qwen2_5_image_processor"
    else:
        transforms += [op("normalize", "Normalize", normalize),
                       op("to_channel_first", "Permute3D", {"dims": [2, 0, 1]}),
                       op("pixtral_image_sizes", "PixtralImageSizes")]
        name = "pixtral_image_processor"
    return {"processor": {"name": name, "transforms": transforms}}


def _session() -> dict:
    return {"log_id": "onnxruntime-genai", "provider_options": []}


def vlm_genai_config(graphs: dict, hf_config, manifest: dict, *, generation: dict | None) -> dict:
    """``genai_config.json`` for the components' graphs (GraphProtos: name -> graph)."""
    from rope_export.hf.vlm.exporting import FILES
    from rope_export.hf.vlm.kinds import GENAI_TYPES
    from rope_export.serve.genai import _names, genai_config

    model_type = manifest["model_type"]
    config = genai_config(graphs["decoder"], hf_config, generation=generation, filename=FILES["decoder"])
    model = config["model"]
    model["type"] = GENAI_TYPES[model_type]
    vision_config = hf_config.vision_config
    for graph, names, what in ((graphs["vision"], {"pixel_values"}, "vision"),
                               (graphs["embedding"], {"input_ids", "image_features"}, "embedding")):
        if names - _names(graph)[0]:
            missing = sorted(names - _names(graph)[0])
            raise ServeError(f"{FILES[what]} lacks the inputs {missing} onnxruntime-genai feeds")
    model["embedding"] = {"filename": FILES["embedding"], "session_options": _session(),
                          "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
                          "outputs": {"inputs_embeds": "inputs_embeds"}}
    merge = getattr(vision_config, "spatial_merge_size", None) or getattr(hf_config, "spatial_merge_size", 1)
    vision = {"filename": FILES["vision"], "config_filename": PROCESSOR_CONFIG, "session_options": _session(),
              "spatial_merge_size": int(merge), "patch_size": int(vision_config.patch_size),
              "inputs": {"pixel_values": "pixel_values"}, "outputs": {"image_features": "image_features"}}
    for name in ("tokens_per_second", "window_size"):  # Qwen's temporal spacing and attention windows
        if getattr(vision_config, name, None) is not None:
            vision[name] = getattr(vision_config, name)
    model["vision"] = vision
    model["image_token_id"] = manifest["image_token_id"]
    for name in ("video_token_id", "vision_start_token_id"):
        if isinstance(getattr(hf_config, name, None), int):
            model[name] = getattr(hf_config, name)
    return config


def package_genai_vlm(out, *, folder: Path | None = None, hf=None, weights=None, random_weights: bool = False,
                      tokenizer=None, target: str = "onnx", dtype: str = "fp32", seed: int = 0,
                      image_size: str | None = None, external: str = "auto",
                      progress: Callable[[str], None] | None = None):
    """The genai folder ``out`` of a VLM export ``folder`` (``export --hf VLM_DIR -o folder/``), or of ``hf``
    exported here (``weights``, ``random_weights``, ``seed``, ``image_size`` as ``export --hf``); ``tokenizer``:
    the folder to copy the tokenizer, ``generation_config.json``'s and ``preprocessor_config.json``'s values from
    (default: ``hf``). See the module docstring."""
    from rope_export.common.fileio import check_writable, commit_moves, staging_dir
    from rope_export.hf.vlm.exporting import MANIFEST
    from rope_export.hf.vlm.kinds import GENAI_TYPES
    from rope_export.serve.genai import TARGETS, GenaiPackage, _check_output, _hf_folder, _read_json

    say = progress or (lambda message: None)
    if (folder is None) == (hf is None):
        raise ServeError("give either a folder `export --hf VLM_DIR -o DIR/` wrote or --hf VLM_DIR")
    if target not in TARGETS:
        raise ServeError(f"target {target!r}: onnxruntime-genai runs {' or '.join(TARGETS)}")
    out = Path(out)
    _check_output(out)
    beside = out.with_name(out.name + ".package")
    check_writable(beside)
    notes: list[str] = []
    with staging_dir(beside) as stage:
        if folder is None:
            folder = _export_here(hf, stage / "exported", weights=weights, random_weights=random_weights, dtype=dtype,
                                  seed=seed, image_size=image_size, notes=notes, say=say)
        manifest = _read_json(Path(folder) / MANIFEST)
        if manifest is None:
            raise ServeError(f"{folder} has no {MANIFEST}: give a folder `rope-export export --hf VLM_DIR -o DIR/` "
                             "wrote")
        if manifest["model_type"] not in GENAI_TYPES:
            raise ServeError(_unsupported(manifest["model_type"]))
        package = stage / "package"
        package.mkdir()
        graphs, hf_config = _lowered(Path(folder), package, target, external, notes, say)
        source = _hf_folder(tokenizer) if tokenizer is not None else _hf_folder(hf)
        config = _write_configs(package, graphs, hf_config, manifest, source, notes)
        say(f"moving the package into {out}")
        commit_moves([(package, out)], trash=stage / ".replaced")
    files = sorted(p for p in out.iterdir() if p.is_file())
    return GenaiPackage(out, config, files, notes)


def _export_here(hf, folder: Path, *, weights, random_weights: bool, dtype: str, seed: int, image_size, notes: list,
                 say) -> Path:
    """``export --hf hf -o folder/`` (the folder's own weights unless told otherwise, as ``export --hf``)."""
    from rope_export.hf.loading import load_hf_config, weights_beside
    from rope_export.hf.vlm import build_vlm
    from rope_export.hf.vlm.exporting import export_vlm
    from rope_export.hf.vlm.kinds import GENAI_TYPES

    config = load_hf_config(hf)
    if config.model_type not in GENAI_TYPES:
        raise ServeError(_unsupported(config.model_type))
    if random_weights and weights is not None:
        raise ServeError("--random-weights and --weights exclude each other: give one")
    weights = weights if weights is not None or random_weights else weights_beside(hf)
    if weights is None:
        why = "--random-weights" if random_weights else f"{hf} holds no weights and no --weights was given"
        notes.append(f"random weights (seed {seed}): {why}")
    say(f"building the model from {hf}")
    model = build_vlm(config, weights, dtype=dtype, seed=seed, random_weights=weights is None, progress=say)
    export_vlm(model, folder, image_size=image_size, weights=None if weights is None else str(weights), seed=seed,
               progress=say)
    return folder


def _lowered(folder: Path, package: Path, target: str, external: str, notes: list, say) -> tuple[dict, object]:
    """Each component lowered to ``target`` into ``package``: ({name: its graph}, the transformers config)."""
    import onnx

    from rope_export.files import onnx_files
    from rope_export.hf.vlm.exporting import FILES
    from rope_export.passes import LoweringLog, lower
    from rope_export.serve.genai import _file_config

    graphs, hf_config = {}, None
    for name, file in FILES.items():
        say(f"lowering the rotary nodes of {file} to {target}")
        ir_model = onnx_files.load(folder / file)
        hf_config = hf_config or _file_config(ir_model, folder / file)
        log = LoweringLog()
        written = onnx_files.write(lower(ir_model, target, log=log), package / file, external=external, progress=say)
        if name != "embedding":  # the merge has no rotary node to lower: nothing to say
            notes += log.notes
        graphs[name] = onnx.load(str(written.path), load_external_data=False).graph
    return graphs, hf_config


def _write_configs(package: Path, graphs: dict, hf_config, manifest: dict, source: Path | None, notes: list) -> dict:
    """``genai_config.json``, ``processor_config.json`` and the tokenizer files; the genai config."""
    from rope_export.serve.genai import GENAI_CONFIG, TOKENIZER_FILES, _read_json

    generation = _read_json(source / "generation_config.json") if source is not None else None
    config = vlm_genai_config(graphs, hf_config, manifest, generation=generation)
    preprocessor = _read_json(source / "preprocessor_config.json") if source is not None else None
    if preprocessor is None:
        notes.append("no preprocessor_config.json in the model folder: the image mean, std and rescale factor are "
                     f"the {manifest['model_type']} image processor's defaults")
    (package / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    processor = processor_config(manifest["model_type"], manifest, hf_config.vision_config, preprocessor)
    (package / PROCESSOR_CONFIG).write_text(json.dumps(processor, indent=2) + "\n", encoding="utf-8")
    copied = [name for name in TOKENIZER_FILES if source is not None and (source / name).is_file()]
    for name in copied:
        (package / name).write_bytes((source / name).read_bytes())
    if not copied:
        notes.append("no tokenizer files copied (none found): genai's processor needs the tokenizer; copy "
                     "tokenizer.json and tokenizer_config.json into the folder")
    notes.append(f"images are resized to {manifest['image']['height']}x{manifest['image']['width']} pixels, the size "
                 "the vision encoder was exported for")
    return config


def _unsupported(model_type: str) -> str:
    from rope_export.hf.vlm.kinds import GENAI_TYPES

    return (f"onnxruntime-genai 0.18 has no multimodal pipeline for {model_type!r} that these components fit "
            f"(it runs {', '.join(sorted(GENAI_TYPES))}); export the components with `rope-export export --hf` "
            "and serve them with onnxruntime")


def is_vlm_source(model=None, hf=None) -> bool:
    """Whether ``package genai`` was given a VLM: an export folder (``vlm.json``) or a vision-language config."""
    from rope_export.hf.vlm.exporting import MANIFEST

    if model is not None:
        return Path(model).is_dir() and (Path(model) / MANIFEST).is_file()
    if hf is None or not Path(hf).exists():
        return False
    from rope_export.hf.loading import load_hf_config
    from rope_export.hf.vlm import is_vlm

    return is_vlm(load_hf_config(hf))
