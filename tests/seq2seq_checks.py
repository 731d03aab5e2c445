"""Encoder-decoder parity with transformers, shared by the Marian, BART-family (M2M100 / NLLB, BART,
mBART) and T5 tests: a tiny model's engines by KV block size, the paged decoder's logits reading the
'cross' pool against HF's full forward, and greedy and beam search through the whole engine, with the
cross pool holding ceil(E/T) blocks once per request at every beam width.

Each family's test states its own sources, tokens and HF generation settings (`hf_settings`: every
setting of `generate` that changes outputs); the checks here take them as arguments.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Sequence

import torch
from beam_checks import assert_beams_match
from kv_helpers import allocate_table

from widebeam.kv.tables import Holding
from widebeam.llm import LLM
from widebeam.model.runner import SequenceInput
from widebeam.params import BeamSearchParams, SamplingParams


class Seq2SeqModel:
    """A saved tiny encoder-decoder (`path`), its transformers reference (`hf`), and widebeam engines
    over it, built once per (tokens_per_block, attention backend) and reused by a module's tests."""

    def __init__(self, name: str, hf, path):
        self.name, self.hf, self.path = name, hf, path
        self._llms: dict = {}

    def llm(self, tokens_per_block: int, attention_backend: str | None = None) -> LLM:
        """float32 on CPU, 8 MiB of KV, up to W = 16; the attention backend the engine picks unless named."""
        key = (tokens_per_block, attention_backend)
        if key not in self._llms:
            backend = {} if attention_backend is None else {"attention_backend": attention_backend}
            self._llms[key] = LLM(str(self.path), dtype="float32", device="cpu",
                                  tokens_per_block=tokens_per_block, kv_cache_memory="8MiB",
                                  max_num_batched_tokens=64, max_beam_width=16, **backend)
        return self._llms[key]


def assert_every_block_back(engine_or_llm) -> None:
    """Every pool's blocks are free: nothing leaked by the run or the check."""
    for name, pool in engine_or_llm.stats()["pools"].items():
        assert pool["free_blocks"] == pool["total_blocks"], name


def assert_logits_match(engine, hf, sources: Sequence[list[int]], decoder_ids: Sequence[list[int]],
                        decode_steps: int = 4, tol: float = 1e-4, token_span: int = 120,
                        check_encoded: Callable[[list], None] | None = None) -> None:
    """The sources encoded into the 'cross' pool (then `check_encoded(cross_tables)`, if given), the
    decoder prefixes of different lengths in one forward (logits of every token), then `decode_steps`
    steps of all sequences together (tokens 3 .. 3 + token_span - 1), against HF's full forward. Every
    block goes back, even when a comparison fails, so one failure does not cascade."""
    self_manager, cross_manager = engine.cache["self"], engine.cache["cross"]
    cross_tables = [allocate_table(cross_manager, Holding(), len(s)) for s in sources]
    decoder_ids = [list(d) for d in decoder_ids]
    tables = [self_manager.new_table(Holding()) for _ in decoder_ids]

    def inputs_for(tokens_per_seq, starts):
        return [SequenceInput(tokens, start, {"self": table.block_ids},
                              {"self": self_manager.append_slots(table, len(tokens))},
                              cross_block_table=cross.block_ids, num_encoder_tokens=cross.num_tokens)
                for tokens, start, table, cross in zip(tokens_per_seq, starts, tables, cross_tables)]

    def expected_logits(source, decoder):
        return hf(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([decoder])).logits[0]

    try:
        engine.runner.encode(sources, [cross_manager.slots(t) for t in cross_tables])
        if check_encoded is not None:
            check_encoded(cross_tables)
        logits = engine.runner.execute(inputs_for(decoder_ids, [0] * len(sources)), all_logits=True)
        offset = 0
        with torch.no_grad():
            for source, decoder in zip(sources, decoder_ids):
                torch.testing.assert_close(logits[offset:offset + len(decoder)],
                                           expected_logits(source, decoder), atol=tol, rtol=tol)
                offset += len(decoder)
        for step in range(decode_steps):
            next_tokens = [[(7 * step + 3 * i) % token_span + 3] for i in range(len(sources))]
            logits = engine.runner.execute(inputs_for(next_tokens, [len(d) for d in decoder_ids]))
            for decoder, token in zip(decoder_ids, next_tokens):
                decoder.extend(token)
            with torch.no_grad():
                for row, source, decoder in zip(logits, sources, decoder_ids):
                    torch.testing.assert_close(row, expected_logits(source, decoder)[-1], atol=tol, rtol=tol)
    finally:
        for table in tables:
            self_manager.release(table)
        for table in cross_tables:
            cross_manager.release(table)
    assert_every_block_back(engine)


def assert_beam_search_matches(llm: LLM, hf, sources: Sequence[list[int]], params: BeamSearchParams,
                               tokens_per_block: int, hf_settings: dict, label: str) -> None:
    """All sources in one `generate` call; each source's beams and scores equal HF's `generate` with
    the same beam settings (its sequences start with the decoder start token), no beam holds a token
    `hf_settings` bans, every beam has `min_new_tokens`, and the cross pool holds ceil(E/T) blocks once
    per request. With W >= 4 and length_penalty <= 0 some beam must end on EOS (the EOS paths ran)."""
    pad, eos = hf_settings["pad_token_id"], hf_settings["eos_token_id"]
    banned = [words[0] for words in hf_settings.get("bad_words_ids") or [] if len(words) == 1]
    num_return = params.num_return_sequences or params.beam_width
    outputs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    saw_eos = False
    for source, output in zip(sources, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=params.beam_width,
                                   max_new_tokens=params.max_new_tokens, length_penalty=params.length_penalty,
                                   early_stopping=params.early_stopping, num_return_sequences=num_return,
                                   min_new_tokens=params.min_new_tokens, output_scores=True,
                                   return_dict_in_generate=True, **hf_settings)
        assert output.prompt_token_ids == source
        assert len(output.outputs) == num_return
        saw_eos |= assert_beams_match(output, expected, 1, pad, eos, params.beam_width,
                                      f"{label} source {source[:4]}")
        # no token of bad_words_ids
        assert all(token not in beam.token_ids for beam in output.outputs for token in banned)
        assert all(len(beam.token_ids) >= params.min_new_tokens for beam in output.outputs)
        # The cross pool: ceil(E/T) blocks, reserved once per request, whatever the beam width.
        cross_blocks = math.ceil(len(source) / tokens_per_block)
        assert output.required_blocks["cross"] == output.peak_blocks["cross"] == cross_blocks
        assert output.peak_blocks["self"] <= output.required_blocks["self"]
    if params.beam_width >= 4 and params.length_penalty <= 0:
        assert saw_eos, "the EOS paths were not exercised"
    assert_every_block_back(llm)


def assert_greedy_matches(llm: LLM, hf, sources: Sequence[list[int]], hf_settings: dict,
                          max_new_tokens: int = 10, ignore_eos: bool = False) -> None:
    """Greedy tokens of all sources in one `generate` call equal HF's, whole (an empty output fails)."""
    settings = {**hf_settings, "eos_token_id": None} if ignore_eos else hf_settings
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    for source, output in zip(sources, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=1, max_new_tokens=max_new_tokens,
                                   **settings)[0, 1:]
        assert len(output.outputs) == 1
        assert output.outputs[0].token_ids == expected.tolist()


def assert_generate_cli_matches(model_dir, text: str, tokenizer, hf, hf_settings: dict) -> list[int]:
    """`widebeam generate TEXT --model DIR` (W = 4, 8 new tokens, T = 4) encodes the text with the
    directory's tokenizer and returns HF's four beams, their texts and scores, with ceil(E/T) cross
    blocks. Returns the source token ids."""
    proc = subprocess.run([sys.executable, "-m", "widebeam", "generate", text, "--model", str(model_dir),
                           "--beam-width", "4", "--max-new-tokens", "8", "--tokens-per-block", "4", "--json",
                           "--kv-cache-memory", "1MiB", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    source = tokenizer(text).input_ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([source]), num_beams=4, num_return_sequences=4, max_new_tokens=8,
                               length_penalty=1.0, early_stopping=False, output_scores=True,
                               return_dict_in_generate=True, **hf_settings)
    assert len(result["outputs"]) == 4
    for rank, beam in enumerate(result["outputs"]):
        generated = expected.sequences[rank, 1:].tolist()
        assert beam["token_ids"] == generated[:len(beam["token_ids"])]
        assert beam["text"] == tokenizer.decode(beam["token_ids"], skip_special_tokens=True)
        assert abs(beam["score"] - float(expected.sequences_scores[rank])) < 1e-4
    assert result["kv_peak_blocks"]["cross"] == math.ceil(len(source) / 4)
    return source
