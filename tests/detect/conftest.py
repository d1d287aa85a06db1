"""Settings for the detection tests (tests/detect mirrors rope_export/detect)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/ holds the shared block zoo (rope_blocks.py); tests/passes holds the transformers exports
for folder in (Path(__file__).parent.parent, Path(__file__).parent.parent / "passes"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
