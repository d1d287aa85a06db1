"""The one error type of rope_export.hf."""

from __future__ import annotations

from rope_export.exporting.core import ExportError


class HFExportError(ExportError):
    """A transformers model or config that cannot be exported; the message names the fix."""
