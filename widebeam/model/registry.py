"""From a resolved model directory to a ready model and tokenizer on a device."""

from __future__ import annotations

import torch

from widebeam.model.gemma3 import SUPPORTED_MODEL_TYPES as GEMMA3_TYPES
from widebeam.model.gemma3 import Gemma3Config, Gemma3ForCausalLM
from widebeam.model.layers import UnsupportedModelError
from widebeam.model.llama import SUPPORTED_MODEL_TYPES as LLAMA_TYPES
from widebeam.model.llama import LlamaConfig, LlamaForCausalLM
from widebeam.model.loader import ModelSource, load_config, load_state_dict
from widebeam.model.marian import SUPPORTED_MODEL_TYPES as MARIAN_TYPES
from widebeam.model.marian import MarianConfig, MarianMTModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_MODEL_TYPES = LLAMA_TYPES + GEMMA3_TYPES + MARIAN_TYPES


def torch_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


def build_model(config: dict) -> torch.nn.Module:
    model_type = config.get("model_type")
    if model_type in LLAMA_TYPES:
        return LlamaForCausalLM(LlamaConfig.from_hf_config(config))
    if model_type in GEMMA3_TYPES:
        return Gemma3ForCausalLM(Gemma3Config.from_hf_config(config))
    if model_type in MARIAN_TYPES:
        return MarianMTModel(MarianConfig.from_hf_config(config))
    raise UnsupportedModelError(
        f"model architecture {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def load_model(source: ModelSource, dtype: str, device: torch.device) -> torch.nn.Module:
    """Build the model from config.json and fill it from safetensors (never a pickle)."""
    config = load_config(source)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device="cpu")  # no random init: every parameter comes from the checkpoint
    model.load_weights(load_state_dict(source))
    if hasattr(model, "tie_weights"):  # models with more than one tie (Marian) tie themselves
        model.tie_weights()
    elif model.arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer saved beside the weights, or None for a directory without one."""
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
