"""A transformers causal LM's weights one decoder layer at a time, for the layer-streamed reference.

Two sources, each giving the weights outside the decoder layers (embeddings, final norm, LM head)
once and then each layer's on request, in the dtype they are stored in:

* ``CheckpointWeights``: a safetensors checkpoint (``save_pretrained``), read tensor by tensor from
  its headers' offsets; names must match the model's one to one (what ``build_causal_lm`` reads
  itself; a renamed or fused checkpoint is refused and check uses the whole-model reference).
* ``RandomWeights``: the random weights ``build_causal_lm`` draws for a seed, drawn again a layer at
  a time. transformers initializes module by module in one post-order walk under one global RNG
  (``PreTrainedModel.initialize_weights``), so a layer's draws depend only on the RNG state when the
  walk reaches it. A first walk draws everything in order, keeping the weights outside the layers
  (a tied LM head redraws the embedding at the end of the walk, so those are only final then) and
  the RNG state at each layer; ``layer(i)`` restores that state and redraws layer ``i`` alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rope_export.check.model_file import CheckError


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: the longest ModuleList named ``layers`` (or ``h``), and its qualified name."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h") and len(module)]
    if not found:
        raise CheckError(f"{type(model).__name__} has no list of decoder layers (a ModuleList named 'layers' or 'h'), "
                         "so it cannot be run layer by layer")
    return max(found, key=lambda item: len(item[1]))


def skeleton(auto_class, config, dtype: torch.dtype, options: dict) -> nn.Module:
    """The model with every parameter on the meta device (buffers real), as ``build_causal_lm`` constructs it."""
    from rope_export.hf.checkpoints import default_dtype, parameters_on_meta

    with parameters_on_meta(), default_dtype(dtype):
        model = auto_class.from_config(config, **{"attn_implementation": "eager", **options, "dtype": dtype})
    return model.eval()


def to_meta(module: nn.Module) -> None:
    """Every allocated parameter of ``module`` back on the meta device (freed where nothing else holds it)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.device.type != "meta":
                sub._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


def _layer_index(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    return int(name[len(prefix) + 1:].split(".", 1)[0])


class CheckpointWeights:
    """Tensors read from a safetensors checkpoint by name (see the module doc)."""

    def __init__(self, folder: str | Path, model: nn.Module):
        from rope_export.hf.checkpoint_files import CheckpointError, CheckpointReader

        try:
            self.reader = CheckpointReader(folder, model)
        except CheckpointError as exc:
            raise CheckError(f"{exc}, so it cannot be read a layer at a time") from None
        self.prefix, layers = decoder_layers(model)
        self.count = len(layers)

    def outside(self) -> dict[str, torch.Tensor]:
        return self.reader.read([n for n in self.reader.names if _layer_index(n, self.prefix) is None])

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return self.reader.read([n for n in self.reader.names if _layer_index(n, self.prefix) == index])


class RandomWeights:
    """``build_causal_lm``'s random weights of ``seed``, redrawn a layer at a time (see the module doc)."""

    def __init__(self, auto_class, config, dtype: torch.dtype, seed: int, options: dict):
        self.model = skeleton(auto_class, config, dtype, options)
        self.dtype, self.seed = dtype, seed
        self.prefix, self.layers = decoder_layers(self.model)
        self.count = len(self.layers)
        # id(meta parameter) -> (it, its allocation): tied parameters allocated once, as materialize() does; the
        # meta parameter is kept alive so that its id is never reused while the entry exists
        self._made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._states: dict[int, torch.Tensor] = {}
        self._walks: dict[int, list] = {}
        self._outside: dict[str, torch.Tensor] | None = None

    def _visits(self):
        """(module, init function, layer index or None) in transformers' smart_apply order."""
        from transformers import PreTrainedModel

        custom = self.model.is_custom_code()
        layer_of = {id(module): i for i, module in enumerate(self.layers)}

        def walk(module, fn, layer):
            for child in module.children():
                inner = layer_of.get(id(child), layer)
                yield from walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn, inner)
            yield module, fn, layer

        for module, fn, layer in walk(self.model, self.model._initialize_weights, None):
            yield module, (lambda m, fn=fn: fn(m, custom)), layer

    def _allocate(self, module: nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param.device.type == "meta":
                if id(param) not in self._made:
                    kind = self.dtype if param.dtype.is_floating_point else param.dtype
                    self._made[id(param)] = (param, nn.Parameter(torch.empty(param.shape, dtype=kind),
                                                                 requires_grad=param.requires_grad))
                module._parameters[name] = param = self._made[id(param)][1]
            param.__dict__.pop("_is_hf_initialized", None)
        module.__dict__.pop("_is_hf_initialized", None)

    def _free_layer(self, index: int) -> None:
        freed = set()
        for module in self.layers[index].modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type != "meta":
                    freed.add(id(param))
                    module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        self._made = {k: v for k, v in self._made.items() if id(v[1]) not in freed}

    def _first_walk(self) -> None:
        from rope_export.hf.checkpoints import default_dtype

        saved = torch.get_rng_state()
        torch.manual_seed(self.seed)
        current = None
        with torch.no_grad(), default_dtype(self.dtype):
            for module, init, layer in self._visits():
                if layer is not None and layer not in self._states:
                    if current is not None:
                        self._free_layer(current)
                    self._states[layer], self._walks[layer], current = torch.get_rng_state(), [], layer
                if layer is not None:
                    self._walks[layer].append((module, init))
                elif current is not None:
                    self._free_layer(current)
                    current = None
                self._allocate(module)
                init(module)
            if current is not None:
                self._free_layer(current)
        torch.set_rng_state(saved)
        prefix = self.prefix + "."
        self._outside = {name: p.detach() for name, p in self.model.named_parameters(remove_duplicate=False)
                         if not name.startswith(prefix) and p.device.type != "meta"}

    def outside(self) -> dict[str, torch.Tensor]:
        if self._outside is None:
            self._first_walk()
        return self._outside

    def release_outside(self) -> None:
        """Free the weights outside the layers (the embedding, the LM head) once they are given; the layers can
        still be redrawn (``layer``), for a layer run again."""
        if self._outside is not None:
            to_meta(self.model)
            self._outside, self._made = {}, {}

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        from rope_export.hf.checkpoints import default_dtype

        if not self._states:
            self._first_walk()
        saved = torch.get_rng_state()
        torch.set_rng_state(self._states[index])
        with torch.no_grad(), default_dtype(self.dtype):
            for module, init in self._walks[index]:
                self._allocate(module)
                init(module)
        torch.set_rng_state(saved)
        prefix = f"{self.prefix}.{index}."
        out = {prefix + name: p.detach() for name, p in self.layers[index].named_parameters(remove_duplicate=False)}
        self._free_layer(index)
        return out
