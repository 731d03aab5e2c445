"""gguf_reader.gguf_parsed_once: one reader per file and one name map per (arch, layers) inside the block,
reading exactly what the stock reader reads, and the stock functions back after it (even on an error).

Byte-for-byte equality of whole conversions (gemma3-270m, SmolLM2) was checked when it was written; the
real models' parity tests (tests/parity/test_gemma3_real.py, test_smollm2_real.py) convert through it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from widebeam.model.loading.gguf_reader import gguf_parsed_once


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "héllo", "", "▁wörld"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0, 1e-3])
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.arange(20, dtype=np.float32).reshape(5, 4))
    writer.add_tensor("blk.0.attn_norm.weight", np.linspace(-1, 1, 4, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _contents(reader) -> tuple[list, list]:
    fields = [(name, field.offset, field.types, field.data, [part.tobytes() for part in field.parts])
              for name, field in reader.fields.items()]
    tensors = [(t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset,
                t.data.dtype, t.data.shape, t.data.tobytes()) for t in reader.tensors]
    return fields, tensors


def test_inside_the_block_one_plain_reader_per_file_reads_what_the_stock_one_reads(tiny_gguf):
    stock = gguf.GGUFReader(tiny_gguf)
    with gguf_parsed_once():
        shared = gguf.GGUFReader(tiny_gguf)
        assert gguf.GGUFReader(str(tiny_gguf)) is shared  # transformers passes a str; one parse per file
        assert gguf.GGUFReader(tiny_gguf, "c") is not shared  # a writable mapping is never shared
        assert type(shared.data) is np.ndarray and not shared.data.flags.writeable
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
    assert _contents(shared) == _contents(stock)
    tokens = shared.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == ["<s>", "</s>", "héllo", "", "▁wörld"]
    assert name_map.mapping == gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).mapping


def test_the_stock_functions_are_back_after_the_block_even_on_an_error(tiny_gguf):
    stock_reader, stock_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_parsed_once():
        assert gguf.GGUFReader is not stock_reader
        raise RuntimeError
    assert gguf.GGUFReader is stock_reader and gguf.get_tensor_name_map is stock_name_map
    assert type(gguf.GGUFReader(tiny_gguf).data) is np.memmap
