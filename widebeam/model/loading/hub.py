"""A Hugging Face repo id (`facebook/nllb-200-distilled-600M`) as a local directory, offline first.

The local Hugging Face cache is asked first (`local_files_only`: no network, the same layout
transformers writes); a repo that is not there is downloaded when the hub is reachable and
`HF_HUB_OFFLINE` is not set. Only what widebeam loads is fetched: config, generation config,
tokenizer files and safetensors weights, never a pickle checkpoint. Anything else is a
`ModelNotFoundError` naming the id and the cache directory.

The cache directory and the offline switch are read from the environment at each call
(`HF_HUB_CACHE`, else `$HF_HOME/hub`, else huggingface_hub's default), so a process that sets them
after importing transformers still gets what it asked for.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from widebeam.errors import ModelNotFoundError

log = logging.getLogger(__name__)

# owner/name as the hub spells them; a path that exists is never taken for one
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WANTED_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                 "tokenizer*", "*.model", "vocab.json", "merges.txt", "special_tokens_map.json",
                 "added_tokens.json", "sentencepiece*", "spiece.model"]
_TRUE = {"1", "true", "yes", "on"}


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cached_repo_file(repo_id: str, filename: str) -> Path | None:
    """A file of the repo's cached snapshot (no network), or None: what `widebeam plan` reads."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir())
    return Path(found) if isinstance(found, str) else None


def resolve_repo_id(repo_id: str) -> Path:
    """The snapshot directory of `repo_id`: from the cache, else downloaded (see the module docstring)."""
    import httpx
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True,
                                      allow_patterns=_WANTED_FILES))
    except (LocalEntryNotFoundError, FileNotFoundError):  # not cached: the hub, unless offline
        log.debug("%s is not in the Hugging Face cache %s", repo_id, cache)
    if hub_offline():
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: "
            f"download it where the hub is reachable (huggingface-cli download {repo_id}), or pass a local "
            "directory holding config.json and *.safetensors")
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_WANTED_FILES))
    except (HfHubHTTPError, httpx.HTTPError, OSError, ValueError) as exc:  # unreachable, unknown, gated
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither in the Hugging Face cache {cache} nor downloadable ({reason}); "
            "pass a local directory holding config.json and *.safetensors, or set HF_HUB_CACHE to a cache "
            "that holds it") from None
