"""Errors the command line prints as one line: raised from any layer, caught by ``rope_export.cli``."""

from __future__ import annotations


class CLIError(Exception):
    """An error the user can fix; printed as one line without a traceback, exit code 2."""
