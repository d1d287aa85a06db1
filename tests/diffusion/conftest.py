"""Settings for the diffusers tests (tests/diffusion mirrors rope_export/diffusion)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/diffusion holds the tiny configs (tiny_configs.py)
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
