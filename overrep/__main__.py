"""``python -m overrep`` = the ``overrep`` command."""

import sys

from .app.cli import main

sys.exit(main())
