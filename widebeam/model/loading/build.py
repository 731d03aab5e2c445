"""From a resolved model directory to a ready model and tokenizer on a device.

Which class runs a config is the family table's answer (families/table.py); this module builds it on the
meta device, fills it from safetensors and moves it to the device.
"""

from __future__ import annotations

import dataclasses

import torch

from widebeam.defaults import DEFAULT_LINEAR_BACKEND, DTYPES, FLOAT_DTYPES
from widebeam.kv.spec import kv_dtype
from widebeam.model.families.table import ParsedConfig, parse_config
from widebeam.model.linears.int8 import fuse_int8_projections, quantize_int8
from widebeam.model.linears.packed import pack_linears
from widebeam.model.loading.sources import ModelSource, load_config, load_state_dict

# torch's dtype by name for the float dtypes; int8 is weights-only (activations and KV in float32)
_TORCH_DTYPES = {name: getattr(torch, name) for name in FLOAT_DTYPES}


def activation_dtype(dtype: str) -> str:
    """The float type activations and KV use under a model `dtype` (int8 weights: float32)."""
    return kv_dtype(dtype)


def torch_dtype(dtype: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[activation_dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The float type a loaded model computes in (its embedding's: int8 linears hold no float weight)."""
    return next(m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Embedding))


def build_model(config: dict) -> torch.nn.Module:
    """The runtime model (contract.CausalModel) of a config.json dict, parameters uninitialised."""
    parsed = parse_config(config)
    return parsed.family.build(parsed)


def build_seq2seq(parsed: ParsedConfig) -> torch.nn.Module:
    """A BART-shaped encoder-decoder (Marian, M2M100/NLLB, BART, mBART): the family's settings are
    the switches of families/seq2seq.py: Seq2SeqConfig (Marian's settings leave the rest at its defaults)."""
    from widebeam.model.families.seq2seq import Seq2SeqConfig, Seq2SeqLM

    return Seq2SeqLM(Seq2SeqConfig(arch=parsed.arch, **dataclasses.asdict(parsed.settings)))




def load_model(source: ModelSource, dtype: str, device: torch.device,
               linear_backend: str = DEFAULT_LINEAR_BACKEND) -> torch.nn.Module:
    """Build the model from config.json and fill it from safetensors (never a pickle). float32 on
    CPU: `linear_backend="onednn"` packs every linear's weight once for oneDNN (linears/packed.py)."""
    config = load_config(source)
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device="cpu")  # no random init: every parameter comes from the checkpoint
    model.load_weights(load_state_dict(source))
    model.tie_weights()  # to_empty gave the tied parameters separate storage
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    if dtype == "int8":
        return fuse_int8_projections(quantize_int8(model, device))
    return pack_linears(model, device, linear_backend)


def load_tokenizer(source: ModelSource):
    """The Hugging Face tokenizer saved beside the weights, or None for a directory without one."""
    if not source.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))
