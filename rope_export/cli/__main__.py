"""``python -m rope_export.cli``: the same as the ``rope-export`` command."""

import sys

from rope_export.cli import main

sys.exit(main())
