"""Llama-family decoders (Llama, SmolLM2, Qwen2, Mistral) now run on the unified decoder
(decoder.py), configured by their family's parse (family_configs.py). These names stay for callers
of the old module: `LlamaForCausalLM(LlamaConfig.from_hf_config(config))` still builds the model.
"""

from __future__ import annotations

from widebeam.model.arch import UnsupportedModelError
from widebeam.model.decoder import DecoderForCausalLM as LlamaForCausalLM  # noqa: F401
from widebeam.model.families import ParsedConfig, parse_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class LlamaConfig:
    @staticmethod
    def from_hf_config(config: dict) -> ParsedConfig:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported by the Llama-family code; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        return parse_config(config)
