"""Settings for the transformers tests (tests/hf mirrors rope_export/hf)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/hf holds the zoo's helpers (hf_zoo.py, hf_zoo_configs.py)
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
