"""Copy-on-write carries only the slots a beam has written in its shared partial block: the manager
queues that count with the copy, and the runner copies those leading slots in every layer (K and V)
and nothing else. Run against the real manager and runner (a stand-in model: the runner reads only
its arch and pool names here)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from widebeam.kv.block_pool import BlockPool
from widebeam.kv.full_attention import FullAttentionManager
from widebeam.kv.spec import FullAttentionSpec
from widebeam.kv.tables import BlockCopy, Holding
from widebeam.model.runner import ModelRunner

SPEC = FullAttentionSpec(name="self", num_layers=1, num_kv_heads=1, head_dim=8)


def test_a_shared_partial_block_is_queued_with_the_tokens_written_in_it():
    t = 4
    manager = FullAttentionManager(SPEC, BlockPool(8, name="self"), t)
    holding = Holding()
    prompt = manager.new_table(holding)
    manager.append_slots(prompt, 6)  # one full block, then 2 of 4 slots of the second
    partial_block = prompt.block_ids[1]
    beams = [manager.fork(prompt), manager.fork(prompt)]
    manager.release(prompt)
    manager.append_slots(beams[0])
    (copy,) = manager.take_copies()
    assert copy == BlockCopy(partial_block, beams[0].block_ids[1], 2)
    assert beams[1].block_ids[1] == partial_block != copy.dst_block_id
    manager.append_slots(beams[0], 3)  # fills its copy, spills into a new block: no copy
    manager.append_slots(beams[1])  # the last sharer writes in place
    assert manager.take_copies() == []
    for beam in beams:
        manager.release(beam)
    assert holding.num_held_blocks == 0


def _runner(num_layers: int, num_blocks: int, t: int) -> ModelRunner:
    arch = SimpleNamespace(num_kv_heads=2, head_dim=3, layer_windows=[None] * num_layers)
    model = SimpleNamespace(arch=arch, layer_pool_names=["self"] * num_layers)
    return ModelRunner(model, {"self": num_blocks}, t, torch.device("cpu"), torch.float32)


def test_the_runner_copies_the_leading_slots_in_every_layer_and_nothing_else():
    t = 4
    runner = _runner(num_layers=3, num_blocks=6, t=t)
    kv = runner.kv_tensors["self"]  # [layers, K/V, slots, kv_heads, head_dim]
    kv.copy_(torch.randn_like(kv))
    before = kv.clone()
    copies = [BlockCopy(0, 3, 2), BlockCopy(1, 4, t), BlockCopy(2, 5, 1)]
    runner.copy_blocks("self", copies)
    expected = before.clone()
    for src, dst, num_tokens in copies:
        expected[:, :, dst * t:dst * t + num_tokens] = before[:, :, src * t:src * t + num_tokens]
    assert torch.equal(kv, expected)
    # the copies' unwritten slots kept what they held
    assert torch.equal(kv[:, :, 3 * t + 2:4 * t], before[:, :, 3 * t + 2:4 * t])
    runner.copy_blocks("self", [])  # nothing queued: nothing done
    assert torch.equal(kv, expected)
