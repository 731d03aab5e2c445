"""From a resolved model directory to a ready model and tokenizer on a device.

Which class runs a config is the family table's answer (families.py); this module builds it on the
meta device, fills it from safetensors and moves it to the device.
"""

from __future__ import annotations

import torch

from widebeam.kv.spec import WEIGHT_ONLY_DTYPES, kv_dtype
from widebeam.model.families import SUPPORTED_MODEL_TYPES, ParsedConfig, parse_config  # noqa: F401
from widebeam.model.loader import ModelSource, load_config, load_state_dict
from widebeam.model.packed_linear import DEFAULT_LINEAR_BACKEND, pack_linears

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


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights, one scale per output channel, and int8 activations, one
    scale per row, quantized on each call: `torch._int_mm` (int8 x int8 -> int32) then both scales.
    Per-row and per-channel scales keep outliers from flattening the other rows and channels (a
    per-tensor activation scale, PyTorch's dynamic quantization, agreed with float32 on 34% of
    SmolLM2's next tokens; see benchmarks/int8_accuracy.py)."""

    _MIN_ROWS = 17  # torch._int_mm wants more than 16 rows: fewer are padded with zeros

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
        self.register_buffer("weight_t", torch.round(weight / scale[:, None]).to(torch.int8).t().contiguous())
        self.register_buffer("weight_scale", scale)  # [out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()  # [num_rows, in]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [num_rows, 1]
        quantized = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
        num_rows = quantized.shape[0]
        if num_rows < self._MIN_ROWS:
            quantized = torch.nn.functional.pad(quantized, (0, 0, 0, self._MIN_ROWS - num_rows))
        out = torch._int_mm(quantized, self.weight_t)[:num_rows].float() * scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Every linear layer (lm_head included) as an `Int8Linear`, in place; CPU only (oneDNN's int8
    kernels). For SmolLM2's shapes the lm_head at 1-16 rows runs 3-5x faster than float32."""
    if device.type != "cpu":
        raise ValueError("dtype='int8' runs on CPU (int8 matmul kernels); on CUDA use bfloat16")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model


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


def load_model(source: ModelSource, dtype: str, device: torch.device,
               linear_backend: str = DEFAULT_LINEAR_BACKEND) -> torch.nn.Module:
    """Build the model from config.json and fill it from safetensors (never a pickle). float32 on
    CPU: `linear_backend="onednn"` packs every linear's weight once for oneDNN (packed_linear.py)."""
    config = load_config(source)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device="cpu")  # no random init: every parameter comes from the checkpoint
    model.load_weights(load_state_dict(source))
    model.tie_weights()  # to_empty gave the tied parameters separate storage
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    if dtype == "int8":
        return quantize_int8(model, device)
    return pack_linears(model, device, linear_backend) if dtype == "float32" else model


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer saved beside the weights, or None for a directory without one."""
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
