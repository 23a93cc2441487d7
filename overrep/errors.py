"""The one exception type users see.

Every failure a user can cause (a wrong path, an impossible ratio, an unsupported
architecture, a corrupt cache, a diverging loss) raises :class:`OverRepError` with a
one-line message that names the problem and, where possible, the fix. The CLI prints
it as ``overrep: error: <message>`` and exits with status 2.
"""


class OverRepError(RuntimeError):
    """A user-facing error with a one-line, specific message."""


class MergeRefused(OverRepError):
    """Folding an overcomplete module was asked for while its annealed activation is not
    yet the identity (the fold is exact only at alpha = 0)."""


class WarmStartTooShort(OverRepError):
    """A time budget leaves a warm start fewer optimiser steps than its floor. Under
    ``recovery.warm_start: auto`` the run starts cold instead; a warm start asked for by name
    stops with this message. ``why``: the shortfall in a few words, for ``metrics.json``;
    ``timed``: the probe's figures, which the cold start reuses rather than time itself again."""

    def __init__(self, message: str, why: str, timed: tuple | None = None):
        super().__init__(message)
        self.why, self.timed = why, timed


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors span many lines)."""
    for line in str(error).splitlines():
        if line.strip():
            return line.strip()
    return type(error).__name__
