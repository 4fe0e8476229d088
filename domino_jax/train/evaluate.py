"""Acceptance length tau on held-out prompts, with the real decode loop, during training.

    prompts = read_eval_prompts("corpus/heldout.jsonl", num_per_kind=8)   # kind -> [text]
    ids = encode_prompts(prompts, encode)                                 # kind -> [[int]]
    evaluator = HeldoutEvaluator(target, target_params, draft_config, ids,
                                 methods=("dflash", "domino"), max_new_tokens=32)
    evaluator(draft_params)       # {"dflash": {"chat": 1.9, ..., "all": 2.1}, "domino": ...}

tau (tokens committed per target forward: accepted drafts + the bonus) is measured with
:func:`domino_jax.decode.speculative.generate`, greedy (T = 0) unless the method name ends in
``":T<temperature>"`` (``"domino:T1"``: target and drafts sampled at T = 1, the references'
sample-and-compare verification, a fixed seed per evaluation), the drafter built from the
current params exactly as :func:`domino_jax.decode.loading.load_pair` builds it from a
checkpoint (fused decode layout, the Domino head's decode leaves). ``"ngram"`` (opt-in) is
the prompt lookup at the CLI's defaults: no drafter, so it is evaluated once and repeated,
the floor line of the curve. ``"dflash"`` on a Domino
drafter drafts the argmax of the same checkpoint's base logits (as
``benchmarks/tau_smollm2.py`` does); ``"ddtree"`` / ``"dominotree"`` (optionally
``"ddtree@32"`` for a budget) run the tree methods.

Cheap by construction: a few prompts per kind, a small ``max_new_tokens``, all prompts in
few fixed-shape batches (sorted by length, the last batch filled with copies of its first
prompt whose rows are ignored). The target is put in the decode layout once per evaluator;
the decode programs are compiled on the first evaluation and reused by every later one
(``speculative``'s program cache is keyed by shapes, which do not change between evals).

Per kind, tau pools the rows of that kind (sum of tokens committed / rounds); ``"all"``
pools every row. Prompts in a JSONL file are ``{"prompt": str, "kind": str, ...}`` records
(the corpus's ``heldout.jsonl``); a file of plain ``{"prompt"}`` lines is one kind, ``"all"``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.config import DraftConfig

log = logging.getLogger(__name__)

CHAIN_METHODS = ("dflash", "domino")
TREE_METHODS = ("ddtree", "dominotree")
LOOKUP_METHODS = ("ngram",)      # prompt lookup: no drafter, the floor a drafter must beat
ALL = "all"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation settings of a training run (not part of the jitted step).

    ``every``: evaluate every that many steps (0: only at the start and the end);
    ``num_prompts``: prompts per kind (the first ones of each kind in file order);
    ``methods``: ``None`` = what the drafter supports (``dflash`` [+ ``domino``]);
    ``batch_size``: rows per decode batch (``None``: all prompts in one batch, at most 64);
    prompts longer than ``max_prompt_tokens`` tokens are skipped; ``at_start``: evaluate the
    starting drafter too (step 0), ``start_in_background``: on a thread beside the first
    training steps (training does not wait for it, and the evaluation's decode programs are
    compiled by the time the next evaluation comes; docs/design.md §29).
    """

    prompts: str | None = None
    every: int = 0
    max_new_tokens: int = 32
    num_prompts: int = 8
    methods: tuple[str, ...] | None = None
    batch_size: int | None = None
    max_prompt_tokens: int = 512
    at_start: bool = True
    start_in_background: bool = False

    def __post_init__(self):
        if self.every < 0 or self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError(f"eval settings out of range: every={self.every} (>= 0), "
                             f"max_new_tokens={self.max_new_tokens} (>= 1), "
                             f"num_prompts={self.num_prompts} (>= 1)")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"eval batch_size must be >= 1, got {self.batch_size}")
        for m in self.methods or ():
            parse_method(m)


def split_temperature(name: str) -> tuple[str, float]:
    """``"domino:T1"`` -> ``("domino", 1.0)``; a name without ``":T"`` -> ``(name, 0.0)``."""
    base, sep, temp = name.partition(":T")
    if not sep:
        return name, 0.0
    try:
        value = float(temp)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"eval method {name!r}: ':T<temperature>' needs a finite temperature "
                         "> 0 (e.g. 'domino:T1')")
    return base, value


def parse_method(name: str) -> tuple[str, dict]:
    """``"domino"`` -> ``("domino", {})``; ``"ddtree@32"`` -> ``("ddtree", {"budget": 32})``;
    a ``":T<temperature>"`` suffix (:func:`split_temperature`) is checked and left out."""
    name, _ = split_temperature(name)
    method, _, budget = name.partition("@")
    known = LOOKUP_METHODS + CHAIN_METHODS + TREE_METHODS
    if method not in known:
        raise ValueError(f"unknown eval method {name!r}; choose from "
                         f"{', '.join(known)} (trees: 'ddtree@BUDGET'; sampled: 'domino:T1')")
    if budget:
        if method not in TREE_METHODS or not budget.isdigit() or int(budget) < 1:
            raise ValueError(f"eval method {name!r}: '@BUDGET' (a positive integer) is for "
                             f"{' / '.join(TREE_METHODS)} only")
        return method, {"budget": int(budget)}
    return method, {}


def default_methods(draft_config: DraftConfig) -> tuple[str, ...]:
    return CHAIN_METHODS if draft_config.has_domino_head else ("dflash",)


def check_methods(methods: Sequence[str], draft_config: DraftConfig) -> None:
    for name in methods:
        method, _ = parse_method(name)
        if method in ("domino", "dominotree") and not draft_config.has_domino_head:
            raise ValueError(f"eval method {name!r} needs a Domino drafter (this one is "
                             "DFlash); use dflash or ddtree")


# ----------------------------------------------------------------------------- prompts

def read_eval_prompts(path: str, num_per_kind: int | None = None) -> dict[str, list[str]]:
    """``kind -> [prompt text]`` from a JSONL file, the first ``num_per_kind`` of each kind
    in file order (kinds sorted). Lines without ``"kind"`` count as kind ``"all"``; a file
    may not mix them with kinds."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"eval prompts {path!r} not found (a JSONL file of "
                                '{"prompt": ..., "kind": ...} records, e.g. heldout.jsonl)')
    by_kind: dict[str, list[str]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from e
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f'{path}:{number}: expected an object with a "prompt" string')
            kind = record.get("kind", ALL)
            if not isinstance(kind, str) or not kind:
                raise ValueError(f'{path}:{number}: "kind" must be a non-empty string')
            texts = by_kind.setdefault(kind, [])
            if num_per_kind is None or len(texts) < num_per_kind:
                texts.append(record["prompt"])
    if not by_kind:
        raise ValueError(f"{path}: no prompts")
    if ALL in by_kind and len(by_kind) > 1:
        raise ValueError(f'{path}: some lines have no "kind" (counted as {ALL!r}) and others '
                         f"do ({sorted(set(by_kind) - {ALL})}); give every line a kind")
    return {k: by_kind[k] for k in sorted(by_kind)}


def encode_prompts(prompts_by_kind: Mapping[str, Sequence[str]], encode: Callable,
                   max_prompt_tokens: int = 512) -> dict[str, list[list[int]]]:
    """Token ids per kind (``encode(text) -> ids``, e.g. the chat template); prompts longer
    than ``max_prompt_tokens`` are skipped (logged); kinds left empty are dropped."""
    out, skipped = {}, 0
    for kind, texts in prompts_by_kind.items():
        ids = [list(map(int, encode(t))) for t in texts]
        kept = [x for x in ids if 0 < len(x) <= max_prompt_tokens]
        skipped += len(ids) - len(kept)
        if kept:
            out[kind] = kept
    if skipped:
        log.warning("eval: skipped %d prompts longer than %d tokens", skipped, max_prompt_tokens)
    if not out:
        raise ValueError(f"no eval prompt of at most {max_prompt_tokens} tokens")
    return out


# ----------------------------------------------------------------------------- tau

def pooled_tau(accept_hist: np.ndarray) -> float:
    """tau of rows pooled: ``accept_hist [rows, W + 1]`` (index n = rounds committing n)."""
    hist = np.asarray(accept_hist).sum(0)
    return float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1))


class HeldoutEvaluator:
    """tau per method per kind for draft params of one fixed geometry (see module doc).

    ``target`` / ``target_params``: the frozen target as trained against (checkpoint
    layout, any dtype; evaluation runs in ``target.dtype``). ``draft_config``: the trained
    drafter's config (checkpoint layout). ``prompts_by_kind``: ``kind -> [token ids]``.
    ``draft_vocab``: the block methods draft over these token ids only (sorted int32; the
    decode option ``draft_vocab``, docs/design.md §32); ``None``: the whole vocabulary.
    """

    def __init__(self, target, target_params, draft_config: DraftConfig,
                 prompts_by_kind: Mapping[str, Sequence[Sequence[int]]],
                 methods: Sequence[str] | None = None, max_new_tokens: int = 32,
                 batch_size: int | None = None, stop_token_ids: Sequence[int] = (),
                 fused: bool = True, draft_vocab: np.ndarray | None = None):
        from domino_jax.models.fused_layout import fuse_model
        from domino_jax.models.qwen3 import TargetLM

        self.methods = tuple(methods or default_methods(draft_config))
        check_methods(self.methods, draft_config)
        if not prompts_by_kind or not any(prompts_by_kind.values()):
            raise ValueError("no eval prompts")
        self.draft_config, self.fused = draft_config, fused
        self.draft_vocab = draft_vocab
        self.max_new_tokens, self.stop_token_ids = max_new_tokens, tuple(stop_token_ids)
        config, params = target.config, target_params
        if fused and not config.fused_projections:
            config, params = fuse_model(config, params)
        # one dtype object (np.dtype): the decode program cache hashes the modules, and
        # hash(jnp.float32) != hash(np.dtype("float32")) although they compare equal
        dtype = jnp.dtype(target.dtype)
        self.target = TargetLM(config, dtype=dtype, param_dtype=dtype,
                               attention_impl=target.attention_impl)
        self.target_params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
        rows = [(kind, list(ids)) for kind, group in prompts_by_kind.items() for ids in group]
        rows.sort(key=lambda r: len(r[1]))                  # similar lengths batch together
        self.kinds = [k for k, _ in rows]
        self.prompts = [p for _, p in rows]
        size = batch_size or min(len(rows), 64)
        self.batches = [self.prompts[i:i + size] for i in range(0, len(rows), size)]
        self.batch_size = size
        self._lookup_taus: dict[str, dict[str, float]] = {}   # ngram: the same every eval

    def _batches(self):
        for chunk in self.batches:                          # fixed [size, ...] batches
            yield chunk + [chunk[0]] * (self.batch_size - len(chunk)), len(chunk)

    def __call__(self, draft_params: Any) -> dict[str, dict[str, float]]:
        """``{method: {kind: tau, ..., "all": tau}}`` for ``draft_params`` (float32 masters
        or any dtype, checkpoint layout)."""
        from domino_jax.decode.loading import draft_decode_layout
        from domino_jax.decode.methods import make_drafter, method_options
        from domino_jax.decode.sampling import SamplingConfig
        from domino_jax.decode.speculative import DecodeConfig, generate

        dtype = self.target.dtype
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), draft_params)
        result: dict[str, dict[str, float]] = {}
        for name in self.methods:
            method, options = parse_method(name)
            if name in self._lookup_taus:
                result[name] = self._lookup_taus[name]
                continue
            if method in LOOKUP_METHODS:            # no drafter: the CLI's default lookup
                drafter, dparams = make_drafter(None, self.target, method), None
            else:
                config, dparams = draft_decode_layout(self.draft_config, params,
                                                      self.target_params, method, self.fused)
                if self.draft_vocab is not None:
                    from domino_jax.decode.loading import draft_vocab_params
                    options = dict(options, draft_vocab=len(self.draft_vocab))
                    dparams = dict(dparams, vocab=draft_vocab_params(
                        self.target.config, self.target_params, self.draft_vocab))
                drafter = make_drafter(config, self.target, method,
                                       method_options(method, **options))
            temperature = split_temperature(name)[1]
            decode = DecodeConfig(method=method, max_new_tokens=self.max_new_tokens,
                                  sampling=SamplingConfig(temperature=temperature),
                                  stop_token_ids=self.stop_token_ids)
            hists = []
            for i, (rows, real) in enumerate(self._batches()):
                out = generate(self.target, self.target_params, rows, decode, drafter, dparams,
                               seed=i)
                hists.append(np.asarray(out.accept_hist)[:real])
            hist = np.concatenate(hists)
            kinds = np.asarray(self.kinds)
            taus = {k: pooled_tau(hist[kinds == k]) for k in dict.fromkeys(self.kinds)}
            taus[ALL] = pooled_tau(hist)
            result[name] = taus
            if method in LOOKUP_METHODS:
                self._lookup_taus[name] = taus
        return result


def heldout_tau(target, target_params, draft_config: DraftConfig, draft_params,
                prompts_by_kind: Mapping[str, Sequence[Sequence[int]]],
                methods: Sequence[str] = CHAIN_METHODS, max_new_tokens: int = 32,
                batch_size: int | None = None, stop_token_ids: Sequence[int] = ()
                ) -> dict[str, dict[str, float]]:
    """One evaluation: ``{method: {kind: tau, "all": tau}}`` (see :class:`HeldoutEvaluator`;
    a loop evaluating repeatedly should keep one evaluator, which lays out the target once)."""
    return HeldoutEvaluator(target, target_params, draft_config, prompts_by_kind, methods,
                            max_new_tokens, batch_size, stop_token_ids)(draft_params)


def best_metric(taus: Mapping[str, Mapping[str, float]], draft_config: DraftConfig) -> float:
    """The number "best checkpoint" ranks by: pooled tau (``"all"``) of the drafter's own
    method (``domino`` for a Domino drafter, else ``dflash``) when evaluated, else of the
    first drafter method evaluated (the lookup, which training does not move, last)."""
    own = "domino" if draft_config.has_domino_head else "dflash"
    drafted = [m for m in taus if parse_method(m)[0] not in LOOKUP_METHODS]
    name = own if own in taus else (drafted or list(taus))[0]
    return float(taus[name][ALL])
