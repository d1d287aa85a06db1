"""The one error class of rope_export.serve: bad input, said in one line (exit 2 at the command line)."""


class ServeError(ValueError):
    """A model, folder or option that a serving package cannot be made from."""
