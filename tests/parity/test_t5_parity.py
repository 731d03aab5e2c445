"""T5 / T5 v1.1 / mT5 through widebeam against transformers' T5ForConditionalGeneration and
MT5ForConditionalGeneration on tiny random models (tests/tiny_t5.py): the encoder's output (as the
cross K/V it leaves in the 'cross' pool), the paged decoder's logits with its causal relative bias
through the attention backend, greedy and beam search through the whole engine (several sources of
different lengths in one `generate` call), the cross pool holding ceil(E/T) blocks once per request at
every beam width, and the t5-small shape at reduced depth. The checks shared with the Marian and
BART-family tests are in tests/seq2seq_checks.py."""

from __future__ import annotations

import pytest
import torch
from seq2seq_checks import (
    Seq2SeqModel,
    assert_beam_search_matches,
    assert_generate_cli_matches,
    assert_greedy_matches,
    assert_logits_match,
)
from tiny_t5 import T5_EOS as EOS
from tiny_t5 import T5_PAD as PAD
from tiny_t5 import T5_SMALL_SHAPE, save_tiny_t5

from widebeam.llm import LLM
from widebeam.model.linears import split as split_linear
from widebeam.params import BeamSearchParams, SamplingParams

# Sources of several lengths (E = 2 .. 37; past the tiny model's max_distance of 20), ending with EOS
# as T5's tokenizer ends them.
SOURCES = [[5, 17, 33, 9, 60, 3, EOS], [7, 7, 9] * 4 + [EOS], list(range(3, 39)) + [EOS], [11, EOS]]
# Everything in HF's generation config that changes outputs, stated explicitly.
HF_SETTINGS = {"do_sample": False, "eos_token_id": EOS, "pad_token_id": PAD, "decoder_start_token_id": PAD,
               "bad_words_ids": None, "forced_eos_token_id": None, "forced_bos_token_id": None,
               "no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "min_length": 0}
TOKEN_SPAN = 90  # decode-step tokens stay inside the tiny vocabulary (96)

# (beam_width, tokens_per_block, length_penalty, early_stopping, num_return_sequences, min_new_tokens[,
#  attention backend: sdpa unless named])
CASES = [
    (1, 4, 1.0, False, 1, 0),
    (4, 1, 1.0, True, 2, 0),
    (4, 16, 2.0, False, 4, 3),
    (4, 4, -1.0, "never", 2, 0),
    (16, 4, 0.0, True, 8, 0),
    (16, 3, 1.0, "never", 3, 2),
    (16, 1, -1.0, False, 4, 1),
    (4, 3, 1.0, False, 4, 2, "reference"),  # the reference backend through the whole engine
]
VARIANTS = ["t5", "t5-v1_1", "mt5"]


@pytest.fixture(scope="module", params=VARIANTS)
def models(request, tmp_path_factory) -> Seq2SeqModel:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return Seq2SeqModel(request.param, save_tiny_t5(path, request.param), path)


def cross_kv_check(engine, hf, sources, tol: float):
    """The check of the encoder's output as the cross K/V it left in the pool: each decoder layer's
    K and V cache rows at the source's slots equal HF's projections of its encoder output."""
    cross_manager = engine.cache["cross"]
    cross_caches = [kv for kv, name in zip(engine.runner.kv_caches, engine.model.layer_pool_names)
                    if name == "cross"]

    def check(cross_tables):
        with torch.no_grad():
            for source, table in zip(sources, cross_tables):
                encoded = hf.get_encoder()(input_ids=torch.tensor([source])).last_hidden_state[0]
                slots = torch.tensor(cross_manager.slots(table))
                for block, (k_cache, v_cache) in zip(hf.decoder.block, cross_caches):
                    attention = block.layer[1].EncDecAttention
                    heads = (len(source), attention.n_heads, attention.key_value_proj_dim)
                    for cache, projection in ((k_cache, attention.k), (v_cache, attention.v)):
                        torch.testing.assert_close(cache[slots], projection(encoded).view(heads),
                                                   atol=tol, rtol=tol)
    return check


def check_logits(engine, hf, sources, decoder_ids, steps: int = 4, tol: float = 1e-4) -> None:
    """The encoder's cross K/V in the pool, then every decoder token's logits (one prefill forward of
    all sequences, then decode steps together) against HF's full forward."""
    assert_logits_match(engine, hf, sources, decoder_ids, decode_steps=steps, tol=tol, token_span=TOKEN_SPAN,
                        check_encoded=cross_kv_check(engine, hf, sources, tol))


@pytest.mark.parametrize("tokens_per_block, attention_backend",
                         [(1, "sdpa"), (3, "sdpa"), (16, "sdpa"), (3, "reference")])
def test_encoder_output_and_logits_match(models, tokens_per_block, attention_backend):
    engine = models.llm(tokens_per_block, attention_backend).engine
    assert engine.runner.attention_backend.name == attention_backend
    # decoder prefixes of different lengths, one past max_distance (20) to reach the log buckets
    decoder_ids = [[PAD, 4, 8, 9, 10], [PAD], [PAD] + [3] * 24, [PAD, 50, 51]]
    check_logits(engine, models.hf, SOURCES, decoder_ids)  # every block back, checked there


@pytest.mark.parametrize("beam_width, tokens_per_block, length_penalty, early_stopping, num_return, min_new, "
                         "attention_backend", [case if len(case) == 7 else (*case, "sdpa") for case in CASES])
def test_beam_search_matches_transformers(models, beam_width, tokens_per_block, length_penalty,
                                          early_stopping, num_return, min_new, attention_backend):
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, num_return_sequences=num_return,
                              min_new_tokens=min_new)
    assert_beam_search_matches(models.llm(tokens_per_block, attention_backend), models.hf, SOURCES, params,
                               tokens_per_block, HF_SETTINGS, models.name)


def test_greedy_matches_transformers(models):
    assert_greedy_matches(models.llm(4, "sdpa"), models.hf, SOURCES, HF_SETTINGS, ignore_eos=True)


def test_int8_runs_greedy(models):
    llm = LLM(str(models.path), dtype="int8", device="cpu", tokens_per_block=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=64, max_beam_width=4)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES],
                           SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_loads_the_checkpoint_with_its_head(models):
    model, hf = models.llm(4, "sdpa").engine.model, models.hf
    shared = model.shared.weight
    assert model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
    tied = hf.lm_head.weight is hf.shared.weight
    assert (model.lm_head.weight is shared) == tied
    assert (model.output_scale is not None) == tied  # T5 v1.0 scales before its tied head; v1.1/mT5 not
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight)


@pytest.mark.parametrize("onednn", [False, True], ids=["as probed", "oneDNN forced past 8 rows"])
def test_t5_small_shape_at_two_layers(tmp_path, monkeypatch, onednn):
    """t5-small's widths (d_model 512, 8 x 64 heads, d_ff 2048, 32128 tokens, 32 buckets to 128). With
    oneDNN forced (as the start-up probe picks it on an AMD EPYC): the decoder's linears and head run it,
    the encoder's and the cross K/V projections keep F.linear (`keeps_f_linear`), and parity holds."""
    if onednn:
        if not split_linear.onednn_plain_available():
            pytest.skip("this torch build has no oneDNN")
        monkeypatch.setattr(split_linear, "probe_many_rows", lambda layers: True)
    hf = save_tiny_t5(tmp_path, "t5", shape=T5_SMALL_SHAPE)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tokens_per_block=16, kv_cache_memory="16MiB",
              max_num_batched_tokens=160, max_beam_width=4)
    if onednn:
        by_name = {name: m.onednn_many_rows for name, m in llm.engine.model.named_modules()
                   if isinstance(m, split_linear.SplitLinear)}
        kept = {name for name, on in by_name.items() if not on}
        assert any(name.startswith("encoder.") for name in kept)
        assert all(name.startswith("encoder.") or name.endswith(("EncDecAttention.k", "EncDecAttention.v"))
                   for name in kept)
        assert by_name["decoder.block.0.layer.0.SelfAttention.q"] and by_name["lm_head"]
    long_source = [(37 * i) % 32000 + 2 for i in range(150)] + [EOS]  # past max_distance 128
    sources = [SOURCES[0], long_source]
    check_logits(llm.engine, hf, sources, [[PAD, 4, 8], [PAD] + [3] * 140], steps=2, tol=2e-4)
    params = BeamSearchParams(beam_width=4, max_new_tokens=6, num_return_sequences=2)
    assert_beam_search_matches(llm, hf, sources, params, 16, HF_SETTINGS, "t5-small shape")


def test_generate_cli_with_a_task_prefix_like_transformers(tmp_path):
    """A model directory with T5's tokenizer: `widebeam generate "translate English to German: ..."`
    encodes the task-prefixed text (EOS appended) as the source and returns HF's beams and scores."""
    pytest.importorskip("sentencepiece")
    from tiny_t5 import save_tiny_t5_tokenizer

    tokenizer = save_tiny_t5_tokenizer(tmp_path)
    hf = save_tiny_t5(tmp_path, "t5-v1_1")
    assert len(tokenizer) <= hf.config.vocab_size
    text = "translate English to German: the quick brown dog sat on the mat"
    source = assert_generate_cli_matches(tmp_path, text, tokenizer, hf, HF_SETTINGS)
    assert source[-1] == EOS
