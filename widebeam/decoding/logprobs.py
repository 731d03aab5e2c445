"""The tensor side of log-probs (what they are is in `widebeam/logprobs.py`): each chosen token's entry
from a log-softmax row, the prompt's collector filled chunk by chunk during the prefill, and the step
that gets every prefill position's logits from the same forward pass."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from widebeam.logprobs import Logprob, TokenLogprobs


def token_logprobs(logprobs: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int],
                   num_top: int) -> list[TokenLogprobs]:
    """For each (row, token): the token's log-prob in `logprobs[row]` ([rows, vocab], a log-softmax),
    its rank there, and the row's `num_top` most likely tokens; one host read for all of them."""
    if not token_ids:
        return []
    device = logprobs.device
    rows_t = torch.tensor(list(rows), dtype=torch.long, device=device)
    tokens_t = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    selected = logprobs.index_select(0, rows_t)
    chosen = selected.gather(1, tokens_t[:, None])[:, 0]
    ranks = (selected > chosen[:, None]).sum(1) + 1
    values = [chosen.double(), ranks.double()]
    top_tokens: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if num_top:
        top_v, top_i = torch.topk(selected, min(num_top, selected.shape[1]), dim=1)
        top_tokens, top_values = top_i.cpu().tolist(), top_v.double().cpu().tolist()
    chosen_l, ranks_l = torch.stack(values).cpu().tolist()
    out = []
    for token, lp, rank, tops, top_lps in zip(token_ids, chosen_l, ranks_l, top_tokens, top_values):
        entry = {int(token): Logprob(lp, int(rank))}
        for j, (top, top_lp) in enumerate(zip(tops, top_lps)):
            if top not in entry:
                entry[top] = Logprob(top_lp, j + 1)
        out.append(entry)
    return out


class PromptLogprobs:
    """The prompt's log-probs of one request, filled chunk by chunk during its prefill: each chunk's
    rows are the log-softmax of every one of its positions (`add_chunk`)."""

    def __init__(self, prompt_token_ids: Sequence[int], num_top: int):
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_top = num_top
        self.entries: list[TokenLogprobs | None] = [None] * len(self.prompt_token_ids)

    def wants(self, start: int, num_tokens: int) -> bool:
        """Whether a sequence input at `start` with `num_tokens` new tokens is a chunk of this prompt."""
        return start + num_tokens <= len(self.prompt_token_ids)

    def add_chunk(self, start: int, logprobs: torch.Tensor) -> None:
        """`logprobs` [n, vocab]: row j is position start + j, which predicts prompt token start + j + 1."""
        last = min(start + logprobs.shape[0], len(self.prompt_token_ids) - 1)  # the last predicted position
        count = last - start
        if count <= 0:
            return
        targets = self.prompt_token_ids[start + 1:start + 1 + count]
        self.entries[start + 1:start + 1 + count] = token_logprobs(logprobs, range(count), targets,
                                                                   self.num_top)


def execute_step(worker, inputs: list, num_rows: list[int],
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
