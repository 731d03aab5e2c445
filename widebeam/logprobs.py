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

The tensor work (computing entries, the prompt's collector, the step that fills it) is in
`widebeam/decoding/logprobs.py`; this module is torch-free so the outputs can name its types.

`decoded_token` is the token's text (`convert_tokens_to_string` of the one token, vLLM's choice):
filled in the final `CompletionOutput` / `RequestOutput`, None in streamed deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token of its row
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


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
