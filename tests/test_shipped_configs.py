"""Every shipped configuration loads and validates: the ``overrep compare`` grids in
examples/compare (each cell's run configuration included), the built-in presets and the preset
files in examples/presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overrep.app.compare import Compare, CompareConfig
from overrep.app.config import RunConfig
from overrep.model.presets import BUILTIN_PRESETS, get_preset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GRIDS = sorted((EXAMPLES / "compare").glob("*.yaml"))
PRESET_FILES = sorted((EXAMPLES / "presets").glob("*.yaml"))


def test_the_examples_are_found():
    assert len(GRIDS) >= 9
    assert len(PRESET_FILES) >= 2


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_compare_grid_and_each_of_its_cells_validates(path, tmp_path):
    cfg = CompareConfig.load(path, {"output": str(tmp_path / "grid")})
    grid = Compare(cfg, progress=False)
    budget = next((b for b in cfg.budgets if b not in ("epochs", "wallclock")), None)
    for method in cfg.methods:
        for criterion, ratio in cfg.pairs():
            cell = grid.cell(criterion, ratio, method, budget or "epochs",
                             seconds=60.0 if budget and cfg.trains(method) else None)
            RunConfig.from_dict(cell.config).validate()


@pytest.mark.parametrize("name", list(BUILTIN_PRESETS))
def test_every_builtin_preset_round_trips_through_yaml_and_validates_as_a_run(name, tmp_path):
    preset = BUILTIN_PRESETS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(preset.to_dict(), sort_keys=False))
    assert get_preset(str(path)).to_dict() == preset.to_dict()
    RunConfig.load(overrides={"recovery": {"preset": name}})
    RunConfig.load(overrides={"recovery": {"preset": str(path)}})


@pytest.mark.parametrize("path", PRESET_FILES, ids=[p.stem for p in PRESET_FILES])
def test_every_shipped_preset_file_loads_under_its_own_name_and_validates_as_a_run(path):
    """The files results-log.md names as candidates (``--preset examples/presets/X.yaml``); linear,
    so that the warm start's fitted function holds from the first step, as ``hybrid-linear``."""
    preset = get_preset(str(path))
    assert preset.name == path.stem and not preset.anneal
    assert all(b.w or b.d for b in preset.blocks)
    RunConfig.load(overrides={"recovery": {"preset": str(path)}})
