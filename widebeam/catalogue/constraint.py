"""The catalogue constraint: a logits processor that keeps every beam of a request inside its
catalogue, with per-beam state (its trie node) reordered with the beams.

Each step a beam may take a child of its node, or an end-of-sequence token where its node ends an
item (so a returned sequence is an item followed by EOS, as beams end in unconstrained search);
on the last allowed step only EOS, so no beam is ever cut inside an item. Everything else gets
-inf. The masks of all beams are built with tensor ops over the trie's CSR ranges (no loop over
beams), and the log-probs of the allowed tokens only are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from widebeam.catalogue.trie import Catalogue


class CatalogueConstraint:
    def __init__(self, catalogue: Catalogue, eos_token_ids: Iterable[int], max_new_tokens: int):
        self.catalogue = catalogue
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_new_tokens = max_new_tokens
        self.nodes: torch.Tensor | None = None  # [live beams] trie node of each; None: the prompt (root)

    def _nodes(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self.nodes is None:
            return torch.zeros(num_rows, dtype=torch.long, device=device)
        return self.nodes

    def allowed(self, num_rows: int, num_generated_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, tokens) [num_allowed] on the catalogue's device: every (beam, token) this step may
        take: each beam's children, and the EOS ids where its node ends an item."""
        catalogue = self.catalogue
        nodes = self._nodes(num_rows, catalogue.device)
        starts = catalogue.child_start[nodes]
        counts = catalogue.child_start[nodes + 1] - starts
        if num_generated_tokens >= self.max_new_tokens - 1:
            counts = torch.zeros_like(counts)  # the last token: EOS only, never a cut item
        total = int(counts.sum())  # the one host read: the size of the allowed set
        row_ids = torch.arange(nodes.shape[0], device=nodes.device)
        rows = torch.repeat_interleave(row_ids, counts, output_size=total)
        # [total] each allowed child's node id: its row's first child + its rank among them
        first = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts, output_size=total)
        tokens = catalogue.node_token[first + torch.arange(total, device=nodes.device)]
        if self.eos_token_ids:
            end_rows = row_ids[catalogue.is_end[nodes]]
            eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=nodes.device)
            rows = torch.cat((rows, end_rows.repeat_interleave(eos.shape[0])))
            tokens = torch.cat((tokens, eos.repeat(end_rows.shape[0])))
        return rows, tokens

    def __call__(self, scores: torch.Tensor, num_generated_tokens: int) -> None:
        """Keep the scores [rows, vocab] of each row's allowed tokens; the rest become -inf."""
        rows, tokens = self.allowed(scores.shape[0], num_generated_tokens)
        rows, tokens = rows.to(scores.device), tokens.to(scores.device)
        kept = scores[rows, tokens]
        scores.fill_(float("-inf"))
        scores[rows, tokens] = kept

    def reorder(self, parent_indices: Sequence[int], token_ids: Sequence[int]) -> None:
        """Beam i of the next step continues beam `parent_indices[i]` with `token_ids[i]`."""
        device = self.catalogue.device
        if not parent_indices:
            self.nodes = torch.zeros(0, dtype=torch.long, device=device)
            return
        parents = torch.tensor(list(parent_indices), dtype=torch.long, device=device)
        nodes = self._nodes(int(parents.max()) + 1, device).index_select(0, parents)
        self.nodes = self.catalogue.child_nodes(nodes, torch.tensor(list(token_ids), dtype=torch.long, device=device))

    def drop(self, seq_indices: Iterable[int]) -> None:
        """These live beams finished (stop strings); the others keep their order."""
        gone = set(seq_indices)
        if self.nodes is not None and gone:
            keep = [i for i in range(self.nodes.shape[0]) if i not in gone]
            self.nodes = self.nodes.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.nodes.device))
