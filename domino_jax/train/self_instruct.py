"""Prompts written by the target itself (the corpus's optional ``--self-instruct N`` add-on).

The target is given only the *user-turn prefix* of its chat template (for SmolLM2: the
default system turn, then ``<|im_start|>user\\n``) and samples what a user would type, up to
the end of the user turn. The texts are filtered (:func:`is_plausible_request`) and
de-duplicated (exact and near-duplicate, as in the corpus), then labelled with a kind by a
few keywords (:func:`guess_kind`), source ``self_instruct``.

    prompts = self_instruct_prompts(target, params, tokenizer, 1000, seed=0)

Kept as training prompts (and as a command): :mod:`domino_jax.train.user_requests`.

Generation is batched AR decoding (:func:`domino_jax.decode.speculative.generate`, method
``"ar"``, temperature sampling): every row of a batch starts from the same prefix and
differs only by its random draws.
"""

from __future__ import annotations

import logging
import math
import re

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
