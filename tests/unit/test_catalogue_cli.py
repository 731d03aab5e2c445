"""The catalogue options of the command line: `generate --catalogue PATH`, `serve --catalogue
NAME=PATH` (repeatable) and `plan --catalogue FILE | --catalogue-items N [--catalogue-item-tokens L]
| --catalogue-bytes B`. No model is loaded: `LLM` and `LLMEngine` are replaced by recorders. The plan's
numbers are checked against the trie's own bytes and the formula (33 bytes a node)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest

from widebeam.cli import main
from widebeam.errors import InvalidParameterError, WidebeamError
from widebeam.params import BeamSearchParams, SamplingParams

ITEMS = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 9, 9], [7, 8]]


class Stop(WidebeamError):
    """Raised by the fake engine once it has recorded its arguments."""


@pytest.fixture()
def catalogue_file(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return path


@pytest.fixture()
def recorded(monkeypatch):
    """Replace `LLM` (records its kwargs and the params it generates with) and `LLMEngine`
    (records, stops)."""
    seen: dict = {}

    class FakeLLM:
        def __init__(self, model="m", **kwargs):
            seen.update(kwargs, model=model)
            self.engine = types.SimpleNamespace(apply_chat_template=lambda text: text)

        def generate(self, prompts, params, use_tqdm=False):
            seen["params"] = params
            if "error" in seen:
                raise seen["error"]
            choice = types.SimpleNamespace(index=0, text="item", token_ids=[1, 2, 3, 4, 0], score=-1.5,
                                           cumulative_logprob=-7.5, finish_reason="stop")
            return [types.SimpleNamespace(outputs=[choice], peak_blocks={}, required_blocks={},
                                          num_cached_tokens=0)]

    def fake_engine(model="m", **kwargs):
        seen.update(kwargs, model=model)
        if "error" in seen:
            raise seen["error"]
        raise Stop("stopped before loading")

    monkeypatch.setattr("widebeam.llm.LLM", FakeLLM)
    monkeypatch.setattr("widebeam.engine.LLMEngine", fake_engine)
    return seen


# -- generate ---------------------------------------------------------------------------------------
def test_generate_catalogue_registers_the_file_and_implies_beam_search(recorded, catalogue_file, capsys):
    assert main(["generate", "user history", "--catalogue", str(catalogue_file), "--json"]) == 0
    assert recorded["catalogues"] == {"cli": str(catalogue_file)}
    params = recorded["params"]
    assert isinstance(params, BeamSearchParams)
    assert (params.beam_width, params.catalogue, params.max_new_tokens) == (8, "cli", None)
    assert recorded["max_beam_width"] == 8
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["score"] == -1.5


def test_generate_catalogue_keeps_the_given_width_and_tokens(recorded, catalogue_file):
    assert main(["generate", "p", "--catalogue", str(catalogue_file), "--beam-width", "3",
                 "--num-return-sequences", "2", "--max-new-tokens", "6", "--json"]) == 0
    params = recorded["params"]
    assert (params.beam_width, params.num_return_sequences, params.max_new_tokens) == (3, 2, 6)


def test_generate_without_a_catalogue_is_unchanged(recorded, capsys):
    assert main(["generate", "p"]) == 0
    assert "catalogues" not in recorded
    assert isinstance(recorded["params"], SamplingParams) and recorded["params"].max_new_tokens == 32


def test_generate_catalogue_with_temperature_is_one_line_exit_2(recorded, catalogue_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "p", "--catalogue", str(catalogue_file), "--temperature", "0.7"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --catalogue: " in err[0] and "--temperature must be 0" in err[0]


@pytest.mark.parametrize("error, fragment", [
    (InvalidParameterError("catalogue", "{catalogue} is malformed: {problem}", problem="item 2 is empty"),
     "argument --catalogue: catalogue is malformed: item 2 is empty"),
])
def test_generate_engine_catalogue_errors_name_the_flag(recorded, catalogue_file, capsys, error, fragment):
    recorded["error"] = error
    with pytest.raises(SystemExit) as exc:
        main(["generate", "p", "--catalogue", str(catalogue_file)])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_generate_file_errors_name_the_flag(recorded, tmp_path, capsys):
    from widebeam.catalogue.trie import CatalogueError

    recorded["error"] = CatalogueError("catalogue file 'x.jsonl', line 3: not valid JSON")
    with pytest.raises(SystemExit):
        main(["generate", "p", "--catalogue", "x.jsonl"])
    assert ("error: argument --catalogue: catalogue file 'x.jsonl', line 3: not valid JSON"
            in capsys.readouterr().err)


# -- serve ------------------------------------------------------------------------------------------
def test_serve_catalogues_reach_the_engine(recorded, catalogue_file, tmp_path, capsys):
    other = tmp_path / "other.npy"
    np.save(other, np.array([[3, 4], [5, -1]]))
    rc = main(["serve", "--port", "0", "--catalogue", f"items={catalogue_file}", "--catalogue", f"b={other}"])
    assert rc == 2 and "stopped before loading" in capsys.readouterr().err
    assert recorded["catalogues"] == {"items": str(catalogue_file), "b": str(other)}


def test_serve_without_catalogues_passes_none(recorded, capsys):
    main(["serve", "--port", "0"])
    assert "catalogues" not in recorded


@pytest.mark.parametrize("value, fragment", [
    ("items.jsonl", "expected NAME=PATH"), ("=x.jsonl", "expected NAME=PATH"), ("a=", "expected NAME=PATH"),
    ("a=/no/such/file.jsonl", "'/no/such/file.jsonl' is not a file"),
])
def test_serve_bad_catalogue_spec_is_one_line_exit_2(value, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--catalogue", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --catalogue: " in err[0] and fragment in err[0]


def test_serve_duplicate_catalogue_name(recorded, catalogue_file, capsys):
    rc = main(["serve", "--catalogue", f"a={catalogue_file}", "--catalogue", f"a={catalogue_file}"])
    assert rc == 2
    assert "argument --catalogue: catalogue name 'a' is given twice" in capsys.readouterr().err
    assert "model" not in recorded  # refused before loading anything


def test_serve_engine_catalogue_error_names_the_flag(recorded, catalogue_file, capsys):
    from widebeam.catalogue.trie import CatalogueError

    recorded["error"] = CatalogueError("catalogue file 'c.npy': expected integer token ids, "
                                       "got dtype float64")
    rc = main(["serve", "--catalogue", f"a={catalogue_file}"])
    assert rc == 2
    assert "widebeam serve: error: argument --catalogue: catalogue file 'c.npy'" in capsys.readouterr().err


# -- plan -------------------------------------------------------------------------------------------
def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--model", "smollm2-135m-instruct", "--memory", "1GiB", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_catalogue_bytes_come_off_the_memory_before_the_kv_share(capsys):
    plain = plan_json(capsys)
    result = plan_json(capsys, "--catalogue-items", "1000000", "--catalogue-item-tokens", "4")
    nodes = 1_000_000 * 4 + 1
    assert result["catalogue"] == {"bytes": 33 * nodes, "num_items": 1_000_000, "num_nodes": nodes,
                                   "max_item_tokens": 4, "exact": False, "upper_bound": True}
    left = 2**30 - result["weight_bytes"] - result["activation_reserve_bytes"] - 33 * nodes
    assert result["kv_cache_bytes"] == int(left * 0.9) < plain["kv_cache_bytes"]
    assert "catalogue" not in plain
    # the engine's default length with a catalogue: the longest item and its end-of-sequence token
    assert result["request"]["max_new_tokens"] == 5 and plain["request"]["max_new_tokens"] == 128


def test_plan_catalogue_bytes_given(capsys):
    result = plan_json(capsys, "--catalogue-bytes", "100MiB", "--max-new-tokens", "9")
    assert result["catalogue"]["bytes"] == 100 * 2**20 and result["catalogue"]["upper_bound"] is False
    left = 2**30 - result["weight_bytes"] - result["activation_reserve_bytes"] - 100 * 2**20
    assert result["kv_cache_bytes"] == int(left * 0.9) and result["request"]["max_new_tokens"] == 9


def test_plan_catalogue_file_is_counted_exactly(capsys, catalogue_file, tmp_path):
    from widebeam.catalogue.trie import Catalogue

    expected = Catalogue.from_sequences(ITEMS, 49152)
    result = plan_json(capsys, "--catalogue", str(catalogue_file))
    assert result["catalogue"] == {"bytes": expected.nbytes, "num_items": 4, "num_nodes": expected.num_nodes,
                                   "max_item_tokens": 4, "exact": True, "upper_bound": False}
    # NAME=PATH as serve takes it, and several files add up
    array = tmp_path / "more.npy"
    np.save(array, np.array([[5, 6, 7, 8, 9, 10]]))
    both = plan_json(capsys, "--catalogue", f"items={catalogue_file}", "--catalogue", str(array))
    assert both["catalogue"]["bytes"] == (expected.nbytes
                                          + Catalogue.from_sequences([[5, 6, 7, 8, 9, 10]], 11).nbytes)
    assert both["catalogue"]["num_items"] == 5 and both["request"]["max_new_tokens"] == 7


def test_plan_catalogue_table_row(capsys):
    assert main(["plan", "--memory", "2GiB", "--catalogue-items", "1000"]) == 0
    out = capsys.readouterr().out
    assert "- catalogue" in out and "<= 128.94 KiB (1,000 items x 4 tokens, <= 4,001 nodes)" in out


@pytest.mark.parametrize("args, flag, fragment", [
    (["--catalogue-item-tokens", "4"], "--catalogue-item-tokens", "give --catalogue-items"),
    (["--catalogue", "FILE", "--catalogue-bytes", "1MiB"], "--catalogue", "drop --catalogue-bytes"),
    (["--catalogue", "missing.jsonl"], "--catalogue", "does not exist"),
    (["--catalogue", "STRINGS"], "--catalogue", "plan reads token ids only"),
    (["--catalogue-items", "0"], "--catalogue-items", "must be >= 1"),
    (["--catalogue-bytes", "2GiB"], "--memory", "the catalogue 2147483648 bytes"),
])
def test_plan_bad_catalogue_input_is_one_line_exit_2(args, flag, fragment, catalogue_file, tmp_path, capsys):
    strings = tmp_path / "strings.jsonl"
    strings.write_text('"red shoes"\n')
    args = [str(catalogue_file) if a == "FILE" else str(strings) if a == "STRINGS" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--memory", "1GiB", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {flag}" in err[0] and fragment in err[0], err


def test_plan_with_a_catalogue_file_stays_torch_free(catalogue_file):
    code = ("import sys, contextlib, io; from widebeam.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['plan', '--catalogue', {str(catalogue_file)!r}, '--json'])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr
