"""Log-probabilities reported with outputs (`SamplingParams(logprobs=k)`, `BeamSearchParams(logprobs=k)`,
`prompt_logprobs=k`), in vLLM's Python shape: one `dict[token_id, Logprob]` per token.

What they are, exactly (vLLM's default, `logprobs_mode="raw_logprobs"`):

* A generated token's entry holds its own log-prob, `log_softmax` of the model's raw float32 logits
  of the row that chose it (before temperature, top-k / top-p, penalties, a catalogue or any other
  logits processor), its `rank` in that row (1 = the most likely token), and the `k` most likely
  tokens of the same row with theirs (ranks 1..k). The chosen token comes first in the dict, so a dict
  holds k or k + 1 entries.
* Beam search: the row that chose a beam's token is its parent's at that step, so each beam's list
  is its own history (it follows the beam through every reorder and fork, as its token ids do). The
  entry of the last token of a finished hypothesis (EOS, or the `max_new_tokens`-th) is there too.
  Without a processor that changes scores (penalties), the sum of a beam's log-probs is its
  `cumulative_logprob`; with penalties the cumulative is over the penalised scores and differs.
* Prompt log-probs: entry i (i >= 1) is prompt token i under the logits of position i - 1, computed
  in the prefill (no second pass); entry 0 is None (nothing predicts the first token). A request that
  asks for them computes its whole prompt (no prefix-cache hit), as in vLLM.

`decoded_token` is the token's text (`convert_tokens_to_string` of the one token, vLLM's choice):
filled in the final `CompletionOutput` / `RequestOutput`, None in streamed deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token of its row
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


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


def with_token_text(entries, tokenizer) -> list | None:
    """`entries` (a list of TokenLogprobs or None, or a `PromptLogprobs`) with each `decoded_token`
    filled; None stays None."""
    entries = getattr(entries, "entries", entries)
    if entries is None:
        return None
    text = token_text_of(tokenizer)
    return [None if entry is None else {t: replace(lp, decoded_token=text(t)) for t, lp in entry.items()}
            for entry in entries]


@lru_cache(maxsize=8)
def token_text_of(tokenizer) -> TokenText:
    return TokenText(tokenizer)


class TokenText:
    """A token's text as vLLM reports it in log-probs: the tokenizer's string for that one token
    (a byte-level BPE piece that is part of a character decodes to the replacement character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                token = self.tokenizer.convert_ids_to_tokens(token_id)
                text = self.tokenizer.convert_tokens_to_string([token]) if token is not None else ""
            if len(self._cache) < 1_000_000:
                self._cache[token_id] = text
        return text


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
        self.entries[start + 1:start + 1 + count] = token_logprobs(logprobs, range(count), targets, self.num_top)


def execute_step(worker, inputs: list, rows: list) -> torch.Tensor:
    """Run a step's forward pass; logits of each sequence's last token [num_seqs, vocab], as
    `worker.execute(inputs)` returns them. A prefill chunk of a request that wants prompt log-probs
    (its decoder's `prompt_logprobs`) also gets the logits of every one of its tokens from the same
    pass, handed to that collector. `rows`: (request, first input, end input) per request."""
    wanted: dict[int, PromptLogprobs] = {}
    for request, start, end in rows:
        collector = getattr(request.decoder, "prompt_logprobs", None)
        if collector is None:
            continue
        for i in range(start, end):
            seq = inputs[i]
            if not seq.tree_parents and collector.wants(seq.num_computed_tokens, len(seq.token_ids)):
                wanted[i] = collector
    if not wanted:
        return worker.execute(inputs)
    counts = [len(seq.token_ids) if i in wanted else 1 for i, seq in enumerate(inputs)]
    logits = worker.execute(inputs, num_logits=counts)
    ends = torch.tensor(counts).cumsum(0).tolist()
    for i, collector in wanted.items():
        chunk = logits[ends[i] - counts[i]:ends[i]]
        collector.add_chunk(inputs[i].num_computed_tokens, torch.log_softmax(chunk.float(), dim=-1))
    return logits.index_select(0, torch.tensor([end - 1 for end in ends], device=logits.device))
