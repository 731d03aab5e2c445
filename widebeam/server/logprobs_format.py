"""The engine's log-prob entries (widebeam/logprobs.py: one `{token_id: Logprob}` per token, the chosen
token first) in OpenAI's response shapes, as vLLM writes them:

* completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; `top_logprobs[i]` maps
  token text -> log-prob for the chosen token and the k most likely (k or k + 1 entries, vLLM's);
  with `echo` the prompt's tokens come first, the very first with `null` log-probs. `text_offset[i]`
  is where token i's text starts in the choice's text (token texts laid end to end).
* chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`,
  `top_logprobs` the k most likely tokens, most likely first (OpenAI's meaning).
* vLLM's `prompt_logprobs`: a list with `null` first, then `{"<token id>": {"logprob", "rank",
  "decoded_token"}}` per prompt token.

A log-prob of -inf (a token the model's logits rule out) is written -9999.0, as vLLM does: JSON has no
infinity.
"""

from __future__ import annotations

from collections.abc import Sequence

from widebeam.logprobs import TokenLogprobs

MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


class LogprobsWriter:
    def __init__(self, token_text):
        self.token_text = token_text  # token id -> its text (widebeam.logprobs.TokenText)

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                   text_offset: int = 0) -> dict:
        """`text_offset`: where the first token's text starts (a stream's earlier text)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = self.token_text(token)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if entry is None:  # the prompt's first token: nothing predicts it
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(entry[token].logprob))
            top_logprobs.append({self.token_text(t): _finite(lp.logprob) for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def chat(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs], num_top: int) -> dict:
        return {"content": [self._chat_token(token, entry, num_top)
                            for token, entry in zip(token_ids, entries)]}

    def _chat_token(self, token: int, entry: TokenLogprobs, num_top: int) -> dict:
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= num_top))
        return {**self._chat_entry(token, entry[token].logprob),
                "top_logprobs": [self._chat_entry(t, logprob) for _, t, logprob in ranked[:num_top]]}

    def _chat_entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def prompt(self, entries: Sequence[TokenLogprobs | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`."""
        if entries is None:
            return None
        return [None if entry is None else
                {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                          "decoded_token": self.token_text(t)}
                 for t, lp in entry.items()} for entry in entries]
