"""``make reference``: the default run's dense figures, fp32 and bf16, written into the package
(:mod:`overrep.eval.reference`), from the model and rows the default run loads."""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

from ..eval.reference import shipped_source, write
from .config import RunConfig
from .pipeline import Pipeline
from .runinfo import processor


def main(argv: list[str] | None = None) -> int:
    """``make reference``: the default run's dense figures in one precision, into the package."""
    ap = argparse.ArgumentParser(prog="python -m overrep.app.dense_reference", description=main.__doc__)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="one a process: its checked rows are timed as a run's first dense scoring")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (the default: none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # an empty cache, as on a first run, the one that reads the entry: the model converted in this
    # process, the criterion computed and the pruned copy made before the checked rows are timed
    # (after an in-process conversion and the copy, those rows measured 1.16-1.28x their time in a
    # process that had done neither; the family 6 model 167 Xeon, bf16)
    before = os.environ.get("OVERREP_CACHE")
    with tempfile.TemporaryDirectory(prefix="overrep-reference-") as empty:
        os.environ["OVERREP_CACHE"] = empty
        try:
            p = Pipeline(RunConfig.load(overrides=args.set), progress=True)
            p.prepare(recovery=False, create_output=False)  # loaded and pruned, as a run scores the dense model
            print(write(p.dense, p.tokenizer, p.eval_data, source=shipped_source(p.model_info),
                        precision=args.precision, machine=processor(p.device)))
        finally:  # the caller's cache again (the folder is gone)
            if before is None:
                os.environ.pop("OVERREP_CACHE", None)
            else:
                os.environ["OVERREP_CACHE"] = before
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
