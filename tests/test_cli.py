"""The command line without surprises: help when called bare, a version, flags users reach for,
help on every flag, one-line errors, and the run flags reaching the fields they name."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from overrep import __version__
from overrep.app.cli import build_parser, main
from overrep.app.commands import FLAG_FIELDS, _config


def test_bare_overrep_prints_help_and_exits_zero():
    out = subprocess.run([sys.executable, "-m", "overrep"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: overrep" in out.stdout and "examples:" in out.stdout
    assert "run" in out.stdout and "Traceback" not in out.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"overrep {__version__}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_has_help():
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:
                assert name == "export" and action.dest == "output"  # the old spelling, still accepted
                continue
            assert action.help, f"overrep {name} {action.option_strings or action.dest} has no help"


def test_run_has_the_flags_users_reach_for():
    help_text = _subparsers(build_parser())["run"].format_help()
    for flag in ("--seed", "--device", "--precision", "--data", "--max-steps", "--time-budget", "--method"):
        assert flag in help_text


@pytest.mark.parametrize("flag,value,field", [("--seed", "7", ("recovery", "seed", 7)),
                                              ("--device", "cpu", ("model", "device", "cpu")),
                                              ("--precision", "fp32", ("recovery", "precision", "fp32")),
                                              ("--data", "c4", ("data", "source", "c4"))])
def test_run_flags_set_their_fields(flag, value, field):
    args = build_parser().parse_args(["run", flag, value])
    section, name, expected = field
    assert getattr(getattr(_config(args), section), name) == expected
    assert any(f"--{f.replace('_', '-')}" == flag for f, _ in FLAG_FIELDS)


def test_export_takes_the_run_folder_and_names_it_when_missing(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert main(["export"]) == 2
    assert "overrep export RUN_DIR" in capsys.readouterr().err


def test_the_whole_run_limit_holds_the_default_budget_only():
    """recovery.run_limit: auto holds the default job to 18 minutes (20 with installation on a
    2-core CPU); a budget the user sets is theirs, uncut, unless they set a limit too."""
    default = _config(build_parser().parse_args(["run"])).recovery
    assert default.run_limit == "auto" and default.resolved_run_limit == "18m"
    own = _config(build_parser().parse_args(["run", "--time-budget", "30m"])).recovery
    assert own.resolved_run_limit is None
    limited = build_parser().parse_args(["run", "--time-budget", "30m", "--set", "recovery.run_limit=20m"])
    assert _config(limited).recovery.resolved_run_limit == "20m" and _config(limited).recovery.time_budget == "30m"
    off = build_parser().parse_args(["run", "--set", "recovery.run_limit=null"])
    assert _config(off).recovery.resolved_run_limit is None
