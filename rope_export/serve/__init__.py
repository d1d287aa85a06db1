"""Serving stacks: folders a server or runtime loads as they are (``genai``: onnxruntime-genai).

Each stack is its own module, imported lazily by the ``package`` command; this file imports nothing.
"""
