"""CTranslate2's soft target prefix (`prefix_bias_beta`) on the tiny Marian, against transformers' beam
search running the same definition as a logits processor (HF's beam search hands its processors the
log-softmax, as CTranslate2 biases log-probs): at step t < len(prefix) the distribution of a beam whose
tokens are still prefix[:t] becomes (1 - beta) p + beta onehot(prefix[t]); a beam that left it is not
biased. Sequences and scores equal to 1e-4 at W in {1, 4, 16}; a beta near 1 reproduces the hard
prefix's tokens, a small one lets the beams leave it.

CTranslate2 itself is the oracle in tests/parity/test_ctranslate2_options.py (a tiny NLLB); its
converter's tiny Marian does not reproduce transformers' logits."""

from __future__ import annotations

import pytest
import torch
from beam_checks import assert_beams_match
from tiny_models import TINY_MARIAN_EOS as EOS
from tiny_models import TINY_MARIAN_PAD as PAD
from transformers import LogitsProcessor, LogitsProcessorList, MarianMTModel

from widebeam.errors import InvalidParameterError
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

SOURCES = [[5, 17, 33, 9, 100, 3, EOS], [7, 7, 9] * 4 + [EOS], [11, EOS]]
PREFIX = [40, 12, 90]


class SoftPrefix(LogitsProcessor):
    """The definition, written for transformers (input_ids hold the start token, then the generated)."""

    def __init__(self, prefix, beta):
        self.prefix, self.beta = prefix, beta

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - 1
        if step >= len(self.prefix):
            return scores
        on_prefix = (input_ids[:, 1:] == torch.tensor(self.prefix[:step])).all(-1)  # others: as they are
        logprobs = torch.log_softmax(scores, -1)
        out = logprobs + torch.log(torch.tensor(1 - self.beta))
        token = self.prefix[step]
        out[:, token] = torch.log((1 - self.beta) * logprobs[:, token].exp() + self.beta)
        return torch.where(on_prefix[:, None], out, scores)


@pytest.fixture(scope="module")
def models(tiny_marian_dir):
    hf = MarianMTModel.from_pretrained(str(tiny_marian_dir), dtype=torch.float32).eval()
    llm = LLM(str(tiny_marian_dir), dtype="float32", device="cpu", tokens_per_block=4, kv_cache_memory="8MiB",
              max_num_batched_tokens=64, max_beam_width=16)
    return llm, hf


@pytest.mark.parametrize("beam_width", [1, 4, 16])
@pytest.mark.parametrize("beta", [0.2, 0.6, 0.99])
def test_soft_prefix_matches_the_definition_in_transformers(models, beam_width, beta):
    llm, hf = models
    params = BeamSearchParams(beam_width=beam_width, max_new_tokens=8, decoder_prefix=PREFIX,
                              prefix_bias_beta=beta)
    outputs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    followed = 0
    for source, output in zip(SOURCES, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([source]), num_beams=beam_width, do_sample=False,
                                   max_new_tokens=8, num_return_sequences=beam_width, eos_token_id=EOS,
                                   pad_token_id=PAD, decoder_start_token_id=PAD, bad_words_ids=[[PAD]],
                                   forced_eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                                   logits_processor=LogitsProcessorList([SoftPrefix(PREFIX, beta)]))
        assert_beams_match(output, expected, 1, PAD, EOS, beam_width, f"beta {beta}")
        followed += output.outputs[0].token_ids[:len(PREFIX)] == PREFIX
    if beta == 0.99:
        assert followed == len(SOURCES)  # nearly hard: every best beam starts with the prefix
    if beta == 0.2:
        assert followed < len(SOURCES)  # soft: some leave it


def test_prefix_bias_is_refused_where_it_cannot_apply():
    for kwargs in ({"prefix_bias_beta": 0.5}, {"prefix_bias_beta": 1.0, "decoder_prefix": [3]},
                   {"prefix_bias_beta": -0.1, "decoder_prefix": [3]},
                   {"prefix_bias_beta": 0.5, "decoder_prefix": [3], "forced_bos_token_id": 4}):
        with pytest.raises(InvalidParameterError) as excinfo:
            BeamSearchParams(**kwargs)
        assert excinfo.value.param == "prefix_bias_beta"
