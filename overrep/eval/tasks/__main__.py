"""``python -m overrep.eval.tasks [DIR]``: write lm-eval's offline task folder and print its path."""

import sys

from ..tasks import main

sys.exit(main())
