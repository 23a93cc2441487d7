"""``overrep compare`` on the tiny model: cells, matched budgets, caching, extension, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import pytest
import yaml

from overrep.app.cli import main
from overrep.app.compare import Compare, CompareConfig
from overrep.app.runinfo import code_fingerprint
from overrep.core.precision import resolve_precision
from overrep.errors import OverRepError


def grid_file(assets, tmp_path, **over) -> str:
    spec = {
        "base": {"model": {"source": str(assets / "tiny-llama")},
                 # budget_min_steps: the tiny grids' budgets of seconds may leave a warm start few steps
                 "recovery": {"epochs": 1, "batch_size": 4, "lora_rank": 4, "checkpoint_every": 100,
                              "budget_min_steps": 1},
                 "data": {"source": str(assets / "corpus.jsonl"), "seq_len": 32, "train_sequences": 16,
                          "heldout_sequences": 4}},
        "methods": ["overrep", "lora"],
        "criteria": ["last"],
        "ratios": [0.3],
        "budgets": ["epochs", "wallclock"],
        "output": str(tmp_path / "grid"),
        **over,
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_grid_runs_caches_and_extends(assets, tmp_path, capsys):
    config = grid_file(assets, tmp_path)
    assert main(["compare", "--config", config, "--quiet"]) == 0
    out = tmp_path / "grid"
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["budget"]): r for r in results["rows"]}
    assert set(rows) == {("overrep", "epochs"), ("lora", "epochs"), ("lora", "wallclock")}
    assert all(r["status"] == "ok" for r in rows.values())
    ref, lora = rows[("overrep", "epochs")], rows[("lora", "epochs")]
    assert ref["steps"] == lora["steps"] == 4  # matched epochs: 16 sequences / batch 4
    # matched wall-clock: the reference's features + training time is lora's time budget; the
    # cell measures its own steps and fixes its step count to fit (recovery.time_budget)
    budget = ref["train_seconds"] + ref["feature_seconds"]
    assert not list((out / "cache" / "cells").glob("*/features/*"))  # a wall-clock cell's own cache is dropped
    (cell,) = [d for d in (out / "cells").glob("*-lora-wallclock-*") if d.is_dir()]
    m = json.loads((cell / "metrics.json").read_text())
    assert m["time_budget"]["seconds"] == pytest.approx(budget, abs=1e-3)
    assert rows[("lora", "wallclock")]["steps"] == m["time_budget"]["steps"] == m["train_steps"] >= 1
    assert ref["removed_layers"] == lora["removed_layers"]  # same pruned model
    assert lora["trainable_params"] < ref["trainable_params"]
    assert all(r["peak_memory_bytes"] > 0 and r["ppl"] > 0 for r in rows.values())
    text = (out / "results.md").read_text()
    assert "matched epochs" in text and "matched wall-clock" in text and "| lora |" in text
    assert (out / "plots" / "perplexity.png").stat().st_size > 0
    assert (out / "plots" / "perplexity_vs_time.png").stat().st_size > 0
    cells = sorted((out / "cells").glob("*/metrics.json"))
    stamps = {c: c.stat().st_mtime_ns for c in cells}

    # extending the grid runs only the new cells
    assert main(["compare", "--config", config, "--methods", "overrep,lora,plain", "--quiet"]) == 0
    for c, t in stamps.items():
        assert c.stat().st_mtime_ns == t, f"{c} was recomputed"
    results = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["budget"]) for r in results["rows"]} == {
        ("overrep", "epochs"), ("lora", "epochs"), ("lora", "wallclock"), ("plain", "epochs"),
        ("plain", "wallclock")}


def test_a_grid_finds_its_cells_by_a_relative_path_or_after_a_move(assets, tmp_path, monkeypatch):
    config = grid_file(assets, tmp_path, methods=["plain"], budgets=["epochs"])
    assert main(["compare", "--config", config, "--quiet"]) == 0
    (cell,) = (tmp_path / "grid" / "cells").glob("*/metrics.json")
    stamp = cell.stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--config", config, "--output", "grid", "--quiet"]) == 0
    (tmp_path / "grid").rename(tmp_path / "moved")
    assert main(["compare", "--config", config, "--output", str(tmp_path / "moved"), "--quiet"]) == 0
    assert [p.stat().st_mtime_ns for p in (tmp_path / "moved" / "cells").glob("*/metrics.json")] == [stamp]
    # a cell named by an earlier hash (one that held the grid's path) is found by its settings
    (d,) = [p for p in (tmp_path / "moved" / "cells").iterdir() if p.is_dir()]
    old = d.with_name(d.name.rsplit("-", 1)[0] + "-0123456789")
    d.rename(old)
    d.with_name(d.name + ".yaml").rename(old.with_name(old.name + ".yaml"))
    assert main(["compare", "--config", config, "--output", str(tmp_path / "moved"), "--quiet"]) == 0
    assert [p.parent for p in (tmp_path / "moved" / "cells").glob("*/metrics.json")] == [old]
    # so is a cell that ran and was refused (its request and its error, no folder)
    shutil.rmtree(old)
    old.with_name(old.name + ".error").write_text("overrep: error: too few steps\n")
    assert main(["compare", "--config", config, "--output", str(tmp_path / "moved"), "--quiet", "--collect-only"]) == 1
    (row,) = json.loads((tmp_path / "moved" / "results.json").read_text())["rows"]
    assert row["status"] == "failed: overrep: error: too few steps"


def test_benchmark_rp_is_collected_for_every_cell(assets, tmp_path):
    """RP through the evaluation command: dense once, the pruned model, each recovered cell."""
    config = grid_file(assets, tmp_path, methods=["overrep"], budgets=["epochs"],
                       benchmarks={"tasks": ["arc_easy"], "limit": 2})
    assert main(["compare", "--config", config, "--quiet"]) == 0
    out = tmp_path / "grid"
    results = json.loads((out / "results.json").read_text())
    (row,) = results["rows"]
    # (a random tiny model may score 0 on two documents, which leaves RP undefined: None)
    assert set(row["benchmarks"]) == {"arc_easy"} and "reasoning" in row["rp"]
    assert "arc_easy" in results["dense"]["benchmarks"]
    assert "reasoning" in results["pruned"]["last-0.3"]["rp"]
    assert len(list((out / "benchmarks").glob("*.json"))) == 3  # dense, pruned, the cell
    assert 0 <= row["benchmark_stderr"]["arc_easy"] <= 0.5  # lm-eval's, over two documents
    text = (out / "results.md").read_text()
    # the plan's benchmark table: accuracy ± stderr for dense, pruned and the cell, and RP
    assert "| model | seed | arc_easy | RP |" in text
    acc, se = row["benchmarks"]["arc_easy"], row["benchmark_stderr"]["arc_easy"]
    assert f"| overrep | 0 | {100 * acc:.1f} ± {100 * se:.1f} |" in text
    assert "| dense | | " in text and "| pruned, no recovery | | " in text
    for path in (out / "benchmarks").glob("*.json"):  # every model's per-document scores, for paired tests
        assert len(json.loads(path.read_text())["tasks"]["arc_easy"]["per_document"]["ids"]) == 2
    # a grid moved (or cloned) elsewhere finds its kept results: nothing scored anew
    kept = sorted(p.name for p in (out / "benchmarks").iterdir())
    out = out.rename(tmp_path / "moved")
    assert main(["compare", "--config", config, "--output", str(out), "--quiet", "--collect-only"]) == 0
    moved = json.loads((out / "results.json").read_text())
    assert moved["rows"][0]["benchmarks"] == row["benchmarks"] and moved["rows"][0]["model_dir"].startswith(str(out))
    assert sorted(p.name for p in (out / "benchmarks").iterdir()) == kept
    # a kept grid's cell without its model (compare_folder): RP from its kept results; none, not a
    # crash, once those are gone too
    (model_dir,) = [p for p in (out / "cells").glob("*/model") if p.is_dir()]
    shutil.rmtree(model_dir)
    assert main(["compare", "--config", config, "--output", str(out), "--quiet", "--collect-only"]) == 0
    assert json.loads((out / "results.json").read_text())["rows"][0]["benchmarks"] == row["benchmarks"]
    (cell_file,) = [p for p in (out / "benchmarks").glob("*.json") if not p.name.startswith(("dense", "pruned"))]
    cell_file.unlink()
    assert main(["compare", "--config", config, "--output", str(out), "--quiet", "--collect-only"]) == 0
    assert "benchmarks" not in json.loads((out / "results.json").read_text())["rows"][0] and not cell_file.exists()
    # --cached-benchmarks: RP where a model was scored (dense, pruned), nothing scored anew
    assert main(["compare", "--config", config, "--output", str(out), "--quiet", "--collect-only",
                 "--cached-benchmarks"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "benchmarks" not in results["rows"][0] and "arc_easy" in results["dense"]["benchmarks"]
    assert "last-0.3" in results["pruned"] and not cell_file.exists()


def test_rows_get_their_paired_rp_difference_to_the_best(tmp_path):
    from overrep.app.compare_benchmarks import paired_to_best
    from overrep.app.compare_report import benchmark_table

    def res(values):
        return {"tasks": {"piqa": {"status": "ok", "value": sum(values) / len(values), "data_id": "piqa/validation",
                                   "num_fewshot": 0, "n_samples": len(values),
                                   "per_document": {"ids": [f"p/{i}" for i in range(len(values))],
                                                    "values": values}}}}

    rows = [{"method": m, "seed": 0, "criterion": "cosine", "ratio": 0.25, "budget": "5m", "status": "ok",
             "benchmarks": {"piqa": sum(v) / 4}, "rp": {"rp": 100 * sum(v) / 4 / 0.5}}
            for m, v in (("overrep", [1, 1, 1, 0]), ("lora-iso", [1, 1, 0, 0]))]
    rp = lambda row: {"rp": row["rp"]["rp"], "dense_average": 50.0, "tasks": {"piqa": {}}}
    paired_to_best([(rows[0], res([1, 1, 1, 0]), rp(rows[0])), (rows[1], res([1, 1, 0, 0]), rp(rows[1]))])
    assert rows[0]["rp_vs_best"]["is_best"] and rows[1]["rp_vs_best"]["best"] == "overrep, seed 0"
    # differences 0, 0, -1, 0: -25 points, se 0.5 / 2 = 25 points; in RP points of a dense 50: -50 ± 50
    assert rows[1]["rp_vs_best"]["difference"] == pytest.approx(-50.0)
    assert rows[1]["rp_vs_best"]["stderr"] == pytest.approx(50.0)
    table = "\n".join(benchmark_table(rows, {"benchmarks": {"piqa": 0.5}}, None))
    assert "RP − best (paired)" in table and "| best |" in table and "| -50.0 ± 50.0 |" in table


def test_failed_cell_is_reported_and_the_grid_goes_on(assets, tmp_path):
    config = grid_file(assets, tmp_path, methods=["overrep", "full-ft"], budgets=["epochs"],
                       base={"model": {"source": str(assets / "tiny-llama")},
                             "recovery": {"epochs": 1, "batch_size": 4, "lr": 1e9},
                             "data": {"source": str(assets / "corpus.jsonl"), "seq_len": 32,
                                      "train_sequences": 16, "heldout_sequences": 4}})
    assert main(["compare", "--config", config, "--quiet"]) == 1
    rows = json.loads((tmp_path / "grid" / "results.json").read_text())["rows"]
    failed = [r for r in rows if r["status"] != "ok"]
    assert failed and all(r["status"].startswith("failed: overrep: error:") for r in failed)


@pytest.mark.parametrize("over, msg", [
    ({"methods": ["lroa"]}, "unknown method 'lroa'"),
    ({"criteria": ["random"]}, "unknown criterion 'random'"),
    ({"ratios": [1.5]}, "between 0 and 1"),
    ({"budgets": ["tokens"]}, "unknown budget 'tokens'"),
    ({"methods": ["lora"], "budgets": ["wallclock"]}, "add 'overrep' to methods"),
    ({"colour": "red"}, "unknown compare field 'colour'"),
    ({"base": {"recovery": {"lr": -1}}}, "recovery.lr must be > 0"),
])
def test_bad_grids_fail_before_any_work(assets, tmp_path, over, msg):
    with pytest.raises(OverRepError, match=msg):
        CompareConfig.load(grid_file(assets, tmp_path, **over))
    assert not (tmp_path / "grid").exists()


def test_wallclock_implies_the_epoch_cells(assets, tmp_path):
    cfg = CompareConfig.load(grid_file(assets, tmp_path, budgets=["wallclock"]))
    assert cfg.budgets == ["epochs", "wallclock"]
    cells = Compare(cfg).epoch_cells("last", 0.3)
    assert [c.method for c in cells] == ["overrep", "lora"]  # the reference first
    assert len({c.dir for c in cells}) == 2


def test_duration_cells_get_the_whole_budget_and_a_cache_of_their_own(assets, tmp_path):
    cfg = CompareConfig.load(grid_file(assets, tmp_path, methods=["overrep", "plain", "lora"],
                                       budgets=["2.5m", 600], seeds=[0, 1]))
    assert cfg.budgets == ["2.5m", "600s"]
    grid = Compare(cfg)
    assert grid.plan_cells() == 2 * 3 * 2
    cells = [grid.duration_cell("last", 0.3, m, "2.5m", seed=1) for m in ("overrep", "plain", "lora")]
    assert {c.config["recovery"]["time_budget"] for c in cells} == {"150.000s"}
    caches = {c.config["cache"]["dir"] for c in cells}
    assert len(caches) == 3 and all("/cache/cells/" in d for d in caches)  # each pays for its own features
    # each scores the dense model on its own machine, never from the package's entry, and that
    # setting is no part of what identifies a cell (cells written before it are found)
    assert all(c.config["eval"]["dense_reference"] is False for c in cells)
    assert "dense_reference" not in grid.settings(cells[0].config)["eval"]
    plain = cells[1]
    assert plain.config["recovery"]["seed"] == plain.seed == 1 and "seed 1" in plain.label
    assert plain.dir != grid.duration_cell("last", 0.3, "plain", "2.5m", seed=0).dir


def test_duration_grid_reports_the_spread_over_seeds(assets, tmp_path):
    config = grid_file(assets, tmp_path, methods=["overrep"], budgets=["6s"], seeds=[0, 1])
    assert main(["compare", "--config", config, "--quiet"]) == 0
    out = tmp_path / "grid"
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert sorted((r["seed"], r["budget"], r["budget_seconds"]) for r in rows) == [(0, "6s", 6.0), (1, "6s", 6.0)]
    for r in rows:
        folder = tmp_path / "grid" / "cells" / r["cell"].split("/")[-1]
        m = json.loads((folder / "metrics.json").read_text())
        tb = m["time_budget"]  # the planned steps, or fewer where the deadline passed first
        assert tb["seconds"] == 6.0 and m["train_steps"] == (tb["stopped_at_step"] or tb["steps"]) >= 1
        # a finished cell keeps its model and drops its checkpoints (only a resume reads them)
        assert (folder / "model" / "config.json").is_file() and not (folder / "checkpoints").exists()
    text = (out / "results.md").read_text()
    assert "wall-clock budget 6s" in text and "Over seeds: overrep" in text and "(n=2" in text
    assert (out / "plots" / "perplexity_vs_budget.png").stat().st_size > 0


@pytest.mark.parametrize("over, msg", [
    ({"budgets": ["5 minutes"]}, "unknown budget '5 minutes'"),
    ({"seeds": [-1]}, "seeds must be non-negative integers"),
])
def test_bad_budgets_and_seeds(assets, tmp_path, over, msg):
    with pytest.raises(OverRepError, match=msg):
        CompareConfig.load(grid_file(assets, tmp_path, **over))


def test_variants_plans_and_closed_forms_in_one_grid(assets, tmp_path):
    """A variant is a method with settings of its own; ``plans`` picks (criterion, ratio) pairs;
    a closed form runs once per plan as the 0-second row of every budget's table; every row
    carries the protocol's figures (interval, seconds used, FLOPs)."""
    config = grid_file(assets, tmp_path, methods=["overrep", "overrep-warm", "replaceme", "linearpatch"], budgets=["6s"],
                       variants={"overrep-warm": {"method": "overrep", "recovery": {"warm_start": "replaceme",
                                                                                     "closed_rows": 4}}},
                       plans=[["last", 0.3]])
    cfg = CompareConfig.load(config)
    assert cfg.pairs() == [("last", 0.3)] and cfg.trains("overrep-warm") and not cfg.trains("replaceme")
    assert Compare(cfg).plan_cells() == 2 + 2
    assert main(["compare", "--config", config, "--quiet"]) == 0
    out = tmp_path / "grid"
    rows = {(r["method"], r["budget"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {("overrep", "6s"), ("overrep-warm", "6s"), ("replaceme", "0s"), ("linearpatch", "0s")}
    assert all(r["status"] == "ok" for r in rows.values())
    # 0s named as a budget is the closed forms' column: no 0-second cell of a method that trains
    assert Compare(dataclasses.replace(cfg, budgets=["6s", "0s"])).plan_cells() == 2 + 2
    assert main(["compare", "--config", config, "--budgets", "6s,0s", "--collect-only", "--quiet"]) == 0
    again = {(r["method"], r["budget"]) for r in json.loads((out / "results.json").read_text())["rows"]}
    assert again == set(rows)
    for budgets in "6s,0s", "0s":  # a closed form's row once in the page, whatever budgets are named
        assert main(["compare", "--config", config, "--budgets", budgets, "--collect-only", "--quiet"]) == 0
        page = (out / "results.md").read_text()
        assert page.count("| replaceme | 0 |") == 1 and page.count("no training (fit)") <= 1, budgets
        assert ("budget 0s" in page) == (budgets == "0s"), budgets  # no empty 0s section beside a trained budget
    warm = yaml.safe_load((out / "cells" / rows[("overrep-warm", "6s")]["cell"].split("/")[-1] / "config.yaml")
                          .read_text())
    assert warm["recovery"]["warm_start"] == "replaceme" and warm["recovery"]["method"] == "overrep"
    for key in ("overrep", "6s"), ("overrep-warm", "6s"):
        r = rows[key]
        assert r["ppl_low"] <= r["ppl"] <= r["ppl_high"] and r["train_flops"] > 0 and r["feature_flops"] > 0
        assert 0 < r["used_seconds"] <= 6.0 * 1.5 and r["machine"] and r["precision"]
        assert r["domain_ratios"] == {}  # one training source: no per-domain ratios (see the test below)
    assert rows[("replaceme", "0s")]["steps"] == 0 and rows[("replaceme", "0s")]["closed_form_seconds"] > 0
    # the cells share the grid's dense / unrecovered figures and criterion scores
    assert (out / "cache" / "eval").is_dir() and any((out / "cache" / "eval").iterdir())
    text = (out / "results.md").read_text()
    assert "| replaceme | 0 |" in text and "(fit)" in text and "Machine and precision:" in text
    assert "| × dense: " in text
    patch = rows[("linearpatch", "0s")]  # a reference row: scored, marked, nothing exported
    assert patch["exportable"] is False and patch["model_dir"] is None and patch["extra_params"] == 32 * 32
    assert "| linearpatch (extra module, not exportable) | 0 |" in text and "M extra |" in text
    scoring = resolve_precision("auto", "cpu")  # eval.precision: auto, stated with the machine
    assert {r["scoring"] for r in rows.values()} == {scoring} and f"{scoring} scoring" in text
    assert len({r["code"] for r in rows.values()}) == 1 and "Code: " in text and "more than one version" not in text
    # a cell written by other code is flagged in the table, not mixed in silently
    m_path = out / "cells" / rows[("replaceme", "0s")]["cell"].split("/")[-1] / "metrics.json"
    m = json.loads(m_path.read_text())
    m["environment"]["code"] = "000000000000"
    m_path.write_text(json.dumps(m))
    assert main(["compare", "--config", config, "--quiet", "--collect-only"]) == 0
    assert "cells from more than one version of the code" in (out / "results.md").read_text()
    # a cell that ran and was refused is listed with its reason, not as "not run yet"
    cell = out / "cells" / rows[("overrep", "6s")]["cell"].split("/")[-1]
    (cell / "metrics.json").rename(cell.parent / "moved-metrics.json")
    (cell.parent / f"{cell.name}.error").write_text("overrep: error: too few steps\n")
    assert main(["compare", "--config", config, "--quiet", "--collect-only"]) == 1  # the grid has a failed cell
    rows = {(r["method"], r["budget"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows[("overrep", "6s")]["status"] == "failed: overrep: error: too few steps"
    assert "Not run yet" not in (out / "results.md").read_text()


def test_criteria_on_the_command_line_pick_from_the_plans(assets, tmp_path):
    config = grid_file(assets, tmp_path, plans=[["last", 0.3], ["cosine", 0.3], ["last", 0.5]])
    assert CompareConfig.load(config, {"criteria": ["last"]}).pairs() == [("last", 0.3), ("last", 0.5)]
    assert CompareConfig.load(config, {"ratios": ["0.3"]}).pairs() == [("last", 0.3), ("cosine", 0.3)]
    with pytest.raises(OverRepError, match="leave none of the config's plans"):
        CompareConfig.load(config, {"criteria": ["block-influence"]})


def test_plans_on_the_command_line_replace_the_files(assets, tmp_path):
    """``--plans`` names the (criterion, ratio) pairs outright, from a file with plans or with
    criteria x ratios; with --criteria or --ratios beside it, or a pair that is not one, it fails."""
    from overrep.app.commands import _plans

    wanted = [["cosine", 0.5], ["block-influence", 0.25]]
    assert _plans("cosine:0.5, block-influence:0.25") == wanted
    for over in ({"plans": [["last", 0.3]]}, {}):
        config = grid_file(assets, tmp_path, **over)
        cfg = CompareConfig.load(config, {"plans": wanted})
        assert cfg.pairs() == [("cosine", 0.5), ("block-influence", 0.25)]
        assert cfg.criteria == ["cosine", "block-influence"] and cfg.ratios == [0.5, 0.25]
    with pytest.raises(OverRepError, match="leave out --criteria and --ratios"):
        CompareConfig.load(config, {"plans": wanted, "ratios": ["0.5"]})
    for bad in ("cosine", "cosine:half", ":0.5"):
        with pytest.raises(OverRepError, match="criterion:ratio pairs"):
            _plans(bad)
    with pytest.raises(OverRepError, match="unknown criterion 'nope'"):
        CompareConfig.load(config, {"plans": [["nope", 0.5]]})


@pytest.mark.parametrize("over, msg", [
    ({"variants": {"x": {"method": "nope"}}}, "variant 'x' needs 'method:'"),
    ({"variants": {"lora": {"method": "overrep"}}}, "has the name of a method"),
    ({"plans": [["last"]]}, "list of \\[criterion, ratio\\] pairs"),
])
def test_bad_variants_and_plans(assets, tmp_path, over, msg):
    with pytest.raises(OverRepError, match=msg):
        CompareConfig.load(grid_file(assets, tmp_path, **over))


def test_into_writes_the_tables_between_the_markers_of_a_page(assets, tmp_path):
    config = grid_file(assets, tmp_path, methods=["plain"], budgets=["epochs"])
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\nbefore\n\n<!-- compare: results -->\nold table\n<!-- /compare -->\n\nafter\n")
    assert main(["compare", "--config", config, "--quiet", "--into", str(page)]) == 0
    text = page.read_text()
    assert "old table" not in text and text.startswith("# Page\n\nbefore\n") and text.endswith("\nafter\n")
    assert f"Written by `overrep compare --config {config} --into {page}`" in text and "| plain | 0 |" in text
    assert (page.parent / "img" / "page-perplexity.png").stat().st_size > 0 and "](img/page-perplexity.png)" in text
    page.write_text("no markers\n")
    assert main(["compare", "--config", config, "--quiet", "--into", str(page)]) == 2
    assert page.read_text() == "no markers\n"


def test_into_a_named_section_leaves_the_pages_other_blocks_alone(assets, tmp_path):
    config = grid_file(assets, tmp_path, methods=["plain"], budgets=["epochs"])
    page = tmp_path / "page.md"
    first = "<!-- compare: results -->\nfirst grid\n<!-- /compare -->\n"
    page.write_text(f"# Page\n\n{first}\nbetween\n\n<!-- compare: later -->\nold\n<!-- /compare -->\nend\n")
    assert main(["compare", "--config", config, "--quiet", "--into", str(page), "--section", "later"]) == 0
    text = page.read_text()
    assert text.startswith(f"# Page\n\n{first}\nbetween\n") and text.endswith("<!-- /compare -->\nend\n")
    assert "old" not in text and "| plain | 0 |" in text and "--into " + str(page) + " --section later`" in text
    assert (tmp_path / "img" / "page-later-perplexity.png").stat().st_size > 0
    assert main(["compare", "--config", config, "--quiet", "--into", str(page), "--section", "absent"]) == 2
    assert main(["compare", "--config", config, "--quiet", "--into", str(page), "--section", "a -->"]) == 2
    assert page.read_text() == text


def test_collect_only_runs_no_cell_and_lists_the_unfinished_ones(assets, tmp_path, capsys):
    from overrep.app.runlock import RunLock

    config = grid_file(assets, tmp_path, methods=["plain"], budgets=["epochs"])
    assert main(["compare", "--config", config, "--quiet"]) == 0
    cells = sorted((tmp_path / "grid" / "cells").glob("*/metrics.json"))
    running = RunLock(tmp_path / "grid")  # another grid running in the folder: no second one runs cells there,
    running.acquire()  # whose timed cells would share the machine, but its tables can be collected
    capsys.readouterr()
    assert main(["compare", "--config", config, "--methods", "plain,lora", "--quiet"]) == 2
    assert "is in use by another overrep run" in capsys.readouterr().err
    assert main(["compare", "--config", config, "--methods", "plain,lora", "--collect-only", "--quiet"]) == 0
    running.release()
    assert sorted((tmp_path / "grid" / "cells").glob("*/metrics.json")) == cells  # nothing new ran
    rows = json.loads((tmp_path / "grid" / "results.json").read_text())["rows"]
    assert {(r["method"], r["status"]) for r in rows} == {("plain", "ok"), ("lora", "not run")}
    text = (tmp_path / "grid" / "results.md").read_text()
    assert "| plain | 0 |" in text and "Not run yet: lora (seed 0)." in text and "| lora |" not in text


def test_per_domain_ratios_leave_the_unseen_corpora_out():
    """The grid's per-domain column: recovered / dense on each training domain's test rows."""
    from overrep.app.compare import _domain_ratios

    m = {"recovered_ppl_domains": {"wiki": 30.0, "ptb": 80.0, "lambada": 120.0},
         "dense_ppl_domains": {"wiki": 20.0, "ptb": 160.0, "lambada": 60.0}}
    assert _domain_ratios(m, unseen={"lambada"}) == {"wiki": 1.5, "ptb": 0.5}
    assert _domain_ratios({}, unseen=set()) == {}


def test_the_unrecovered_figure_names_its_methods_where_the_pruned_models_differ():
    from overrep.app.compare_report import _pruned

    same = [{"method": "overrep", "pruned_ppl": 677.4}, {"method": "plain", "pruned_ppl": 677.4}]
    assert _pruned(same) == "677"
    mixed = same + [{"method": "overrep-warm", "pruned_ppl": 510.9}, {"method": "overrep-warm", "pruned_ppl": 510.9}]
    assert _pruned(mixed) == "677 (overrep, plain); 511 (overrep-warm) (the recovery layouts differ)"
    assert _pruned([{"method": "replaceme"}]) == "–"


def test_a_budget_with_nothing_trained_yet_is_one_line_not_the_closed_forms_again(tmp_path):
    from overrep.app.compare_report import _groups, _idle, markdown, plot_perplexity

    def cell(method, budget, status="ok", seed=0):
        row = {"criterion": "last", "ratio": 0.25, "budget": budget, "method": method, "seed": seed, "status": status}
        if status == "ok":
            row.update(ppl=100.0 if budget != "0s" else 300.0, trainable_params=1e6, steps=10,
                       removed_layers=[1, 2], recovery_seconds=1.0)
        return row

    results = {"config": {"criteria": ["last"], "ratios": [0.25], "budgets": ["2.5m", "5m"], "reference": "overrep"},
               "rows": [cell("replaceme", "0s"), cell("overrep", "2.5m"), cell("overrep", "2.5m", "not run", 1),
                        cell("overrep", "5m", "not run"), cell("plain", "5m", "not run", 1)],
               "dense": {}}
    text = markdown(results)
    text = text[text.index("## last, ratio"):]  # the tables (the grid at a glance above them has its own rows)
    short = text.split("## last, ratio 0.25, wall-clock budget 5m (features + training)")[1]
    assert short.lstrip().startswith("Not run yet: overrep, plain (every seed); the closed forms are in this plan's")
    assert "| replaceme |" not in short and text.count("| replaceme |") == 1
    assert "Not run yet: overrep (seed 1)." in text  # the 2.5-minute table lists its missing seed as before
    assert _idle(_groups(results)) == {("last", 0.25, "5m")}  # and the plot leaves that panel out
    plot_perplexity(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    only_closed = dict(results, rows=[cell("replaceme", "0s"), cell("overrep", "2.5m", "not run"),
                                      cell("overrep", "5m", "not run")])
    tables = markdown(only_closed).split("## last, ratio", 1)[1]
    assert tables.count("| replaceme |") == 2  # no plan trained yet: the closed forms stay in every table


def test_the_warm_start_summary_pairs_seeds_and_leaves_out_a_warm_cell_that_started_cold():
    from overrep.app.compare_report import markdown

    def cell(method, seed, val, test, used, budget="2.5m", criterion="last"):
        return {"criterion": criterion, "ratio": 0.25, "budget": budget, "method": method, "seed": seed,
                "status": "ok", "ppl": test, "val_ppl": val, "warm_start": used, "trainable_params": 1e6,
                "steps": 10, "removed_layers": [1, 2], "recovery_seconds": 1.0}

    rows = [cell("overrep", 0, 100.0, 90.0, "none"), cell("overrep-warm", 0, 80.0, 70.0, "replaceme"),
            cell("overrep", 1, 110.0, 95.0, "none"), cell("overrep-warm", 1, 120.0, 105.0, "replaceme"),
            cell("overrep-warm", 2, 50.0, 50.0, "replaceme"),  # no cold seed 2: not a pair
            cell("lora-iso", 0, 60.0, 55.0, "none"),  # no warm cell: no row
            # auto started this "-warm" cell cold (a mask of several runs): not a pair
            cell("overrep", 0, 100.0, 90.0, "none", criterion="block-influence"),
            cell("overrep-warm", 0, 100.0, 90.0, "none", criterion="block-influence")]
    results = {"config": {"criteria": ["last", "block-influence"], "ratios": [0.25], "budgets": ["2.5m"],
                          "reference": "overrep"}, "rows": rows, "dense": {}}
    text = markdown(results).split("## The warm start against the cold one")[1].split("Columns:")[0]
    lines = [line for line in text.splitlines() if line.startswith("| last")]
    assert lines == ["| last 0.25 | 2.5m | overrep | 0, 1 | 105 → 100 | -5% | 1 of 2 | 92.5 → 87.5 |"]
    assert "block-influence" not in text and "lora-iso" not in text
    cold_only = dict(results, rows=[r for r in rows if r["criterion"] == "block-influence"])
    assert "## The warm start against the cold one" not in markdown(cold_only)


def test_the_grid_at_a_glance_gives_each_method_its_mean_over_seeds_at_every_budget():
    from overrep.app.compare_report import markdown

    def cell(method, budget, seed, ppl, status="ok", used=100.0, criterion="cosine"):
        row = {"criterion": criterion, "ratio": 0.25, "budget": budget, "method": method, "seed": seed,
               "status": status}
        if status == "ok":
            row.update(ppl=ppl, trainable_params=1e6, steps=10, removed_layers=[1, 2], recovery_seconds=1.0,
                       used_seconds=used if budget != "0s" else None, budget_seconds=100.0 if budget != "0s" else None)
        return row

    rows = [cell("overrep", "2.5m", 0, 80.0), cell("overrep", "2.5m", 1, 90.0), cell("overrep", "2.5m", 2, 0, "failed: x"),
            cell("lora-iso", "2.5m", 0, 70.0, used=103.0),  # over its budget's +2%
            cell("overrep", "5m", 0, 60.0), cell("lora-iso", "5m", 0, 0, "not run"),
            cell("replaceme", "0s", 0, 300.0), cell("overrep", "2.5m", 0, 50.0, criterion="last"),
            cell("overrep-warm", "2.5m", 0, 95.0), cell("overrep-warm", "2.5m", 1, 85.0)]
    rows[0]["rp"], rows[1]["rp"], rows[4]["rp"] = {"rp": 90.0}, {"rp": 80.0}, {"rp": 95.0}  # scored on the benchmarks
    rows[-2]["warm_start"], rows[-1]["warm_start"] = "none", "replaceme"  # auto started seed 0 cold
    rows[-2]["cold_because"] = "the time budget leaves the warm start 3 of the 20 optimiser steps it needs"
    results = {"config": {"criteria": ["cosine", "last"], "ratios": [0.25], "budgets": ["2.5m", "5m", "10m"],
                          "methods": ["overrep", "overrep-warm", "lora-iso", "replaceme"], "reference": "overrep"},
               "rows": rows, "dense": {}}
    text = markdown(results).split("## The grid at a glance")[1].split("\n## ")[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines == [
        "| plan | method | 2.5m | 5m | no training (fit) |",  # 10m: nothing ran, no column
        "| cosine 0.25 | overrep | 85 (80–90, n=2), 1 failed; RP 85.0 | **60** (n=1); RP 95.0 |  |",
        "| cosine 0.25 | overrep-warm | 90 (85–95, n=2), started cold: too short for the warm start (1 of 2) |  |  |",
        "| cosine 0.25 | lora-iso | **70** (n=1) **over budget** |  |  |",  # its 5m cell has not run
        "| cosine 0.25 | replaceme |  |  | **300** (n=1) |",
        "| last 0.25 | overrep | **50** (n=1) |  |  |"]
    assert "| overrep-warm (started cold: too short for the warm start) | 0 |" in markdown(results)
    rows[-2]["cold_because"] = "the mask removes 5 separate runs, where the warm start measured worse"
    assert "| overrep-warm (started cold: a mask of several runs) | 0 |" in markdown(results)
    assert "started cold: a mask of several runs (1 of 2)" in markdown(results)
    rows[-2]["cold_code"] = "no-map"  # the code a run records decides over its sentence
    assert "started cold: the map does not apply (1 of 2)" in markdown(results)
    rows[1]["rp"] = None  # one of two seeds scored: the RP says of how many
    assert "85 (80–90, n=2), 1 failed; RP 90.0 (n=1) |" in markdown(results)
    assert "## The grid at a glance" not in markdown(dict(results, rows=rows[:1]))  # one entry: no summary


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH: Python 3.11+")
def test_a_cell_runs_the_grids_code_not_a_checkout_in_its_working_directory(assets, tmp_path, monkeypatch):
    """``python -m`` puts the working directory first on the path: a grid started inside another
    checkout of overrep must not run its cells on that checkout's code."""
    fake = tmp_path / "elsewhere" / "overrep"
    fake.mkdir(parents=True)
    for name in ("__init__.py", "__main__.py"):
        (fake / name).write_text("raise SystemExit('another overrep')\n")
    config = grid_file(assets, tmp_path, methods=["replaceme"], budgets=["6s"])
    monkeypatch.chdir(fake.parent)
    assert main(["compare", "--config", config, "--quiet"]) == 0
    (row,) = json.loads((tmp_path / "grid" / "results.json").read_text())["rows"]
    assert row["status"] == "ok" and row["code"] == code_fingerprint()
