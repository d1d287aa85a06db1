"""A transformers causal LM run one decoder layer at a time, in one or more precisions at once.

At real sizes a float32 reference of a half-precision model does not fit beside it (an 8B model is
32 GB in float32); a decoder layer does (0.9 GB). So every precision gets a skeleton of the model
(parameters on the meta device) and the weights arrive a unit at a time (``layer_weights``): first
those outside the layers, then each layer's, which is given to every precision (cast to it: the
float32 reference computes with exactly the file's half-precision weights), run on every case, and
freed before the next.

The layers are called as the model's own forward calls them: one forward per case runs with each
layer replaced by a recorder of its arguments (masks, position embeddings, the cache; none depends
on the hidden states), stopped at the final norm. Then each layer runs on each case's hidden state
with its recorded arguments, updating the case's cache. A last forward per case, with every layer
returning the final hidden state, applies the model's own norm, LM head and any logit soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from rope_export.check.layer_weights import decoder_layers, to_meta


class _Stop(Exception):
    """Raised by the final norm in the recording forward: nothing after the layers is needed yet."""


@dataclass
class _Case:
    inputs: dict  # input_ids, position_ids, attention_mask for the forward
    past: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (key, value), length > 0
    cache: object = None
    hidden: torch.Tensor | None = None
    first_hidden: torch.Tensor | None = None  # the first layer's input, kept for a layer run again
    calls: list = field(default_factory=list)  # per layer: (args after the hidden state, kwargs)
    layer_states: list[np.ndarray] = field(default_factory=list)


@dataclass
class StreamedOutputs:
    """One precision's results: per case, the outputs by graph name, and the hidden state after each layer."""

    dtype: torch.dtype
    outputs: list[dict[str, np.ndarray]]
    layer_states: list[list[np.ndarray]]  # [case][layer] -> [B, S, hidden]


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    from rope_export.runtimes.contract_runners import to_numpy

    return to_numpy(tensor.detach())


def _set(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Make ``model``'s parameter ``name`` (on meta) ``tensor`` in ``dtype`` (shared, not copied, when already so)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    old = module._parameters[leaf]
    value = tensor if tensor.dtype == dtype or not tensor.is_floating_point() else tensor.to(dtype)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)


def _set_all(model: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """``_set`` for each, a tensor named twice (tied) converted once."""
    converted: dict[int, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if id(tensor) not in converted:
            same = tensor.dtype == dtype or not tensor.is_floating_point()
            converted[id(tensor)] = tensor if same else tensor.to(dtype)
        _set(model, name, converted[id(tensor)], dtype)


def _tie(model: nn.Module) -> None:
    """Parameters still on meta that the model ties to an allocated one (a tied LM head): point them at it."""
    try:
        model.tie_weights()
    except TypeError:
        model.tie_weights(recompute_mapping=False)


def _new_cache(case: _Case, dtype: torch.dtype):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    for i, (key, value) in sorted(case.past.items()):
        cache.update(key.to(dtype), value.to(dtype), i)
    return cache


class _Precision:
    def __init__(self, model: nn.Module, dtype: torch.dtype, feeds: list[dict], past_layers: list[int]):
        from rope_export.runtimes.contract_runners import to_torch

        self.model, self.dtype = model, dtype
        self.prefix, self.layers = decoder_layers(model)
        self.cases = []
        for f in feeds:
            t = {k: to_torch(v) for k, v in f.items()}
            past = {}
            for i in past_layers:
                key, value = t[f"past_key_values.{i}.key"], t[f"past_key_values.{i}.value"]
                if key.shape[2]:
                    past[i] = (key, value)
            self.cases.append(_Case({k: t[k] for k in ("input_ids", "attention_mask", "position_ids") if k in t}, past))
        self.past_layers = past_layers

    def _forward(self, case: _Case, cache):
        from rope_export.hf.cache_io import with_cache

        return with_cache(self.model, cache, **case.inputs)

    def record(self) -> None:
        """Each case's input to the first layer and every layer's arguments (see the module doc)."""
        _, norm = self._final_norm()
        for case in self.cases:
            case.cache = _new_cache(case, self.dtype)

            def recorder(*args, case=case, **kwargs):
                if "hidden_states" in kwargs:
                    hidden = kwargs.pop("hidden_states")
                else:
                    hidden, args = args[0], args[1:]
                if case.hidden is None:
                    case.hidden = case.first_hidden = hidden
                case.calls.append((args, kwargs))
                return hidden

            def stop(*args, **kwargs):
                raise _Stop

            for layer in self.layers:
                layer.forward = recorder
            norm.forward = stop
            try:
                self._forward(case, case.cache)
            except _Stop:
                pass
            finally:
                for layer in self.layers:
                    del layer.forward
                del norm.forward
            if len(case.calls) != len(self.layers):
                raise RuntimeError(f"the forward called {len(case.calls)} of {len(self.layers)} decoder layers")

    def _final_norm(self):
        parent = self.model.get_submodule(self.prefix.rpartition(".")[0]) if "." in self.prefix else self.model
        for name in ("norm", "final_layernorm", "ln_f", "final_norm"):
            if isinstance(getattr(parent, name, None), nn.Module):
                return name, getattr(parent, name)
        raise RuntimeError(f"no final norm found beside {self.prefix}")

    def run_layer(self, index: int) -> None:
        layer = self.layers[index]
        with torch.no_grad():
            for case in self.cases:
                args, kwargs = case.calls[index]
                out = layer(case.hidden, *args, **kwargs)
                case.hidden = out if isinstance(out, torch.Tensor) else out[0]
                case.layer_states.append(_to_numpy(case.hidden))

    def finish(self) -> StreamedOutputs:
        outputs = []
        for case in self.cases:
            final = case.hidden
            for layer in self.layers:
                layer.forward = lambda *args, final=final, **kwargs: final
            try:
                with torch.no_grad():
                    out = self._forward(case, _new_cache(case, self.dtype))
            finally:
                for layer in self.layers:
                    del layer.forward
            result = {"logits": _to_numpy(out.logits)}
            del out  # that forward's cache holds only the past: the presents are the streamed layers' cache
            for i in self.past_layers:
                cache_layer = case.cache.layers[i]
                result[f"present.{i}.key"] = _to_numpy(cache_layer.keys)
                result[f"present.{i}.value"] = _to_numpy(cache_layer.values)
            outputs.append(result)
        return StreamedOutputs(self.dtype, outputs, [c.layer_states for c in self.cases])


class LayerStream:
    """The causal LM in each of ``dtypes``, run a layer at a time (``run``); after the run, any one layer can run
    again on chosen cases with its inputs and arguments as they were (``rerun_layer``: what ``check`` records the
    intermediate values of, to say which op of a layer loses precision).

    ``weights``: a ``layer_weights`` source (``outside()``, ``layer(i)``, ``count``)."""

    def __init__(self, auto_class, config, weights, dtypes: list[torch.dtype], feeds: list[dict],
                 past_layers: list[int], options: dict):
        from rope_export.check.layer_weights import skeleton

        self.weights = weights
        self.runs = [_Precision(skeleton(auto_class, config, dtype, options), dtype, feeds, past_layers)
                     for dtype in dtypes]

    def run(self, say=lambda message: None) -> list[StreamedOutputs]:
        """Every case through every layer, per precision (the module doc)."""
        weights, runs = self.weights, self.runs
        say("layer-streamed reference: weights outside the decoder layers")
        outside = weights.outside()
        for run in runs:
            _set_all(run.model, outside, run.dtype)
            _tie(run.model)
            missing = [n for n, p in run.model.named_parameters() if p.device.type == "meta"
                       and not n.startswith(run.prefix + ".")]
            if missing:
                raise RuntimeError(f"no weights for {', '.join(missing[:3])}")
            run.record()
        del outside
        for index in range(weights.count):
            say(f"layer-streamed reference: decoder layer {index + 1}/{weights.count}")
            tensors = weights.layer(index)
            for run in runs:
                _set_all(run.model, tensors, run.dtype)
                run.run_layer(index)
                to_meta(run.layers[index])
            del tensors
        results = [run.finish() for run in runs]
        for run in runs:
            to_meta(run.model)
        getattr(weights, "release_outside", lambda: None)()  # kept for rerun_layer: only what redraws a layer
        return results

    def rerun_layer(self, index: int, cases: list[int], recording) -> list[list[dict]]:
        """Layer ``index`` once more on each of ``cases`` (indices), per precision, from its input in that
        precision's run and with a fresh cache holding the feeds' past; ``recording(layer)`` is a context manager
        yielding a dict it fills while the layer runs. Returns [precision][case] -> that dict."""
        from rope_export.runtimes.contract_runners import to_torch

        tensors = self.weights.layer(index)
        results = []
        try:
            for run in self.runs:
                _set_all(run.model, tensors, run.dtype)
                per_case = []
                for k in cases:
                    case = run.cases[k]
                    hidden = case.first_hidden if index == 0 else to_torch(case.layer_states[index - 1])
                    args, kwargs = _fresh_cache(case.calls[index], _new_cache(case, run.dtype))
                    with torch.no_grad(), recording(run.layers[index]) as values:
                        run.layers[index](hidden, *args, **kwargs)
                    per_case.append(values)
                results.append(per_case)
                to_meta(run.layers[index])
        finally:
            del tensors
        return results


def _fresh_cache(call, cache):
    """A layer's recorded (args, kwargs) with the case's cache object replaced by ``cache``."""
    from transformers.cache_utils import Cache

    args, kwargs = call
    return (tuple(cache if isinstance(a, Cache) else a for a in args),
            {k: cache if isinstance(v, Cache) else v for k, v in kwargs.items()})


def stream_causal_lm(auto_class, config, weights, dtypes: list[torch.dtype], feeds: list[dict],
                     past_layers: list[int], options: dict, say=lambda message: None) -> list[StreamedOutputs]:
    """Run every case (graph feeds by name) through the model in each of ``dtypes``, a layer at a time
    (``LayerStream.run``)."""
    return LayerStream(auto_class, config, weights, dtypes, feeds, past_layers, options).run(say)
