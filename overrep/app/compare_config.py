"""The YAML of ``overrep compare`` (:class:`CompareConfig`): the grid's base run configuration,
methods and their variants, criteria, ratios, budgets and seeds (see :mod:`overrep.app.compare`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OverRepError
from ..recovery.budget import parse_duration
from ..recovery.methods import METHODS
from ..yamlio import read_yaml
from .config import RunConfig

BUDGETS = ("epochs", "wallclock")  # and durations ("5m", "600s"): see budget_seconds
FREE = "0s"  # the budget label of a method that does not train (a closed form)


def budget_seconds(budget: str) -> float | None:
    """The wall-clock of a duration budget; None for ``epochs`` and ``wallclock``."""
    if budget == FREE:
        return 0.0
    return None if budget in BUDGETS else parse_duration(budget, "compare budget")


@dataclass
class CompareConfig:
    base: dict = field(default_factory=dict)
    methods: list = field(default_factory=lambda: ["overrep", "plain", "lora"])
    criteria: list = field(default_factory=lambda: ["last"])
    ratios: list = field(default_factory=lambda: [0.25])
    budgets: list = field(default_factory=lambda: ["epochs"])
    seeds: list = field(default_factory=lambda: [0])  # recovery.seed of every cell (spread over seeds)
    reference: str = "overrep"
    plans: list | None = None  # [[criterion, ratio], ...]: these pairs instead of every criterion x ratio
    variants: dict = field(default_factory=dict)  # name -> {"method": a method, any run-config sections: overrides}
    benchmarks: dict | None = None  # {"tasks": [...], "limit": N}
    output: str = "runs/compare"

    @classmethod
    def load(cls, path: str | Path | None, overrides: dict | None = None) -> "CompareConfig":
        data = read_yaml(path, "compare config") if path is not None else {}
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        if "plans" in overrides:  # these pairs, whatever the file's criteria, ratios or plans
            if "criteria" in overrides or "ratios" in overrides:
                raise OverRepError("compare: --plans names the (criterion, ratio) pairs; leave out --criteria and --ratios")
            data.pop("criteria", None), data.pop("ratios", None)
        elif data.get("plans") and ("criteria" in overrides or "ratios" in overrides):  # a part of the plans
            keep_c, keep_r = overrides.pop("criteria", None), overrides.pop("ratios", None)
            data["plans"] = [[c, r] for c, r in data["plans"] if (keep_c is None or c in keep_c)
                             and (keep_r is None or float(r) in [float(x) for x in keep_r])]
            if not data["plans"]:
                raise OverRepError("compare: --criteria / --ratios leave none of the config's plans")
        data.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OverRepError(f"unknown compare field '{unknown[0]}'; known: {', '.join(sorted(known))}")
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("methods", "criteria", "ratios", "budgets", "seeds"):
            value = getattr(self, name)
            if isinstance(value, (str, int, float)):
                setattr(self, name, [value])
            if not getattr(self, name):
                raise OverRepError(f"compare: '{name}' is empty")
        if self.plans is not None:
            if not isinstance(self.plans, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in self.plans):
                raise OverRepError("compare: plans must be a list of [criterion, ratio] pairs")
            self.criteria = list(dict.fromkeys(str(c) for c, _ in self.plans))  # for the report's order
            self.ratios = list(dict.fromkeys(float(r) for _, r in self.plans))
        for name, spec in self.variants.items():
            if not isinstance(spec, dict) or spec.get("method") not in METHODS:
                raise OverRepError(f"compare: variant '{name}' needs 'method:' naming one of {', '.join(METHODS)}")
            if name in METHODS:
                raise OverRepError(f"compare: variant '{name}' has the name of a method; give it another")
        bad = [m for m in self.methods if m not in METHODS and m not in self.variants]
        if bad:
            raise OverRepError(f"compare: unknown method '{bad[0]}'; available: {', '.join(METHODS)} "
                               f"and the variants {', '.join(self.variants) or '(none)'}")
        from ..pruning.registry import CRITERIA

        bad = [c for c in self.criteria if c not in CRITERIA]
        if bad:
            raise OverRepError(f"compare: unknown criterion '{bad[0]}'; available: {', '.join(CRITERIA)}")
        self.budgets = [f"{b:g}s" if isinstance(b, (int, float)) else str(b) for b in self.budgets]
        for b in self.budgets:
            try:
                budget_seconds(b)
            except OverRepError:
                raise OverRepError(f"compare: unknown budget '{b}'; use epochs, wallclock or a duration "
                                   "such as 5m or 600s") from None
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.seeds):
            raise OverRepError(f"compare: seeds must be non-negative integers, got {self.seeds}")
        try:
            self.ratios = [float(r) for r in self.ratios]
        except (TypeError, ValueError):
            raise OverRepError(f"compare: ratios must be numbers, got {self.ratios}") from None
        if any(not 0 < r < 1 for r in self.ratios):
            raise OverRepError(f"compare: every ratio must be between 0 and 1, got {self.ratios}")
        if "wallclock" in self.budgets and self.reference not in self.methods:
            raise OverRepError(f"compare: the wall-clock budget is the reference method's time; add "
                               f"'{self.reference}' to methods")
        if "wallclock" in self.budgets and "epochs" not in self.budgets:
            self.budgets = ["epochs", *self.budgets]  # step costs are measured in the epoch cells
        RunConfig.from_dict(self.base).validate()  # fail now, not in the tenth cell
        for name in self.variants:
            RunConfig.from_dict(deep_update(self.base, self.variant(name))).validate()

    def pairs(self) -> list[tuple[str, float]]:
        """The (criterion, ratio) plans of the grid, in order."""
        if self.plans is not None:
            return [(c, float(r)) for c, r in self.plans]
        return [(c, r) for c in self.criteria for r in self.ratios]

    def trains(self, name: str) -> bool:
        """Whether a method (or variant) of the grid trains; a closed form runs once per plan
        and seed, as the 0-second row of every budget's table."""
        return METHODS[self.variant(name)["recovery"]["method"]].trains

    def variant(self, name: str) -> dict:
        """The run-config sections a method name of the grid sets: ``recovery.method`` and, for
        a variant, its overrides."""
        spec = copy.deepcopy(self.variants.get(name, {"method": name}))
        method = spec.pop("method")
        spec.setdefault("recovery", {})["method"] = method
        return spec


def deep_update(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out
