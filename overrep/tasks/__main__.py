"""``python -m overrep.tasks [DIR]``: write lm-eval's offline task folder and print its path."""

import sys

from . import main

sys.exit(main())
