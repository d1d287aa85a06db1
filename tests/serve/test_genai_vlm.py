"""onnxruntime-genai runs the multimodal folder ``package genai`` writes, and generates transformers' tokens.

A tiny random-weight VLM is saved with ``save_pretrained`` and a tokenizer (``vlm_configs``), packaged with
``package_genai_vlm(hf=...)`` (Qwen2.5-VL) or from the folder ``export_vlm`` wrote (Mistral 3); the test makes a PNG
image of the exported size. genai's own processor (the generated ``processor_config.json``) turns the image and a
prompt into pixel values and token ids; both must equal what
transformers' image processor (the PIL one) and tokenizer make, and genai's greedy tokens must equal
transformers' ``generate(do_sample=False)``. The weights are scaled up so that the tokens depend on the image:
another image must change transformers' tokens (else equal tokens would prove nothing about the vision path).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
og = pytest.importorskip("onnxruntime_genai")
sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))

import vlm_configs  # noqa: E402

from rope_export.hf.vlm import ImageSize, build_vlm, kind_of  # noqa: E402
from rope_export.hf.vlm.exporting import export_vlm  # noqa: E402
from rope_export.serve.genai_vlm import package_genai_vlm  # noqa: E402

NEW_TOKENS = 12
PROMPTS = {"qwen2_5_vl": "describe <|vision_start|><|image_pad|><|vision_end|> the cat",
           "mistral3": "[INST] describe [IMG] the cat [/INST]"}


def _model(model_type: str):
    # tiny random weights make near-uniform logits; scaled, the image moves the tokens
    return vlm_configs.trained_like(build_vlm(vlm_configs.tiny_config(model_type), seed=0))


def _image(path: Path, size: ImageSize, seed: int) -> Path:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size.height, size.width, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def genai_run(folder: Path, prompt: str, image: Path) -> tuple[list[int], dict[str, np.ndarray]]:
    model = og.Model(str(folder))
    inputs = model.create_multimodal_processor()(prompt, images=og.Images.open(str(image)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=128, do_sample=False)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    for _ in range(NEW_TOKENS):
        if generator.is_done():
            break
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)], {k: inputs[k].as_numpy() for k in inputs.keys()}


def transformers_inputs(model_type: str, config, folder: Path, prompt: str, image: Path, size: ImageSize) -> dict:
    """What transformers' processor makes of the prompt and the image: the image's tokens expanded in the prompt
    as its processor expands them (Qwen: one pad per merged patch; Pixtral: rows of [IMG] ended by [IMG_BREAK],
    the last by [IMG_END]), the pixels from its PIL image processor."""
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = kind_of(config).geometry(config, size).tokens
    picture = Image.open(image)
    if model_type.startswith("qwen"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vision = config.vision_config
        pixels = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                          temporal_patch_size=vision.temporal_patch_size)(images=picture,
                                                                                          return_tensors="pt")
        ids = tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * tokens), return_tensors="pt")["input_ids"]
        return dict(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                    mm_token_type_ids=(ids == config.image_token_id).int())
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    pixels = PixtralImageProcessorPil(patch_size=config.vision_config.patch_size,
                                      size={"longest_edge": max(size.height, size.width)})(images=picture,
                                                                                           return_tensors="pt")
    unit = config.vision_config.patch_size * config.spatial_merge_size
    rows, cols = size.height // unit, size.width // unit
    expanded = ("[IMG]" * cols + "[IMG_BREAK]") * (rows - 1) + "[IMG]" * cols + "[IMG_END]"
    ids = tokenizer(prompt.replace("[IMG]", expanded), return_tensors="pt")["input_ids"]
    return dict(input_ids=ids, pixel_values=pixels["pixel_values"], image_sizes=pixels["image_sizes"])


def generate(model, inputs: dict) -> list[int]:
    with torch.no_grad():
        return model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)[0].tolist()


@pytest.mark.parametrize("model_type", [pytest.param("qwen2_5_vl", id="qwen2_5_vl"),
                                        pytest.param("mistral3", id="mistral3", marks=pytest.mark.slow)])
def test_genai_generates_transformers_tokens_from_an_image_and_a_prompt(model_type, tmp_path):
    model = _model(model_type)
    folder = vlm_configs.save_folder(model, tmp_path / "model")
    size = ImageSize.parse(vlm_configs.IMAGE_SIZES[model_type])
    if model_type == "qwen2_5_vl":  # exported by package genai itself
        package = package_genai_vlm(tmp_path / "genai", hf=folder, image_size=str(size))
    else:  # a folder `export --hf` wrote, the tokenizer from the model folder
        export_vlm(build_vlm(folder), tmp_path / "export", image_size=size, weights=str(folder))
        package = package_genai_vlm(tmp_path / "genai", folder=tmp_path / "export", tokenizer=folder)
    config = json.loads((tmp_path / "genai" / "genai_config.json").read_text())
    assert config == package.config and config["model"]["type"] == model_type
    assert config["model"]["decoder"]["inputs"]["inputs_embeds"] == "inputs_embeds"
    assert (tmp_path / "genai" / "processor_config.json").is_file()

    prompt = PROMPTS[model_type]
    image = _image(tmp_path / "image.png", size, seed=0)
    got, feeds = genai_run(tmp_path / "genai", prompt, image)
    want_inputs = transformers_inputs(model_type, model.config, folder, prompt, image, size)
    # genai's processor made what transformers' makes: the prompt's ids with the image's tokens, the pixels
    assert feeds["input_ids"].reshape(-1).tolist() == want_inputs["input_ids"][0].tolist()
    np.testing.assert_allclose(feeds["pixel_values"].reshape(want_inputs["pixel_values"].shape),
                               want_inputs["pixel_values"].numpy(), atol=1e-5)
    want = generate(model, want_inputs)
    assert len(want) > want_inputs["input_ids"].shape[1]
    assert got == want

    other = transformers_inputs(model_type, model.config, folder, prompt, _image(tmp_path / "other.png", size, 1),
                                size)
    assert generate(model, other) != want, "the tokens do not depend on the image: equal tokens prove nothing"
