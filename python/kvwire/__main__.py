"""``python -m kvwire ...``: the ``kvwire`` command (``kvwire.tools.cli``) without the console script."""

import sys

from .tools.cli import main

sys.exit(main())
