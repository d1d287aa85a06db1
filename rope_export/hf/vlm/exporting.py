"""``export_vlm``: a vision-language model to a folder of components, every rotation one rotary node.

Each component (``components.py``) goes through the export core of ``export_hf``:

1. the rotations transformers performs in one eager forward of the component are counted
   (``rope_export.detect.count_rotations``, by data flow);
2. the rotary functions the component's code calls are found and verified (``rope_export.hf.hooking.detect``),
   then checked on the component's own calls: hooked, one eager forward must give what the unhooked one gives
   (the vision towers rotate token-major ``[tokens, heads, dim]`` tensors, a layout the hook does not take: their
   rotations are fused instead);
3. exported with the functions that passed routed through the rotary op; rotations no hook reached are fused
   (``rope_export.passes.fuse``, verified numerically before each rewrite);
4. the file's rotary nodes are compared with the count: fewer is an error naming the sites left decomposed
   (``allow_decomposed``: a warning and a note);
5. metadata (``rope_export.*``: the config, weights, seed, the component and the image geometry), onnx.checker,
   and the whole folder moved into place at once.

Where positions are computed: the decoder takes ``position_ids`` as an input (mRoPE: ``[3, batch, seq]``, made by
the serving stack from the prompt and the image grid, transformers' ``get_rope_index``; onnxruntime-genai computes
them itself for Qwen2.5-VL); the vision tower's 2-D positions, windows and attention segments come from the image
grid and are computed at export, per token, for the exported image size (constants of the graph).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rope_export import __version__
from rope_export.detect import rotary_nodes
from rope_export.detect.functions import recorded_calls
from rope_export.exporting import precision
from rope_export.exporting.core import (
    DTYPES,
    METADATA_PREFIX,
    check_opset,
    finish_export,
    graph_proto,
)
from rope_export.hf.cache_io import CacheLayout, cache_layout, check_sliding_layers
from rope_export.hf.counting import count_and_compare, eager_rotations
from rope_export.hf.errors import HFExportError
from rope_export.hf.families import family_of, text_config
from rope_export.hf.hooking import detect, model_state_kept, rotary_hooked
from rope_export.hf.metadata import hf_metadata
from rope_export.hf.tracing import export_failure, fuse_unreached, trace_onnx
from rope_export.hf.vlm.components import (
    COMPONENTS,
    DecoderWithCache,
    EmbeddingMerge,
    VisionEncoder,
    io_names,
    placeholder_checks_off,
)
from rope_export.hf.vlm.kinds import Geometry, ImageSize, VLMKind, base_model, kind_of
from rope_export.op.contract import DOMAIN

MANIFEST = "vlm.json"  # the folder's table of contents, written last
FILES = {name: f"{name}.onnx" for name in COMPONENTS}
POSITIONS = {
    3: "decoder position_ids [3, batch, seq] (mRoPE rows: temporal, height, width) are an input: the serving stack "
       "computes them from the prompt and the image grid (transformers' get_rope_index; onnxruntime-genai does it "
       "itself for qwen2_5_vl)",
    2: "decoder position_ids [batch, seq] are an input (past length + 0..seq-1 for a prompt without padding)",
}
VISION_POSITIONS = ("vision positions (2-D patch coordinates, windows, attention segments) come from the image grid: "
                    "computed at export for the exported image size, per-token cos/sin tables in the graph")


@dataclass
class ComponentResult:
    name: str
    path: Path
    rotations: int  # transformers' rotations in one eager forward of the component
    nodes: int  # rotary nodes in the file
    how: str  # what was hooked, or how the rotations were fused
    notes: list[str] = field(default_factory=list)
    interleaved: bool = False  # the rotary nodes rotate GPT-J / Meta pairs (2i, 2i+1)


@dataclass
class VLMExportResult:
    folder: Path
    kind: VLMKind
    geometry: Geometry
    components: dict[str, ComponentResult]
    layout: CacheLayout
    notes: list[str] = field(default_factory=list)

    @property
    def manifest(self) -> dict:
        return json.loads((self.folder / MANIFEST).read_text())


def _ids(vocab: int, avoid: set[int], shape, generator) -> torch.Tensor:
    ids = torch.randint(0, vocab, shape, generator=generator)
    for token in avoid:  # a token that is not the image token
        ids[ids == token] = min(set(range(vocab)) - avoid)
    return ids


def image_token_id(model) -> int:
    config = base_model(model).config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if not isinstance(token, int):
        raise HFExportError(f"{model.config.model_type}: the config names no image token (image_token_id)")
    return token


def example_inputs(model, kind: VLMKind, geometry: Geometry, layout: CacheLayout, seed: int = 0) -> dict:
    """Each component's tracing inputs: an image of the exported size, a batch of two prompts holding its tokens,
    a decode step (batch 2, 4 new tokens, past 3)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    text = text_config(model.config)
    hidden, vocab, token = int(text.hidden_size), int(text.vocab_size), image_token_id(model)
    pixels = torch.randn(geometry.pixel_shape, generator=generator).to(dtype)
    n = max(1, geometry.tokens)
    ids = _ids(vocab, {token}, (2, n + 4), generator)
    ids[:, 2:2 + n] = token
    features = torch.randn(2 * n, hidden, generator=generator).to(dtype)
    batch, seq, past = 2, 4, 3
    positions = (torch.arange(seq) + past).expand(batch, seq)
    if kind.position_rank == 3:
        positions = torch.stack([positions, positions + 1, positions + 2])
    extras = ()
    if kind.decoder_extras:  # Qwen3-VL: two image tokens in the step, with their deepstack rows
        mask = torch.zeros(batch, seq, dtype=torch.bool)
        mask[0, 1] = mask[1, 2] = True
        layers = len(base_model(model).visual.deepstack_visual_indexes)
        extras = (mask, torch.randn(layers, 2, hidden, generator=generator).to(dtype))
    past_tensors = [torch.randn(shape, generator=generator).to(dtype) for io in layout.layers
                    for shape in io.shapes(batch, past)]
    return {
        "vision": (pixels,),
        "embedding": (ids, features),
        "decoder": (torch.randn(batch, seq, hidden, generator=generator).to(dtype), positions.contiguous(),
                    torch.ones(batch, past + seq, dtype=torch.long), *extras, *past_tensors),
    }


def _dynamic_shapes(kind: VLMKind, layout: CacheLayout) -> dict:
    """The vision encoder is fixed to the image size; prompts, batches and the past are dynamic."""
    dim = torch.export.Dim
    batch, seq, past = dim("batch", min=1, max=4096), dim("seq", min=1, max=2**20), dim("past", min=0, max=2**20)
    tokens = dim("image_tokens", min=0, max=2**20)
    positions = {1: batch, 2: seq} if kind.position_rank == 3 else {0: batch, 1: seq}
    extras = ({0: batch, 1: seq}, {1: dim("visual_tokens", min=0, max=2**20)})[:len(kind.decoder_extras)]
    pasts = tuple({0: batch, axis: past} if axis is not None else {0: batch} for axis in layout.past_axes())
    return {
        "vision": None,
        "embedding": ({0: batch, 1: seq}, {0: tokens}),
        # forward(inputs_embeds, position_ids, attention_mask, *rest): the varargs take one tuple of specs
        "decoder": ({0: batch, 1: seq}, positions, {0: batch, 1: dim.DYNAMIC}, (*extras, *pasts)),
    }


def _outputs_equal(a, b) -> bool:
    a = [a] if isinstance(a, torch.Tensor) else list(a)
    b = [b] if isinstance(b, torch.Tensor) else list(b)
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-5)
                                    for x, y in zip(a, b, strict=True))


def _hook_holds(model, module, inputs, functions, eager) -> str:
    """Why the hooked functions do not reproduce the component's own calls ("" when they do)."""
    try:
        with model_state_kept(model), torch.no_grad(), rotary_hooked(model, functions=functions):
            hooked = module(*inputs)
    except Exception as exc:  # noqa: BLE001 - a layout the replacement does not take
        return f"the hook does not take these calls ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return "" if _outputs_equal(hooked, eager) else "the hooked forward differs from transformers'"


def export_component(model, name: str, module, inputs: tuple, shapes, names: tuple[list[str], list[str]], *,
                     opset: int, allow_decomposed: bool, say: Callable[[str], None], verbose: bool = False):
    """(graph ModelProto, program, ComponentResult without its path) of one component (the module docstring's
    steps 1-4)."""
    notes: list[str] = []
    say(f"{name}: counting the rotations transformers performs in one eager forward")
    with model_state_kept(model), recorded_calls() as called:
        census = eager_rotations(module, inputs)
        with torch.no_grad():
            eager = module(*inputs)
    functions = detect(model, family_of(model), called) if census.total else []
    why = _hook_holds(model, module, inputs, functions, eager) if functions else ""
    if why:
        notes.append(f"{', '.join(f.qualified for f in functions)} not hooked here: {why}; its rotations are fused")
        functions = []
    say(f"{name}: exporting {type(module).__name__} with torch.export")
    hook_ctx = rotary_hooked(model, functions=functions) if functions else contextlib.nullcontext()
    try:
        with model_state_kept(model), placeholder_checks_off(), hook_ctx as hook:
            program = trace_onnx(module, inputs, shapes, *names, opset, verbose, say)
    except HFExportError:
        raise
    except Exception as exc:  # torch.export / onnxscript errors: name the model and the op
        raise export_failure(model, exc, CacheLayout((), 0)) from exc
    _drop_noop_squeezes(program.model)
    if census.plain and len(rotary_nodes(program.model)) < len(census.plain):
        fuse_unreached(program, notes, hooked=hook is not None)
        notes[-1] = notes[-1].replace("no rotary function verified", "rotations not hooked")
    precision.state_norm_precision(program.model)  # float32 norm statistics in the types (exporting.precision)
    proto = graph_proto(program)
    report = count_and_compare(census, proto, allow_decomposed=allow_decomposed, notes=notes)
    how = hook.description if hook is not None else ("fused by rope_export.passes.fuse" if census.plain else
                                                     "no rotation")
    if hook is not None and report.found > hook.rotations:
        how += "; the rest fused by rope_export.passes.fuse"
    interleaved = any(a.name == "interleaved" and a.i == 1 for n in proto.graph.node if n.domain == DOMAIN
                      for a in n.attribute)
    return proto, program, ComponentResult(name, Path(FILES[name]), report.expected, report.found, how, notes,
                                           interleaved)


def _drop_noop_squeezes(model) -> None:
    """torch's ``squeeze(dim)`` leaves a dim that is not 1 alone; torch.onnx writes a Squeeze of it all the same
    (Mistral 3's ``image_features.squeeze(0)`` of [tokens, hidden]), which onnx.checker refuses. Such a node is
    what torch computed: nothing; its output is its input."""
    import onnx_ir as ir

    for node in list(model.graph):
        if node.op_type != "Squeeze" or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        data, axes = node.inputs
        shape = data.shape
        if axes.const_value is None or shape is None or node.outputs[0].is_graph_output():
            continue
        dims = [shape[int(a) % len(shape)] for a in axes.const_value.numpy().reshape(-1)]
        if dims and all(isinstance(d, int) and d != 1 for d in dims):
            ir.convenience.replace_all_uses_with(node.outputs[0], data)
            model.graph.remove(node, safe=True)


def _metadata(model, name: str, kind: VLMKind, geometry: Geometry, result: ComponentResult, *, dtype: str,
              weights: str | None, seed: int) -> dict[str, str]:
    """The causal-LM metadata (config, weights, seed, the text tower's RoPE) plus the component and the image
    geometry; only the decoder says ``source: transformers`` (its RoPE is the text config's), the others
    ``transformers-vlm`` (their reference is the component itself)."""
    meta = hf_metadata(model, family_of(model), hook_description=result.how, interleaved=result.interleaved,
                       dtype=dtype,
                       kind=f"hf-vlm-{name}", weights=weights, seed=seed, layer=None)
    if name != "decoder":
        meta[METADATA_PREFIX + "source"] = "transformers-vlm"
        for key in ("rope", "rope_extra", "layer_types", "position_ids_rank"):
            meta.pop(METADATA_PREFIX + key, None)
    meta[METADATA_PREFIX + "vlm"] = json.dumps({"component": name, "kind": kind.name, "image": geometry.to_dict()},
                                               sort_keys=True)
    meta[METADATA_PREFIX + "rotations_eager"] = str(result.rotations)
    meta[METADATA_PREFIX + "rotary_nodes"] = str(result.nodes)
    return meta


def check_output_folder(out: Path) -> None:
    """A new or empty folder, or an earlier VLM export (it is replaced)."""
    if out.suffix == ".onnx":
        raise HFExportError(f"{out}: a vision-language model exports as a folder of components (vision, embedding, "
                            "decoder); give -o OUT_DIR/")
    if out.exists() and not out.is_dir():
        raise HFExportError(f"{out} exists and is not a folder; give a folder for the components")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise HFExportError(f"{out} is a folder with other files in it; give a new or empty folder (a folder holding "
                            f"{MANIFEST} is replaced)")


def export_vlm(model, output, *, image_size: ImageSize | str | None = None, opset: int = 23,
               weights: str | None = None, seed: int = 0, allow_decomposed: bool = False, external: str = "auto",
               progress: Callable[[str], None] | None = None, verbose: bool = False) -> VLMExportResult:
    """Export ``model`` (a transformers image-text-to-text model) to the folder ``output``: ``vision.onnx``,
    ``embedding.onnx``, ``decoder.onnx`` and ``vlm.json``, each component with one rotary node per rotation
    transformers performs in it (see the module docstring). ``image_size``: the image the vision encoder takes
    (``ImageSize`` or "HxW"; default: the kind's, on the merged-token grid)."""
    from rope_export.common.fileio import check_writable, commit_moves, staging_dir

    say = progress or (lambda message: None)
    check_opset(opset)
    out = Path(output)
    check_output_folder(out)
    beside = out.with_name(out.name + ".export")
    check_writable(beside)
    kind = kind_of(model.config)
    size = ImageSize.parse(image_size) if isinstance(image_size, str) else image_size or kind.default_size(model.config)
    kind.check_size(model.config, size)
    geometry = kind.geometry(model.config, size)
    dtype = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "fp32")
    with model_state_kept(model):
        layout = cache_layout(kind.text_model(model))
        check_sliding_layers(kind.text_model(model))
    modules = {"vision": VisionEncoder(model, kind, geometry).eval(), "embedding": EmbeddingMerge(model, kind).eval(),
               "decoder": DecoderWithCache(model, kind, layout).eval()}
    inputs, shapes, names = example_inputs(model, kind, geometry, layout, seed), _dynamic_shapes(kind, layout), \
        io_names(kind, layout)
    with torch.no_grad():
        # transformers installs its output-capturing hooks (Mistral 3 reads a vision layer's hidden states) on the
        # first forward and marks the model; done here, before any model_state_kept block, so that the mark is not
        # undone while the hooks stay (each later forward would install them again and capture every state twice)
        modules["vision"](*inputs["vision"])
    results: dict[str, ComponentResult] = {}
    with staging_dir(beside) as stage:
        folder = stage / "folder"
        folder.mkdir()
        for name in COMPONENTS:
            proto, program, result = export_component(model, name, modules[name], inputs[name], shapes[name],
                                                      names[name], opset=opset, allow_decomposed=allow_decomposed,
                                                      say=say, verbose=verbose)
            for key, value in _metadata(model, name, kind, geometry, result, dtype=dtype, weights=weights,
                                        seed=seed).items():
                proto.metadata_props.add(key=key, value=value)
            proto.producer_name, proto.producer_version = "rope-export", __version__
            say(f"{name}: writing {FILES[name]}")
            finish_export(proto, program, folder / FILES[name], external=external, progress=say)
            results[name] = result
            del program, proto
        manifest = _manifest(model, kind, geometry, results, weights=weights, seed=seed, dtype=dtype)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        say(f"moving the components into {out}")
        commit_moves([(folder, out)], trash=stage / ".replaced")
    for result in results.values():
        result.path = out / result.path
    return VLMExportResult(out, kind, geometry, results, layout)


def _manifest(model, kind: VLMKind, geometry: Geometry, results: dict[str, ComponentResult], *, weights, seed,
              dtype) -> dict:
    return {
        "rope_export_version": __version__,
        "model_type": model.config.model_type,
        "architecture": type(model).__name__,
        "kind": kind.name,
        "dtype": dtype,
        "weights": weights or "random",
        "seed": seed,
        "image": geometry.to_dict(),
        "image_token_id": image_token_id(model),
        "positions": {"decoder": POSITIONS[kind.position_rank], "vision": VISION_POSITIONS},
        "components": {name: {"file": FILES[name], "rotations": r.rotations, "rotary_nodes": r.nodes,
                              "how": r.how, "notes": r.notes} for name, r in results.items()},
    }

