"""Tiny random-weight transformers models, built offline from configs, exported to ONNX.

The exported module is one attention layer with its rotary embedding (``rotary_emb`` +
``self_attn``; GPT-J's attention computes its own sin/cos): the RoPE code is the family's own,
and the graph stays small. Files are made once per session.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings

import onnx
import torch

FAMILIES = ("llama", "qwen2", "phi", "gpt_neox", "gptj")
EXPORTERS = ("torchscript", "dynamo")
HIDDEN = 32

# (form, partial?, layout) each family's attention writes
EXPECTED = {
    "llama": ("rotate-half", False, "bhsd"),
    "qwen2": ("rotate-half", False, "bhsd"),
    "phi": ("rotate-half", True, "bhsd"),
    "gpt_neox": ("rotate-half", True, "bhsd"),
    "gptj": ("interleaved", True, "bshd"),
}


def config(family: str):
    import transformers as tf

    common = dict(vocab_size=64, max_position_embeddings=32, use_cache=False)
    configs = {
        "llama": lambda: tf.LlamaConfig(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, **common),
        "qwen2": lambda: tf.Qwen2Config(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=64,
                                        num_attention_heads=4, num_key_value_heads=2, **common),
        "phi": lambda: tf.PhiConfig(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=64,
                                    num_attention_heads=2, partial_rotary_factor=0.5, **common),
        "gpt_neox": lambda: tf.GPTNeoXConfig(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=64,
                                             num_attention_heads=2, rotary_pct=0.25, **common),
        # n_positions 32: onnx.reference's GatherElements (np.choose) takes at most 32 rows
        "gptj": lambda: tf.GPTJConfig(n_layer=1, n_embd=HIDDEN, n_head=2, rotary_dim=8, n_positions=32,
                                      vocab_size=64, use_cache=False),
    }
    return configs[family]()


class Attention(torch.nn.Module):
    """The model's first attention layer fed as its decoder feeds it, found through the product's own helpers
    (rope_export.hf), so a transformers refactor (GPT-J's rotary module in 5.24) changes one place."""

    def __init__(self, family: str, model):
        super().__init__()
        from rope_export.hf import attention_layers, rotary_module

        self.family = family
        self.attn, self.rot = attention_layers(model)[0], rotary_module(model)

    def forward(self, hidden, position_ids):
        if self.rot is None:  # the attention computes its own angles (GPT-J before transformers 5.24)
            return self.attn(hidden, position_ids=position_ids)[0]
        return self.attn(hidden, position_embeddings=self.rot(hidden, position_ids), attention_mask=None)[0]


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript",
                                              "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def example(dtype: torch.dtype = torch.float32, batch: int = 2, seq: int = 7, offset: int = 3):
    hidden = torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = torch.stack([torch.arange(seq) + i * offset for i in range(batch)])
    return hidden, positions


@functools.cache
def exported(family: str, exporter: str, dtype: str = "float32", opset: int | None = None) -> onnx.ModelProto:
    """``opset``: dynamo only (at >= 23 torch.onnx's optimizer writes ai.onnx RotaryEmbedding itself)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
    torch.manual_seed(0)
    with _quiet():
        model = AutoModelForCausalLM.from_config(config(family), attn_implementation="eager").eval().to(torch_dtype)
        module = Attention(family, model)
        args = example(torch_dtype, seq=4)
        names = dict(input_names=["hidden", "position_ids"], output_names=["out"])
        with torch.no_grad():
            if exporter == "dynamo":
                batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
                program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=({0: batch, 1: seq},) * 2,
                                            verbose=False, opset_version=opset, **names)
                return program.model_proto
            buffer = io.BytesIO()
            axes = {0: "batch", 1: "seq"}
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=17,
                              dynamic_axes={"hidden": axes, "position_ids": axes}, **names)
            return onnx.load_from_string(buffer.getvalue())


@functools.cache
def exported_causal_lm(family: str = "llama") -> onnx.ModelProto:
    """A whole one-layer model (embeddings, mask, MLP, head) through the dynamo exporter.

    The TorchScript exporter cannot export transformers 5's mask code (aten::diff)."""
    return export_causal_lm(config(family))


def export_causal_lm(model_config, opset: int = 18) -> onnx.ModelProto:
    """A whole model from ``model_config`` (random weights) through the dynamo exporter, logits out."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)

    class LM(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids):
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    with _quiet():
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="eager").eval()
        ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(4).expand(2, -1).contiguous()
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        with torch.no_grad():
            program = torch.onnx.export(LM(model), (ids, positions), dynamo=True, verbose=False, opset_version=opset,
                                        input_names=["input_ids", "position_ids"], output_names=["logits"],
                                        dynamic_shapes=({0: batch, 1: seq},) * 2)
    return program.model_proto
