"""Tables that stay whole in an 80-column terminal and in logs.

Rich cuts a cell that does not fit with an ellipsis ("llama-…", "onnxruntim…"), which loses the very
name a user must type. Here: no vertical rules (two characters per column saved), a cell that still
does not fit folds onto the next line instead of being cut, and the columns named in ``keep`` (the
names) are the last to be narrowed. Written to a pipe or a log, the console is 160 columns wide
whatever ``COLUMNS`` says, so each row stays on one line.
"""

from __future__ import annotations

LOG_WIDTH = 160


def console():
    """A rich Console for the command's output: the terminal's width, or LOG_WIDTH when not a terminal."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=LOG_WIDTH)


def table(title: str, columns, keep=()):
    """A rich Table with ``columns`` (their headings); cells are folded, never cut, and the ``keep`` columns
    are not wrapped while the others can be."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in columns:
        t.add_column(column, no_wrap=column in keep, overflow="fold")
    return t


def print_table(console, t) -> None:
    """Print ``t`` whole: when its rows do not fit the console on one line each, every column but the
    ``keep`` ones is set to its longest word (header and cells), so cells wrap at spaces and no name is cut."""
    from rich.text import Text

    def plain(cell) -> str:
        return Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)

    texts = [[plain(c) for c in (column.header, *column._cells)] for column in t.columns]
    full = [max(len(x) for x in column) for column in texts]
    if sum(full) + 2 * len(full) <= console.width:
        console.print(t)
        return
    for column, cells, width in zip(t.columns, texts, full, strict=True):
        word = max((len(w) for x in cells for w in x.split()), default=1)
        column.min_width = column.max_width = width if column.no_wrap else word
    console.print(t)
