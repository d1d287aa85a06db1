"""matplotlib is optional: plots are made when it is installed and skipped (not failed) without it."""

from __future__ import annotations

import os

from rope_export.common.fileio import atomic_path


def pyplot_or_none():
    """matplotlib.pyplot on the non-interactive Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_png(fig, path: str | os.PathLike) -> None:
    """Write the figure atomically, then free it."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
