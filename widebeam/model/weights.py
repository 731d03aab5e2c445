"""Filling a model built from its config with a checkpoint's tensors, strictly."""

from __future__ import annotations

import torch

from widebeam.model.layers import UnsupportedModelError


def copy_checkpoint(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy every checkpoint tensor into the parameter of the same name; refuse a checkpoint whose
    names do not match the model's layout (a missing tensor would leave uninitialised weights).

    With tied embeddings the LM head is the embedding matrix, so a stored `lm_head.weight` is ignored.
    """
    state_dict = dict(state_dict)
    expected = set(model.state_dict())
    if model.arch.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(k for k in set(state_dict) - expected if "rotary_emb" not in k)
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint does not match the {model.arch.model_type} layout: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in state_dict.items():
            if name in params:
                params[name].copy_(tensor)
