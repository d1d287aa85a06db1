"""Trained-like statistics planted into a (random-weight) transformers decoder, for half-precision checks.

Random weights hide what trained weights do to half precision. Trained LLMs have:

* **massive activations** (Sun et al. 2024, "Massive Activations in Large Language Models"): a few
  residual channels carry values of hundreds to thousands at a few tokens (the first token,
  delimiters), constant across layers; their squares overflow float16 (max 65504), so a norm
  whose statistics are computed in float16 returns nonsense for those tokens;
* **outlier features** (Dettmers et al. 2022, LLM.int8()): a channel some tens of times larger
  than the rest on most tokens;
* **attention sinks and large logits**: queries of every token and keys of the massive tokens
  share a few low-frequency rotary dims, so attention logits reach tens and the softmax is peaked;
  a softmax in float16 then rounds exp(logit - max) to a few bits.

``plant_trained_statistics`` writes these into a model's weights in place, from a seed: embedding
rows of a few "sink" token ids carry the massive channels, every embedding row the outlier feature;
the norms' weights vary by channel (small on the massive channels, as trained models learn); each
layer's q/k projections read the outlier feature (queries) and the massive channels (keys) into the
lowest-frequency rotary pair of every head, scaled so the sink logits reach ``sink_logit``; values
read the massive channels weakly. The layers' inputs are measured by one probe forward, so the
sizes hold at any hidden size. It needs the Llama-family names (``embed_tokens``/input embeddings,
``q_proj``, ``k_proj``, ``v_proj``, norms with a per-channel ``weight``) and says so otherwise.

``measure_statistics`` reports what a model's forward shows (largest residual activation against
the median, largest attention logit, attention mass on the sinks): the planting is checked by what
it does, not assumed. Save the planted model with ``save_pretrained`` and export/check the folder
like a real checkpoint (docs/checking.md, "Half precision with real weights").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PlantedStatistics:
    """Where the statistics were planted (channel indices into the hidden size, token ids, head dims)."""

    massive_channels: tuple[int, ...]
    outlier_channel: int
    sink_tokens: tuple[int, ...]
    qk_dims: tuple[int, ...]  # the rotary pair of every head that queries and sink keys share
    massive: float
    sink_logit: float

    def describe(self) -> str:
        return (f"massive activations {self.massive:g} in channels {list(self.massive_channels)} at tokens "
                f"{list(self.sink_tokens)[:8]}{' ...' if len(self.sink_tokens) > 8 else ''}; outlier feature in "
                f"channel {self.outlier_channel}; q/k outlier dims {list(self.qk_dims)} of every head (sink logits "
                f"about {self.sink_logit:g})")


@dataclass(frozen=True)
class Statistics:
    """What one forward shows: the residual stream's largest |value| and its median, attention logits."""

    max_activation: float
    median_activation: float
    max_logit: float
    sink_attention: float  # mean attention weight of the non-sink queries on sink keys (0 without sinks)

    @property
    def massive_ratio(self) -> float:
        return self.max_activation / max(self.median_activation, 1e-30)


def _parts(model: nn.Module):
    """(embedding, attention modules, norm modules) or a ValueError naming what is missing."""
    from rope_export.hf.cache_io import attention_layers

    embedding = model.get_input_embeddings()
    attentions = attention_layers(model)
    missing = [name for name in ("q_proj", "k_proj", "v_proj") if attentions and not
               isinstance(getattr(attentions[0], name, None), nn.Linear)]
    if not isinstance(embedding, nn.Embedding) or not attentions or missing:
        raise ValueError(f"{type(model).__name__}: planting needs an nn.Embedding and attention layers with "
                         f"q_proj/k_proj/v_proj linears (Llama-family names); missing: "
                         f"{', '.join(missing) or 'the embedding or the attention layers'}")
    hidden = embedding.weight.shape[1]
    norms = [m for name, m in model.named_modules() if "norm" in name.rsplit(".", 1)[-1].lower()
             and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.shape == (hidden,)]
    return embedding, attentions, norms


def _head_dim(attention: nn.Module) -> int:
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int):
        raise ValueError(f"{type(attention).__name__} has no integer head_dim")
    return head_dim


def plant_trained_statistics(model: nn.Module, *, seed: int = 0, massive: float = 1000.0,
                             outlier_feature: float = 6.0, sink_logit: float = 40.0, sink_fraction: float = 0.125,
                             logit_std: float = 4.0) -> PlantedStatistics:
    """Give ``model`` trained-like statistics in place (module doc); returns where they are.

    ``massive``: the massive channels' value at sink tokens; ``outlier_feature``: the outlier channel's size in
    units of a typical channel; ``sink_logit``: the attention logit (after scaling) of a query on a sink key;
    ``sink_fraction``: the share of token ids that are sinks; ``logit_std``: the spread of the other logits."""
    embedding, attentions, norms = _parts(model)
    generator = torch.Generator().manual_seed(seed)
    vocab, hidden = embedding.weight.shape
    if hidden < 8:
        raise ValueError(f"hidden size {hidden} is too small to plant into (at least 8)")
    channels = torch.randperm(hidden, generator=generator)[:3].tolist()
    massive_channels, outlier_channel = tuple(sorted(channels[:2])), channels[2]
    sinks = tuple(sorted(torch.randperm(vocab, generator=generator)[:max(1, round(vocab * sink_fraction))].tolist()))
    head_dim = _head_dim(attentions[0])
    qk_dims = (head_dim // 2 - 1, head_dim - 1)  # rotate-half's lowest-frequency pair (i, i + D/2)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator)

    with torch.no_grad():
        table = torch.randn(vocab, hidden, generator=generator)  # trained embeddings: rows of RMS about 1
        table[:, outlier_channel] = outlier_feature * uniform(vocab, 0.8, 1.2)
        for k, channel in enumerate(massive_channels):
            table[list(sinks), channel] = (-1) ** k * massive * uniform(len(sinks), 0.7, 1.3)
        embedding.weight.copy_(table)
        for norm in norms:  # per-channel gains; the massive channels nearly switched off
            gains = uniform(hidden, 0.5, 1.5)
            gains[list(massive_channels)] = uniform(len(massive_channels), 0.02, 0.05)
            norm.weight.copy_(gains)
        for attention in attentions:
            for name in ("q_proj", "k_proj"):
                linear = getattr(attention, name)
                rows, cols = linear.weight.shape
                linear.weight.copy_(torch.randn(rows, cols, generator=generator) * logit_std ** 0.5 / cols ** 0.5)
            attention.v_proj.weight[:, list(massive_channels)] *= 0.01  # sinks carry small values
    inputs = _probe_inputs(vocab, sinks, generator)
    queries, keys = _qk_inputs(model, attentions, inputs, sinks, outlier_channel, massive_channels)
    scale = head_dim ** -0.5
    per_dim = (sink_logit / scale / len(qk_dims)) ** 0.5  # q_d = k_d = per_dim on each shared dim
    with torch.no_grad():
        for attention, q_in, k_in in zip(attentions, queries, keys, strict=True):
            q_weight, k_weight = attention.q_proj.weight, attention.k_proj.weight
            for head in range(q_weight.shape[0] // head_dim):
                for dim in qk_dims:
                    q_weight[head * head_dim + dim].zero_()
                    q_weight[head * head_dim + dim, outlier_channel] = per_dim / q_in
            for head in range(k_weight.shape[0] // head_dim):
                for dim in qk_dims:
                    k_weight[head * head_dim + dim].zero_()
                    for channel, value in zip(massive_channels, k_in, strict=True):
                        k_weight[head * head_dim + dim, channel] = per_dim / len(massive_channels) / value
    return PlantedStatistics(massive_channels, outlier_channel, sinks, qk_dims, massive, sink_logit)


def _probe_inputs(vocab: int, sinks: tuple[int, ...], generator: torch.Generator, length: int = 32) -> torch.Tensor:
    """Token ids with a sink first and about one in four a sink."""
    ids = torch.randint(0, vocab, (1, length), generator=generator)
    every = torch.arange(length) % 4 == 0
    ids[0, every] = torch.tensor(sinks)[torch.randint(0, len(sinks), (int(every.sum()),), generator=generator)]
    return ids


def _qk_inputs(model, attentions, ids, sinks, outlier_channel, massive_channels):
    """Per layer: the mean normalized outlier channel over non-sink tokens (what queries read), and the mean
    signed massive channels over sink tokens (what sink keys read), from one probe forward."""
    seen: list[torch.Tensor] = []
    handles = [a.q_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().float()))
               for a in attentions]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    is_sink = torch.isin(ids[0], torch.tensor(sinks))
    queries, keys = [], []
    for x in seen:
        queries.append(float(x[0, ~is_sink, outlier_channel].mean()))
        keys.append(tuple(float(x[0, is_sink, c].mean()) for c in massive_channels))
    if any(abs(q) < 1e-6 for q in queries) or any(abs(v) < 1e-6 for k in keys for v in k):
        raise ValueError("the probe forward shows no outlier feature or massive channel at a layer's input")
    return queries, keys


def measure_statistics(model: nn.Module, input_ids: torch.Tensor, sinks: tuple[int, ...] = ()) -> Statistics:
    """One eager forward (attention weights returned): the residual stream's and the attention's statistics."""
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, output_attentions=True, use_cache=False)
    states = torch.stack([h.float() for h in out.hidden_states[1:]])
    magnitudes = states.abs()
    _, attentions, _ = _parts(model)
    logits = _max_logits(model, attentions, input_ids)
    share = 0.0
    if sinks:
        is_sink = torch.isin(input_ids[0], torch.tensor(sinks))
        weights = torch.stack([a[0].float() for a in out.attentions])  # [layers, heads, q, k]
        share = float(weights[:, :, ~is_sink][..., is_sink].sum(-1).mean()) if (~is_sink).any() else 0.0
    return Statistics(float(magnitudes.max()), float(magnitudes.median()), logits, share)


def _max_logits(model, attentions, input_ids) -> float:
    """The largest attention logit (q.k x scaling) of any layer, from the rotated q and k the attention sees."""
    import sys

    largest = [0.0]
    patched = [m for m in {sys.modules.get(type(a).__module__) for a in attentions}
               if hasattr(m, "eager_attention_forward")]
    saved = [(m, m.eager_attention_forward) for m in patched]

    def recording(original):
        def attention(module, query, key, *args, **kwargs):
            groups = query.shape[1] // key.shape[1]
            scores = query.float() @ key.float().repeat_interleave(groups, 1).transpose(2, 3)
            scaling = kwargs.get("scaling", args[2] if len(args) > 2 else None) or query.shape[-1] ** -0.5
            largest[0] = max(largest[0], float(scores.max()) * scaling)
            return original(module, query, key, *args, **kwargs)
        return attention

    try:
        for m, original in saved:
            m.eager_attention_forward = recording(original)
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for m, function in saved:
            m.eager_attention_forward = function
    return largest[0]
