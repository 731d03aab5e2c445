"""Workers scope their pools in one KV cache: a second worker (a draft model, next) sits beside the
target with its own pool names, one request's coordinator allocates in both, and each worker runs
on its own pools only."""

from __future__ import annotations

import torch

from widebeam.kv.budget import KVRequest
from widebeam.kv.cache import KVCache
from widebeam.model.loading.build import load_model
from widebeam.model.loading.sources import resolve_model
from widebeam.model.runner import SequenceInput
from widebeam.worker import Worker


def test_two_workers_share_one_cache_without_name_clashes(tiny_llama_dir):
    device = torch.device("cpu")
    source = resolve_model(str(tiny_llama_dir))
    target = Worker("target", load_model(source, "float32", device), "float32")
    draft = Worker("draft", load_model(source, "float32", device), "float32", prefix="draft")
    assert [s.name for s in target.specs] == ["self"] and [s.name for s in draft.specs] == ["draft"]
    assert target.specs[0].bytes_per_token == draft.specs[0].bytes_per_token

    cache = KVCache([(spec, 32) for spec in target.specs + draft.specs], tokens_per_block=4)
    assert [b.pool for b in cache.budgets(KVRequest(10, 6, 2))] == ["self", "draft"]
    for worker in (target, draft):
        worker.start({"self": 32, "draft": 32}, 4, device)

    kv = cache.new_request()
    prompt = list(range(3, 13))
    slots = kv.prefill_slots(len(prompt))
    assert set(slots) == {"self", "draft"}
    seq = SequenceInput(prompt, 0, kv.block_tables(0), slots)
    # Same weights on both sides: the draft, reading and writing only its own pool, computes the same.
    torch.testing.assert_close(draft.execute([seq]), target.execute([seq]))
    kv.reorder([0, 0])
    step = kv.decode_slots()
    inputs = [SequenceInput([20 + i], len(prompt), kv.block_tables(i), step[i]) for i in range(2)]
    copies = cache.take_copies()  # each worker runs the copies of its own pools
    for worker in (target, draft):
        worker.copy_blocks(copies)
    torch.testing.assert_close(draft.execute(inputs), target.execute(inputs))
    kv.free()
    assert cache.num_free_blocks() == {"self": 32, "draft": 32}
