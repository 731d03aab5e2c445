"""A worker: one model, its runner, and the KV pools its layers use, named in the engine's scope.

An engine holds one or more workers (the target model now; a draft model next) over one `KVCache`
whose pools are named per worker: the target's keep the model's own names ("self", "sliding_512",
"cross"), another worker's carry its name ("draft" for its self pool, "draft/sliding_512"), so pools
of two models never clash while admission and the scheduler see all of them in one place.
"""

from __future__ import annotations

import torch

from widebeam.decoding.logprobs import PromptLogprobs
from widebeam.kv.spec import PoolSpec, kv_dtype
from widebeam.layout import scoped_specs
from widebeam.model.loading.build import model_dtype
from widebeam.model.runner import ModelRunner, SequenceInput


class Worker:
    def __init__(self, name: str, model: torch.nn.Module, dtype: str, prefix: str = "",
                 kv_cache_dtype: str = "auto"):
        self.name = name
        self.model = model
        self.prefix = prefix
        self.arch = model.arch
        # Model pool name -> engine pool name, and each pool's spec under its engine name (the layout's
        # rule: the engine sizes these pools from a `StartupLayout` computed with the same names).
        scoped = scoped_specs(self.arch, dtype, prefix, kv_cache_dtype)  # int8 weights keep float KV
        self.kv_cache_dtype = kv_dtype(dtype, kv_cache_dtype)  # what every pool of this worker stores
        self.specs: list[PoolSpec] = list(scoped.values())
        self.pool_names: dict[str, str] = {local: spec.name for local, spec in scoped.items()}
        self.runner: ModelRunner | None = None

    def start(self, blocks_per_pool: dict[str, int], tokens_per_block: int, device: torch.device,
              attention_backend: str | None = None) -> None:
        """Allocate the K/V tensors for the blocks sizing gave this worker's pools."""
        local_blocks = {local: blocks_per_pool[scoped] for local, scoped in self.pool_names.items()}
        self.runner = ModelRunner(self.model, local_blocks, tokens_per_block, device, model_dtype(self.model),
                                  attention_backend, kv_cache_dtype=self.kv_cache_dtype)

    def copy_blocks(self, copies_by_pool: dict[str, list[tuple[int, int, int]]]) -> None:
        for local, scoped in self.pool_names.items():
            if copies_by_pool.get(scoped):
                self.runner.copy_blocks(local, copies_by_pool[scoped])

    def encode(self, sources: list[list[int]], cross_slots: list[dict[str, list[int]]]) -> None:
        """Encoder-decoder workers: write the sources' cross K/V (slots per engine pool name)."""
        if not sources:
            return
        shared = [scoped for local, scoped in self.pool_names.items()
                  if not _spec_named(self.specs, scoped).per_sequence]
        self.runner.encode(sources, [slots[shared[0]] for slots in cross_slots])

    def execute(self, seqs: list[SequenceInput], all_logits: bool = False,
                num_logits: list[int] | None = None) -> torch.Tensor:
        """Run the step with pool names translated to the model's; float32 logits, one row per
        sequence by default (see `ModelRunner.execute` for `all_logits` and `num_logits`)."""
        if self.prefix:
            seqs = [self._localized(seq) for seq in seqs]
        return self.runner.execute(seqs, all_logits=all_logits, num_logits=num_logits)

    def _localized(self, seq: SequenceInput) -> SequenceInput:
        local_of = {scoped: local for local, scoped in self.pool_names.items()}
        return SequenceInput(seq.token_ids, seq.num_computed_tokens,
                             {local_of[k]: v for k, v in seq.block_tables.items() if k in local_of},
                             {local_of[k]: v for k, v in seq.slots.items() if k in local_of},
                             seq.group, seq.cross_block_table, seq.num_encoder_tokens, seq.tree_parents)


def execute_step(worker: Worker, inputs: list[SequenceInput], num_rows: list[int],
                 collectors: dict[int, PromptLogprobs]) -> torch.Tensor:
    """Run a step's forward pass: the logits of the last `num_rows[i]` tokens of input i, in order
    [sum(num_rows), vocab], as `worker.execute(inputs, num_logits=num_rows)` returns them. A prompt
    chunk with a collector (`collectors[i]`: its request wants prompt log-probs) also gets the
    logits of every one of its tokens from the same pass, handed to the collector; its last row is
    returned as usual."""
    wanted = {i: c for i, c in collectors.items() if not inputs[i].tree_parents
              and c.wants(inputs[i].num_computed_tokens, len(inputs[i].token_ids))}
    if not wanted:
        if all(n == 1 for n in num_rows):
            return worker.execute(inputs)
        return worker.execute(inputs, num_logits=num_rows)
    counts = [len(seq.token_ids) if i in wanted else n for i, (seq, n) in enumerate(zip(inputs, num_rows))]
    logits = worker.execute(inputs, num_logits=counts)
    ends = torch.tensor(counts).cumsum(0).tolist()
    for i, collector in wanted.items():
        chunk = logits[ends[i] - counts[i]:ends[i]]
        collector.add_chunk(inputs[i].num_computed_tokens, torch.log_softmax(chunk.float(), dim=-1))
    keep = [row for i, end in enumerate(ends) for row in range(end - num_rows[i], end)]
    return logits.index_select(0, torch.tensor(keep, device=logits.device))


def _spec_named(specs: list[PoolSpec], name: str) -> PoolSpec:
    return next(s for s in specs if s.name == name)
