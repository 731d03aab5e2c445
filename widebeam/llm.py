"""`LLM`: offline batches over one engine, `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from widebeam.defaults import DEFAULT_MODEL
from widebeam.engine import LLMEngine
from widebeam.errors import InvalidParameterError
from widebeam.outputs import RequestOutput, ScoreOutput
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.score_params import ScoreParams
from widebeam.scoring import score_groups, score_outputs


class LLM:
    """Offline batches: `LLM(model=...).generate(prompts, params)`."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self._ids = itertools.count()

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def register_catalogue(self, name: str, source, subsets: dict | None = None):
        """Register a catalogue for `BeamSearchParams(catalogue=name)` (`LLMEngine.register_catalogue`),
        with named `subsets` of its item indices for `BeamSearchParams(catalogue_subset=...)`."""
        return self.engine.register_catalogue(name, source, subsets)

    def score(self, prompts, continuations, decoder_prefix=(), max_input_length: int | None = None,
              use_tqdm: bool = False) -> list[ScoreOutput]:
        """The log-prob of each continuation after its prompt, token by token and summed (the model's raw
        log-softmax: transformers' log-softmax of the forced sequence, CTranslate2's `score_batch`).
        `prompts`: one prompt for all continuations, or one per continuation; `continuations`:
        token-id lists or texts (tokenized without special tokens). Continuations of one prompt share
        its computation: it is prefilled once and they fork from it as beams do (widebeam/scoring.py).
        Encoder-decoder models: the prompt is the source, the continuation follows the decoder's start
        token and `decoder_prefix`."""
        groups = score_groups(prompts, continuations, self.engine.max_beam_width, decoder_prefix,
                              max_input_length)
        outputs = self.generate([g.prompt for g in groups], [g.params for g in groups], use_tqdm=use_tqdm)
        return score_outputs(groups, outputs)

    def generate(self, prompts, params: SamplingParams | BeamSearchParams | ScoreParams
                 | Sequence[SamplingParams | BeamSearchParams | ScoreParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`. `params`: one for all
        prompts, or a list of one per prompt (they run together in the same steps).

        Every prompt is checked before anything runs: if one can never fit, this raises and
        nothing is queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidParameterError("params", "{params} must give one per prompt: {count} prompts, "
                                            "got {value}", count=len(prompts), value=len(params))
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        added = []
        try:
            for request_id, prompt, request_params in zip(ids, prompts, per_prompt):
                self.engine.add_request(request_id, prompt, request_params)
                added.append(request_id)
        except ValueError as exc:
            for request_id in added:
                self.engine.abort(request_id)
            exc.args = (f"prompt {len(added)} of the batch: {exc}",)  # keeps the type and its attributes
            raise
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(prompts) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc="requests", unit="req")
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.finished:
                        results[delta.request_id] = delta.output
                        if progress:
                            progress.update(1)
        finally:
            if progress:
                progress.close()
        return [results[request_id] for request_id in ids]
