"""Tiny random models built with transformers and saved as safetensors, for tests.

A module of its own (not conftest.py): tests/ and tests/e2e/ both have a conftest, so
`from conftest import ...` would be ambiguous.
"""

from __future__ import annotations

import torch


def save_tiny_model(path, model_type: str = "llama", **overrides):
    """Build a tiny random model of a family transformers ships, save it as safetensors, return it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init is near-uniform; sharpen the distribution so greedy choices are well separated.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return model
