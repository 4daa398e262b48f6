"""``python -m moe.plan ...``: see `moe.plan.cli`."""

import sys

from .cli import main

sys.exit(main())
