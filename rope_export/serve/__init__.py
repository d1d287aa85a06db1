"""Serving stacks: what a server or runtime loads as it is (``genai``: an onnxruntime-genai folder;
``triton``: a Triton Inference Server model repository).

Each stack is its own module, imported lazily by the ``package`` command; this file imports nothing.
"""
