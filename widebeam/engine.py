"""LLMEngine (add_request / step / abort) and LLM, the offline front door.

One step runs one forward pass: the prefill of newly admitted requests and one decode token for
every running sequence, in one batch. A request is admitted when its worst case (`required_blocks`
minus what it already holds) fits beside the remaining worst cases of the running ones, so nothing
is ever evicted and a request that cannot fit right now waits instead of spinning.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field

import torch

from widebeam.errors import InvalidParameterError
from widebeam.kv.cache import KVCache
from widebeam.kv.managers import BlockTable, Holding
from widebeam.kv.sizing import PoolNeed, resolve_max_seq_len, split_by_need, tokens_per_sequence
from widebeam.model.loader import DEFAULT_MODEL, resolve_model
from widebeam.model.registry import load_model, load_tokenizer
from widebeam.model.runner import ModelRunner, SequenceInput
from widebeam.outputs import CompletionOutput, RequestOutput
from widebeam.params import SamplingParams
from widebeam.sampling import sample_token
from widebeam.sched.admission import Admission, admit_check
from widebeam.units import parse_bytes


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


@dataclass(eq=False)  # identity, not field equality: requests are looked up in queues
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    admission: Admission
    holdings: dict[str, Holding]
    tables: dict[str, BlockTable] = field(default_factory=dict)
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    text: str = ""
    generator: torch.Generator | None = None

    def remaining_blocks(self) -> dict[str, int]:
        """Blocks this request may still take, per pool (its reservation)."""
        return {pool: need - self.holdings[pool].num_held_blocks
                for pool, need in self.admission.required_blocks.items()}


class LLMEngine:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str | None = None,
                 tokens_per_block: int = 16, kv_cache_memory: int | str | None = None,
                 kv_cache_fraction: float = 0.9, max_seq_len: int | None = None):
        if not 0 < kv_cache_fraction <= 1:
            raise InvalidParameterError("kv_cache_fraction", f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
        self.device = torch.device(device) if device else default_device()
        self.dtype = dtype
        self.source = resolve_model(model)
        self.model = load_model(self.source, dtype, self.device)
        self.tokenizer = load_tokenizer(self.source)
        self.arch = self.model.arch

        if kv_cache_memory is None:
            kv_cache_bytes = int(available_memory_bytes(self.device) * kv_cache_fraction)
        else:
            kv_cache_bytes = parse_bytes(kv_cache_memory)
        specs = self.arch.kv_pool_specs(dtype)
        needs = [PoolNeed(s, tokens_per_sequence(s, self.arch.max_position_embeddings)) for s in specs]
        pool_blocks = split_by_need(kv_cache_bytes, needs, tokens_per_block)
        self.cache = KVCache(list(zip(specs, pool_blocks)), tokens_per_block)
        self.max_seq_len = resolve_max_seq_len(self.arch.max_position_embeddings,
                                               min(pool_blocks) * tokens_per_block, max_seq_len)
        self.runner = ModelRunner(self.model, {s.name: n for s, n in zip(specs, pool_blocks)},
                                  tokens_per_block, self.device, self.model.lm_head.weight.dtype)
        self.eos_token_ids = self._eos_token_ids()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._num_rejected = 0

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | dict | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raise at once if it can never run (nothing is queued then)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidParameterError("request_id", f"request_id {request_id!r} is already in use")
        try:
            text, token_ids = self._tokenize(prompt)
            admission = admit_check(self.cache, self.max_seq_len, len(token_ids), params.max_new_tokens,
                                    params.beam_width)
        except ValueError:
            self._num_rejected += 1
            raise
        request = _Request(request_id, text, token_ids, params, admission,
                           holdings={name: Holding() for name in self.cache.managers})
        if params.seed is not None:
            request.generator = torch.Generator().manual_seed(params.seed)
        self._requests[request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free all its blocks."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request in self._waiting:
            self._waiting.remove(request)
        if request in self._running:
            self._running.remove(request)
        self._release(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict:
        return {
            "pools": {name: {"total_blocks": s["total_blocks"], "free_blocks": s["free_blocks"]}
                      for name, s in self.cache.stats().items()},
            "running": len(self._running),
            "waiting": len(self._waiting),
            "rejected": self._num_rejected,
        }

    # -- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit what fits, run one forward pass, sample; return the requests that finished."""
        prefills = self._admit()
        inputs: list[SequenceInput] = []
        batch: list[_Request] = []
        for request in self._running:
            if request in prefills:
                inputs.append(self._prefill_input(request))
            else:
                inputs.append(self._decode_input(request))
            batch.append(request)
        if not batch:
            return []
        for name, manager in self.cache.managers.items():
            self.runner.copy_blocks(name, manager.take_copies())
        logits = self.runner.execute(inputs)
        finished = []
        for request, row in zip(batch, logits):
            token, logprob = sample_token(row, request.params, request.generator)
            self._append_token(request, token, logprob)
            if request.finish_reason is not None:
                self._running.remove(request)
                self._release(request)
                del self._requests[request.request_id]
                finished.append(self._output(request))
        return finished

    def _admit(self) -> list[_Request]:
        free = self.cache.num_free_blocks()
        for request in self._running:
            for pool, blocks in request.remaining_blocks().items():
                free[pool] -= blocks
        admitted = []
        while self._waiting:
            head = self._waiting[0]
            if any(blocks > free[pool] for pool, blocks in head.admission.required_blocks.items()):
                break  # FCFS: the head waits for blocks; it is never skipped or dropped
            for pool, blocks in head.admission.required_blocks.items():
                free[pool] -= blocks
            self._waiting.popleft()
            self._running.append(head)
            admitted.append(head)
        return admitted

    def _prefill_input(self, request: _Request) -> SequenceInput:
        slots = {}
        for name, manager in self.cache.managers.items():
            request.tables[name] = manager.new_table(request.holdings[name])
            slots[name] = manager.append_slots(request.tables[name], len(request.prompt_token_ids))
        return SequenceInput(request.prompt_token_ids, 0, {k: t.block_ids for k, t in request.tables.items()}, slots)

    def _decode_input(self, request: _Request) -> SequenceInput:
        position = len(request.prompt_token_ids) + len(request.output_token_ids) - 1
        slots = {name: manager.append_slots(request.tables[name], 1) for name, manager in self.cache.managers.items()}
        return SequenceInput([request.output_token_ids[-1]], position,
                             {k: t.block_ids for k, t in request.tables.items()}, slots)

    def _append_token(self, request: _Request, token: int, logprob: float) -> None:
        params = request.params
        request.output_token_ids.append(token)
        request.cumulative_logprob += logprob
        num_new = len(request.output_token_ids)
        if token in params.stop_token_ids and num_new > params.min_new_tokens or token in self.eos_token_ids and not params.ignore_eos and num_new > params.min_new_tokens:
            request.finish_reason = "stop"
        if self.tokenizer is not None:
            request.text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            if params.stop and request.finish_reason is None:
                cut = min((request.text.find(s) for s in params.stop if s in request.text), default=-1)
                if cut >= 0:
                    request.text = request.text[:cut]
                    request.finish_reason = "stop"
        if request.finish_reason is None and num_new >= request.admission.max_new_tokens:
            request.finish_reason = "length"

    def _release(self, request: _Request) -> None:
        for name, table in request.tables.items():
            if not table.released:
                self.cache[name].release(table)
        request.tables.clear()

    def _output(self, request: _Request) -> RequestOutput:
        completion = CompletionOutput(0, request.text, list(request.output_token_ids), request.cumulative_logprob,
                                      request.finish_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion], True)

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

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        generation_config = self.source.path / "generation_config.json"
        candidates = []
        if generation_config.exists():
            import json

            candidates.append(json.loads(generation_config.read_text()).get("eos_token_id"))
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

    def generate(self, prompts, params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
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
