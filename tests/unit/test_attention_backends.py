"""Every attention backend against dense attention on random paged layouts.

A layout is made the way the KV manager makes one: requests whose beams share their prompt's full
blocks and copy the partial one on write, beams forked again mid-generation (sharing generated
blocks too), sequences that share nothing, prefill chunks (from position 0 and after cached
tokens), blocks scattered at random, and in windowed pools the blocks behind every window released
(-1 in the table, NaN in the cache). The expected output is computed densely, in float64, from each
sequence's own keys and values, so the reference backend is checked too.
"""

from __future__ import annotations

import random

import pytest
import torch

from widebeam.model.attention.backends import attention_backend_names, get_attention_backend

# the dense-cache kernel reads run here on every build (tests/conftest.py), not only where they pay
pytestmark = pytest.mark.usefixtures("dense_kernel_reads_anywhere")


class Layout:
    """A paged cache filled token by token; `seqs` hold each sequence's table and its keys/values."""

    def __init__(self, t: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int,
                 seed: int, scattered: bool = True):
        self.t, self.rng = t, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(num_blocks))[::-1]  # popped from the end: in order
        if scattered:
            self.rng.shuffle(self.free)  # scattered, non-contiguous blocks
        shape = (num_blocks * t, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)  # never-written slots are NaN
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.seqs: list[dict] = []

    def new(self, group: str | None = None) -> dict:
        seq = {"table": [], "len": 0, "k": [], "v": [], "group": group, "queries": 0}
        self.seqs.append(seq)
        return seq

    def fork(self, src: dict, group: str | None) -> dict:
        """Share the full blocks, copy the partial one (copy-on-write)."""
        seq = self.new(group)
        full = src["len"] // self.t
        seq["table"] = src["table"][:full]
        if src["len"] % self.t:
            block = self.free.pop()
            for cache in (self.k_cache, self.v_cache):
                old = src["table"][full] * self.t
                cache[block * self.t:(block + 1) * self.t] = cache[old:old + self.t]
            seq["table"].append(block)
        seq.update(len=src["len"], k=list(src["k"]), v=list(src["v"]))
        return seq

    def append(self, seq: dict, n: int) -> None:
        for _ in range(n):
            if seq["len"] % self.t == 0:
                seq["table"].append(self.free.pop())
            slot = seq["table"][seq["len"] // self.t] * self.t + seq["len"] % self.t
            k, v = (torch.randn(self.k_cache.shape[1:], generator=self.gen).to(self.k_cache.dtype)
                    for _ in range(2))
            self.k_cache[slot], self.v_cache[slot] = k, v
            seq["k"].append(k.double())
            seq["v"].append(v.double())
            seq["len"] += 1

    def step(self, seq: dict, num_queries: int) -> None:
        """This step's tokens: written now, attended by `num_queries` queries."""
        self.append(seq, num_queries)
        seq["queries"] = num_queries

    def release_behind(self, window: int) -> None:
        """Blocks before every query's window leave the tables (-1); blocks nobody sees are wiped."""
        needed = set()
        for seq in self.seqs:
            first_visible = max(0, seq["len"] - seq["queries"] - window + 1)
            dropped = first_visible // self.t
            needed.update(seq["table"][dropped:])
            seq["table"] = [-1] * dropped + seq["table"][dropped:]
        for block in {b for seq in self.seqs for b in seq["table"]} - needed - {-1}:
            for cache in (self.k_cache, self.v_cache):
                cache[block * self.t:(block + 1) * self.t] = float("nan")

    def metadata(self, backend, window: int | None):
        seqs = [s for s in self.seqs if s["queries"]]
        query_start_loc = [0]
        for s in seqs:
            query_start_loc.append(query_start_loc[-1] + s["queries"])
        slots = [s["table"][p // self.t] * self.t + p % self.t for s in seqs
                 for p in range(s["len"] - s["queries"], s["len"])]
        return backend.build_metadata(query_start_loc=query_start_loc, seq_lens=[s["len"] for s in seqs],
                                      block_tables=[s["table"] for s in seqs], slot_mapping=slots,
                                      tokens_per_block=self.t, device=torch.device("cpu"),
                                      groups=[s["group"] for s in seqs], sliding_window=window)

    def dense(self, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """Attention of each sequence's queries over its own keys, float64, masks spelled out."""
        out, row = [], 0
        for s in (s for s in self.seqs if s["queries"]):
            k, v = torch.stack(s["k"]), torch.stack(s["v"])  # [S, KV, d]
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            for j in range(s["queries"]):
                pos = s["len"] - s["queries"] + j
                visible = [p for p in range(s["len"]) if p <= pos and (window is None or pos - p < window)]
                scores = torch.einsum("hd,shd->hs", q[row].double(), k[visible]) * scale
                out.append(torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v[visible]))
                row += 1
        return torch.stack(out)


def random_layout(seed: int, t: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Layout:
    """Two beam requests (one with a second-level fork), loose decodes, two prefill chunks."""
    rng = random.Random(seed)
    lay = Layout(t, num_kv_heads, head_dim, dtype, num_blocks=600 // t + 40, seed=seed)
    for name in ("a", "b"):
        root = lay.new()
        lay.append(root, rng.randint(1, 40))  # the prompt
        beams = [lay.fork(root, name) for _ in range(rng.randint(2, 5))]
        lay.seqs.remove(root)
        generated = rng.randint(0, 9)
        for beam in beams:
            lay.append(beam, generated)
        late = lay.fork(beams[0], name)  # forked mid-generation: shares generated blocks too
        for beam in [*beams, late]:
            lay.step(beam, 1)
    for _ in range(2):  # sequences that share nothing
        loose = lay.new()
        lay.append(loose, rng.randint(0, 30))
        lay.step(loose, 1)
    lay.step(lay.new(), rng.randint(2, 25))  # a prefill from position 0
    chunk = lay.new()
    lay.append(chunk, rng.randint(1, 30))
    lay.step(chunk, rng.randint(2, 12))  # a later chunk of a longer prompt
    return lay


BACKENDS = attention_backend_names()
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def test_both_backends_are_registered():
    assert {"reference", "sdpa"} <= set(BACKENDS)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (9, 3), (4, 1)])
@pytest.mark.parametrize("window", [None, 1, 6, 13])
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_backend_matches_dense_attention(backend_name, dtype, num_heads, num_kv_heads, window, t, seed):
    head_dim = 8
    lay = random_layout(seed, t, num_kv_heads, head_dim, dtype)
    if window is not None:
        lay.release_behind(window)
    backend = get_attention_backend(backend_name)
    meta = lay.metadata(backend, window)
    q = torch.randn(meta.query_start_loc[-1], num_heads, head_dim,
                    generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    actual = backend.forward(q, lay.k_cache, lay.v_cache, meta, 0.4)
    expected = lay.dense(q, 0.4, window)
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


def test_the_layouts_exercise_every_path():
    """Shared-prefix groups, a loose batch and both kinds of prefill chunk occur, so the comparisons
    above cover each branch of the "sdpa" backend."""
    sdpa = get_attention_backend("sdpa")
    prefixes, causal = set(), set()
    for seed in (0, 1):
        meta = random_layout(seed, 4, 2, 8, torch.float32).metadata(sdpa, None)
        prefixes |= {g.prefix_tokens > 0 for g in meta.decode_groups}
        causal |= {s.causal for s in meta.sequences}
        windowed = random_layout(seed, 4, 2, 8, torch.float32)
        windowed.release_behind(6)
        assert all(g.prefix_tokens == 0 for g in windowed.metadata(sdpa, 6).decode_groups)
    assert prefixes == {True, False} and causal == {True, False}


@pytest.mark.parametrize("num_rows", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_rows_read_in_place_match_dense_attention(num_rows, window, t):
    """Width-1 decodes whose blocks came off the free list in order: each row's keys are one run of
    slots, read through a view of the cache (`DecodeGroup.key_ranges`), not gathered."""
    lay = Layout(t, 3, 8, torch.float32, num_blocks=200 // t + 20, seed=num_rows, scattered=False)
    for i in range(num_rows):
        seq = lay.new()
        lay.append(seq, 7 + 13 * i)  # each request's blocks follow each other
        lay.step(seq, 1)
    if window is not None:
        lay.release_behind(window)
    sdpa = get_attention_backend("sdpa")
    meta = lay.metadata(sdpa, window)
    (group,) = meta.decode_groups
    assert group.key_ranges is not None and len(group.key_ranges) == num_rows  # the in-place path ran
    q = torch.randn(num_rows, 9, 8, generator=torch.Generator().manual_seed(t))
    actual = sdpa.forward(q, lay.k_cache, lay.v_cache, meta, 0.4)
    torch.testing.assert_close(actual.double(), lay.dense(q, 0.4, window), atol=2e-5, rtol=2e-5)


def test_scattered_or_many_rows_are_gathered():
    sdpa = get_attention_backend("sdpa")
    scattered = Layout(4, 2, 8, torch.float32, num_blocks=64, seed=3)
    for _ in range(2):
        seq = scattered.new()
        scattered.append(seq, 30)
        scattered.step(seq, 1)
    assert scattered.metadata(sdpa, None).decode_groups[0].key_ranges is None
    many = Layout(4, 2, 8, torch.float32, num_blocks=64, seed=3, scattered=False)
    for _ in range(5):
        seq = many.new()
        many.append(seq, 9)
        many.step(seq, 1)
    assert many.metadata(sdpa, None).decode_groups[0].key_ranges is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_beams, t", [(40, 4), (70, 16)])
def test_wide_groups_read_the_prefix_through_the_fused_kernel(num_beams, t, dtype):
    """A request wide enough (beams x grouped heads >= FUSED_PREFIX_MIN_ROWS) reads its shared prompt
    through PyTorch's fused CPU kernel and merges the beams' own keys by log-sum-exp: equal to dense."""
    from widebeam.model.attention.backends import FUSED_PREFIX_MIN_ROWS

    lay = Layout(t, 2, 8, dtype, num_blocks=2000 // t + 200, seed=num_beams)
    root = lay.new()
    lay.append(root, 37)
    beams = [lay.fork(root, "wide") for _ in range(num_beams)]
    lay.seqs.remove(root)
    for i, beam in enumerate(beams):
        lay.append(beam, i % 5)  # own tokens of several lengths
        lay.step(beam, 1)
    sdpa = get_attention_backend("sdpa")
    meta = lay.metadata(sdpa, None)
    (group,) = meta.decode_groups
    assert group.prefix_tokens > 0 and num_beams * 3 >= FUSED_PREFIX_MIN_ROWS
    q = torch.randn(num_beams, 6, 8, generator=torch.Generator().manual_seed(t)).to(dtype)
    actual = sdpa.forward(q, lay.k_cache, lay.v_cache, meta, 0.4)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), lay.dense(q, 0.4, None), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_beams, t", [(2, 4), (4, 16), (40, 4)])
@pytest.mark.parametrize("scattered", [False, True])
def test_one_request_reads_its_prompt_as_a_view_of_the_cache(num_beams, t, scattered, dtype):
    """A decode step of one beam request (width 4, say): its group holds every row, so no rows are
    selected or scattered back, and a prompt whose blocks are one run of slots is read through a view
    of the cache (`DecodeGroup.prefix_start`), not gathered; scattered blocks are still gathered.
    Both equal dense attention, through the plain products and (40 beams) the fused prefix kernel."""
    lay = Layout(t, 2, 8, dtype, num_blocks=2000 // t + 200, seed=num_beams, scattered=scattered)
    root = lay.new()
    lay.append(root, 45)
    beams = [lay.fork(root, "req") for _ in range(num_beams)]
    lay.seqs.remove(root)
    for i, beam in enumerate(beams):
        lay.append(beam, i % 3)
        lay.step(beam, 1)
    sdpa = get_attention_backend("sdpa")
    meta = lay.metadata(sdpa, None)
    (group,) = meta.decode_groups
    assert group.prefix_tokens == 45 // t * t and not meta.sequences
    if scattered:
        assert group.prefix_start is None
    else:
        assert group.prefix_start == lay.seqs[0]["table"][0] * t
    q = torch.randn(num_beams, 6, 8, generator=torch.Generator().manual_seed(t)).to(dtype)
    actual = sdpa.forward(q, lay.k_cache, lay.v_cache, meta, 0.4)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), lay.dense(q, 0.4, None), atol=tol, rtol=tol)
