"""Drafters: fill each sequence's `DraftTree` for a round.

- `NgramDrafter` ("ngram"): prompt lookup, one chain per sequence, no model.
- `ModelDrafter` ("draft"): a second model in its own worker and pools. One pass over the pending
  tokens (with the step's prompt chunks, which the draft must also hold, and the tokens it missed
  while it lagged), then one pass per tree level over the previous level's nodes (tree attention),
  best-first within each sequence's budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from widebeam.model.runner import SequenceInput
from widebeam.speculative.ngram import lookup_continuation
from widebeam.speculative.round import SequenceRound
from widebeam.speculative.tree import ROOT


class NgramDrafter:
    def draft(self, rounds: Sequence[SequenceRound], prefill_inputs: Sequence[SequenceInput] = ()) -> None:
        """Chains from prompt lookup; prompt chunks need nothing (the lookup reads the request's tokens)."""
        for rnd in rounds:
            parent = ROOT
            for token_id in lookup_continuation(rnd.history, min(rnd.max_depth, rnd.max_nodes)):
                parent = rnd.tree.add(parent, token_id)


class ModelDrafter:
    def __init__(self, worker, vocab_size: int):
        self.worker = worker
        self.vocab_size = vocab_size  # the target's: the draft never proposes a token it lacks
        # What the draft model was fed, in tokens (one per sequence position): prompt chunks; the
        # rounds' first passes (tokens a lagging draft missed, then the pending ones); drafted nodes
        # fed to draft their children. And its forward passes. (`stats`: what a lazy draft saves.)
        self.counts = {"prompt_tokens": 0, "round_tokens": 0, "node_tokens": 0, "passes": 0}

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def _execute(self, inputs: Sequence[SequenceInput], **kwargs) -> torch.Tensor:
        self.counts["passes"] += 1
        return self.worker.execute(inputs, **kwargs)

    def draft(self, rounds: Sequence[SequenceRound], prefill_inputs: Sequence[SequenceInput] = ()) -> None:
        """Fill the rounds' trees; the step's prompt chunks ride along the first pass (the draft
        must hold every prompt; their logits are not used).

        The first pass feeds each round's `draft_feed`: a sequence that drafts feeds its pending
        tokens, after any tokens the draft missed while the request did not draft (the lazy
        catch-up); a sequence with nothing to draft feeds nothing, so a plain round costs the
        draft nothing (the request, not the drafter, decides: `RequestDraft.plan_round`)."""
        fed = [rnd for rnd in rounds if rnd.draft_feed is not None]
        active = [rnd for rnd in fed if rnd.max_depth > 0]
        inputs = list(prefill_inputs) + [rnd.draft_feed for rnd in fed]
        if not inputs:
            return
        self.counts["prompt_tokens"] += sum(len(seq.token_ids) for seq in prefill_inputs)
        self.counts["round_tokens"] += sum(len(rnd.draft_feed.token_ids) for rnd in fed)
        logits = self._execute(inputs)  # [num_seqs, vocab]: each sequence's last token
        rows = {id(rnd): len(prefill_inputs) + i for i, rnd in enumerate(fed)}
        if not active:
            return
        self._expand(active, [[ROOT] for _ in active], logits[[rows[id(rnd)] for rnd in active]])
        depth = 1
        while True:
            growing = [rnd for rnd in active
                       if depth < rnd.max_depth and len(rnd.tree) < rnd.max_nodes and rnd.tree.level(depth)]
            if not growing:
                return
            inputs = [rnd.level_input(depth) for rnd in growing]
            self.counts["node_tokens"] += sum(len(seq.token_ids) for seq in inputs)
            logits = self._execute(inputs, all_logits=True)  # [num_nodes, vocab]
            self._expand(growing, [rnd.tree.level(depth) for rnd in growing], logits)
            depth += 1

    def _expand(self, rounds: Sequence[SequenceRound], parents: Sequence[list[int]],
                logits: torch.Tensor) -> None:
        """Add each parent's best children, best-first by the draft's path score within each
        sequence's node budget; one top-k and one host read for all rows."""
        width = max(rnd.branching for rnd in rounds)
        logprobs = torch.log_softmax(logits[:, :self.vocab_size].float(), dim=-1)
        top = torch.topk(logprobs, width, dim=-1)
        values, tokens = top.values.tolist(), top.indices.tolist()
        row = 0
        for rnd, nodes in zip(rounds, parents):
            candidates = []
            for node in nodes:
                base = 0.0 if node == ROOT else rnd.tree.scores[node]
                candidates.extend((base + v, node, t) for v, t in zip(values[row][:rnd.branching],
                                                                       tokens[row][:rnd.branching]))
                row += 1
            candidates.sort(key=lambda c: -c[0])
            for score, node, token_id in candidates:
                if len(rnd.tree) >= rnd.max_nodes:
                    break
                rnd.tree.add(node, token_id, score)
