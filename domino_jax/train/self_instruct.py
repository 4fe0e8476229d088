"""Prompts written by the target itself (the corpus's optional ``--self-instruct N`` add-on).

The target is given only the *user-turn prefix* of its chat template (for SmolLM2: the
default system turn, then ``<|im_start|>user\\n``) and samples what a user would type, up to
the end of the user turn. The texts are filtered (:func:`is_plausible_request`) and
de-duplicated (exact and near-duplicate, as in the corpus), then labelled with a kind by a
few keywords (:func:`guess_kind`), source ``self_instruct``.

    prompts = self_instruct_prompts(target, params, tokenizer, 1000, seed=0)

As a command, requests kept as a corpus keeps training prompts against a held-out split
(``corpus.training_records``), e.g. the campaign's requests evaluation set
(``benchmarks/campaign/README.md``)::

    python -m domino_jax.train.self_instruct --out requests.jsonl --num 40 --keep 32 \
        --seed 1000000 --batch-size 64 --dtype float32 --against CORPUS/heldout.jsonl \
        [--kind request] [--target DIR]

Generation is batched AR decoding (:func:`domino_jax.decode.speculative.generate`, method
``"ar"``, temperature sampling): every row of a batch starts from the same prefix and
differs only by its random draws.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from typing import Sequence

from domino_jax.train.corpus_dedup import NearDuplicateIndex, normalise

log = logging.getLogger(__name__)

_SENTINEL = "\u2063USER-REQUEST\u2063"
_SPECIAL = re.compile(r"<\|[^|>]*\|>|<s>|</s>|\[INST\]|\[/INST\]")


def user_turn_prefix(tokenizer) -> tuple[str, str]:
    """``(prefix, suffix)``: the chat template's text before and after a user message.

    Raises ``ValueError`` if the tokenizer has no chat template that shows the message."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-instruct needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                         tokenize=False, add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not show the user message verbatim")
    prefix, _, suffix = text.partition(_SENTINEL)
    return prefix, suffix


def end_of_turn_ids(tokenizer, suffix: str) -> tuple[int, ...]:
    """Stop tokens: the first token of the template's text after a user message (e.g.
    ``<|im_end|>``) and the tokenizer's EOS."""
    ids = set()
    if suffix.strip():
        encoded = tokenizer.encode(suffix.strip(), add_special_tokens=False)
        if encoded:
            ids.add(int(encoded[0]))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def is_plausible_request(text: str, min_words: int = 4, max_words: int = 150) -> bool:
    """A user request worth keeping: ``min_words..max_words`` words, no chat-template
    markup, printable, mostly letters, not a loop of the same few words."""
    words = text.split()
    if not min_words <= len(words) <= max_words or _SPECIAL.search(text):
        return False
    if not all(c.isprintable() or c in "\n\t" for c in text):
        return False
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in visible) < 0.6 * len(visible):
        return False
    return len(words) < 8 or len({w.lower() for w in words}) >= 0.4 * len(words)


_CODE_WORDS = re.compile(r"\b(python|code|function|program|script|javascript|sql|bug|class|"
                         r"algorithm|compile|api|regex|html|css)\b", re.I)
_MATH_WORDS = re.compile(r"\b(solve|calculate|equation|how many|how much|percent|probability|"
                         r"sum of|average|integer|prove)\b|\d+\s*[-+*/^=]\s*\d+", re.I)
_SUMMARY_WORDS = re.compile(r"\b(summar\w*|tl;dr|key points|main idea)\b", re.I)
_CONTINUE_WORDS = re.compile(r"\b(continue|finish (this|the) (story|sentence|text))\b", re.I)


def guess_kind(text: str) -> str:
    """``code`` / ``math`` / ``summarize`` / ``continuation`` by keywords, else ``chat``."""
    for kind, pattern in (("summarize", _SUMMARY_WORDS), ("continuation", _CONTINUE_WORDS),
                          ("code", _CODE_WORDS), ("math", _MATH_WORDS)):
        if pattern.search(text):
            return kind
    return "chat"


def self_instruct_prompts(target, target_params, tokenizer, num: int, *, seed: int = 0,
                          batch_size: int = 256, max_new_tokens: int = 96,
                          temperature: float = 1.0, top_p: float = 0.95,
                          max_batches: int | None = None, require_stop: bool = True,
                          min_words: int = 4, max_words: int = 150,
                          near_threshold: float = 0.8) -> list[dict]:
    """Up to ``num`` distinct user requests written by the target:
    ``[{"kind", "source": "self_instruct", "prompt"}]``.

    Runs batches of ``batch_size`` rows (seed ``seed + batch``) until ``num`` prompts pass
    the filter or ``max_batches`` (default ``4 * ceil(num / batch_size) + 2``) are spent.
    ``require_stop``: keep only rows that ended their turn (a stop token) within
    ``max_new_tokens``; a truncated request is usually a broken one.
    """
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate

    if num < 1:
        return []
    prefix, suffix = user_turn_prefix(tokenizer)
    prefix_ids = [int(t) for t in tokenizer.encode(prefix, add_special_tokens=False)]
    if not prefix_ids:
        raise ValueError("the chat template's user-turn prefix encodes to no tokens")
    stop_ids = end_of_turn_ids(tokenizer, suffix)
    config = DecodeConfig(method="ar", max_new_tokens=max_new_tokens,
                          sampling=SamplingConfig(temperature=temperature, top_p=top_p),
                          stop_token_ids=stop_ids)
    vocab = len(tokenizer)
    max_batches = max_batches or 4 * math.ceil(num / batch_size) + 2
    index, seen, out = NearDuplicateIndex(threshold=near_threshold), set(), []
    for b in range(max_batches):
        result = generate(target, target_params, [prefix_ids] * batch_size, config, seed=seed + b)
        for row in result.tokens:
            stopped = bool(row) and row[-1] in stop_ids
            if require_stop and not stopped:
                continue
            body = [t for t in (row[:-1] if stopped else row) if 0 <= t < vocab]
            text = tokenizer.decode(body, skip_special_tokens=False).strip()
            key = normalise(text)
            if key in seen or not is_plausible_request(text, min_words, max_words):
                continue
            seen.add(key)
            if index.add(text) is not None:
                continue
            out.append({"kind": guess_kind(text), "source": "self_instruct", "prompt": text})
            if len(out) >= num:
                return out
        log.info("self-instruct batch %d: %d / %d prompts", b, len(out), num)
    return out


def self_instruct_from_dir(target_dir: str, num: int, *, seed: int = 0, batch_size: int = 256,
                           max_new_tokens: int = 96, dtype: str = "bfloat16",
                           **options) -> list[dict]:
    """:func:`self_instruct_prompts` for the HF target folder ``target_dir``."""
    import jax.numpy as jnp

    from converters.hf_target import load_target
    from domino_jax.decode.loading import load_tokenizer
    from domino_jax.models.qwen3 import TargetLM

    dt = jnp.dtype(dtype)
    config, params = load_target(target_dir, dt)
    target = TargetLM(config, dtype=dt, param_dtype=dt)
    return self_instruct_prompts(target, params, load_tokenizer(target_dir), num, seed=seed,
                                 batch_size=batch_size, max_new_tokens=max_new_tokens, **options)

def new_requests(target_dir: str | None, num: int, *, seed: int = 0,
                 against: Sequence[str] = (), exclude: Sequence[str] = (),
                 eval_fraction: float = 0.0, batch_size: int = 256, max_new_tokens: int = 96,
                 dtype: str = "bfloat16") -> tuple[list[dict], dict]:
    """Up to ``num`` requests the target (``target_dir``, default the demo SmolLM2) writes,
    kept as a corpus keeps training prompts (:func:`domino_jax.train.corpus.training_records`):
    not a repeat, near copy or 8-gram sharer of a prompt of the ``against`` .jsonl files
    (e.g. a held-out split), no 8-gram of an ``exclude`` file's text, none held out by the
    id rule at ``eval_fraction``. Returns the kept records (with their corpus ids) and a
    summary: requested, generated, kept, rejected (by reason) and kinds."""
    from domino_jax.train.corpus import training_records
    from domino_jax.train.corpus_dedup import iter_jsonl

    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    written = self_instruct_from_dir(target_dir, num, seed=seed, batch_size=batch_size,
                                     max_new_tokens=max_new_tokens, dtype=dtype)
    taken = [r for path in against for _, r in iter_jsonl(path)]
    kept, rejected = training_records(written, taken, eval_fraction=eval_fraction,
                                      exclude_files=[*against, *exclude])
    kinds: dict[str, int] = {}
    for r in kept:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return kept, {"requested": num, "generated": len(written), "kept": len(kept),
                  "rejected": rejected, "kinds": kinds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.self_instruct",
                                description="User requests written by the target, as .jsonl")
    p.add_argument("--out", required=True, help="the .jsonl to write")
    p.add_argument("--num", type=int, required=True, help="requests to have the target write")
    p.add_argument("--keep", type=int, default=None, help="the first KEEP of those kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--against", action="append", default=[], metavar="JSONL",
                   help="prompts the requests must not repeat or near-copy (e.g. a held-out "
                        "split); repeatable")
    p.add_argument("--kind", default=None,
                   help="every record's kind (the guessed one goes to guessed_kind)")
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    args = p.parse_args(argv)
    for path in args.against:
        if not os.path.isfile(path):
            p.error(f"--against {path!r}: no such file")
    kept, summary = new_requests(args.target, args.num, seed=args.seed, against=args.against,
                                 batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    kept = kept[:args.keep]
    with open(args.out, "w") as f:
        for r in kept:
            if args.kind:
                r = {"id": r["id"], "kind": args.kind, "source": r["source"],
                     "guessed_kind": r["kind"], "prompt": r["prompt"]}
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"out": args.out, "written": summary["generated"], "kept": len(kept),
                      "rejected": summary["rejected"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
