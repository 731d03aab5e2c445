"""What int8 weights cost in accuracy on the default model, against float32, in one process.

    python benchmarks/int8_accuracy.py            # old README text (benchmarks/data/), 8 prompts, W 4, 16

1. Top-1 agreement of next-token logits over a text: the float32 and the int8 model (PyTorch's
   dynamic int8 quantization, the kernels `dtype="int8"` uses: tests/parity/test_int8_parity.py
   shows widebeam's int8 equals transformers' int8) score every position of the same text, teacher
   forced; the share of positions whose argmax agrees, and the mean KL(float32 || int8).
2. Beam overlap: widebeam float32 and int8 engines run the same chat prompts at W=4 and 16; per
   prompt, the share of the W returned beams (token sequences) both return, and whether the best
   beam is the same.

Writes benchmarks/results/int8_accuracy.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from tables import machine_info, markdown_table, print_table

from widebeam.llm import LLM
from widebeam.model.linears.int8 import quantize_int8
from widebeam.params import BeamSearchParams

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).parent / "results"
PROMPTS = ["Name three colours.", "Write a haiku about the sea.", "What is the capital of France?",
           "Give me a tip for learning to cook.", "Describe a cat in one sentence.", "What is 12 times 7?",
           "Suggest a name for a bakery.", "Why is the sky blue?"]


def logits_agreement(source_path: Path, text_ids: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(str(source_path), dtype=torch.float32).eval()
    int8 = quantize_int8(copy.deepcopy(fp32), torch.device("cpu"))
    with torch.no_grad():
        ids = torch.tensor([text_ids])
        a = fp32(ids).logits[0].float()
        b = int8(ids).logits[0].float()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    return {"positions": len(text_ids), "top1_agreement": agree, "mean_kl": kl}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text-tokens", type=int, default=1024)
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "int8_accuracy.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {dtype: LLM(MODEL, device="cpu", dtype=dtype, kv_cache_memory="1GiB",
                          enable_prefix_caching=False)
               for dtype in ("float32", "int8")}
    tokenizer = engines["float32"].tokenizer
    # the README as it was when results/int8_accuracy.json was recorded (0747ad5): its text is the prompt
    text = (Path(__file__).parent / "data" / "int8_accuracy_text.md").read_text()
    agreement = logits_agreement(engines["float32"].engine.source.path,
                                 tokenizer.encode(text)[:args.text_tokens])
    print(f"top-1 agreement over {agreement['positions']} positions: {agreement['top1_agreement']:.3f}, "
          f"mean KL {agreement['mean_kl']:.4f}", flush=True)
    rows = []
    for width in args.widths:
        params = BeamSearchParams(beam_width=width, max_new_tokens=args.max_new_tokens)
        overlaps, same_best = [], 0
        for prompt in PROMPTS:
            chat = engines["float32"].engine.apply_chat_template(prompt)
            beams = {}
            for dtype, llm in engines.items():  # one request at a time: int8 activation scales are per call
                (out,) = llm.generate([chat], params, use_tqdm=False)
                beams[dtype] = [tuple(c.token_ids) for c in out.outputs]
            overlaps.append(len(set(beams["float32"]) & set(beams["int8"])) / width)
            same_best += beams["float32"][0] == beams["int8"][0]
        rows.append({"width": width, "prompts": len(PROMPTS),
                     "mean_beam_overlap": sum(overlaps) / len(overlaps), "same_best": same_best})
    headers = ["measure", "value"]
    positions = f"{agreement['top1_agreement']:.3f} over {agreement['positions']} positions"
    table = [["top-1 agreement (teacher forced)", positions],
             ["mean KL(float32 || int8)", f"{agreement['mean_kl']:.4f}"]]
    for r in rows:
        table.append([f"W={r['width']}: returned beams both return", f"{r['mean_beam_overlap']:.2f}"])
        table.append([f"W={r['width']}: same best beam", f"{r['same_best']} of {r['prompts']} prompts"])
    print_table("int8 vs float32", headers, table, "ll")
    report = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "model": MODEL, "logits": agreement, "beams": rows, "machine": machine_info(args.threads)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(f"int8 weights vs float32, {MODEL} (`{report['command']}`).\n\n"
                                           + markdown_table(headers, table, "ll") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
