"""``python -m rope_export.bench``: the same as ``rope-export bench``."""

from rope_export.bench import main

raise SystemExit(main())
