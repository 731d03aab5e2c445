"""layers.Embedding: no random init on the meta device (where models are built: torch's normal_ there
imports torch._dynamo, ~1 s of every model load), nn.Embedding's own init anywhere else."""

from __future__ import annotations

import torch
from torch import nn

from widebeam.model.families.layers import Embedding


def test_no_init_on_meta_and_nn_embeddings_init_elsewhere(monkeypatch):
    devices = []
    normal_ = torch.nn.init.normal_
    monkeypatch.setattr(torch.nn.init, "normal_",
                        lambda tensor, *args, **kwargs: devices.append(tensor.device.type) or normal_(
                            tensor, *args, **kwargs))
    with torch.device("meta"):
        meta = Embedding(10, 4, padding_idx=1)
    assert meta.weight.is_meta and meta.weight.shape == (10, 4) and devices == []

    torch.manual_seed(0)
    ours = Embedding(10, 4, padding_idx=1)
    torch.manual_seed(0)
    theirs = nn.Embedding(10, 4, padding_idx=1)
    assert devices == ["cpu", "cpu"]
    assert torch.equal(ours.weight, theirs.weight) and not ours.weight[1].any() and ours.weight.std() > 0
