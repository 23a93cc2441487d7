"""The README's commands, links and library example work as written (documentation that
nothing checks rots).

Every shell command in the README's code blocks is checked by what it is: `overrep ...`
through the real argument parser (and its `--set` values through the configuration's own
validation; the listing commands are run), `make X` against the Makefile's targets, `pip
install ...` against the packages pyproject.toml and the Makefile name. A command of any
other kind fails the test until a check for it is added here.
"""

import re
import shlex
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
# `overrep` subcommands that run in seconds without a model: the test runs them for real.
RUNNABLE = {"presets", "methods"}
RUN_FAMILY = {"run", "inspect", "prune", "cache", "recover"}


def readme_commands() -> list[list[str]]:
    """Every command of the README's shell code blocks, as argv lists (`a && b` is two)."""
    commands = []
    for block in SHELL_BLOCK.findall(README.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append(words)
    return commands


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def makefile_pins() -> dict[str, str]:
    """Package name -> pinned version, from the Makefile's TORCH and EMBEDDED lines."""
    text = (ROOT / "Makefile").read_text()
    specs = " ".join(re.findall(r"^(?:TORCH|EMBEDDED) := (.*)$", text, re.M)).split()
    return dict(spec.split("==") for spec in specs)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def check_pip(words: list[str]) -> None:
    assert words[:2] == ["pip", "install"], words
    project = pyproject()
    deps = {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    pins = {_norm(k): v for k, v in makefile_pins().items()}
    args = iter(words[2:])
    for arg in args:
        if arg in ("--index-url", "--extra-index-url"):
            # only PyTorch's own wheel index: the README's CPU/CUDA torch builds
            assert next(args).startswith("https://download.pytorch.org/whl/"), words
        elif arg in ("-e", "--no-deps", "-q", "-U", "--upgrade"):
            continue
        elif arg.startswith("."):
            path, _, extras = arg.partition("[")
            assert (ROOT / path / "pyproject.toml").exists(), arg
            for extra in filter(None, extras.rstrip("]").split(",")):
                assert extra in project["optional-dependencies"], f"no extra {extra!r} in pyproject.toml"
        else:
            name, _, version = arg.partition("==")
            assert _norm(name) in deps | set(pins), f"{name} is named by neither pyproject.toml nor the Makefile"
            if version and _norm(name) in pins:
                assert version == pins[_norm(name)], f"{arg}: the Makefile pins {pins[_norm(name)]}"


def check_overrep(argv: list[str], capsys) -> None:
    from overrep.app.cli import build_parser, main
    from overrep.app.config import RunConfig

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`overrep {' '.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
    if args.command in RUN_FAMILY:
        # the same validation a run does before it loads anything: unknown keys, types, ranges
        RunConfig.load(getattr(args, "config", None), args.set)
    if args.command in RUNNABLE:
        assert main(argv) == 0
        assert capsys.readouterr().out.strip()
    if args.command == "plan" and args.model.endswith(".json"):
        assert (ROOT / args.model).exists(), args.model
    if args.command == "compare" and args.config:
        assert (ROOT / args.config).exists(), args.config


def check(words: list[str], capsys) -> None:
    head = words[0]
    if head == "make":
        assert set(words[1:]) <= makefile_targets(), f"no such make target: {words[1:]}"
    elif head == "pip":
        check_pip(words)
    elif head.endswith("overrep"):
        check_overrep(words[1:], capsys)
    elif words[:3] == ["python3", "-m", "venv"] or (head in (".", "source") and words[1].endswith("bin/activate")):
        pass  # creating and entering a virtual environment
    else:
        pytest.fail(f"no check for the README command {' '.join(words)!r}: add one to tests/test_readme.py")


COMMANDS = readme_commands()


def test_readme_shows_the_two_commands():
    assert ["make", "run"] in COMMANDS and ["make", "test"] in COMMANDS


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(c)[:70] for c in COMMANDS])
def test_readme_command_is_valid(words, capsys):
    check(words, capsys)


def test_a_broken_command_is_caught(capsys):
    """The checks above can fail: a misspelt flag, make target or package is refused."""
    for words in (["overrep", "run", "--ratoi", "0.25"], ["make", "runn"], ["pip", "install", "torchh"],
                  ["curl", "example.org"]):
        with pytest.raises((pytest.fail.Exception, AssertionError)):
            check(words, capsys)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def check_links(page: Path) -> None:
    """Every relative link of a page names a file that exists, and a heading there if it has #."""
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text()) if not re.match(r"[a-z]+:", t)]
    for link in links:
        path, _, anchor = link.partition("#")
        target = page.parent / path if path else page
        assert target.exists(), f"{page.name} links to {path}, which does not exist"
        if anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path} has no heading for #{anchor}"


def test_readme_links_exist():
    assert re.search(r"\]\(docs/", README.read_text())
    check_links(README)


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_links_exist(page):
    check_links(ROOT / "docs" / page)


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert pages
    assert [p for p in pages if f"]({p}" not in text] == []


def test_library_api_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "contributing.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "plan_pruning" in b]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "docs/contributing.md", "exec"), {})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compact-model")
    assert model.config.num_hidden_layers == 5


PLANNED = re.compile(r"<!-- planner: (.*?) -->\n```\n(.*?)\n```", re.S)


def test_readme_scaling_commands_are_what_the_planner_prints(capsys):
    """Each command under a ``<!-- planner: ARGS -->`` marker (README, docs/scaling.md) is
    `overrep plan ARGS`'s command."""
    import json

    from overrep.app.cli import main

    found = PLANNED.findall(README.read_text())
    assert found, "the README shows no planner command"
    scaling = PLANNED.findall((ROOT / "docs" / "scaling.md").read_text())
    assert len(scaling) >= 5, "docs/scaling.md: the 1-GPU, 8-GPU and two-machine commands, 8B and 70B"
    found += scaling
    for args, shown in found:
        assert main(["plan", *args.split(), "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)["layout"]["command"]
        assert shown.strip() == printed, f"the documented command for `overrep plan {args}` is stale"
