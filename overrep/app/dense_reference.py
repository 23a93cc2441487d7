"""``make reference``: the default run's dense figures, fp32 and bf16, written into the package
(:mod:`overrep.eval.reference`), from the model and rows the default run loads."""

from __future__ import annotations

import argparse
import logging

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
    p = Pipeline(RunConfig.load(overrides=args.set), progress=True)
    p.load(create_output=False)
    print(write(p.dense, p.tokenizer, p.eval_data, source=shipped_source(p.model_info), precision=args.precision,
                machine=processor(p.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
