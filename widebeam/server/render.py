"""A call's choices as the API writes them: text (with the prompt used before it for `echo`), finish reason,
beam score, and log-probs (completions' and chat's shapes, vLLM's `prompt_logprobs`), whole or as
stream chunks. The shapes of the log-probs themselves are in logprobs_format.py."""

from __future__ import annotations

from widebeam.logprobs import TokenText
from widebeam.outputs import CompletionOutput, RequestOutput
from widebeam.prompts import tokenize_prompt, truncate_prompt
from widebeam.server import protocol as p
from widebeam.server import schemas as s
from widebeam.server.logprobs_format import LogprobsWriter


class ChoiceRenderer:
    def __init__(self, plan: p.Plan, chat: bool, tokenizer, token_text: TokenText):
        self.plan = plan
        self.chat = chat
        self.tokenizer = tokenizer
        self.writer = LogprobsWriter(token_text)
        self._offsets: dict[int, int] = {}  # a streamed completion choice's text_offset so far

    @property
    def logprobs(self) -> bool:
        return self.plan.num_top_logprobs is not None

    def prompt_text(self, prompt, vocab_size: int) -> str:
        """What `echo` puts before a choice: the prompt that was used, as its log-probs and `usage`
        count it. The prompt as given, or its token ids decoded; a prompt `max_input_length` cut (a
        decoder-only prompt keeps its last tokens, prompts.py) is its kept tokens decoded. Raises
        `InvalidParameterError` for a prompt the engine would refuse (it tokenizes the same way)."""
        max_input_length = self.plan.params[0].max_input_length
        if isinstance(prompt, str) and (max_input_length is None or self.tokenizer is None):
            return prompt
        if self.tokenizer is None:
            return ""
        _, token_ids = tokenize_prompt(prompt, self.tokenizer, vocab_size)
        kept = truncate_prompt(token_ids, max_input_length, decoder_start_token_id=None)
        if isinstance(prompt, str) and len(kept) == len(token_ids):
            return prompt
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def whole(self, index: int, output: RequestOutput, completion: CompletionOutput,
              prompt_text: str) -> dict:
        """One choice of a whole response (or a beam's closing stream chunk when `chunk`)."""
        return self._render(index, output, completion, prompt_text, chunk=False)

    def closing_chunk(self, index: int, output: RequestOutput, completion: CompletionOutput,
                      prompt_text: str, whole_text: bool) -> dict:
        """A request's last stream chunk: a beam's whole choice (`whole_text`), or a sample's finish
        reason (its text and log-probs went out as they came)."""
        if whole_text:
            return self._render(index, output, completion, prompt_text, chunk=True)
        return s.chunk_choice(self.chat, index, "", completion.finish_reason)

    def _render(self, index: int, output: RequestOutput, completion: CompletionOutput, prompt_text: str,
                chunk: bool) -> dict:
        plan = self.plan
        text = (prompt_text if plan.echo else "") + completion.text
        score = completion.score if plan.beam else None
        if chunk:
            out = s.chunk_choice(self.chat, index, text, completion.finish_reason, score)
        else:
            out = s.choice(self.chat, index, text, completion.finish_reason, score)
        if self.logprobs:
            token_ids, entries = list(completion.token_ids), list(completion.logprobs or ())
            if plan.echo:
                token_ids = list(output.prompt_token_ids) + token_ids
                entries = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + entries
            out["logprobs"] = self._logprobs(token_ids, entries)
        if plan.prompt_logprobs is not None and not self.chat:
            out["prompt_logprobs"] = self.writer.prompt(output.prompt_logprobs)
        return out

    def _logprobs(self, token_ids, entries, offset: int = 0) -> dict:
        if self.chat:
            return self.writer.chat(token_ids, entries, self.plan.num_top_logprobs)
        return self.writer.completion(token_ids, entries, offset)

    def text_chunk(self, index: int, text: str, token_ids: list[int], entries: list) -> dict:
        """A sample's streamed step: its new text and, with logprobs, its new tokens' log-probs."""
        out = s.chunk_choice(self.chat, index, text, None)
        if self.logprobs:
            offset = self._offsets.get(index, 0)
            out["logprobs"] = self._logprobs(token_ids, entries, offset)
            self._offsets[index] = offset + sum(len(self.writer.token_text(t)) for t in token_ids)
        return out

    def echo_chunk(self, index: int, prompt_text: str) -> dict:
        """A streamed sample's first chunk with `echo`: the prompt."""
        self._offsets[index] = len(prompt_text)
        return s.chunk_choice(self.chat, index, prompt_text, None)

    def search_trees(self, outputs: list[RequestOutput]) -> list[dict] | None:
        """`return_tree`: one search tree per prompt (a beam request per prompt), else None."""
        if not self.plan.return_tree:
            return None
        return [output.tree for output in outputs]

    def chat_prompt_logprobs(self, outputs: list[RequestOutput]) -> list | None:
        """vLLM's top-level `prompt_logprobs` of a chat response (one prompt)."""
        if not self.chat or self.plan.prompt_logprobs is None or not outputs:
            return None
        return self.writer.prompt(outputs[0].prompt_logprobs)
