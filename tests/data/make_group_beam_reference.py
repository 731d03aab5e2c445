"""Make tests/data/group_beam_reference.json: transformers 4.46's group (diverse) beam search
(`_group_beam_search`: `num_beam_groups`, `diversity_penalty`, Hamming diversity) on a tiny random
Llama, the reference widebeam's `num_beam_groups` is tested against (tests/parity/test_group_beam.py).

transformers 5 moved group beam search out of its core, so this script installs transformers 4.46.3
into a throwaway virtual environment and runs itself there:

    python tests/data/make_group_beam_reference.py            # creates /tmp/tf446 when missing

The model's weights come from a seeded generator over the state dict's names and shapes
(`tiny_state_dict`), not from transformers' initialisation, so the test rebuilds the same model with
whatever transformers it has. Outputs: every case's generated tokens (prompt excluded, padding
stripped) and `sequences_scores`. Generation pads with the EOS id (transformers' fallback for a
model without a pad token, and what widebeam does: a done group's padding counts as EOS in later
groups' diversity penalties).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VENV = Path("/tmp/tf446")
PINS = ("torch==2.13.0", "transformers==4.46.3")
OUT = Path(__file__).with_name("group_beam_reference.json")
EOS, PAD = 2, 0
CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": PAD,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SEED = 1234
PROMPTS = [[5, 17, 33, 9, 100, 3, 8], [7, 7, 9, 7, 7, 9], [11, 12]]
# (num_beams, num_beam_groups, diversity_penalty, length_penalty, early_stopping)
CASES = [
    (4, 2, 0.5, 1.0, False), (4, 4, 1.0, 1.0, False), (4, 2, 2.0, -1.0, True),
    (8, 2, 1.0, 1.0, False), (8, 4, 0.5, 0.0, "never"), (8, 8, 1.5, 1.0, False), (8, 4, 3.0, 2.0, True),
    (30, 2, 1.0, 1.0, False), (30, 30, 0.7, 1.0, False), (30, 2, 0.3, -1.0, "never"),
]
MAX_NEW_TOKENS = 8


def tiny_state_dict(shapes: dict[str, tuple[int, ...]]):
    """Weights for every name in `shapes`: norms 1 + U(-0.5, 0.5), the rest N(0, 0.2), drawn in sorted
    name order from one seeded generator (the same in any transformers version)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    weights = {}
    for name in sorted(shapes):
        if "norm" in name:
            weights[name] = 1.0 + torch.rand(shapes[name], generator=generator) - 0.5
        else:
            weights[name] = torch.randn(shapes[name], generator=generator) * 0.2
    return weights


def build_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIG)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if "rotary" not in name}
    model.load_state_dict(tiny_state_dict(shapes), strict=False)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3.0  # EOS often near the top: hypotheses finish early too
    return model


def generate() -> dict:
    import torch
    import transformers

    model = build_model()
    cases = []
    for num_beams, groups, diversity, length_penalty, early_stopping in CASES:
        for prompt in PROMPTS:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), num_beams=num_beams, num_beam_groups=groups,
                                     diversity_penalty=diversity, do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS,
                                     length_penalty=length_penalty, early_stopping=early_stopping,
                                     num_return_sequences=num_beams, eos_token_id=EOS, pad_token_id=EOS,
                                     output_scores=True, return_dict_in_generate=True)
            sequences = []
            for row in out.sequences[:, len(prompt):].tolist():
                if EOS in row:
                    row = row[:row.index(EOS) + 1]
                sequences.append(row)
            cases.append({"prompt": prompt, "num_beams": num_beams, "num_beam_groups": groups,
                          "diversity_penalty": diversity, "length_penalty": length_penalty,
                          "early_stopping": early_stopping, "max_new_tokens": MAX_NEW_TOKENS,
                          "sequences": sequences, "scores": out.sequences_scores.tolist()})
    return {"transformers": transformers.__version__, "torch": torch.__version__, "config": CONFIG,
            "seed": SEED, "eos_lm_head_scale": 3.0, "cases": cases}


def ensure_venv() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    check = subprocess.run([str(python), "-c", "import torch, transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, check=False)
    if check.returncode != 0 or check.stdout.strip() != "4.46.3":
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inside", action="store_true", help="(internal) run in the transformers 4.46 venv")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not args.inside:
        python = ensure_venv()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([str(python), __file__, "--inside", "--out", str(args.out)], check=True, env=env)
        return
    result = generate()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {len(result['cases'])} cases to {args.out} (transformers {result['transformers']})")


if __name__ == "__main__":
    main()
