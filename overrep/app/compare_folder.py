"""What a comparison grid's folder keeps, and whose machine it is.

A grid of the headline's size is tens of hours on a 2-core CPU: more than one sitting, so it is
built up over several, and its finished cells must outlive the machine's scratch space. Each
cell's request, ``metrics.json``, training log, report and error are small (tens of kB); its
model, checkpoints and features are not. :func:`prepare` writes a ``.gitignore`` into the grid
folder that leaves the large parts out, so the folder can be committed as it grows: a later
``overrep compare`` on a checkout of it finds every finished cell by its settings and runs only
the cells it lacks (RP of a cell whose model was left out comes from the benchmark results kept
in ``benchmarks/``, or is missing).

Seconds and step counts compare only on one machine, so :func:`check_machine` refuses to add
cells to a grid whose finished cells ran on another one: one grid (and one table) is one machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import OverRepError

#: what a grid's ``.gitignore`` leaves out: large, and rebuilt where they are needed
IGNORED = ["cache/", "cells/*/model/", "cells/*/pruned-model/", "cells/*/checkpoints/", "cells/*/plots/"]


def prepare(out: Path) -> None:
    """Create the grid folder ``out`` with its ``.gitignore`` (an existing one is left as it is)."""
    out.mkdir(parents=True, exist_ok=True)
    ignore = out / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# Written by `overrep compare`: the grid's requests, metrics, logs, reports and benchmark\n"
                          "# results can be kept under version control, so that the grid is built up over several\n"
                          "# sittings; its models, checkpoints, features and per-cell plots are large and left out.\n"
                          + "\n".join(IGNORED) + "\n")


def machines(out: Path) -> dict[str, str]:
    """The machine each finished cell of the grid in ``out`` ran on (cell folder name: machine)."""
    found = {}
    for path in sorted((out / "cells").glob("*/metrics.json")):
        try:
            machine = (json.loads(path.read_text()).get("environment") or {}).get("machine")
        except (OSError, ValueError):
            continue  # unreadable: the grid says so when it reads the cell
        if machine:
            found[path.parent.name] = machine
    return found


def check_machine(out: Path, here: str) -> None:
    """Refuse to run a cell on machine ``here`` in a grid whose finished cells ran elsewhere."""
    other = sorted({m for m in machines(out).values() if m != here})
    if other:
        raise OverRepError(f"{out} holds cells run on {', '.join(other)}; this machine is {here}: one grid is one "
                           "machine (its seconds and steps compare only there), so give this one a grid of its own "
                           "with --output (--collect-only still writes the existing grid's tables)")
