"""One round of one sequence: where its pending and drafted tokens go, and the inputs the draft
and the target run on. Every decode step is a round; one with no drafted nodes (D = 0) feeds the
pending tokens alone, as a plain decode step.

A round starts from C committed tokens (in every pool of both workers) and k >= 1 pending tokens
(chosen, not yet in the cache: the last token plus those accepted in the previous round, re-fed
because the drafted tree's K/V are discarded). It takes slots for k + D tokens at once in every
pool (`RequestKV.decode_slots`), so nothing is allocated mid-round and every pool's bound is the
one admission checked (`KVRequest(extra_tokens=D, refeed_tokens=D)`); the tree uses the first
`len(tree)` of the D drafted slots, and everything past C + k is rolled back at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from widebeam.model.runner import SequenceInput
from widebeam.speculative.tree import DraftTree


@dataclass
class SequenceRound:
    committed_tokens: int  # C: in the cache before the round
    pending_token_ids: list[int]  # k tokens fed first, at positions C .. C + k - 1
    block_tables: dict[str, list[int]]  # every pool of both workers, covering C + k + D tokens
    slots: dict[str, list[int]]  # pool -> k + D slots
    group: str  # the request: its sequences share prompt blocks
    history: list[int]  # prompt + generated tokens (pending included): what prompt lookup searches
    max_depth: int  # the deepest node worth drafting (a round never passes max_new_tokens)
    branching: int  # children drafted per node
    max_nodes: int  # D
    tree: DraftTree = field(default_factory=DraftTree)
    row_start: int = 0  # this sequence's first row in the verify pass's logits
    # What a draft model's first pass of the round feeds for this sequence (None: nothing, the draft
    # lags): its pending tokens, after the tokens it missed while it lagged (`RequestDraft.feed`).
    draft_feed: SequenceInput | None = None
    # Encoder-decoder models: the request's cross table (read by every sequence) and its tokens.
    cross_block_table: list[int] | None = None
    num_encoder_tokens: int = 0

    @property
    def num_pending(self) -> int:
        return len(self.pending_token_ids)

    def _slots(self, start: int, end: int) -> dict[str, list[int]]:
        return {name: slots[start:end] for name, slots in self.slots.items()}

    def pending_input(self) -> SequenceInput:
        """The pending tokens alone (the draft's first pass of the round)."""
        return SequenceInput(list(self.pending_token_ids), self.committed_tokens, self.block_tables,
                             self._slots(0, self.num_pending), self.group)

    def level_input(self, depth: int) -> SequenceInput:
        """The nodes at `depth` (contiguous in breadth-first order), to draft their children; the
        shallower nodes are in the draft's cache already."""
        nodes = self.tree.level(depth)
        first, last = nodes[0], nodes[-1]
        start = self.num_pending + first
        return SequenceInput(self.tree.token_ids[first:last + 1], self.committed_tokens + start,
                             self.block_tables, self._slots(start, start + len(nodes)), self.group,
                             tree_parents=self.tree.parents[:last + 1])

    def verify_input(self) -> SequenceInput:
        """Pending tokens then every drafted node, for the target's one pass."""
        num_tokens = self.num_pending + len(self.tree)
        return SequenceInput(self.pending_token_ids + self.tree.token_ids, self.committed_tokens,
                             self.block_tables, self._slots(0, num_tokens), self.group,
                             self.cross_block_table, self.num_encoder_tokens,
                             list(self.tree.parents) if len(self.tree) else None)

    @property
    def num_verify_rows(self) -> int:
        """Logits rows the verify pass returns for this sequence: its last pending token's and each node's."""
        return 1 + len(self.tree)

    def row(self, node: int) -> int:
        """The verify logits row that scores the token after `node` (ROOT: after the pending tokens)."""
        return self.row_start + 1 + node  # ROOT is -1


def number_verify_rows(rounds: list[SequenceRound], first_row: int) -> list[int]:
    """Give each round its rows in the verify pass's logits (`row_start`), in order after `first_row`
    rows; returns each round's row count."""
    row = first_row
    for rnd in rounds:
        rnd.row_start = row
        row += rnd.num_verify_rows
    return [rnd.num_verify_rows for rnd in rounds]
