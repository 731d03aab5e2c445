"""The catalogue constraint: a logits processor that keeps every beam of a request inside its
catalogue, with per-beam state (its trie node) moved with the beams (the step context's moves).

Each step a beam may take a child of its node, or an end-of-sequence token where its node ends an
item (so a returned sequence is an item followed by EOS, as beams end in unconstrained search);
on the last allowed step only EOS, so no beam is ever cut inside an item. Everything else gets
-inf. The masks of all beams are built with tensor ops over the trie's CSR ranges (no loop over
beams), and the log-probs of the allowed tokens only are kept. Alone in a request's list, the
constraint offers its allowed (beam, token) pairs (`allowed`) and beam search ranks just those.
A request's item filter (`catalogue/filters.py`) prunes those pairs inside the same walk.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from widebeam.catalogue.trie import Catalogue
from widebeam.decoding.context import BeamMoves, StepContext
from widebeam.decoding.processors import BeamStateFollower, StepProcessor


class CatalogueConstraint(BeamStateFollower, StepProcessor):
    def __init__(self, catalogue: Catalogue, eos_token_ids: Iterable[int], max_new_tokens: int):
        self.catalogue = catalogue
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_new_tokens = max_new_tokens
        self.nodes: torch.Tensor | None = None  # [live beams] trie node of each; None: the prompt (root)

    def _nodes(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self.nodes is None:
            return torch.zeros(num_rows, dtype=torch.long, device=device)
        return self.nodes

    def allowed(self, context: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, tokens) [num_allowed] on the catalogue's device: every (beam, token) this step may
        take: each beam's children, and the EOS ids where its node ends an item."""
        self.follow(context)
        return self._allowed(context.num_rows, context.num_generated_tokens)

    def _allowed(self, num_rows: int, num_generated_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        catalogue = self.catalogue
        nodes = self._nodes(num_rows, catalogue.device)
        # index_select, not advanced indexing: the same gather, ~5x faster on CPU at 100k+ candidates
        starts = catalogue.child_start.index_select(0, nodes)
        counts = catalogue.child_start.index_select(0, nodes + 1) - starts
        if num_generated_tokens >= self.max_new_tokens - 1:
            counts = torch.zeros_like(counts)  # the last token: EOS only, never a cut item
        total = int(counts.sum())  # the one host read: the size of the allowed set
        row_ids = torch.arange(nodes.shape[0], device=nodes.device)
        rows = torch.repeat_interleave(row_ids, counts, output_size=total)
        # [total] each allowed child's node id: its row's first child + its rank among them
        first_child = starts - (torch.cumsum(counts, 0) - counts)  # [rows]
        first = torch.repeat_interleave(first_child, counts, output_size=total)
        children = first + torch.arange(total, device=nodes.device)
        item_filter = getattr(catalogue, "item_filter", None)
        ends = catalogue.is_end.index_select(0, nodes)
        if item_filter is not None:
            # a request's filter (catalogue/filters.py): no child without an allowed item below it,
            # no EOS after an item it excludes; one nonzero serves both selections
            live = item_filter.live_indices(children, counts)
            rows, children = rows.index_select(0, live), children.index_select(0, live)
            ends = ends & item_filter.ends_allowed(nodes)
        tokens = catalogue.node_token.index_select(0, children)
        if self.eos_token_ids:
            end_rows = row_ids[ends]
            eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=nodes.device)
            rows = torch.cat((rows, end_rows.repeat_interleave(eos.shape[0])))
            tokens = torch.cat((tokens, eos.repeat(end_rows.shape[0])))
        return rows, tokens

    def process(self, scores: torch.Tensor, context: StepContext) -> None:
        """Keep the scores [rows, vocab] of each row's allowed tokens; the rest become -inf."""
        rows, tokens = self.allowed(context)
        rows, tokens = rows.to(scores.device), tokens.to(scores.device)
        kept = scores[rows, tokens]
        scores.fill_(float("-inf"))
        scores[rows, tokens] = kept

    def move(self, moves: BeamMoves) -> None:
        """Beam i of this step continues beam `moves.parent_indices[i]` with `moves.token_ids[i]`."""
        device = self.catalogue.device
        if not moves.parent_indices:
            self.nodes = torch.zeros(0, dtype=torch.long, device=device)
            return
        parents = torch.tensor(moves.parent_indices, dtype=torch.long, device=device)
        nodes = self._nodes(int(parents.max()) + 1, device).index_select(0, parents)
        tokens = torch.tensor(moves.token_ids, dtype=torch.long, device=device)
        self.nodes = self.catalogue.child_nodes(nodes, tokens)
