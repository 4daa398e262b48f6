"""``python -m moe``: the same as the ``moe`` command."""

import sys

from .cli import main

sys.exit(main())
