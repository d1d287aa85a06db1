"""Settings for the graph-pass tests (tests/passes mirrors rope_export/passes)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/ holds shared helpers (exported.py); tests/passes holds passes_util.py
for folder in (Path(__file__).parent, Path(__file__).parent.parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
