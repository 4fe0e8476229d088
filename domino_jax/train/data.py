"""Self-distillation data (docs/algorithms.md §9.9): the target answers offline prompts.

    prompts = build_prompts(2000, seed=0)                 # chat / arithmetic / code, offline
    train_prompts, eval_prompts = split_prompts(prompts)  # held out by hash, never trained on
    examples = generate_dataset(target, target_params, tokenizer, train_prompts,
                                max_new_tokens=192, batch_size=256, temperature=0.0, seed=0)
    save_dataset("data.npz", examples); examples = load_dataset("data.npz")
    batch = batch_for_step(examples, step, batch_size=8, micro_batches=1, max_length=512)

An example is ``{"input_ids": int32 [n], "loss_mask": int32 [n]}``: the chat-templated
prompt followed by the target's own response (stop token included); ``loss_mask`` is 1 on
the response. Batches are a pure function of ``(seed, step)`` (epoch-wise permutations),
so a resumed run sees exactly the batches it would have seen.

CLI: ``python -m domino_jax.train.data --target DIR --out FILE --num-prompts N
--max-new-tokens M`` (also writes ``FILE.eval.jsonl`` with the held-out prompts).

At scale, data lives in a shards directory (:mod:`domino_jax.train.shards`: resumable,
appendable generation from a corpus); :func:`load_dataset` returns a lazy
:class:`~domino_jax.train.shard_store.ShardDataset` for one and :func:`filter_examples`
filters it from recorded lengths, so training streams it (nothing loaded whole).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import random
import time
from typing import Iterator, Sequence

import numpy as np

from domino_jax.console import add_verbose_flag, setup_logging
from domino_jax.text import encode_prompt as chat_ids  # noqa: F401 (public name)
from domino_jax.text import stop_token_ids as stop_ids_of  # noqa: F401
from domino_jax.train.shard_store import ShardDataset

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- prompts

_TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "vaccines",
    "machine learning", "the water cycle", "plate tectonics", "the stock market", "democracy",
    "climate change", "the immune system", "quantum computing", "the Roman Empire", "recycling",
    "sleep", "coffee", "the internet", "electric cars", "honey bees", "volcanoes", "jazz",
    "the moon landing", "inflation", "meditation", "rainforests", "blockchain", "DNA",
    "the printing press", "solar energy", "friendship", "time management", "the ocean tides",
    "gravity", "chess", "the human heart", "languages", "museums", "public libraries",
    "renewable energy", "social media", "the Olympic Games", "bread baking", "mountains",
    "the Silk Road", "antibiotics", "rain", "autumn", "trains", "robots", "a small village",
    "a lighthouse", "winter mornings", "a lost cat", "the desert", "city traffic", "gardening",
    "learning to swim", "a thunderstorm", "the first day of school", "a birthday party",
]
_CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "Write a short poem about {t}.",
    "Summarise the key ideas of {t} in three sentences.", "List five facts about {t}.",
    "Write a haiku about {t}.", "Give me three tips related to {t}.",
    "What are the pros and cons of {t}?", "Describe {t} to a ten-year-old.",
    "Write a short story that involves {t}.", "Why is {t} important?",
    "Write a tweet about {t}.", "Compare {t} and {u}.", "How are {t} and {u} related?",
    "Write a limerick about {t}.", "Give a one-paragraph history of {t}.",
    "What questions would a student ask about {t}? List four.",
    "Write an email to a friend about {t}.", "Explain a common misconception about {t}.",
    "Write a product description inspired by {t}.", "Create a short quiz about {t}.",
]
_NAMES = ["Alice", "Bob", "Maria", "Ken", "Priya", "Omar", "Lena", "Tom", "Sara", "Yuki"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards"]


def chat_prompts(rng: random.Random) -> list[str]:
    """All chat/writing prompts from the templates (one or two topics each)."""
    out = []
    for template in _CHAT_TEMPLATES:
        for t in _TOPICS:
            u = _TOPICS[(_TOPICS.index(t) * 7 + 3) % len(_TOPICS)]
            out.append(template.format(t=t, u=u))
    rng.shuffle(out)
    return out


def math_prompt(rng: random.Random) -> str:
    """A GSM8K-style multi-step arithmetic word problem."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c, d = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9), rng.randint(1, 20)
    kind = rng.randrange(4)
    if kind == 0:
        q = (f"{name} has {a} {item}. {other} gives {name} {b} more, then {name} gives away "
             f"{d}. How many {item} does {name} have now?")
    elif kind == 1:
        q = (f"{name} buys {c} packs of {item} with {b} in each pack and shares them equally "
             f"among {c + 1} friends including {name}self. How many does each get, and how "
             "many are left over?")
    elif kind == 2:
        q = (f"A shop sells {item} for ${c} each. {name} buys {a} and pays with a ${a * c + d}"
             f" bill. How much change does {name} get?")
    else:
        q = (f"{name} reads {b} pages a day for {c} days, then {d} pages a day for {c + 2} "
             f"days. How many pages has {name} read in total?")
    return q + " Solve it step by step."


_CODE_MODULES = ["textwrap", "json.encoder", "string", "heapq", "bisect", "functools",
                 "statistics", "colorsys", "fnmatch", "shlex", "calendar", "difflib",
                 "base64", "html", "ipaddress", "fractions", "csv", "glob", "posixpath",
                 "random", "copy", "pprint", "urllib.parse", "gettext", "quopri", "uu",
                 "contextlib", "dataclasses", "enum", "operator", "keyword", "locale"]
_CODE_TEMPLATES = ["Explain this function:\n\n```python\n{src}```",
                   "What does this Python code do? Describe it briefly.\n\n```python\n{src}```",
                   "Suggest improvements to this function:\n\n```python\n{src}```",
                   "Write a docstring for this function:\n\n```python\n{src}```"]


def code_prompts(rng: random.Random, max_lines: int = 30) -> list[str]:
    """Prompts over short function bodies from Python's own stdlib source."""
    import importlib

    sources = []
    for name in _CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (module missing on this Python)
            continue
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            if getattr(fn, "__module__", None) != module.__name__:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 3 <= src.count("\n") <= max_lines:
                sources.append(src)
    out = [rng.choice(_CODE_TEMPLATES).format(src=s) for s in sorted(set(sources))]
    rng.shuffle(out)
    return out


def build_prompts(num: int, seed: int = 0) -> list[str]:
    """``num`` distinct prompts: ~50% chat/writing, ~25% arithmetic, ~25% code (code and
    chat cycle through their pools; arithmetic problems are generated fresh)."""
    rng = random.Random(seed)
    chat, code = chat_prompts(rng), code_prompts(rng)
    out, seen = [], set()
    i = attempts = 0
    while len(out) < num and attempts < 20 * num + 100:
        attempts += 1
        r = i % 4
        if r in (0, 2) and chat:
            p = chat[(i // 2) % len(chat)]
        elif r == 1 or not code:
            p = math_prompt(rng)
        else:
            p = code[(i // 4) % len(code)]
        i += 1
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def is_eval_prompt(prompt: str, eval_fraction: float = 0.05) -> bool:
    """Deterministic held-out split: sha256 of the prompt text below ``eval_fraction``."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2.0 ** 64 < eval_fraction


def split_prompts(prompts: Sequence[str], eval_fraction: float = 0.05
                  ) -> tuple[list[str], list[str]]:
    """``(train, eval)`` by :func:`is_eval_prompt` (training never sees an eval prompt)."""
    train = [p for p in prompts if not is_eval_prompt(p, eval_fraction)]
    held = [p for p in prompts if is_eval_prompt(p, eval_fraction)]
    return train, held


# ----------------------------------------------------------------------------- generation

def generate_dataset(target, target_params, tokenizer, prompts: Sequence[str],
                     max_new_tokens: int, batch_size: int, temperature: float = 0.0,
                     seed: int = 0, max_prompt_len: int = 256,
                     stop_token_ids: Sequence[int] | None = None) -> list[dict]:
    """The target's own responses to ``prompts``, in memory, in prompt order (prompts of
    more than ``max_prompt_len`` tokens are skipped). Batched like the shards generator
    (:func:`domino_jax.train.shards.plan_batches`: fixed ``[batch_size, width]`` programs,
    one per prompt-length bucket). ``tokenizer`` may also be a callable ``prompt -> ids``.
    For large runs use ``python -m domino_jax.train.shards generate`` (resumable, on disk).
    """
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, prompt_bucket
    from domino_jax.train.shards import plan_batches, run_batch

    encode = tokenizer if callable(tokenizer) and not hasattr(tokenizer, "apply_chat_template") \
        else (lambda p: chat_ids(tokenizer, p))
    if stop_token_ids is None:
        stop_token_ids = stop_ids_of(tokenizer, target.config)
    encoded = [encode(p) for p in prompts]
    encoded = [ids for ids in encoded if 0 < len(ids) <= max_prompt_len]
    if not encoded:
        raise ValueError(f"no prompt of at most {max_prompt_len} tokens to generate from")
    top = prompt_bucket(max_prompt_len)
    widths = sorted({min(w, top) for w in (64, 128, 256)} | {top})
    batches, _ = plan_batches([len(ids) for ids in encoded], widths, batch_size)
    config = DecodeConfig(method="ar", max_new_tokens=max_new_tokens,
                          sampling=SamplingConfig(temperature=temperature),
                          stop_token_ids=tuple(stop_token_ids))
    responses: dict[int, list[int]] = {}
    t0, new_tokens = time.perf_counter(), 0
    for b, (width, chunk) in enumerate(batches):
        out, _ = run_batch(target, target_params, [encoded[p] for p in chunk], width,
                           batch_size, config, seed + b)
        responses.update(zip(chunk, out))
        new_tokens += sum(len(r) for r in out)
        log.info("generated batch %d/%d: %.0f new tokens/s", b + 1, len(batches),
                 new_tokens / max(time.perf_counter() - t0, 1e-9))
    return [{"input_ids": np.asarray(ids + responses[p], np.int32),
             "loss_mask": np.asarray([0] * len(ids) + [1] * len(responses[p]), np.int32)}
            for p, ids in enumerate(encoded) if responses[p]]


# ----------------------------------------------------------------------------- storage

def save_dataset(path: str, examples: Sequence[dict]) -> None:
    """``.jsonl`` (one ``{"input_ids", "loss_mask"}`` per line) or ``.npz`` (flat arrays
    ``input_ids``, ``loss_mask`` + ``offsets``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            for ex in examples:
                f.write(json.dumps({k: np.asarray(ex[k]).tolist()
                                    for k in ("input_ids", "loss_mask")}) + "\n")
        return
    lengths = [len(ex["input_ids"]) for ex in examples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cat = lambda k: (np.concatenate([np.asarray(ex[k], np.int32) for ex in examples])
                     if examples else np.zeros((0,), np.int32))
    np.savez(path, input_ids=cat("input_ids"), loss_mask=cat("loss_mask"), offsets=offsets)


def load_dataset(path: str, kinds: Sequence[str] | None = None,
                 modes: Sequence[str] | None = None):
    """The examples in ``path``: a shards directory gives a lazy :class:`ShardDataset`
    (optionally only some ``kinds`` / ``modes``); a ``.jsonl`` / ``.npz`` file gives a list
    of examples in memory."""
    if os.path.isdir(path):
        return ShardDataset(path, kinds=kinds, modes=modes)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training data {path!r} not found (build it with "
                                "`python -m domino_jax.train.shards generate --out DIR ...` "
                                "or `python -m domino_jax.train.data --out FILE ...`)")
    if kinds is not None or modes is not None:
        raise ValueError(f"{path}: selecting kinds/modes needs a shards directory (.npz and "
                         ".jsonl data carry no labels)")
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [{k: np.asarray(v, np.int32) for k, v in json.loads(line).items()}
                    for line in f if line.strip()]
    with np.load(path) as z:
        ids, mask, off = z["input_ids"], z["loss_mask"], z["offsets"]
    return [{"input_ids": ids[a:b], "loss_mask": mask[a:b]} for a, b in zip(off[:-1], off[1:])]


def filter_examples(examples: Sequence[dict], min_loss_tokens: int, max_length: int
                    ) -> Sequence[dict]:
    """Drop examples with fewer than ``min_loss_tokens`` response tokens inside
    ``max_length`` (SpecForge drops samples with fewer than ``2 * block_size``). A
    :class:`ShardDataset` is filtered from its recorded lengths (a view; no token reads)."""
    if isinstance(examples, ShardDataset):
        return examples.filter(min_loss_tokens, max_length)
    return [ex for ex in examples if int(np.sum(ex["loss_mask"][:max_length])) >= min_loss_tokens]


# ----------------------------------------------------------------------------- batches

def batch_for_step(examples: Sequence[dict], step: int, batch_size: int, micro_batches: int,
                   max_length: int, seed: int = 0, pad_id: int = 0,
                   rows: tuple[int, int] | None = None) -> dict:
    """The batch of optimizer step ``step`` (0-based): ``{"input_ids", "loss_mask"}`` int32
    ``[micro_batches, batch_size // micro_batches, max_length]`` (right-padded with
    ``pad_id`` / mask 0, truncated at ``max_length``). Sample ``i = step * batch_size + r``
    is example ``perm_e[i % n]`` with ``e = i // n`` and ``perm_e`` a permutation seeded by
    ``(seed, e)``; row ``r`` of the flat batch is row ``r % (batch_size // micro_batches)``
    of micro-batch ``r // (batch_size // micro_batches)``.

    ``rows = (start, stop)``: only those rows of every micro-batch (shape ``[micro_batches,
    stop - start, max_length]``, the same values as that slice of the whole batch; only
    their examples are read): one process's part of a multi-process global batch."""
    n = len(examples)
    if n == 0:
        raise ValueError("no training examples")
    per_micro = batch_size // micro_batches
    start, stop = (0, per_micro) if rows is None else rows
    flat = [m * per_micro + j for m in range(micro_batches) for j in range(start, stop)]
    ids = np.full((len(flat), max_length), pad_id, np.int32)
    mask = np.zeros((len(flat), max_length), np.int32)
    perms: dict[int, np.ndarray] = {}
    for out, r in enumerate(flat):
        i = step * batch_size + r
        epoch = i // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        ex = examples[int(perms[epoch][i % n])]
        length = min(len(ex["input_ids"]), max_length)
        ids[out, :length] = ex["input_ids"][:length]
        mask[out, :length] = ex["loss_mask"][:length]
    shape = (micro_batches, stop - start, max_length)
    return {"input_ids": ids.reshape(shape), "loss_mask": mask.reshape(shape)}


def batches(examples: Sequence[dict], batch_size: int, micro_batches: int, max_length: int,
            seed: int = 0, start_step: int = 0, num_steps: int | None = None
            ) -> Iterator[dict]:
    """:func:`batch_for_step` for ``start_step, start_step + 1, ...`` (epochs wrap)."""
    step = start_step
    while num_steps is None or step < start_step + num_steps:
        yield batch_for_step(examples, step, batch_size, micro_batches, max_length, seed)
        step += 1


# ----------------------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m domino_jax.train.data",
                                     description="Build self-distillation data from a target.")
    parser.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    parser.add_argument("--out", required=True, help="output .npz or .jsonl")
    parser.add_argument("--num-prompts", type=int, default=2000,
                        help="training prompts (held-out eval prompts come on top)")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose, fmt="%(asctime)s %(message)s")

    import jax.numpy as jnp

    from converters.hf_target import load_target
    from domino_jax.text import load_tokenizer
    from domino_jax.models.qwen3 import TargetLM

    target_dir = args.target
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    dtype = jnp.dtype(args.dtype)
    config, params = load_target(target_dir, dtype)
    target = TargetLM(config, dtype=dtype, param_dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    pool = build_prompts(int(args.num_prompts / (1 - args.eval_fraction) * 1.05) + 8, args.seed)
    train, held = split_prompts(pool, args.eval_fraction)
    train = train[:args.num_prompts]
    t0 = time.perf_counter()
    examples = generate_dataset(target, params, tokenizer, train, args.max_new_tokens,
                                args.batch_size, args.temperature, args.seed, args.max_prompt_len)
    seconds = time.perf_counter() - t0
    save_dataset(args.out, examples)
    with open(args.out + ".eval.jsonl", "w") as f:
        for p in held:
            f.write(json.dumps({"prompt": p}) + "\n")
    new = int(sum(int(ex["loss_mask"].sum()) for ex in examples))
    summary = {"examples": len(examples), "response_tokens": new, "seconds": round(seconds, 2),
               "tokens_per_second": round(new / max(seconds, 1e-9), 1),
               "eval_prompts": len(held), "out": args.out}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
