"""The requests a run sends: `build_requests(config)` -> one `RequestSpec` per request, from one seeded
generator (the same seed gives the same bodies).

- `genrec`: generative recommendation shaped like OneRec's serving traffic: a long prefix shared by every
  request (instructions and a catalogue description: a prefix cache keeps it) and a short user part (a
  history of item ids), then a beam search whose width is drawn from a width mix ("64:0.5,256:0.5"),
  over a catalogue the server registered (`--catalogue NAME`: each returned beam is one item).
- `translation`: short sentences to an encoder-decoder server, a narrow beam each (the mix's widths).
- `chat`: chat completions, a fraction greedy and the rest sampled (seeded, so reproducible).
- `jsonl`: one request body per line of a file, used as written (cycled to the number of requests).

Every generated body streams with `stream_options.include_usage`, so TTFT and inter-token times are seen
and token counts come from the server's own `usage`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from widebeam.bench_serve.records import RequestSpec

WORKLOADS = ("genrec", "translation", "chat", "jsonl")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DEFAULT_WIDTH_MIX = {"genrec": "64:0.5,256:0.5", "translation": "4:1"}
DEFAULT_OUTPUT_LEN = {"genrec": 8, "translation": 32, "chat": 64}

_PREFIX_SENTENCE = ("You recommend the next item a user will engage with. Items are written as item ids; "
                    "consider the user's recent history, the season, popularity and diversity. ")
_SUBJECTS = ("The old man", "My sister", "The small dog", "A teacher", "The farmers", "Our neighbour")
_VERBS = ("reads", "buys", "paints", "finds", "carries", "repairs")
_OBJECTS = ("a red book", "the bread", "a wooden chair", "the letters", "two apples", "the bicycle")
_PLACES = ("in the morning.", "near the river.", "at the market.", "after school.", "every Sunday.")
_QUESTIONS = ("Name three colours.", "Explain what a prefix cache is in one paragraph.",
              "Write a haiku about the sea.", "List four animals that live in the desert.",
              "Summarise the rules of chess briefly.", "What should I cook for dinner tonight?",
              "Give me three tips for learning a language.",
              "Describe a sunset to someone who never saw one.")


def parse_width_mix(text: str) -> list[tuple[int, float]]:
    """"64:0.5,256:0.5" -> [(64, 0.5), (256, 0.5)]; a bare "64" is "64:1". Weights need not sum to 1
    (they are normalised); a ValueError names what is wrong."""
    mix = []
    for part in (p.strip() for p in text.split(",")):
        width_text, _, weight_text = part.partition(":")
        try:
            width, weight = int(width_text), float(weight_text or 1)
        except ValueError:
            raise ValueError(f"expected WIDTH:WEIGHT pairs like 64:0.5,256:0.5, got {text!r}") from None
        if width < 1 or not weight > 0 or weight == float("inf"):
            raise ValueError(f"widths must be >= 1 and weights finite and > 0, got {part!r}")
        mix.append((width, weight))
    return mix


@dataclass(frozen=True)
class WorkloadConfig:
    workload: str = "chat"
    num_requests: int = 100
    seed: int = 0
    model: str | None = None
    endpoint: str | None = None  # None: the workload's own (chat: /v1/chat/completions, else /v1/completions)
    width_mix: str | None = None  # None: DEFAULT_WIDTH_MIX
    num_returned_beams: int | None = None  # `n` of a genrec request; None: every beam searched
    catalogue: str | None = None
    output_len: int | None = None  # max_tokens; None: DEFAULT_OUTPUT_LEN (a catalogue sets its own)
    prefix_num_words: int = 400
    history_num_items: int = 10
    greedy_fraction: float = 0.5
    ignore_eos: bool = False
    dataset_path: str | None = None


def build_requests(config: WorkloadConfig) -> list[RequestSpec]:
    rng = np.random.default_rng(config.seed)
    builders = {"genrec": _genrec, "translation": _translation, "chat": _chat, "jsonl": _jsonl}
    if config.workload not in builders:
        raise ValueError(f"unknown workload {config.workload!r}; expected one of {', '.join(WORKLOADS)}")
    return builders[config.workload](config, rng)


def _common(config: WorkloadConfig, body: dict) -> dict:
    """The fields every generated body carries: the model, streaming with usage, the output length."""
    if config.model:
        body["model"] = config.model
    if config.ignore_eos:
        body["ignore_eos"] = True
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _widths(config: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    mix = parse_width_mix(config.width_mix or DEFAULT_WIDTH_MIX.get(config.workload, "1:1"))
    weights = np.array([w for _, w in mix])
    picks = rng.choice(len(mix), size=config.num_requests, p=weights / weights.sum())
    return np.array([mix[i][0] for i in picks], dtype=int)


def _output_len(config: WorkloadConfig) -> int:
    return config.output_len or DEFAULT_OUTPUT_LEN[config.workload]


def shared_prefix(num_words: int) -> str:
    """The genrec prefix every request starts with: `num_words` words, the same for every request."""
    words = _PREFIX_SENTENCE.split()
    return " ".join(words[i % len(words)] for i in range(num_words))


def _genrec(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    prefix = shared_prefix(config.prefix_num_words)
    specs = []
    for width in _widths(config, rng):
        history = " ".join(f"item_{i}" for i in rng.integers(0, 100_000, size=config.history_num_items))
        prompt = f"{prefix}\nUser {int(rng.integers(0, 10**6))} history: {history}\nNext item:"
        n = min(config.num_returned_beams or int(width), int(width))
        body = {"prompt": prompt, "use_beam_search": True, "beam_width": int(width), "n": n}
        if config.catalogue:  # the server sets max_tokens from the catalogue's longest item
            body["catalogue"] = config.catalogue
        else:
            body["max_tokens"] = _output_len(config)
        specs.append(RequestSpec(config.endpoint or COMPLETIONS, _common(config, body), "genrec",
                                 beam_width=int(width), catalogue=bool(config.catalogue)))
    return specs


def _translation(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    specs = []
    for width in _widths(config, rng):
        sentence = " ".join(str(rng.choice(words)) for words in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES))
        body = {"prompt": sentence, "use_beam_search": True, "beam_width": int(width), "n": 1,
                "max_tokens": _output_len(config)}
        specs.append(RequestSpec(config.endpoint or COMPLETIONS, _common(config, body), "translation",
                                 beam_width=int(width)))
    return specs


def _chat(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    specs = []
    for _ in range(config.num_requests):
        body = {"messages": [{"role": "user", "content": str(rng.choice(_QUESTIONS))}],
                "max_tokens": _output_len(config)}
        if rng.random() < config.greedy_fraction:
            body["temperature"], kind = 0.0, "chat-greedy"
        else:
            body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2**31)))
            kind = "chat-sampled"
        specs.append(RequestSpec(config.endpoint or CHAT, _common(config, body), kind))
    return specs


def _line_error(path: str, number: int, message: str) -> ValueError:
    """A bad line of a user's file, named by path and line number (the CLI prints it on one line)."""
    return ValueError(f"{path}:{number}: {message}")


def _jsonl(config: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    if not config.dataset_path:
        raise ValueError("the jsonl workload needs --dataset-path (one request body per line)")
    bodies = []
    for number, line in enumerate(Path(config.dataset_path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _line_error(config.dataset_path, number, f"not JSON ({exc.msg})") from None
        if not isinstance(body, dict):
            raise _line_error(config.dataset_path, number, "expected a JSON object (a request body)")
        bodies.append(body)
    if not bodies:
        raise ValueError(f"{config.dataset_path}: no request bodies")
    specs = []
    for i in range(config.num_requests):
        body = dict(bodies[i % len(bodies)])
        if config.model and "model" not in body:
            body["model"] = config.model
        # streaming unless the file says otherwise: TTFT needs it
        if body.setdefault("stream", True) and "stream_options" not in body:
            body["stream_options"] = {"include_usage": True}
        beam = bool(body.get("use_beam_search"))
        width = int(body.get("beam_width") or body.get("best_of") or body.get("n") or 1) if beam else 0
        endpoint = config.endpoint or (CHAT if "messages" in body else COMPLETIONS)
        constrained = beam and bool(body.get("catalogue") or body.get("allowed_sequences"))
        specs.append(RequestSpec(endpoint, body, "jsonl", beam_width=width, catalogue=constrained))
    return specs


def load_catalogue_items(path: str) -> set[str]:
    """The items' texts of a catalogue file (.jsonl of strings, or of objects with "text"), to check the
    returned items against (`invalid_items`). Token-id items cannot be compared to returned text."""
    items = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        value = json.loads(line)
        if isinstance(value, dict):
            value = value.get("text")
        if not isinstance(value, str):
            raise _line_error(path, number, "expected a string item or {\"text\": ...} (token-id items "
                                            "cannot be checked against returned text)")
        items.add(value.strip())
    return items
