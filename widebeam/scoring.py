"""Scoring requests (`LLM.score`, `POST /v1/score`, `widebeam batch --score`): (prompt, continuation)
pairs grouped by prompt into engine requests, and their outputs back in the order given.

The continuations of one prompt go to the engine together, as one `ScoreParams` request: the prompt is
computed once and the continuations fork from it as beams do (decoding/scoring.py). A request holds at
most the engine's `max_beam_width` continuations (its rows at one position; the activation reserve is
sized for that many); more of one prompt become several requests, which the prefix cache lets share
the prompt's computed blocks (only its last partial block is computed again by each).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from widebeam.errors import InvalidParameterError
from widebeam.outputs import RequestOutput, ScoreOutput
from widebeam.score_params import ScoreParams


@dataclass(frozen=True)
class ScoreGroup:
    """One engine request: a prompt, its params, and the input positions of its continuations."""

    prompt: object
    params: ScoreParams
    indices: tuple[int, ...]


def _is_prompt(value) -> bool:
    """One prompt: text, `{"prompt_token_ids": [...]}`, or a list of token ids."""
    return isinstance(value, (str, dict)) or (isinstance(value, list) and bool(value)
                                              and all(isinstance(t, int) for t in value))


def _key(prompt) -> str:
    """Prompts that are the same request share a group."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt)
    return json.dumps(prompt, sort_keys=True, default=repr)


def score_groups(prompts, continuations: Sequence, max_rows: int, decoder_prefix=(),
                 max_input_length: int | None = None) -> list[ScoreGroup]:
    """`prompts`: one prompt for every continuation, or one per continuation (pairs). Continuations of
    the same prompt share requests of at most `max_rows` continuations each, in input order."""
    if isinstance(continuations, str) or not isinstance(continuations, Sequence) or not continuations:
        raise InvalidParameterError("continuations", "{continuations} must be a non-empty list of "
                                    "token-id lists or texts")
    if _is_prompt(prompts):
        prompts = [prompts] * len(continuations)
    elif not isinstance(prompts, Sequence) or len(prompts) != len(continuations):
        raise InvalidParameterError("prompts", "{prompts} must be one prompt or one per continuation: "
                                    "{count} continuations, got {value}", count=len(continuations),
                                    value=len(prompts) if isinstance(prompts, Sequence) else repr(prompts))
    by_prompt: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(_key(prompt), []).append(i)
    groups = []
    for indices in by_prompt.values():
        for start in range(0, len(indices), max_rows):
            chunk = tuple(indices[start:start + max_rows])
            items = [continuations[i] for i in chunk]
            items = [tuple(c) if isinstance(c, list) else c for c in items]
            params = ScoreParams(tuple(items), decoder_prefix=decoder_prefix,
                                 max_input_length=max_input_length)
            groups.append(ScoreGroup(prompts[chunk[0]], params, chunk))
    return groups


def distinct_prompts(groups: Sequence[ScoreGroup]) -> int:
    """How many different prompts the groups score (a prompt's continuations may take several)."""
    return len({_key(group.prompt) for group in groups})


def score_outputs(groups: Sequence[ScoreGroup], outputs: Sequence[RequestOutput]) -> list[ScoreOutput]:
    """One `ScoreOutput` per continuation, in input order, from each group's finished request."""
    results: dict[int, ScoreOutput] = {}
    for group, output in zip(groups, outputs):
        for index, completion in zip(group.indices, output.outputs):
            values = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
            results[index] = ScoreOutput(list(output.prompt_token_ids), list(completion.token_ids), values,
                                         completion.cumulative_logprob)
    return [results[i] for i in range(len(results))]
