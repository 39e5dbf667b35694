"""``python -m fxlite``: the same as the ``fxlite`` command."""

import sys

from .cli import main

sys.exit(main())
