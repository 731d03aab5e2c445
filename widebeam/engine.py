"""LLMEngine (add_request / step / abort): the engine's loop over its workers and one KV cache.

One step runs one forward pass: prompt chunks of newly admitted requests and one round of every
running request (its live sequences' pending tokens and any drafted nodes; no drafts: a plain
decode step), and returns one `RequestDelta` per request that chose a token. Admission and
preemption are the scheduler's (sched/); one request's path is in docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Sequence

import torch

from widebeam.catalogue.registry import CatalogueRegistry
from widebeam.catalogue.trie import Catalogue
from widebeam.config import EngineConfig
from widebeam.decoder_factory import build_request_decoder
from widebeam.decoding.decoders import StepScores
from widebeam.decoding.processors import LogitsProcessor
from widebeam.decoding.scoring import ScoringDecoder
from widebeam.decoding.stream import output_stream
from widebeam.defaults import DEFAULT_MODEL
from widebeam.device import default_device
from widebeam.model.runner import SequenceInput
from widebeam.outputs import RequestDelta
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.pinning import pin_prefixes, pin_token_ids
from widebeam.prompts import (
    PromptRules,
    chat_prompt,
    read_generation_settings,
    tokenize_prompt,
)
from widebeam.request import Request
from widebeam.request_sizer import RequestSizer
from widebeam.sched.preemption import make_scheduler
from widebeam.sched.queue_bound import WaitingQueueBound
from widebeam.score_params import ScoreParams
from widebeam.speculative.drafting import Drafting
from widebeam.speculative.round import SequenceRound, number_verify_rows
from widebeam.startup import allocate_pools, lay_out_pools, load_workers
from widebeam.structured.grammars import Grammars
from widebeam.worker import execute_step

log = logging.getLogger("widebeam")
RECENT_REQUESTS = 32  # finished requests kept in stats()["recent_requests"]


class LLMEngine:
    def __init__(self, model: str = DEFAULT_MODEL, catalogues: dict | None = None, **kwargs):
        """`kwargs`: the settings of `EngineConfig.from_kwargs` (config.py; as command-line options in
        engine_args.py). `catalogues`: name -> source, registered before the KV pools are sized, so
        their bytes come off the memory budget (see `register_catalogue`).

        Start-up, in order: load the models (workers), register the catalogues, lay out the pools
        (layout.py, what `widebeam plan` prints), allocate them, build the scheduler; last, with the
        engine whole, compute the pinned prefixes through `add_request` / `step`."""
        self.config = config = EngineConfig.from_kwargs(model, **kwargs)
        cache_config, sched_config = config.cache, config.scheduler
        self.max_beam_width = sched_config.max_beam_width
        # a preempted request re-feeds each beam into blocks of its own: a schedule's bound counts that
        self._preempts = (sched_config.scheduling_policy == "max_utilization"
                          or sched_config.priority_preemption)
        self.device = torch.device(config.model.device) if config.model.device else default_device()
        self.dtype = config.model.dtype
        loaded = load_workers(config, model, self.device)
        self.source, self.tokenizer, self.workers = loaded.source, loaded.tokenizer, loaded.workers
        self.model = self.workers[0].model
        self.arch = self.model.arch
        self.catalogues = CatalogueRegistry(self.arch.vocab_size, self.device, self.tokenizer)
        for name, source in (catalogues or {}).items():  # before the layout: their bytes come off the memory
            self.catalogues.register(name, source)
        self.catalogue_bytes = self.catalogues.nbytes
        # the layout counts the pins' blocks from token ids: text pins are tokenized now
        pins = pin_token_ids(cache_config.pinned_prefixes,
                             lambda text: tokenize_prompt(text, self.tokenizer, self.arch.vocab_size)[1])
        self.layout = layout = lay_out_pools(config, self.workers, self.device, self.catalogue_bytes, pins)
        self.activation_peak_bytes = layout.activation_bytes
        self.max_encoder_tokens = layout.max_encoder_tokens
        self.max_seq_len = layout.max_seq_len
        self.cache = allocate_pools(config, layout, self.workers, self.device)
        generation = read_generation_settings(self.source, self.tokenizer)
        self.eos_token_ids = generation.eos_token_ids
        self.grammars = Grammars(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)  # response_format
        self.prompt_rules = PromptRules(self.tokenizer, self.arch.vocab_size,
                                        generation.decoder_start_token_id, generation.forced_bos_token_id,
                                        self.max_seq_len)
        self.suppress_token_ids = generation.suppress_token_ids
        self.forced_eos_token_id = generation.forced_eos_token_id
        # speculative decoding (`config` None: none): the drafter, its policy's memory, each step's timing
        self.drafting = Drafting(config, loaded.drafter, self.cache)
        # what a request needs, read before anything is queued (request_sizer.py; the router's ingress
        # sizes with a copy)
        self.sizer = RequestSizer(self.cache, self.prompt_rules, self.eos_token_ids, self.suppress_token_ids,
                                  self.max_seq_len, self.max_encoder_tokens, self.max_beam_width,
                                  self.drafting.num_draft_tokens, self._preempts, self.catalogues.fit_request)
        self.scheduler = make_scheduler(sched_config.scheduling_policy, self.cache,
                                        sched_config.max_num_batched_tokens, sched_config.max_preemptions,
                                        self.drafting.num_draft_tokens, sched_config.priority_preemption,
                                        sched_config.priority_yield)
        self._requests: dict[str, Request] = {}
        self._num_rejected = 0
        # the waiting queue's bound (None: unbounded): past it a request is refused, not queued
        self.queue_bound = WaitingQueueBound(sched_config.max_waiting_requests,
                                             sched_config.max_waiting_blocks)
        # The last finished requests' KV blocks per pool, required (admission's bound) vs peak (held at
        # once): `stats()["recent_requests"]`, drawn by the web page's capacity panel.
        self._recent_requests: deque[dict] = deque(maxlen=RECENT_REQUESTS)
        # The engine is whole: the pins run as requests do, and must hold the blocks the layout counted.
        self.pinned_blocks = pin_prefixes(pins, layout, self.cache, self.add_request, self.step,
                                          self.has_unfinished)

    @property
    def runner(self):
        """The target model's runner."""
        return self.workers[0].runner

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams | ScoreParams | None = None,
                    logits_processors: Sequence[LogitsProcessor] = ()) -> list[int]:
        """Validate and queue a request; raise at once if it can never run (nothing is queued then).
        Returns the prompt token ids as the engine counts them (an encoder-decoder's source).

        `logits_processors` run after the engine's own on this request's scores every step
        (`fn(scores [rows, vocab], num_generated_tokens)`, in place; see decoding/processors.py). One
        that raises fails this request alone: the step reports it and goes on for the others."""
        params = params or SamplingParams()
        scoring = isinstance(params, ScoreParams)
        try:
            sized = self.sizer.size(request_id, prompt, params, logits_processors, ids_in_use=self._requests)
        except ValueError:
            if request_id not in self._requests:  # a request id in use is no rejected request
                self._num_rejected += 1
            raise
        params, prepared, admission = sized.params, sized.prepared, sized.admission
        catalogue = sized.catalogue
        token_ids, encoder_token_ids = prepared.token_ids, prepared.encoder_token_ids
        # a valid request the queue has no room for: refused before anything of it is held
        self.queue_bound.check(self.scheduler.waiting, admission.required_blocks)
        if scoring:  # forced rows along the continuations, raw log-probs: no processor, no forced token
            decoder = ScoringDecoder(params)
        else:
            decoder = build_request_decoder(params, admission.max_new_tokens, self.eos_token_ids,
                                            prompt_token_ids=token_ids, catalogue=catalogue,
                                            suppress_token_ids=self.suppress_token_ids,
                                            forced_eos_token_id=self.forced_eos_token_id,
                                            grammar=self.grammars.constraint(params.response_format),
                                            extra_processors=logits_processors,
                                            forced_bos_token_id=prepared.forced_bos_token_id,
                                            soft_prefix=prepared.soft_prefix)
        draft = self.drafting.new_request(params.beam_width, admission.max_new_tokens, scoring,
                                          sum(r.params.beam_width for r in self._requests.values()))
        kv = self.cache.new_request(sized.key, len(encoder_token_ids or ()))
        request = Request(request_id, prepared.text, token_ids, admission, kv, decoder,
                          output_stream(decoder, self.tokenizer), encoder_token_ids, draft, catalogue)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return list(request.source_token_ids)

    # -- catalogues -------------------------------------------------------------------------------
    def register_catalogue(self, name: str, source, subsets: dict | None = None) -> Catalogue:
        """Register a catalogue under `name` for `BeamSearchParams(catalogue=name)`: a built
        `Catalogue`, token-id sequences, a [num_items, width] array (-1 padded), or a file
        (`catalogue/sources.py`: .jsonl, .npy, .parquet). Returns it; re-registering a name replaces it.
        `subsets`: subset name -> item indices, for `BeamSearchParams(catalogue_subset=...)`."""
        return self.catalogues.register(name, source, subsets)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free all its blocks."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.remove(request)
        request.kv.free()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt block no request holds (pinned prefixes stay); returns how many."""
        return self.cache.reset_prefix_cache()

    def stats(self) -> dict:
        cache = self.cache
        keys = ("total_blocks", "free_blocks", "evictable_blocks", "pinned_blocks")
        stats = {
            "pools": {name: {key: s[key] for key in keys} for name, s in cache.stats().items()},
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "rejected": self._num_rejected,
            "queue": {"waiting_by_priority": dict(sorted(Counter(r.priority for r in self.scheduler.waiting)
                                                          .items())),
                      "max_waiting_requests": self.queue_bound.max_waiting_requests,
                      "max_waiting_blocks": self.queue_bound.max_waiting_blocks,
                      "refused": self.queue_bound.num_refused},
            "scheduling": self.scheduler.stats(),  # policy, preemptions, recomputed_tokens
            # what a new request could reserve now, per pool: the exact-fit router's report (ray_router.py)
            "routing": {"capacity_blocks": {name: m.capacity_blocks() for name, m in cache.managers.items()},
                        "headroom_blocks": self.scheduler.headroom_blocks(), "taken_at_s": time.time()},
            "recent_requests": list(self._recent_requests),
            "prefix_cache": {"enabled": cache.enable_prefix_caching,
                             "queried_tokens": cache.num_queried_tokens, "hit_tokens": cache.num_hit_tokens,
                             "hit_rate": cache.num_hit_tokens / max(cache.num_queried_tokens, 1)},
        }
        if self.catalogues:  # per-request item filters' memory (catalogue/filters.py)
            stats["catalogue_filters"] = self.catalogues.stats(
                [r.catalogue for r in (*self.scheduler.running, *self.scheduler.waiting)])
        return {**stats, **self.drafting.stats()}  # "speculative", with speculative decoding

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule, build every request's inputs, run one forward pass, update each request; one
        delta per request that chose a token this step (finished ones carry their `output`).

        Prompt chunks and rounds share the pass. A round feeds each live sequence's pending tokens
        and the nodes a drafter (if any) drafted; without drafts it is a plain decode step, so
        plain and speculative decoding are one loop (docs/architecture.md)."""
        started_s = time.perf_counter()  # the draft policy times rounds from here
        schedule = self.scheduler.schedule()
        draft_step = self.drafting.step(schedule.scheduled, started_s)
        deltas: list[RequestDelta] = []
        prefills: list[tuple[Request, SequenceInput]] = []
        rounds_by_request: list[tuple[Request, list[SequenceRound]]] = []
        parts: list[tuple[Request, list[SequenceRound]]] = []  # rounds split over steps: this step's rows
        sources, cross_slots = [], []
        for item in schedule.scheduled:
            request = item.request
            try:  # one request's inputs whole, or none of them
                encoder_input = request.encoder_input()
                if item.num_prompt_tokens:
                    prefills.append((request, request.prefill_input(item.num_prompt_tokens)))
                elif item.num_rows is not None or request.split is not None:
                    parts.append((request, request.begin_round_part(item.num_rows, draft_step.begin_round)))
                else:
                    rounds_by_request.append((request, draft_step.begin_round(request)))
            except Exception as exc:  # noqa: BLE001  (any failure of its own fails this request alone)
                deltas.append(self._fail(request, exc))
                continue
            if encoder_input is not None:
                sources.append(encoder_input[0])
                cross_slots.append(encoder_input[1])
        if not prefills and not rounds_by_request and not parts:
            return deltas
        # Copy-on-write copies queued while building the inputs must land before the forward writes.
        copies = self.cache.take_copies()
        for worker in self.workers:
            worker.copy_blocks(copies)
        target = self.workers[0]
        target.encode(sources, cross_slots)  # cross K/V in place before the decoder reads them
        rounds = [rnd for _, request_rounds in (*rounds_by_request, *parts) for rnd in request_rounds]
        draft_step.draft(rounds, prefills)
        # One target pass: each prompt chunk's last token, and per round the last pending token and
        # every drafted node (tree attention), each with its logits.
        num_rows = [1] * len(prefills) + number_verify_rows(rounds, len(prefills))
        collectors = {i: request.decoder.prompt_logprobs for i, (request, _) in enumerate(prefills)
                      if request.decoder.prompt_logprobs is not None}
        greedy_rows = [i for i, (request, _) in enumerate(prefills)
                       if request.prompt_done and request.decoder.batched_greedy]
        greedy_rows += [r for request, request_rounds in rounds_by_request if request.decoder.batched_greedy
                        for rnd in request_rounds
                        for r in range(rnd.row_start, rnd.row_start + rnd.num_verify_rows)]
        inputs = [seq for _, seq in prefills] + [rnd.verify_input() for rnd in rounds]
        logits = execute_step(target, inputs, num_rows, collectors)
        scores = StepScores(logits, greedy_rows)  # a failure of the shared pass fails the whole batch
        for i, (request, _) in enumerate(prefills):
            self._collect(deltas, request, request.finish_prefill, scores, i)
        for request, request_rounds in rounds_by_request:
            self._collect(deltas, request, request.finish_round, request_rounds, scores)
        for request, part in parts:
            self._collect(deltas, request, request.finish_round_part, part, scores)
        draft_step.end(rounds_by_request, ran_prefills=bool(prefills))
        return deltas

    def _collect(self, deltas: list[RequestDelta], request: Request, finish, *args) -> None:
        """Run one request's `finish(*args)`: its delta joins `deltas`; a finished request leaves;
        one that raises fails alone."""
        try:
            delta = finish(*args)
        except Exception as exc:  # noqa: BLE001  (this request's own work: it fails alone)
            deltas.append(self._fail(request, exc))
            return
        if delta is None:
            return
        if delta.output is not None:
            self._recent_requests.append({"request_id": request.request_id,
                                          "beam_width": request.params.beam_width,
                                          "required_blocks": dict(delta.output.required_blocks),
                                          "peak_blocks": dict(delta.output.peak_blocks)})
        if delta.finished:
            self.queue_bound.record_finish()
            self.scheduler.remove(request)
            del self._requests[request.request_id]
        deltas.append(delta)

    def _fail(self, request: Request, exc: Exception) -> RequestDelta:
        """Abort one request whose own processing raised; the step goes on for the others."""
        log.error("request %s failed and was aborted: %s", request.request_id, exc, exc_info=exc)
        self.abort(request.request_id)
        return RequestDelta(request.request_id, finished=True, error=f"{type(exc).__name__}: {exc}")

    def apply_chat_template(self, message: str) -> str:
        return chat_prompt(self.tokenizer, message)
