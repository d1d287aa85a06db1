"""Vision-language models whole: ``export --hf VLM_DIR -o OUT_DIR/`` writes the components a serving stack runs.

* ``kinds``: per kind of model (Qwen2-VL-style: Qwen2/2.5-VL, the GLM-4V family, Cosmos3-Omni; Qwen3-VL;
  Mistral 3; Llama 4), the image geometry, what the vision tower hands the decoder, the decoder's position rank
  and extras;
* ``loading``: ``is_vlm`` and ``build_vlm`` (offline, as ``build_hf_model``);
* ``components``: the vision encoder, the merge of image features into the token embeddings, the decoder with
  its cache, as modules calling the model's own code;
* ``exporting``: ``export_vlm``, each component through the export core with its rotations counted;
* ``pipeline``: the whole pipeline as a serving stack runs it, and transformers' answer (for ``check``).

``rope-export export --hf`` routes such a model to ``rope_export.cli.export_vlm``.

transformers is imported lazily: the package imports without it.
"""

from rope_export.hf.vlm.kinds import KINDS, MODEL_TYPES, Geometry, ImageSize, VLMKind, kind_of
from rope_export.hf.vlm.loading import build_vlm, is_vlm

__all__ = ["KINDS", "MODEL_TYPES", "Geometry", "ImageSize", "VLMKind", "build_vlm", "is_vlm", "kind_of"]
