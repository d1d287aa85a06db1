"""Packaging exported files for serving stacks (``rope-export package ...``).

Each stack has its own module (``triton``: a Triton Inference Server model repository); ``cli``
adds the ``package`` command and one sub-command per stack.
"""
