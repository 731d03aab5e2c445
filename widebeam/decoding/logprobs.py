"""The tensor side of log-probs (what they are is in `widebeam/logprobs.py`): each chosen token's entry
from a log-softmax row, and the prompt's collector filled chunk by chunk during the prefill (from the
step's own forward pass: `worker.py: execute_step`)."""

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

