"""No host reads inside the model forward: the runner builds every index tensor once per step, and
the layers only launch device work (on CUDA a `.tolist()` or `.item()` per layer stalls the stream
once per layer).

A real step of a tiny model through `ModelRunner`: beams of one request sharing their prompt's
blocks, a loose decoding sequence and a prefill chunk in one batch, over a full-attention pool and
a sliding-window pool whose released blocks are -1 in the tables (Gemma 3), and over a self pool
and a cross pool (Marian). A `TorchFunctionMode` counts every call that reads a tensor's value back
to the host while the model's `forward` runs (after the runner built the metadata), and every
tensor built from host values inside a `PagedAttention` layer (an index rebuilt per layer).
"""

from __future__ import annotations

import traceback

import pytest
import torch
from tiny_models import save_tiny_marian, save_tiny_model
from torch.overrides import TorchFunctionMode

from widebeam.model.attention.paged import PagedAttention
from widebeam.model.loading.build import load_model
from widebeam.model.loading.sources import resolve_model
from widebeam.model.runner import ModelRunner, SequenceInput

T = 4  # tokens per block
WINDOW = 8
# Calls that copy a tensor's value to the host (or need it there to know an output's shape).
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero",
              "argwhere", "masked_select", "unique", "unique_consecutive", "numpy", "cpu", "equal",
              "allclose"}
# Tensors made from host values: an index tensor built inside a layer (the runner builds them).
FACTORIES = {"tensor", "as_tensor", "asarray", "from_numpy", "arange", "range", "linspace", "full", "ones",
             "zeros"}


class HostReadCounter(TorchFunctionMode):
    """Records each host read with the widebeam frame that made it."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.built_in_attention: list[str] = []
        self.attention_depth = 0  # > 0 inside a PagedAttention layer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS or self._needs_host_value(name, args, kwargs):
            self.reads.append(f"{name} at {self._where()}")
        if self.attention_depth and name in FACTORIES:
            self.built_in_attention.append(f"{name} at {self._where()}")
        return func(*args, **kwargs)

    @staticmethod
    def _where() -> str:
        frames = [f for f in traceback.extract_stack()[:-2] if "widebeam" in f.filename]
        return f"{frames[-1].filename.split('widebeam/')[-1]}:{frames[-1].lineno}" if frames else "?"

    @staticmethod
    def _needs_host_value(name: str, args, kwargs) -> bool:
        if name in ("__getitem__", "__setitem__") and len(args) > 1:  # boolean-mask indexing
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return "output_size" not in kwargs
        return False


def count_forward_host_reads(runner: ModelRunner,
                             seqs: list[SequenceInput]) -> tuple[HostReadCounter, torch.Tensor]:
    """Run one step; count what happens inside `model.forward` only."""
    model = runner.model
    counter = HostReadCounter()
    inner = type(model).forward

    def counted_forward(*args, **kwargs):
        with counter:
            return inner(model, *args, **kwargs)

    def enter(*_):
        counter.attention_depth += 1

    def leave(*_):
        counter.attention_depth -= 1

    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    assert layers, "the model's attention does not go through PagedAttention"
    hooks = [h for m in layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    model.forward = counted_forward
    try:
        logits = runner.execute(seqs)
    finally:
        del model.forward
        for hook in hooks:
            hook.remove()
    return counter, logits


class Tables:
    """Hand-made block tables: fresh blocks per pool, the prompt's full blocks shared by beams."""

    def __init__(self, pools):
        self.pools = pools
        self.next = dict.fromkeys(pools, 0)

    def new(self, pool: str, count: int) -> list[int]:
        blocks = list(range(self.next[pool], self.next[pool] + count))
        self.next[pool] += count
        return blocks


def slots_of(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // T] * T + p % T for p in range(start, end)]


def windowed(pool: str, table: list[int], seq_len: int, num_queries: int) -> list[int]:
    """A sliding pool's table with the blocks behind every query's window released (-1)."""
    if not pool.startswith("sliding_"):
        return table
    released = max(0, seq_len - num_queries - WINDOW + 1) // T
    return [-1] * released + table[released:]


def mixed_step(runner: ModelRunner, pools: list[str], cross: dict | None = None) -> list[SequenceInput]:
    """Prefill a 21-token prompt and a 10-token loose sequence; then return the mixed step: four
    beams of the prompt (full prompt blocks shared, the partial one copied), the loose sequence's
    next token and a 6-token prefill chunk of a third sequence that already has 5 tokens."""
    cross = cross or {}
    tables = Tables(pools)
    prompt, loose, third = 21, 10, 5
    prompt_tables = {p: tables.new(p, -(-prompt // T)) for p in pools}
    loose_tables = {p: tables.new(p, -(-(loose + 1) // T)) for p in pools}
    third_tables = {p: tables.new(p, -(-(third + 6) // T)) for p in pools}
    warm = [
        SequenceInput(list(range(3, 3 + prompt)), 0, prompt_tables,
                      {p: slots_of(prompt_tables[p], 0, prompt) for p in pools}, group="a", **cross),
        SequenceInput(list(range(40, 40 + loose)), 0, loose_tables,
                      {p: slots_of(loose_tables[p], 0, loose) for p in pools}, **cross),
        SequenceInput(list(range(60, 60 + third)), 0, third_tables,
                      {p: slots_of(third_tables[p], 0, third) for p in pools}, **cross),
    ]
    runner.execute(warm)
    shared = prompt // T
    step = []
    for beam in range(4):
        beam_tables = {}
        for p in pools:
            own = tables.new(p, 1)
            runner.copy_blocks(p, [(prompt_tables[p][shared], own[0], T)])
            beam_tables[p] = prompt_tables[p][:shared] + own
        step.append(SequenceInput([7 + beam], prompt,
                                  {p: windowed(p, beam_tables[p], prompt + 1, 1) for p in pools},
                                  {p: slots_of(beam_tables[p], prompt, prompt + 1) for p in pools}, group="a",
                                  **cross))
    step.append(SequenceInput([50], loose, {p: windowed(p, loose_tables[p], loose + 1, 1) for p in pools},
                              {p: slots_of(loose_tables[p], loose, loose + 1) for p in pools}, **cross))
    step.append(SequenceInput(list(range(70, 76)), third,
                              {p: windowed(p, third_tables[p], third + 6, 6) for p in pools},
                              {p: slots_of(third_tables[p], third, third + 6) for p in pools}, **cross))
    return step


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("host-sync-gemma3")
    save_tiny_model(path, "gemma3_text", num_hidden_layers=2, tie_word_embeddings=True, sliding_window=WINDOW,
                    head_dim=16, layer_types=["sliding_attention", "full_attention"])
    return load_model(resolve_model(str(path)), "float32", torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_marian(tmp_path_factory):
    path = tmp_path_factory.mktemp("host-sync-marian")
    save_tiny_marian(path)
    return load_model(resolve_model(str(path)), "float32", torch.device("cpu"))


def runner_for(model, backend: str | None) -> ModelRunner:
    pools = dict.fromkeys(model.layer_pool_names, 64)
    kwargs = {} if backend is None else {"attention_backend": backend}
    return ModelRunner(model, pools, T, torch.device("cpu"), torch.float32, **kwargs)


@pytest.mark.parametrize("backend", [None, "sdpa", "reference"])
def test_decode_step_makes_no_host_reads_in_the_forward(tiny_gemma3, backend):
    runner = runner_for(tiny_gemma3, backend)
    assert set(runner.kv_tensors) == {"self", f"sliding_{WINDOW}"}
    step = mixed_step(runner, list(runner.kv_tensors))
    counter, logits = count_forward_host_reads(runner, step)
    assert counter.reads == [], f"{len(counter.reads)} host reads in the forward: {counter.reads[:6]}"
    assert counter.built_in_attention == [], \
        f"tensors built in attention layers: {counter.built_in_attention[:6]}"
    assert logits.shape == (len(step), tiny_gemma3.arch.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", [None, "reference"])
def test_encoder_decoder_step_makes_no_host_reads_in_the_forward(tiny_marian, backend):
    runner = runner_for(tiny_marian, backend)
    source = list(range(3, 12))
    runner.encode([source], [list(range(len(source)))])  # cross blocks 0..2
    cross = {"cross_block_table": [0, 1, 2], "num_encoder_tokens": len(source)}
    step = mixed_step(runner, ["self"], cross)
    counter, logits = count_forward_host_reads(runner, step)
    assert counter.reads == [], f"{len(counter.reads)} host reads in the forward: {counter.reads[:6]}"
    assert counter.built_in_attention == [], \
        f"tensors built in attention layers: {counter.built_in_attention[:6]}"
    assert torch.isfinite(logits).all()


def test_the_counter_sees_a_per_layer_read(tiny_gemma3):
    """The counter itself: a host read and an index built in every attention layer are both seen."""
    runner = runner_for(tiny_gemma3, None)
    step = mixed_step(runner, list(runner.kv_tensors))
    original = torch.nn.functional.scaled_dot_product_attention

    def syncing_sdpa(*args, **kwargs):
        out = original(*args, **kwargs)
        out.sum().item()
        torch.arange(3)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", syncing_sdpa)
        counter, _ = count_forward_host_reads(runner, step)
    assert counter.reads and all(r.startswith("item") for r in counter.reads)
    assert counter.built_in_attention and all(r.startswith("arange") for r in counter.built_in_attention)
