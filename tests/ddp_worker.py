"""``overrep``'s command line as one ``torchrun`` rank, for the multi-process tests.

With ``OVERREP_TEST_KILL=R:S`` in the environment, rank R dies as it starts step S, by
SIGKILL (like ``kill -9``: no handler runs, nothing is saved).
"""

import os
import signal
import sys

from overrep.app.cli import main
from overrep.recovery.trainer import Trainer

if os.environ.get("OVERREP_TEST_KILL"):
    rank, at = map(int, os.environ["OVERREP_TEST_KILL"].split(":"))
    if int(os.environ.get("RANK", "0")) == rank:
        step = Trainer._step

        def dying(self):
            if self.step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self)

        Trainer._step = dying

sys.exit(main(sys.argv[1:]))
