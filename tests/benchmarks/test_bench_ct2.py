"""CTranslate2 as a bench peer: the model directory widebeam loads, converted by CTranslate2's own
converter, generates N tokens whatever EOS says, and its best beam equals widebeam's in float32."""

from __future__ import annotations

import pytest

from widebeam.bench_ct2 import CT2Peer
from widebeam.llm import LLM
from widebeam.params import BeamSearchParams

pytest.importorskip("ctranslate2", reason="make test installs CTranslate2 (the dev extra)")


@pytest.fixture(scope="module")
def tiny_with_vocab(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a word-level tokenizer, so CTranslate2's converter has a vocabulary."""
    import shutil

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-vocab")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        unk_token="t0", bos_token="t1", eos_token="t2")
    tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("width", [1, 4])
def test_ctranslate2_best_beam_is_widebeams(tiny_with_vocab, tmp_path, width):
    llm = LLM(str(tiny_with_vocab), dtype="float32", device="cpu", kv_cache_memory="1MiB")
    peer = CT2Peer(tiny_with_vocab, "float32", 1, tmp_path, llm.tokenizer)
    prompt = [(i * 37 + 5) % 120 + 3 for i in range(20)]
    n = 8
    result = peer.run(prompt, width, n, eos_id=2)
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          BeamSearchParams(beam_width=width, max_new_tokens=n, min_new_tokens=n),
                          use_tqdm=False)
    assert len(result["best"]) == n  # min_length = max_length = N generated tokens, the prompt not counted
    assert result["best"] == out.outputs[0].token_ids
    again = CT2Peer(tiny_with_vocab, "float32", 1, tmp_path, llm.tokenizer)  # converted once, then reused
    assert again.run(prompt, width, n, eos_id=2)["best"] == result["best"]
    for each in (peer, again):
        each.close()
