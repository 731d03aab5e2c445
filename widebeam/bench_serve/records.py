"""What one request was (`RequestSpec`) and what happened to it (`RequestRecord`): the only things the
metrics read, so that they can be computed from hand-written records in tests without a server."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Outcome(str, Enum):
    COMPLETED = "completed"
    # the server refused it at admission (HTTP 4xx, 429 included): it told the client, nothing was lost
    REJECTED = "rejected"
    # 5xx, a timeout, a connection error, a stream that ended early or carried an error event
    FAILED = "failed"


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its path (`/v1/completions`), its JSON body, and what the metrics need to know
    about it without parsing the body again."""

    endpoint: str
    body: dict
    kind: str  # the workload's name for it: genrec, translation, chat-greedy, chat-sampled, jsonl
    beam_width: int = 0  # beams searched; 0: not a beam request
    catalogue: bool = False  # constrained to a catalogue: each returned choice is an item


@dataclass
class RequestRecord:
    """One request's timings (seconds, from the moment it was sent) and answer."""

    spec: RequestSpec
    outcome: Outcome = Outcome.FAILED
    latency_s: float = 0.0  # sent to last byte
    ttft_s: float | None = None  # sent to the first chunk carrying text
    itls_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks carrying text
    num_text_chunks: int = 0
    prompt_tokens: int | None = None  # from `usage` when the server sent it
    output_tokens: int = 0  # `usage.completion_tokens`, else the chunks carrying text
    num_choices: int = 0
    choice_texts: list[str] = field(default_factory=list)
    http_status: int | None = None
    retry_after: str | None = None  # a refusal's Retry-After header: when to come back
    reason: str = ""  # why it was rejected or failed: the HTTP status, "timeout", "stream_cut", ...
    error: str = ""  # the server's message or the exception, for the result's `errors`

    @property
    def tokens_per_choice(self) -> float:
        return self.output_tokens / max(self.num_choices, 1)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT), for an answer that arrived in pieces.
        A beam answer arrives whole at the end (its beams are reordered until then): it has none."""
        if self.ttft_s is None or self.num_text_chunks < 2 or self.tokens_per_choice <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.tokens_per_choice - 1)
