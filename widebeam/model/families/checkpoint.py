"""A family's checkpoint into the model built from its config, strictly: names mapped by the family's
`CheckpointLayout` (table.py), every tensor present, shapes equal."""

from __future__ import annotations

import torch

from widebeam.errors import UnsupportedModelError
from widebeam.model.families.arch import ModelArch
from widebeam.model.families.table import CheckpointLayout


def to_model_names(state_dict: dict[str, torch.Tensor], layout: CheckpointLayout,
                   arch: ModelArch) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the model's parameter names: skipped prefixes dropped, renamed
    prefixes rewritten, packed tensors split into their parts (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if layout.skipped_prefixes and name.startswith(layout.skipped_prefixes):
            continue
        for old, new in layout.renamed_prefixes:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for packed in layout.packed_weights:
            marker = f".{packed.packed}."
            if marker not in f".{name}":
                continue
            rows = packed.part_rows(arch)
            if tensor.shape[0] != sum(rows):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name} has {tensor.shape[0]} rows; the {arch.model_type} layout "
                    f"splits it into {dict(zip(packed.parts, rows))}")
            head, tail = f".{name}".split(marker, 1)
            for part, piece in zip(packed.parts, tensor.split(rows, dim=0)):
                out[f"{head}.{part}.{tail}".lstrip(".")] = piece
            break
        else:
            out[name] = tensor
    return out


def copy_checkpoint(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy every checkpoint tensor into the parameter of the same name; refuse a checkpoint whose
    names do not match the model's layout (a missing tensor would leave uninitialised weights).

    A model with a `checkpoint_layout` (its family's, see families/table.py) has its checkpoint's names
    mapped first. With tied embeddings the LM head is the embedding matrix, so a stored
    `lm_head.weight` is ignored.
    """
    layout = getattr(model, "checkpoint_layout", None)
    state_dict = to_model_names(state_dict, layout, model.arch) if layout is not None else dict(state_dict)
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
