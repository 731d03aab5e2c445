"""A worker: one model, its runner, and the KV pools its layers use, named in the engine's scope.

An engine holds one or more workers (the target model now; a draft model next) over one `KVCache`
whose pools are named per worker: the target's keep the model's own names ("self", "sliding_512",
"cross"), another worker's carry its name ("draft" for its self pool, "draft/sliding_512"), so pools
of two models never clash while admission and the scheduler see all of them in one place.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from widebeam.kv.spec import PoolSpec
from widebeam.model.registry import activation_dtype, model_dtype
from widebeam.model.runner import ModelRunner, SequenceInput


class Worker:
    def __init__(self, name: str, model: torch.nn.Module, dtype: str, prefix: str = ""):
        self.name = name
        self.model = model
        self.prefix = prefix
        self.arch = model.arch
        # Model pool name -> engine pool name, and each pool's spec under its engine name.
        self.specs: list[PoolSpec] = []
        self.pool_names: dict[str, str] = {}
        for spec in self.arch.kv_pool_specs(activation_dtype(dtype)):  # int8 weights keep float KV
            scoped = scoped_pool_name(prefix, spec.name)
            self.pool_names[spec.name] = scoped
            self.specs.append(_renamed(spec, scoped))
        self.runner: ModelRunner | None = None

    def start(self, blocks_per_pool: dict[str, int], tokens_per_block: int, device: torch.device,
              attention_backend: str | None = None) -> None:
        """Allocate the K/V tensors for the blocks sizing gave this worker's pools."""
        local_blocks = {local: blocks_per_pool[scoped] for local, scoped in self.pool_names.items()}
        self.runner = ModelRunner(self.model, local_blocks, tokens_per_block, device, model_dtype(self.model),
                                  attention_backend)

    def copy_blocks(self, copies_by_pool: dict[str, list[tuple[int, int]]]) -> None:
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


def scoped_pool_name(prefix: str, local_name: str) -> str:
    """The engine's name of a worker's pool: the model's own without a prefix; else the prefix
    alone for the self pool ("draft") and prefix/name for the others ("draft/sliding_512")."""
    if not prefix:
        return local_name
    return prefix if local_name == "self" else f"{prefix}/{local_name}"


def _renamed(spec: PoolSpec, name: str) -> PoolSpec:
    return spec if spec.name == name else replace(spec, name=name)


def _spec_named(specs: list[PoolSpec], name: str) -> PoolSpec:
    return next(s for s in specs if s.name == name)
