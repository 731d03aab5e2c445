"""From a resolved model directory to a ready model and tokenizer on a device.

Which class runs a config is the family table's answer (families.py); this module builds it on the
meta device, fills it from safetensors and moves it to the device.
"""

from __future__ import annotations

import torch

from widebeam.kv.spec import WEIGHT_ONLY_DTYPES, kv_dtype
from widebeam.model.families import SUPPORTED_MODEL_TYPES, ParsedConfig, parse_config  # noqa: F401
from widebeam.model.loader import ModelSource, load_config, load_state_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def activation_dtype(dtype: str) -> str:
    """The float type activations and KV use under a model `dtype` (int8 weights: float32)."""
    return kv_dtype(dtype)


def torch_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[activation_dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join([*DTYPES, *WEIGHT_ONLY_DTYPES])}, got {dtype!r}") from None


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The float type a loaded model computes in (its embedding's: int8 linears hold no float weight)."""
    return next(m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Embedding))


def quantize_int8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Every linear layer (lm_head included) with int8 weights, per-tensor scales, activations
    quantized per call: PyTorch's x86/fbgemm dynamic quantization, 2-14x faster than float32 for
    SmolLM2's shapes on this CPU where `_weight_int8pack_mm` was 2-20x slower (issue #19)."""
    if device.type != "cpu":
        raise ValueError("dtype='int8' runs on CPU (x86/fbgemm int8 kernels); on CUDA use bfloat16")
    import warnings

    # torch.ao's deprecation notices (quantized tensors; torch.ao moving to torchao), once per layer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def build_model(config: dict) -> torch.nn.Module:
    """The runtime model (contract.CausalModel) of a config.json dict, parameters uninitialised."""
    parsed = parse_config(config)
    return parsed.family.build(parsed)


def build_marian(parsed: ParsedConfig) -> torch.nn.Module:
    from widebeam.model.marian import MarianConfig, MarianMTModel

    settings = parsed.settings
    return MarianMTModel(MarianConfig(arch=parsed.arch, encoder_heads=settings.encoder_heads,
                                      activation=settings.activation, embed_scale=settings.embed_scale,
                                      decoder_start_token_id=settings.decoder_start_token_id))


def load_model(source: ModelSource, dtype: str, device: torch.device) -> torch.nn.Module:
    """Build the model from config.json and fill it from safetensors (never a pickle)."""
    config = load_config(source)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device="cpu")  # no random init: every parameter comes from the checkpoint
    model.load_weights(load_state_dict(source))
    model.tie_weights()  # to_empty gave the tied parameters separate storage
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    return quantize_int8(model, device) if dtype == "int8" else model


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer saved beside the weights, or None for a directory without one."""
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
