"""Gemma 3 text decoders ("gemma3_text", and the text half of the multimodal "gemma3") now run on
the unified decoder (decoder.py); their config parse is `family_configs.parse_gemma3` and their
multimodal checkpoint names are mapped by `families.GEMMA3_MULTIMODAL_LAYOUT`.

These names stay for callers of the old module. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from widebeam.model.arch import ModelArch, UnsupportedModelError
from widebeam.model.families import ParsedConfig, parse_config
from widebeam.model.family_configs import GEMMA3_TEXT_DEFAULTS as TEXT_CONFIG_DEFAULTS
from widebeam.model.family_configs import gemma3_rope_parameters, gemma3_text_config

SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma3")


def text_config(config: dict) -> dict:
    """The decoder's config as one flat dict, Gemma3TextConfig defaults filled in."""
    _check_type(config)
    return gemma3_text_config(config)


@dataclass(frozen=True)
class Gemma3Config:
    """The parsed config under the old module's field names."""

    parsed: ParsedConfig
    query_pre_attn_scalar: float

    @classmethod
    def from_hf_config(cls, config: dict) -> Gemma3Config:
        _check_type(config)
        return cls(parse_config(config), float(gemma3_text_config(config)["query_pre_attn_scalar"]))

    @property
    def arch(self) -> ModelArch:
        return self.parsed.arch

    @property
    def rms_norm_eps(self) -> float:
        return self.parsed.settings.rms_norm_eps

    @property
    def rope(self) -> dict[str, dict]:
        return self.parsed.settings.rope

    @property
    def final_logit_softcapping(self) -> float | None:
        return self.parsed.settings.final_logit_softcap


def _check_type(config: dict) -> None:
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model type {config.get('model_type')!r} is not supported by the Gemma 3 code; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


__all__ = ["SUPPORTED_MODEL_TYPES", "TEXT_CONFIG_DEFAULTS", "Gemma3Config", "gemma3_rope_parameters", "text_config"]
