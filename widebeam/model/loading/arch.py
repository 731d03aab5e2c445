"""A model's architecture without its weights: what `widebeam plan` and the web page's plan read.

A built-in name (families/arch.py: BUILTIN_CONFIGS), a `config.json` path, a directory holding one, or
a repo id in the local Hugging Face cache (never the network: a plan must be quick and run anywhere).
Torch-free, like the family table it parses through.
"""

from __future__ import annotations

import json
from pathlib import Path

from widebeam.errors import ConfigError, UnsupportedModelError
from widebeam.model.families.arch import BUILTIN_CONFIGS, ModelArch
from widebeam.model.families.table import parse_config
from widebeam.model.loading.hub import cached_repo_file, hub_cache_dir, looks_like_repo_id


def load_arch(model: str) -> ModelArch:
    """A built-in name, a `config.json` path, or a directory holding one."""
    if model in BUILTIN_CONFIGS:
        config = BUILTIN_CONFIGS[model]
    else:
        config = _read_config(model)
    try:
        return parse_config(config, name=str(model)).arch
    except UnsupportedModelError as exc:
        # a plan for a model the engine cannot run is refused the same way a bad config is
        raise ConfigError(str(exc)) from None


def _read_config(model: str) -> dict:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    elif looks_like_repo_id(model):  # a repo in the local Hugging Face cache (no network for a plan)
        cached = cached_repo_file(model, "config.json")
        if cached is None:
            raise ConfigError(f"model {model!r} is not in the Hugging Face cache {hub_cache_dir()}: load it "
                              "once (widebeam generate --model ...), or give its config.json path")
        path = cached
    if path.suffix != ".json" or not path.exists():
        raise ConfigError(
            f"unknown model {model!r}: use one of {', '.join(BUILTIN_CONFIGS)}, "
            "a Hugging Face model directory or repo id, or a config.json path"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    return config
