"""LLMEngine (add_request / step / abort) and LLM, the offline front door.

One step runs one forward pass: the prefill of newly admitted requests and one decode token for
every running sequence, in one batch. A request is admitted when its worst case (`required_blocks`
minus what it already holds) fits beside the remaining worst cases of the running ones, so nothing
is ever evicted and a request that cannot fit right now waits instead of spinning.
"""

from __future__ import annotations

import itertools
import logging
import os

import torch

from widebeam.errors import InvalidParameterError
from widebeam.kv.cache import KVCache
from widebeam.kv.managers import Holding
from widebeam.kv.sizing import (
    PoolNeed,
    capacity_tokens,
    resolve_max_seq_len,
    split_by_need,
    tokens_per_sequence,
)
from widebeam.model.loader import DEFAULT_MODEL, load_config, resolve_model
from widebeam.model.registry import load_model, load_tokenizer
from widebeam.model.runner import ModelRunner, SequenceInput
from widebeam.model.warmup import estimate_activation_peak_bytes, measure_activation_peak_bytes
from widebeam.outputs import RequestOutput
from widebeam.params import BeamSearchParams, SamplingParams
from widebeam.request import RequestState
from widebeam.sched.admission import admit_check
from widebeam.sched.scheduler import Scheduler, SchedulerOutput
from widebeam.units import format_bytes, parse_bytes

log = logging.getLogger("widebeam")

# On a CPU host the KV cache shares memory with everything else the user runs, and tests and
# users may hold several engines in one process: without `kv_cache_memory`, take at most this.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_memory_bytes(device: torch.device) -> int:
    """Memory still free on the device: `mem_get_info` on CUDA, MemAvailable on a CPU host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class LLMEngine:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str | None = None,
                 tokens_per_block: int = 16, kv_cache_memory: int | str | None = None,
                 kv_cache_fraction: float = 0.9, max_seq_len: int | None = None, max_beam_width: int = 256,
                 max_num_batched_tokens: int = 2048):
        if max_beam_width < 1:
            raise InvalidParameterError("max_beam_width", f"max_beam_width must be >= 1, got {max_beam_width}")
        self.max_beam_width = max_beam_width
        if not 0 < kv_cache_fraction <= 1:
            raise InvalidParameterError("kv_cache_fraction", f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
        self.device = torch.device(device) if device else default_device()
        self.dtype = dtype
        self.source = resolve_model(model)
        self.model = load_model(self.source, dtype, self.device)
        self.tokenizer = load_tokenizer(self.source)
        self.arch = self.model.arch

        if kv_cache_memory is None:
            # the pools take what is left, so measure what the largest steps really need
            self.activation_peak_bytes = measure_activation_peak_bytes(
                self.model, self.device, self.model.lm_head.weight.dtype, tokens_per_block, max_num_batched_tokens,
                max_beam_width)
        else:
            # the user sized the cache: a shape-based bound is enough to check it leaves room
            # (a measured warm-up costs seconds per engine on a CPU)
            self.activation_peak_bytes = estimate_activation_peak_bytes(self.arch, max_num_batched_tokens,
                                                                        max_beam_width)
        free_bytes = max(available_memory_bytes(self.device) - self.activation_peak_bytes, 0)
        kv_cache_bytes = int(free_bytes * kv_cache_fraction)
        if kv_cache_memory is not None:
            kv_cache_bytes = min(kv_cache_bytes, parse_bytes(kv_cache_memory))
        elif self.device.type == "cpu":
            kv_cache_bytes = min(kv_cache_bytes, DEFAULT_CPU_KV_CACHE_BYTES)
        specs = self.arch.kv_pool_specs(dtype)
        # Encoder-decoder: the source is bounded by the model's positions, as the decoder's length is.
        self.max_encoder_tokens = self.arch.max_position_embeddings if self.arch.is_encoder_decoder else 0
        needs = [PoolNeed(s, tokens_per_sequence(s, self.arch.max_position_embeddings, self.max_encoder_tokens,
                                                 prefill_chunk_tokens=max_num_batched_tokens)) for s in specs]
        pool_blocks = split_by_need(kv_cache_bytes, needs, tokens_per_block)
        self.cache = KVCache(list(zip(specs, pool_blocks)), tokens_per_block, max_num_batched_tokens)
        bound_tokens = capacity_tokens(specs, pool_blocks, tokens_per_block)
        self.max_seq_len = resolve_max_seq_len(
            self.arch.max_position_embeddings,
            self.arch.max_position_embeddings if bound_tokens is None else bound_tokens, max_seq_len)
        log.info(
            "KV cache %s: %s; max_seq_len %d; activation peak %s; device %s",
            format_bytes(kv_cache_bytes),
            ", ".join(f"{s.name} {n} blocks x {tokens_per_block} = {n * tokens_per_block} tokens"
                      for s, n in zip(specs, pool_blocks)),
            self.max_seq_len, format_bytes(self.activation_peak_bytes), self.device,
        )
        self.runner = ModelRunner(self.model, {s.name: n for s, n in zip(specs, pool_blocks)},
                                  tokens_per_block, self.device, self.model.lm_head.weight.dtype)
        self.eos_token_ids = frozenset(self._eos_token_ids())
        self.decoder_start_token_id, self.suppress_token_ids, self.forced_eos_token_id = \
            self._encoder_decoder_settings()
        self.scheduler = Scheduler(self.cache, max_num_batched_tokens)
        self.last_schedule: SchedulerOutput | None = None  # what the latest step ran (for tests and metrics)
        self._requests: dict[str, RequestState] = {}
        self._num_rejected = 0

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | BeamSearchParams | None = None) -> None:
        """Validate and queue a request; raise at once if it can never run (nothing is queued then)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidParameterError("request_id", f"request_id {request_id!r} is already in use")
        try:
            if not isinstance(params, (SamplingParams, BeamSearchParams)):
                raise InvalidParameterError("params", f"expected SamplingParams or BeamSearchParams, got {params!r}")
            if params.beam_width > self.max_beam_width:
                raise InvalidParameterError(
                    "beam_width", f"beam_width must be in [1, {self.max_beam_width}] (the engine's max_beam_width), "
                    f"got {params.beam_width}")
            text, token_ids = self._tokenize(prompt)
            encoder_token_ids = None
            if self.decoder_start_token_id is not None:
                if not token_ids:
                    raise InvalidParameterError("prompt", "the source is empty: give at least one token")
                # the prompt is the source; the decoder starts from its start token alone
                encoder_token_ids, token_ids = token_ids, [self.decoder_start_token_id]
            admission = admit_check(self.cache, self.max_seq_len, len(token_ids), params.max_new_tokens,
                                    params.beam_width, encoder_tokens=len(encoder_token_ids or ()),
                                    max_encoder_tokens=self.max_encoder_tokens)
        except ValueError:
            self._num_rejected += 1
            raise
        request = RequestState(request_id, text, token_ids, params, admission,
                               holdings={name: Holding() for name in self.cache.managers},
                               eos_token_ids=self.eos_token_ids, tokenizer=self.tokenizer,
                               encoder_token_ids=encoder_token_ids, suppress_token_ids=self.suppress_token_ids,
                               forced_eos_token_id=self.forced_eos_token_id)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free all its blocks."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.remove(request)
        request.release(self.cache)

    def poll(self, request_id: str) -> RequestOutput | None:
        """The current state of an unfinished request (partial text and tokens, for streaming);
        None once it has finished or if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return request.partial_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        return {
            "pools": {name: {"total_blocks": s["total_blocks"], "free_blocks": s["free_blocks"]}
                      for name, s in self.cache.stats().items()},
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "rejected": self._num_rejected,
        }

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, advance every scheduled request; return those that finished."""
        schedule = self.scheduler.schedule()
        self.last_schedule = schedule
        if not schedule.scheduled:
            return []
        inputs: list[SequenceInput] = []
        rows: list[tuple[RequestState, int, int]] = []
        sources, cross_slots = [], []
        for item in schedule.scheduled:
            request = item.request
            encoder_input = request.encoder_input(self.cache)
            if encoder_input is not None:
                sources.append(encoder_input[0])
                cross_slots.append(encoder_input[1])
            if item.num_prompt_tokens:
                request_inputs = [request.prefill_input(self.cache, item.num_prompt_tokens)]
            else:
                request_inputs = request.decode_inputs(self.cache)
            rows.append((request, len(inputs), len(inputs) + len(request_inputs)))
            inputs.extend(request_inputs)
        # Copy-on-write copies queued while building the inputs must land before the forward writes.
        for name, manager in self.cache.managers.items():
            self.runner.copy_blocks(name, manager.take_copies())
        self.runner.encode(sources, cross_slots)  # cross K/V in place before the decoder reads them
        logits = self.runner.execute(inputs)
        finished = []
        for request, start, end in rows:
            request.advance(logits[start:end], self.cache)
            if request.finished:
                self.scheduler.remove(request)
                del self._requests[request.request_id]
                finished.append(request.output())
        return finished

    # -- text -------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise InvalidParameterError("prompt", "a dict prompt needs 'prompt_token_ids'")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and 0 <= t < self.arch.vocab_size for t in prompt):
                raise InvalidParameterError("prompt", f"token ids must be integers in [0, {self.arch.vocab_size})")
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise InvalidParameterError("prompt", f"prompt must be a string or token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidParameterError("prompt", "prompt is empty: give at least one token")
        if self.tokenizer is None:
            raise InvalidParameterError("prompt", "this model directory has no tokenizer: pass prompt_token_ids")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, message: str) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidParameterError("chat", "this model has no chat template")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                  add_generation_prompt=True)

    def _generation_config(self) -> dict:
        path = self.source.path / "generation_config.json"
        if not path.exists():
            return {}
        import json

        return json.loads(path.read_text())

    def _encoder_decoder_settings(self) -> tuple[int | None, tuple[int, ...], int | None]:
        """(decoder_start_token_id, token ids never generated, forced_eos_token_id) of an
        encoder-decoder model; (None, (), None) for a decoder-only one. Single-token `bad_words_ids`
        (Marian bans its pad token) are suppressed the way HF's processor does; longer banned
        sequences are not supported. The forced EOS is HF's: the last allowed token (number
        max_new_tokens) is EOS."""
        if not self.arch.is_encoder_decoder:
            return None, (), None
        generation_config = self._generation_config()
        start = generation_config.get("decoder_start_token_id")
        if start is None:
            start = self.model.decoder_start_token_id
        bad_words = generation_config.get("bad_words_ids") or []
        suppress = tuple(sorted({ids[0] for ids in bad_words if len(ids) == 1}))
        # As transformers: a saved generation config is the whole story (a setting it leaves out is
        # off); only a model without one falls back to config.json.
        settings = generation_config if generation_config else load_config(self.source)
        forced_eos = settings.get("forced_eos_token_id")
        return int(start), suppress, forced_eos if isinstance(forced_eos, int) else None

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        candidates = [self._generation_config().get("eos_token_id")]
        from widebeam.model.loader import load_config

        candidates.append(load_config(self.source).get("eos_token_id"))
        if self.tokenizer is not None:
            candidates.append(self.tokenizer.eos_token_id)
        for value in candidates:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return ids


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

    def generate(self, prompts, params: SamplingParams | BeamSearchParams | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`.

        Every prompt is checked before anything runs: if one can never fit, this raises and
        nothing is queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt in zip(ids, prompts):
                self.engine.add_request(request_id, prompt, params)
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
                for output in self.engine.step():
                    results[output.request_id] = output
                    if progress:
                        progress.update(1)
        finally:
            if progress:
                progress.close()
        return [results[request_id] for request_id in ids]
