"""``python -m overrep`` = the ``overrep`` command."""

import sys

from .cli import main

sys.exit(main())
