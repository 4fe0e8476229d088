"""The offline prompt corpus for self-distillation.

    python -m domino_jax.train.corpus --out DIR --num-prompts 60000 --seed 0 \\
        [--eval-fraction 0.02] [--exclude FILE ...] [--self-instruct N --target DIR] \\
        [--extends EARLIER_DIR]

writes ``DIR/train.jsonl`` and ``DIR/heldout.jsonl`` (one record a line: ``{"id": 16 hex
digits = sha256 of the normalised prompt, "kind", "source", "prompt"}``) and ``DIR/card.json``
(counts per kind and source, seed, version, exclusion and deduplication statistics, build
time). ``--num-prompts`` is the total of both files (before any self-instruct prompts).

Kinds (:data:`KINDS`) and their default shares (:data:`DEFAULT_MIX`): ``math`` (procedural
reasoning and math, :mod:`corpus_math`), ``code`` (tasks over real stdlib functions and
composed programming requests, :mod:`corpus_code`), ``chat`` (templated chat / writing /
advice, a minority, :mod:`corpus_chat`), ``continuation`` and ``summarize`` (documentation
text installed with Python and domino_jax's dependencies, plus story openings and synthetic
documents, :mod:`corpus_text`). Everything is offline and a pure function of the seed, the
Python version and the installed versions of the documentation packages (all in the card).

Every candidate passes, in order: a length check, exact deduplication (same id), the
benchmark filter (fingerprints of public benchmark items and ``--exclude`` n-gram overlap)
and near-duplicate removal (shingle Jaccard >= ``--near-threshold``), all in
:mod:`corpus_dedup`. The held-out split is by hash: a prompt is held out iff its id, read as
a number in [0, 1), is below ``--eval-fraction``; the rule is the same for every kind and
depends on the prompt alone, so a prompt held out in one build is held out in every build.
Because near-duplicates are removed over the whole corpus before the split, no training
prompt is a near-duplicate of a held-out prompt.

``--extends EARLIER_DIR`` builds a follow-on corpus for later rounds of a training campaign:
only prompts that are neither exact nor near duplicates of the earlier corpus's, none sharing
an n-gram with its held-out split, and that split copied as this corpus's held-out file.
Repeat it to follow several builds (a third corpus avoids the first two); their held-out
files must be one.

Python API: :func:`build_corpus`, :func:`write_corpus`, :func:`read_corpus`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import random
import sys
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from domino_jax.console import add_verbose_flag, setup_logging
from domino_jax.train import corpus_chat, corpus_code, corpus_math, corpus_text
from domino_jax.train.corpus_dedup import (BenchmarkFilter, NearDuplicateIndex, iter_jsonl,
                                           normalise, normalised_id, words_of)

log = logging.getLogger(__name__)

CORPUS_VERSION = 1
KINDS = ("chat", "math", "code", "continuation", "summarize")
DEFAULT_MIX = {"math": 0.30, "code": 0.25, "chat": 0.18, "continuation": 0.14, "summarize": 0.13}
RECORD_KEYS = ("id", "kind", "source", "prompt")
MIN_CHARS, MAX_CHARS = 12, 2000
MAX_CONSECUTIVE_REJECTS = 400     # an endless generator that only repeats itself is spent


@dataclasses.dataclass(frozen=True)
class Source:
    """One stream of candidate prompts of a kind: ``make(rng)`` yields ``(source, prompt)``.

    ``weight`` is its share within the kind while it lasts; ``templated`` marks prompts
    composed from templates (reported as the card's ``templated_fraction``)."""

    name: str
    kind: str
    weight: float
    make: Callable[[random.Random], Iterator[tuple[str, str]]]
    templated: bool


def _forever(family) -> Callable[[random.Random], Iterator[tuple[str, str]]]:
    def make(rng):
        while True:
            yield f"gen.math.{family.__name__}", family(rng)
    return make


def default_sources(seed: int, doc_packages: Sequence[str] = corpus_text.DOC_PACKAGES,
                    text_dir: str | None = None) -> list[Source]:
    """The corpus's sources. Lazy: files are parsed only when a source needs them; the text
    pool is shared by the two text kinds (each document goes to one of them)."""
    pool = corpus_text.TextPool(seed, tuple(doc_packages), text_dir)
    package_roots = [(name, root) for name in doc_packages
                     if (root := corpus_text.package_root(name)) is not None]
    sources = [Source(f"gen.math.{fn.__name__}", "math", w, _forever(fn), False)
               for fn, w in corpus_math.MATH_FAMILIES]
    sources += [
        Source("stdlib.code", "code", 0.6, corpus_code.stdlib_code_prompts, False),
        Source("packages.code", "code", 0.25,
               lambda rng: corpus_code.package_code_prompts(rng, package_roots), False),
        Source("gen.code", "code", 0.15, corpus_code.generated_code_prompts, True),
        Source("template.chat", "chat", 1.0, corpus_chat.chat_prompts, True),
        Source("docs.continue", "continuation", 0.8,
               lambda rng: corpus_text.continuation_prompts(pool.documents("continuation"), rng), False),
        Source("gen.continue", "continuation", 0.2, corpus_text.story_prompts, True),
        Source("docs.summarize", "summarize", 0.45,
               lambda rng: corpus_text.summary_passages(pool.documents("summarize"), rng), False),
        Source("gen.summarize", "summarize", 0.55, corpus_text.synthetic_documents, True),
    ]
    return sources


class _KindStream:
    """Weighted interleaving of one kind's sources; a source dies at its end or after
    :data:`MAX_CONSECUTIVE_REJECTS` rejected candidates in a row."""

    def __init__(self, sources: list[Source], seed: int):
        self.rng = random.Random(f"{seed}:mix:{sources[0].kind}")
        self.sources = sources
        self.iters: list[Iterator | None] = [None] * len(sources)
        self.alive = [True] * len(sources)
        self.rejects = [0] * len(sources)
        self.seed = seed
        self.current = -1

    def next(self) -> tuple[Source, str, str] | None:
        while any(self.alive):
            weights = [s.weight if a else 0.0 for s, a in zip(self.sources, self.alive)]
            i = self.rng.choices(range(len(self.sources)), weights)[0]
            if self.iters[i] is None:
                self.iters[i] = iter(self.sources[i].make(
                    random.Random(f"{self.seed}:{self.sources[i].name}")))
            try:
                source, prompt = next(self.iters[i])
            except StopIteration:
                self.alive[i] = False
                continue
            self.current = i
            return self.sources[i], source, prompt
        return None

    def feedback(self, accepted: bool) -> None:
        i = self.current
        self.rejects[i] = 0 if accepted else self.rejects[i] + 1
        if self.rejects[i] >= MAX_CONSECUTIVE_REJECTS:
            self.alive[i] = False

    def dead(self) -> list[str]:
        return [s.name for s, a in zip(self.sources, self.alive) if not a]


class _Filters:
    """Length, exact, benchmark and near-duplicate checks with their rejection counts."""

    def __init__(self, benchmark: BenchmarkFilter, near_threshold: float):
        self.benchmark = benchmark
        self.near = NearDuplicateIndex(threshold=near_threshold)
        self.ids: set[str] = set()
        self.rejected: dict[str, int] = {}
        self.rejected_by_source: dict[str, dict[str, int]] = {}
        self.cpu_seconds = 0.0

    def accept(self, prompt: str, source: str = "") -> str | None:
        """The prompt's id if it is kept (and then indexed), else None."""
        t0 = time.process_time()
        try:
            return self._accept(prompt, source)
        finally:
            self.cpu_seconds += time.process_time() - t0

    def _accept(self, prompt: str, source: str) -> str | None:
        if not MIN_CHARS <= len(prompt) <= MAX_CHARS:
            return self._reject("length", source)
        normalised = normalise(prompt)
        pid = normalised_id(normalised)
        if pid in self.ids:
            return self._reject("exact_duplicate", source)
        words = words_of(normalised)
        reason = self.benchmark.reason_words(words)
        if reason is not None:
            return self._reject(reason, source)
        if self.near.add_words(words) is not None:
            return self._reject("near_duplicate", source)
        self.ids.add(pid)
        return pid

    def index(self, prompt: str) -> None:
        """Count ``prompt`` as already taken (an earlier corpus's), without the other checks."""
        normalised = normalise(prompt)
        self.ids.add(normalised_id(normalised))
        self.near.add_words(words_of(normalised))

    def _reject(self, reason: str, source: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        family = ".".join(source.split(".")[:2])
        per = self.rejected_by_source.setdefault(reason, {})
        per[family] = per.get(family, 0) + 1
        return None


def is_heldout(pid: str, eval_fraction: float) -> bool:
    """The held-out rule: the 16-hex-digit id as a fraction of 16**16 is < eval_fraction."""
    return int(pid, 16) / 16.0 ** 16 < eval_fraction


def training_records(records: Sequence[dict], taken: Sequence[dict], *,
                     eval_fraction: float = 0.02, near_threshold: float = 0.8,
                     exclude_files: Sequence[str] = ()) -> tuple[list[dict], dict[str, int]]:
    """New prompts (``{"kind", "source", "prompt"}``, e.g. a campaign round's self-instruct
    requests) that a corpus would take for training: the corpus's filters (length, exact and
    near duplicates among themselves and of ``taken``'s prompts, the benchmark fingerprints
    and ``exclude_files``), and none held out by :func:`is_heldout`. Returns the kept
    records in order, each with its ``id``, and the rejections counted by reason
    (``heldout`` for the rule)."""
    filters = _Filters(BenchmarkFilter(exclude_files), near_threshold)
    for record in taken:
        filters.index(record["prompt"])
    kept = []
    for record in records:
        pid = filters.accept(record["prompt"], record["source"])
        if pid is None:
            continue
        if is_heldout(pid, eval_fraction):
            filters._reject("heldout", record["source"])
            continue
        kept.append({"id": pid, "kind": record["kind"], "source": record["source"],
                     "prompt": record["prompt"]})
    return kept, dict(filters.rejected)


def parse_mix(text: str) -> dict[str, float]:
    """``"math=0.3,code=0.25,..."`` -> normalised shares over :data:`KINDS` (others 0)."""
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, value = part.partition("=")
        if kind not in KINDS:
            raise ValueError(f"--mix: unknown kind {kind!r}; kinds are {', '.join(KINDS)}")
        try:
            mix[kind] = float(value)
        except ValueError:
            raise ValueError(f"--mix: {part!r} is not KIND=NUMBER") from None
        if mix[kind] < 0:
            raise ValueError(f"--mix: share of {kind!r} is negative")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--mix: the shares add up to 0")
    return {k: mix.get(k, 0.0) / total for k in KINDS}


def _quotas(num: int, mix: dict[str, float]) -> dict[str, int]:
    raw = {k: num * mix.get(k, 0.0) for k in KINDS}
    quotas = {k: int(v) for k, v in raw.items()}
    for k in sorted(KINDS, key=lambda k: quotas[k] - raw[k])[:num - sum(quotas.values())]:
        quotas[k] += 1
    return quotas


@dataclasses.dataclass
class Corpus:
    train: list[dict]
    heldout: list[dict]
    card: dict


def build_corpus(num_prompts: int, seed: int = 0, *, mix: dict[str, float] | None = None,
                 eval_fraction: float = 0.02, exclude_files: Sequence[str] = (),
                 exclude_ngram: int = 8, near_threshold: float = 0.8,
                 sources: Sequence[Source] | None = None, extra: Sequence[dict] = (),
                 doc_packages: Sequence[str] = corpus_text.DOC_PACKAGES,
                 text_dir: str | None = None, earlier: Sequence[dict] = ()) -> Corpus:
    """``num_prompts`` distinct prompts (fewer only if every source of a kind runs dry and
    no other kind can take its share), split into train / held-out, plus ``extra`` records
    (``{"kind", "source", "prompt"}``, e.g. self-instruct prompts) that pass the same filters
    first and come on top.

    ``earlier``: records of an earlier corpus (train and held-out). They are indexed first,
    so no new prompt is an exact or near duplicate of one of them; they are not returned."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    mix = dict(DEFAULT_MIX if mix is None else mix)
    sources = list(default_sources(seed, doc_packages, text_dir) if sources is None else sources)
    filters = _Filters(BenchmarkFilter(exclude_files, ngram=exclude_ngram), near_threshold)
    for record in earlier:
        filters.index(record["prompt"])
    records: list[dict] = []
    templated = 0
    for record in extra:
        pid = filters.accept(record["prompt"], record["source"])
        if pid is not None:
            records.append({"id": pid, "kind": record["kind"], "source": record["source"],
                            "prompt": record["prompt"]})
    quotas = _quotas(num_prompts, mix)
    streams = {k: _KindStream([s for s in sources if s.kind == k], seed)
               for k in KINDS if quotas[k] and any(s.kind == k for s in sources)}
    for k in KINDS:
        if quotas[k] and k not in streams:
            raise ValueError(f"kind {k!r} has a share but no source")
    taken = {k: 0 for k in KINDS}
    shortfall: dict[str, int] = {}
    while True:
        open_kinds = [k for k in streams if taken[k] < quotas[k]]
        if not open_kinds:
            break
        kind = min(open_kinds, key=lambda k: (taken[k] / quotas[k], KINDS.index(k)))
        drawn = streams[kind].next()
        if drawn is None:                       # the kind ran dry: others take its share
            missing = quotas[kind] - taken[kind]
            shortfall[kind] = missing
            quotas[kind] = taken[kind]
            del streams[kind]
            rest = {k: mix[k] for k in streams if mix[k] > 0}
            if not rest:
                break
            for k, extra_quota in _quotas(missing, {k: v / sum(rest.values())
                                                    for k, v in rest.items()}).items():
                quotas[k] += extra_quota
            continue
        source, name, prompt = drawn
        pid = filters.accept(prompt, name)
        streams[kind].feedback(pid is not None)
        if pid is None:
            continue
        records.append({"id": pid, "kind": kind, "source": name, "prompt": prompt})
        taken[kind] += 1
        templated += source.templated
    train = [r for r in records if not is_heldout(r["id"], eval_fraction)]
    heldout = [r for r in records if is_heldout(r["id"], eval_fraction)]
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    card = _card(train, heldout, seed=seed, num_prompts=num_prompts, mix=mix,
                 eval_fraction=eval_fraction, filters=filters, exclude_ngram=exclude_ngram,
                 near_threshold=near_threshold, shortfall=shortfall,
                 exhausted=sorted(n for s in streams.values() for n in s.dead()),
                 templated=templated, doc_packages=doc_packages, text_dir=text_dir,
                 seconds=seconds, cpu_seconds=cpu_seconds)
    return Corpus(train, heldout, card)


def extend(corpus: Corpus, earlier_heldout: list[dict], earlier_dirs: Sequence[str],
           earlier_count: int) -> Corpus:
    """A follow-on corpus: ``corpus``'s training prompts, and the earlier corpus's held-out
    split in place of its own (new prompts that hash as held-out are dropped, so that the
    held-out rule stays one rule over every build and later rounds evaluate on one split)."""
    card = dict(corpus.card)
    card["extends"] = {"dirs": list(earlier_dirs), "earlier_prompts": earlier_count,
                       "heldout": len(earlier_heldout),
                       "new_heldout_dropped": len(corpus.heldout)}
    card["counts"] = dict(card["counts"], heldout=_count(earlier_heldout, "kind"),
                          total=_count(corpus.train + earlier_heldout, "kind"))
    return Corpus(corpus.train, list(earlier_heldout), card)


def _count(records, key) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r[key]] = out.get(r[key], 0) + 1
    return dict(sorted(out.items()))


def _versions(packages) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in packages:
        dist = {"orbax": "orbax-checkpoint"}.get(name, name)
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _card(train, heldout, *, seed, num_prompts, mix, eval_fraction, filters, exclude_ngram,
          near_threshold, shortfall, exhausted, templated, doc_packages, text_dir, seconds,
          cpu_seconds):
    everything = train + heldout
    chars = np.array([len(r["prompt"]) for r in everything] or [0])
    fingerprint = {k.split(":", 1)[1]: v for k, v in filters.rejected.items()
                   if k.startswith("fingerprint:")}
    excluded = {k.split(":", 1)[1]: v for k, v in filters.rejected.items()
                if k.startswith("exclude:")}
    return {
        "corpus_version": CORPUS_VERSION, "seed": seed, "num_prompts_requested": num_prompts,
        "num_prompts": len(everything), "eval_fraction": eval_fraction,
        "mix": {k: round(v, 4) for k, v in mix.items()},
        "counts": {"train": _count(train, "kind"), "heldout": _count(heldout, "kind"),
                   "total": _count(everything, "kind")},
        "sources": _count(everything, "source"),
        "templated_fraction": round(templated / max(len(everything), 1), 4),
        "prompt_chars": {"p50": int(np.percentile(chars, 50)), "p90": int(np.percentile(chars, 90)),
                         "p99": int(np.percentile(chars, 99)), "max": int(chars.max())},
        "exclusion": {"fingerprint_hits": fingerprint, "exclude_file_hits": excluded,
                      "exclude_files": filters.benchmark.files, "exclude_ngram": exclude_ngram,
                      "exclude_texts_too_short": filters.benchmark.ignored_short},
        "dedup": {"exact_duplicates": filters.rejected.get("exact_duplicate", 0),
                  "near_duplicates": filters.rejected.get("near_duplicate", 0),
                  "near_threshold": near_threshold, "shingle_words": filters.near.shingle,
                  "length_rejects": filters.rejected.get("length", 0),
                  "rejected_by_source": filters.rejected_by_source,
                  "filter_cpu_seconds": round(filters.cpu_seconds, 2)},
        "shortfall": shortfall, "exhausted_sources": exhausted,
        "versions": _versions(doc_packages), "text_dir": text_dir,
        "build_seconds": round(seconds, 2), "build_cpu_seconds": round(cpu_seconds, 2),
    }


# ---------------------------------------------------------------- files

def write_corpus(corpus: Corpus, out_dir: str) -> None:
    """``train.jsonl``, ``heldout.jsonl`` and ``card.json`` in ``out_dir`` (atomic renames)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, records in (("train.jsonl", corpus.train), ("heldout.jsonl", corpus.heldout)):
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps({k: r[k] for k in RECORD_KEYS}, ensure_ascii=False) + "\n")
        os.replace(tmp, os.path.join(out_dir, name))
    tmp = os.path.join(out_dir, "card.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(corpus.card, f, indent=1, ensure_ascii=False)
    os.replace(tmp, os.path.join(out_dir, "card.json"))


def read_corpus(path: str) -> list[dict]:
    """Records of a corpus ``.jsonl`` file (or of ``DIR/train.jsonl`` for a directory),
    each checked to have :data:`RECORD_KEYS` with string values."""
    if os.path.isdir(path):
        path = os.path.join(path, "train.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} not found (build one with "
                                "`python -m domino_jax.train.corpus --out DIR`)")
    records = []
    for number, record in iter_jsonl(path):
        missing = [k for k in RECORD_KEYS
                   if not isinstance(record, dict) or not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{number}: record lacks string field(s) {missing}")
        records.append(record)
    return records


def token_length_stats(records: Sequence[dict], tokenizer) -> dict:
    """Percentiles of the prompts' token counts (plain text, no chat template)."""
    lengths = np.array([len(ids) for ids in tokenizer(
        [r["prompt"] for r in records], add_special_tokens=False)["input_ids"]] or [0])
    return {"p50": int(np.percentile(lengths, 50)), "p90": int(np.percentile(lengths, 90)),
            "p99": int(np.percentile(lengths, 99)), "max": int(lengths.max()),
            "share_under_200": round(float(np.mean(lengths < 200)), 4)}


# ---------------------------------------------------------------- CLI

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m domino_jax.train.corpus",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-prompts", type=int, default=60000,
                        help="offline prompts in train + held-out (default 60000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-fraction", type=float, default=0.02,
                        help="held-out share by hash (default 0.02)")
    parser.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="FILE",
                        help=".jsonl / .txt of texts whose word n-grams no prompt may share")
    parser.add_argument("--extends", action="append", default=[], metavar="DIR",
                        help="an earlier corpus: new prompts only (no exact or near duplicate "
                             "of its prompts, no n-gram overlap with its held-out split), and "
                             "its heldout.jsonl as this corpus's held-out split; repeatable "
                             "(every earlier build, one held-out split)")
    parser.add_argument("--exclude-ngram", type=int, default=8)
    parser.add_argument("--near-threshold", type=float, default=0.8,
                        help="word-5-gram Jaccard at or above which prompts are near-duplicates")
    parser.add_argument("--mix", default=None,
                        help="kind shares, e.g. math=0.3,code=0.25,chat=0.18,continuation=0.14,"
                             "summarize=0.13 (normalised)")
    parser.add_argument("--text-dir", default=None,
                        help="extra .txt files (e.g. public-domain books) for continuation "
                             "and summarisation")
    parser.add_argument("--doc-packages", default=",".join(corpus_text.DOC_PACKAGES),
                        help="installed packages whose docstrings feed the text kinds")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer folder: record prompt token lengths in the card")
    parser.add_argument("--self-instruct", type=int, default=0, metavar="N",
                        help="add up to N prompts written by --target itself")
    parser.add_argument("--target", default=None, help="HF target folder for --self-instruct")
    parser.add_argument("--self-instruct-batch", type=int, default=256)
    parser.add_argument("--self-instruct-max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", help="target dtype for --self-instruct")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose, fmt="%(asctime)s %(message)s")
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not 0.0 <= args.eval_fraction < 1.0:
        parser.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if not 0.0 < args.near_threshold <= 1.0:
        parser.error(f"--near-threshold must be in (0, 1], got {args.near_threshold}")
    if args.exclude_ngram < 2:
        parser.error(f"--exclude-ngram must be >= 2, got {args.exclude_ngram}")
    if args.self_instruct < 0:
        parser.error(f"--self-instruct must be >= 0, got {args.self_instruct}")
    if args.self_instruct and not args.target:
        parser.error("--self-instruct needs --target DIR (the model that writes the prompts)")
    try:
        mix = parse_mix(args.mix) if args.mix else None
        for path in args.exclude:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"--exclude file {path!r} not found")
        exclude, earlier_heldout, earlier = list(args.exclude), [], []
        for folder in args.extends:
            heldout = read_corpus(os.path.join(folder, "heldout.jsonl"))
            if earlier_heldout and heldout != earlier_heldout:
                raise ValueError(f"--extends {folder!r}: its heldout.jsonl differs from "
                                 f"{args.extends[0]!r}'s (follow-on builds share one split)")
            earlier_heldout = heldout
            earlier += read_corpus(os.path.join(folder, "train.jsonl"))
        earlier += earlier_heldout
        if args.extends:
            exclude.append(os.path.join(args.extends[0], "heldout.jsonl"))
        if args.text_dir and not os.path.isdir(args.text_dir):
            raise FileNotFoundError(f"--text-dir {args.text_dir!r} is not a directory")
        if args.target and not os.path.isdir(args.target):
            raise FileNotFoundError(f"--target {args.target!r} is not a directory")
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    t0 = time.perf_counter()
    extra = []
    if args.self_instruct:
        from domino_jax.train.self_instruct import self_instruct_from_dir
        extra = self_instruct_from_dir(args.target, args.self_instruct, seed=args.seed,
                                       batch_size=args.self_instruct_batch,
                                       max_new_tokens=args.self_instruct_max_new_tokens,
                                       dtype=args.dtype)
    corpus = build_corpus(args.num_prompts, args.seed, mix=mix, eval_fraction=args.eval_fraction,
                          exclude_files=exclude, exclude_ngram=args.exclude_ngram,
                          near_threshold=args.near_threshold, extra=extra,
                          doc_packages=[p for p in args.doc_packages.split(",") if p],
                          text_dir=args.text_dir, earlier=earlier)
    if args.extends:
        corpus = extend(corpus, earlier_heldout, args.extends, len(earlier))
    kept = sum(r["source"] == "self_instruct" for r in corpus.train + corpus.heldout)
    corpus.card["self_instruct"] = {"requested": args.self_instruct, "written": len(extra),
                                    "kept": kept, "target": args.target}
    if args.tokenizer:
        from domino_jax.decode.loading import load_tokenizer
        corpus.card["prompt_tokens"] = token_length_stats(corpus.train + corpus.heldout,
                                                          load_tokenizer(args.tokenizer))
    corpus.card["total_seconds"] = round(time.perf_counter() - t0, 2)
    write_corpus(corpus, args.out)
    summary = {"out": args.out, "train": len(corpus.train), "heldout": len(corpus.heldout),
               "per_kind": corpus.card["counts"]["total"],
               "build_seconds": corpus.card["build_seconds"],
               "build_cpu_seconds": corpus.card["build_cpu_seconds"],
               "total_seconds": corpus.card["total_seconds"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
