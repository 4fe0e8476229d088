"""Self-distillation at scale: the target answers corpus prompts, written as shards.

    python -m domino_jax.train.shards generate --corpus corpus/train.jsonl --out shards/ \\
        --modes greedy,sampled --max-new-tokens 256 --batch-size 256 [--temperature 1.0] \\
        [--target DIR] [--limit N] [--shard-examples 8192] [--dtype bfloat16]
    python -m domino_jax.train.shards merge --out shards/ machine_b_shards/ [...]
    python -m domino_jax.train.shards info shards/ [--verify]

Input: corpus records ``{"id", "kind", "source", "prompt"}``, one JSON object a line.
Every prompt is chat-templated (:func:`domino_jax.decode.loading.encode_prompt`, thinking
off) and answered by the target's jitted AR loop once per mode: ``greedy`` (T = 0) and
``sampled`` (``--temperature``/``--top-p``/``--top-k``); both are kept, labelled with their
mode. Output: a shards directory (:mod:`domino_jax.train.shard_store`), read back by
:class:`ShardDataset` and by ``train --data SHARDS``.

Speed: prompts are bucketed by token length into a few fixed widths (``--widths``, default
64,128,256,512; longer prompts are skipped and counted) and every batch has the same
``--batch-size`` rows (short batches are filled with discarded filler rows), so one program
per (mode, width) compiles; the widths' batches interleave, so a run stopped by its time
budget has answered every width's share (:func:`plan_batches`). One host sync per batch
(the whole batch's decode loop runs on the device).

Resume: the ``(id, mode)`` pairs already in the manifest are skipped, so a run that stopped
(crash, ``--limit``, a lost machine) continues where it stopped and never writes a pair
twice. Shards are flushed at batch boundaries, so the done pairs of an interrupted run are a
prefix of the same plan; each batch's sampling seed is a hash of ``(--seed, mode, the
batch's ids)``, so a resumed run writes the same examples as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from domino_jax.console import add_verbose_flag, setup_logging
from domino_jax.decode.sampling import SamplingConfig
from domino_jax.decode.speculative import DecodeConfig, generate, precompile, prompt_bucket
from domino_jax.train.shard_store import (META_KEYS, ShardDataset, ShardError, ShardWriter,
                                          merge_shards, pack_examples, read_manifest,
                                          token_dtype, verify_shards)

log = logging.getLogger(__name__)

MODES = ("greedy", "sampled")
DEFAULT_WIDTHS = (64, 128, 256, 512)
SHARD_BYTES = 14 << 20        # tokens per shard, at most (fits 16 MiB transfer parts)

__all__ = ["MODES", "GenerationSettings", "ShardDataset", "generate_shards", "merge_shards",
           "plan_batches", "read_records", "run_batch"]


# ----------------------------------------------------------------------------- inputs

def read_records(path: str) -> list[dict]:
    """Corpus records from a ``.jsonl`` file: ``id`` and ``prompt`` (non-empty strings) are
    required, ``kind`` and ``source`` default to ``"unknown"``. Errors name ``file:line``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} not found")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object "
                                 '{"id", "kind", "source", "prompt"}')
            for key in ("id", "prompt"):
                if not isinstance(record.get(key), str) or not record[key]:
                    raise ValueError(f"{where}: key {key!r} is missing or not a non-empty "
                                     "string")
            for key in ("kind", "source"):
                if not isinstance(record.get(key, "unknown"), str):
                    raise ValueError(f"{where}: key {key!r} must be a string")
            records.append({"id": record["id"], "kind": record.get("kind", "unknown"),
                            "source": record.get("source", "unknown"),
                            "prompt": record["prompt"]})
    return records


def check_modes(modes: Sequence[str] | str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in modes.split(",")) if isinstance(modes, str) else tuple(modes)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {unknown or modes!r}; choose from {', '.join(MODES)}")
    return tuple(dict.fromkeys(modes))


def check_widths(widths: Sequence[int]) -> tuple[int, ...]:
    """Sorted distinct widths, each one a padded width of ``prompt_bucket`` (16..256 powers
    of two, then multiples of 256), so a batch's padded width is its bucket's width."""
    widths = tuple(sorted(set(int(w) for w in widths)))
    bad = [w for w in widths if w < 1 or prompt_bucket(w) != w]
    if bad or not widths:
        raise ValueError(f"bad prompt width(s) {bad or widths}: use powers of two from 16 to "
                         "256, then multiples of 256 (e.g. 64,128,256,512)")
    return widths


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """How responses are generated (recorded per shard in the manifest)."""

    max_new_tokens: int = 256
    batch_size: int = 256
    queue: int = 1                    # > 1: queue x batch_size prompts a call, slots refilled
    batch_tokens: int = 0             # > 0: a width's rows at most batch_tokens // width
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    temperature: float = 1.0          # mode "sampled"; "greedy" is T = 0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "widths", check_widths(self.widths))
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.batch_tokens < 0:
            raise ValueError(f"batch_tokens must be >= 0 (0: off), got {self.batch_tokens}")
        if self.queue < 1:
            raise ValueError(f"queue must be >= 1, got {self.queue}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not np.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(f"the sampled mode needs a finite temperature > 0, got "
                             f"{self.temperature}")
        self.sampling("sampled")       # validates top_p / top_k

    def rows(self, width: int) -> int:
        """Rows (slots) of a width's batches: ``batch_size``, or fewer for wide prompts so
        that ``rows * width <= batch_tokens`` (at least 1): a prefill's memory grows with
        rows x width (and its attention with width squared), and 1,024 rows of 512-token
        prompts did not fit an 80 GB GPU (``docs/design.md`` §26)."""
        if not self.batch_tokens:
            return self.batch_size
        return max(1, min(self.batch_size, self.batch_tokens // width))

    def sampling(self, mode: str) -> SamplingConfig:
        if mode == "greedy":
            return SamplingConfig()
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def decode_config(self, mode: str) -> DecodeConfig:
        return DecodeConfig(method="ar", max_new_tokens=self.max_new_tokens,
                            sampling=self.sampling(mode),
                            stop_token_ids=tuple(self.stop_token_ids))

    def record(self, modes: Sequence[str]) -> dict:
        """JSON for the manifest: the common settings and each mode's sampling."""
        return {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
                "batch_tokens": self.batch_tokens,
                "queue": self.queue,
                "widths": list(self.widths), "seed": self.seed,
                "stop_token_ids": list(self.stop_token_ids),
                "modes": {m: dataclasses.asdict(self.sampling(m)) for m in modes}}


# ----------------------------------------------------------------------------- batches

def plan_batches(lengths: Sequence[int], widths: Sequence[int],
                 batch_size: int | Mapping[int, int]
                 ) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """``(batches, too_long)``: each batch ``(width, positions)`` holds at most
    ``batch_size`` prompts (or ``batch_size[width]``, per width) (positions into
    ``lengths``, in order) of the smallest width that fits them; ``too_long`` lists the
    prompts longer than every width.

    A full batch whose longest prompt would pad to less than its width gives up one row to
    a full-width filler (:func:`run_batch`), so every batch of a width runs one program
    (with ``batch_size == 1`` a short prompt may pad narrower).

    The widths' batches are interleaved in proportion (a width's ``i``-th of ``n`` batches
    at ``(i + 1/2) / n`` of the run), so a run stopped by its time budget has answered every
    width's share of the prompts, not only the short ones (docs/design.md §26). Planning
    only the prompts a stopped run left gives the rest of the same batches, row for row (a
    width's batches are consecutive slices of its prompts), so a resumed run writes what an
    uninterrupted one would."""
    widths = check_widths(widths)
    buckets: dict[int, list[int]] = {w: [] for w in widths}
    too_long = []
    for position, n in enumerate(lengths):
        width = next((w for w in widths if n <= w), None)
        (buckets[width] if width is not None else too_long).append(position)
    per_width = []
    for width in widths:
        size = batch_size[width] if isinstance(batch_size, Mapping) else batch_size
        rows, start, chunks = buckets[width], 0, []
        while start < len(rows):
            chunk = rows[start:start + size]
            if (len(chunk) == size > 1
                    and prompt_bucket(max(lengths[p] for p in chunk)) < width):
                chunk = chunk[:-1]
            chunks.append(chunk)
            start += len(chunk)
        per_width += [((i + 0.5) / len(chunks), width, chunk) for i, chunk in enumerate(chunks)]
    return [(width, chunk) for _, width, chunk in sorted(per_width, key=lambda b: b[:2])], \
        too_long


def run_batch(target, target_params, prompts: Sequence[Sequence[int]], width: int,
              batch_size: int, config: DecodeConfig, seed: int, queue: int = 1):
    """``(responses, result)``: the target's responses (stop token included, at most
    ``config.max_new_tokens``) to ``prompts`` (at most ``queue * batch_size`` token lists of
    at most ``width`` tokens).

    ``queue == 1``: one ``[batch_size, width]`` :func:`generate` call (a static batch: every
    row waits for the longest response); the rows after the prompts are fillers of
    ``width`` tokens whose output is discarded. ``queue > 1``: the prompts go through
    ``batch_size`` slots with continuous batching (:func:`~domino_jax.decode.serving.serve`:
    a finished row's slot takes the next prompt), plus one discarded filler of ``width``
    tokens so every call of a width runs the same programs. Greedy responses are the
    same either way."""
    if len(prompts) > batch_size * queue:
        raise ValueError(f"{len(prompts)} prompts do not fit {queue} x {batch_size} rows")
    if queue > 1 and len(prompts) > batch_size:
        from domino_jax.decode.serving import serve

        rows = list(prompts) + [[0] * width]
        result = serve(target, target_params, rows, config, slots=batch_size, seed=seed)
        return result.tokens[:len(prompts)], result
    rows = list(prompts) + [[0] * width] * (batch_size - len(prompts))
    result = generate(target, target_params, rows, config, seed=seed)
    return result.tokens[:len(prompts)], result


def compile_jobs(target, target_params, settings: GenerationSettings,
                 plans: dict[str, list[tuple[int, list[int]]]]) -> list[Callable[[], float]]:
    """The compiles (thunks returning seconds) of the programs :func:`run_batch` will run
    for ``plans`` (mode -> :func:`plan_batches`' batches), each program once, in the order
    the batches first need them: a queue's (:func:`~domino_jax.decode.serving.compile_jobs`)
    or a static batch's (:func:`~domino_jax.decode.speculative.precompile`)."""
    from domino_jax.decode import serving

    jobs, seen = [], set()
    for mode, batches in plans.items():
        config = settings.decode_config(mode)
        for width, chunk in batches:
            queued = settings.queue > 1 and len(chunk) > settings.rows(width)
            if (mode, width, queued) in seen:
                continue
            seen.add((mode, width, queued))
            if queued:
                jobs += serving.compile_jobs(target, target_params, config, width,
                                             settings.rows(width))
            else:
                rows = [[0] * width] * settings.rows(width)
                jobs.append(lambda rows=rows, config=config:
                            precompile(target, target_params, rows, config))
    return jobs


class CompileAhead:
    """Runs compile thunks on ``workers`` threads from construction (none with 0); the
    program cache they fill is thread-safe, and a batch whose program is still compiling
    waits for it (``docs/design.md`` §26). :meth:`close` (or leaving it as a context)
    cancels what has not started and returns ``{"compile_ahead_jobs", "compile_ahead_failed", "compile_ahead_seconds"}`` of
    those that finished (a failed compile is logged: its batch compiles it again)."""

    def __init__(self, jobs: Sequence[Callable[[], float]], workers: int):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(workers) if workers > 0 and jobs else None
        self.futures = [self.pool.submit(job) for job in jobs] if self.pool else []
        if self.pool:
            log.info("compiling %d programs ahead on %d threads", len(jobs), workers)

    def __enter__(self) -> "CompileAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()                  # a run that raised leaves no compile queued

    def close(self) -> dict:
        if self.pool is None:
            return {}
        pool, self.pool = self.pool, None
        pool.shutdown(wait=False, cancel_futures=True)
        done = [f for f in self.futures if f.done() and not f.cancelled()]
        failed = [f.exception() for f in done if f.exception() is not None]
        for error in failed[:3]:
            log.warning("a compile ahead failed (its batch compiled it again): %r", error)
        return {"compile_ahead_jobs": len(done) - len(failed),
                "compile_ahead_failed": len(failed),
                "compile_ahead_seconds": round(sum(f.result() for f in done
                                                   if f.exception() is None), 3)}


def batch_seed(seed: int, mode: str, ids: Sequence[str]) -> int:
    """The sampling seed of a batch: a hash of ``(seed, mode, ids)`` (independent of where
    the batch falls in a run, so resumed and uninterrupted runs agree)."""
    digest = hashlib.sha256(f"{seed}\0{mode}\0".encode() + "\0".join(ids).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ----------------------------------------------------------------------------- generation

class _Pending:
    """Examples generated but not yet written (flushed as one shard)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.prompts, self.responses, self.stopped = [], [], []
        self.meta = {k: [] for k in META_KEYS}
        self.tokens = 0

    def add(self, record: dict, mode: str, prompt: np.ndarray, response: np.ndarray,
            stopped: bool) -> None:
        for key, value in zip(META_KEYS, (record["id"], record["kind"], record["source"], mode)):
            self.meta[key].append(value)
        self.prompts.append(prompt)
        self.responses.append(response)
        self.stopped.append(stopped)
        self.tokens += len(prompt) + len(response)

    def __len__(self) -> int:
        return len(self.prompts)


def generate_shards(records: Sequence[dict], out_dir: str, target, target_params,
                    encode: Callable[[str], list[int]], target_info: dict,
                    settings: GenerationSettings = GenerationSettings(),
                    modes: Sequence[str] = ("greedy",), shard_examples: int = 8192,
                    shard_bytes: int = SHARD_BYTES, progress: bool = True,
                    on_batch: Callable[[int], None] | None = None,
                    seconds: float | None = None, compile_workers: int = 0) -> dict:
    """Answer every ``(record, mode)`` not yet in ``out_dir`` and write the examples as
    shards of whole batches (each at most ``shard_examples`` examples and ``shard_bytes``
    of tokens, unless one batch alone is larger). ``encode(prompt) -> ids`` is the prompt encoder (the CLI
    uses the chat template); ``target_info`` is ``{"name", "vocab_size", "fingerprint"}``
    (:func:`target_fingerprint`). ``on_batch(batches_done)`` is called after each batch
    (tests interrupt a run by raising from it). ``seconds``: start no batch after that many
    seconds (what is done is written; the rest is left for a later call, ``stopped`` in the
    summary). ``compile_workers > 0`` compiles every program the plan will run (each mode's
    and width's) on that many threads from the start, in the order the batches need them,
    while the first batches decode (:class:`CompileAhead`); 0 compiles each when its first
    batch comes. Returns a summary (counts, seconds, response tokens/s)."""
    from tqdm.auto import tqdm

    modes = check_modes(modes)
    if shard_examples < 1:
        raise ValueError(f"shard_examples must be >= 1, got {shard_examples}")
    unique, seen = [], set()
    for record in records:
        if record["id"] in seen:
            log.warning("duplicate corpus id %s: keeping its first record", record["id"])
            continue
        seen.add(record["id"])
        unique.append(record)
    stats = dict(written=0, already_done=0, skipped_too_long=0, skipped_empty=0, batches=0,
                 stopped=False,
                 response_tokens=0, prompt_tokens=0, compile_seconds=0.0, prefill_seconds=0.0,
                 decode_seconds=0.0)
    t_start = time.perf_counter()
    with ShardWriter(out_dir, target_info) as writer:
        todo = {m: [r for r in unique if (r["id"], m) not in writer.done] for m in modes}
        stats["already_done"] = len(unique) * len(modes) - sum(len(v) for v in todo.values())
        needed = {r["id"]: r["prompt"] for m in modes for r in todo[m]}
        t0 = time.perf_counter()
        ids_of = {i: np.asarray(encode(p), np.int32) for i, p in needed.items()}
        log.info("encoded %d prompts in %.1f s", len(ids_of), time.perf_counter() - t0)
        stop_ids = set(settings.stop_token_ids)
        pending = _Pending()
        bar = tqdm(total=sum(len(v) for v in todo.values()), unit="ex", disable=not progress,
                   desc="self-distill", dynamic_ncols=True)

        def flush():
            if len(pending):
                tokens, index = pack_examples(pending.prompts, pending.responses, writer.dtype)
                index["stopped"] = pending.stopped
                name = writer.write_shard(tokens, index, pending.meta,
                                          settings.record(sorted(set(pending.meta["modes"]))))
                log.info("wrote %s: %d examples, %d tokens", name, len(pending), len(tokens))
            pending.clear()

        plans = {}
        for mode in modes:
            recs = [r for r in todo[mode] if len(ids_of[r["id"]])]
            stats["skipped_empty"] += len(todo[mode]) - len(recs)
            batches, too_long = plan_batches([len(ids_of[r["id"]]) for r in recs],
                                             settings.widths,
                                             {w: settings.rows(w) * settings.queue
                                              for w in settings.widths})
            if too_long:
                log.warning("%s: %d prompts longer than %d tokens skipped", mode, len(too_long),
                            settings.widths[-1])
            stats["skipped_too_long"] += len(too_long)
            bar.total -= len(too_long) + len(todo[mode]) - len(recs)
            plans[mode] = recs, batches
        bar.refresh()
        with CompileAhead(compile_jobs(target, target_params, settings,
                                       {m: b for m, (_, b) in plans.items()}),
                          compile_workers) as ahead:
            for mode in modes:
                config = settings.decode_config(mode)
                recs, batches = plans[mode]
                for width, chunk in batches:
                    if seconds is not None and time.perf_counter() - t_start >= seconds:
                        stats["stopped"] = True
                        break
                    batch = [recs[p] for p in chunk]
                    prompts = [ids_of[r["id"]] for r in batch]
                    responses, result = run_batch(target, target_params, prompts, width,
                                                  settings.rows(width), config,
                                                  batch_seed(settings.seed, mode,
                                                             [r["id"] for r in batch]),
                                                  settings.queue)
                    batch_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
                    if len(pending) + len(batch) > shard_examples or \
                            (pending.tokens + batch_tokens) * writer.dtype.itemsize > shard_bytes:
                        flush()                                   # shards end at batch boundaries
                    for record, prompt, response in zip(batch, prompts, responses):
                        pending.add(record, mode, prompt, np.asarray(response, np.int32),
                                    bool(response) and response[-1] in stop_ids)
                        stats["response_tokens"] += len(response)
                        stats["prompt_tokens"] += len(prompt)
                    stats["written"] += len(batch)
                    stats["batches"] += 1
                    stats["compile_seconds"] += result.compile_seconds
                    stats["prefill_seconds"] += result.prefill_seconds
                    stats["decode_seconds"] += result.decode_seconds
                    elapsed = time.perf_counter() - t_start
                    report = log.debug if progress else log.info      # the bar shows it
                    report("batch %d (%s, width %d, %d rows): %d response tokens; compile %.1f s, "
                           "prefill %.1f s, decode %.1f s; %.0f tok/s so far", stats["batches"],
                           mode, width, len(batch), sum(len(r) for r in responses),
                           result.compile_seconds, result.prefill_seconds, result.decode_seconds,
                           stats["response_tokens"] / max(elapsed, 1e-9))
                    bar.update(len(batch))
                    bar.set_postfix(mode=mode, width=width,
                                    tok_s=f"{stats['response_tokens'] / max(elapsed, 1e-9):.0f}")
                    if on_batch is not None:
                        on_batch(stats["batches"])
                if stats["stopped"]:
                    break
            flush()
            bar.close()
            stats.update(ahead.close())
    seconds = time.perf_counter() - t_start
    device = stats["prefill_seconds"] + stats["decode_seconds"]
    stats.update({k: round(stats[k], 3) for k in ("compile_seconds", "prefill_seconds",
                                                  "decode_seconds")})
    stats.update(seconds=round(seconds, 3), device_seconds=round(device, 3),
                 tokens_per_second=round(stats["response_tokens"] / max(seconds, 1e-9), 1),
                 device_tokens_per_second=round(stats["response_tokens"] / max(device, 1e-9), 1),
                 decode_tokens_per_second=round(
                     stats["response_tokens"] / max(stats["decode_seconds"], 1e-9), 1),
                 out=out_dir)
    log.info("self-distillation: %s", json.dumps(stats))
    return stats


def target_fingerprint(target_dir: str) -> str:
    """sha256 over the target folder's config, tokenizer files and the safetensors headers
    (tensor names, dtypes, shapes, offsets; not the weights), so copies of one target on
    different machines agree and different targets differ."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(target_dir)):
        path = os.path.join(target_dir, name)
        if name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "special_tokens_map.json"):
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
        elif name.endswith(".safetensors"):
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                digest.update(name.encode() + b"\0" + f.read(min(size, 1 << 26)))
    return digest.hexdigest()


# ----------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m domino_jax.train.shards",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer corpus prompts with the target, write shards")
    g.add_argument("--corpus", required=True, help="corpus .jsonl ({id, kind, source, prompt})")
    g.add_argument("--out", required=True, help="shards directory (created, or appended to)")
    g.add_argument("--modes", default="greedy,sampled", help="comma list of greedy,sampled")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--batch-size", type=int, default=256, help="rows per generate call")
    g.add_argument("--batch-tokens", type=int, default=0, metavar="N",
                   help="a width's rows at most N // width (fewer rows for long prompts: a "
                        "prefill's memory grows with rows x width); 0: --batch-size for all")
    g.add_argument("--queue", type=int, default=1,
                   help="prompts per row and call: > 1 runs queue x batch-size prompts through "
                        "batch-size slots with continuous batching (a finished row takes the "
                        "next prompt) instead of static batches")
    g.add_argument("--temperature", type=float, default=1.0, help="the sampled mode's T")
    g.add_argument("--top-p", type=float, default=1.0, help="the sampled mode's top-p")
    g.add_argument("--top-k", type=int, default=0, help="the sampled mode's top-k (0 = off)")
    g.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    g.add_argument("--limit", type=int, default=None,
                   help="use only the first N corpus records (a later run without it resumes)")
    g.add_argument("--shard-examples", type=int, default=8192, help="examples per shard, max")
    g.add_argument("--seconds", type=float, default=None,
                   help="start no batch after this many seconds (the rest is left for a "
                        "later call: rerun the same command to continue)")
    g.add_argument("--widths", default=",".join(map(str, DEFAULT_WIDTHS)),
                   help="prompt length buckets (tokens); longer prompts are skipped")
    g.add_argument("--compile-workers", type=int, default=0, metavar="N",
                   help="compile every program the run needs on N threads from the start, "
                        "while the first batches decode (0: each when first needed)")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true")
    m = sub.add_parser("merge", help="add the (id, mode) pairs of SRC dirs missing from --out")
    m.add_argument("--out", required=True, help="destination shards directory")
    m.add_argument("sources", nargs="+", help="shards directories to merge in")
    i = sub.add_parser("info", help="counts per mode and kind")
    i.add_argument("shards", help="shards directory")
    i.add_argument("--verify", action="store_true", help="check every file's sha256")
    for command in (g, m, i):
        add_verbose_flag(command)
    return p


def _generate(args) -> dict:
    import jax.numpy as jnp

    from domino_jax.decode.loading import (encode_prompt, load_pair, load_tokenizer,
                                           stop_token_ids)

    records = read_records(args.corpus)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        records = records[:args.limit]
    modes = check_modes(args.modes)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError as e:
        raise ValueError(f"--widths {args.widths!r}: expected comma-separated integers") from e
    target_dir = args.target
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    if not os.path.isdir(target_dir):
        raise FileNotFoundError(f"--target {target_dir!r} is not a folder")
    tokenizer = load_tokenizer(target_dir)
    target, target_params, _, _ = load_pair(target_dir, None, "ar", jnp.dtype(args.dtype))
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, queue=args.queue,
        batch_tokens=args.batch_tokens,
        widths=tuple(widths),
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stop_token_ids=stop_token_ids(tokenizer, target.config))
    info = {"name": os.path.basename(os.path.normpath(target_dir)),
            "vocab_size": int(target.config.vocab_size),
            "fingerprint": target_fingerprint(target_dir)}
    log.info("target %s (vocab %d, tokens stored as %s), dtype %s, %d records, modes %s",
             target_dir, info["vocab_size"], token_dtype(info["vocab_size"]), args.dtype,
             len(records), ",".join(modes))
    summary = generate_shards(records, args.out, target, target_params,
                              lambda text: encode_prompt(tokenizer, text), info, settings,
                              modes, args.shard_examples, progress=not args.no_progress,
                              seconds=args.seconds, compile_workers=args.compile_workers)
    summary["dtype"] = args.dtype
    return summary


def _info(args) -> dict:
    manifest = read_manifest(args.shards)
    out = {"target": manifest["target"], "token_dtype": manifest["token_dtype"],
           "shards": len(manifest["shards"]), **ShardDataset(args.shards).summary()}
    if args.verify:
        out["verified_shards"] = verify_shards(args.shards)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, fmt="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.command == "generate":
            result = _generate(args)
        elif args.command == "merge":
            result = merge_shards(args.out, args.sources)
        else:
            result = _info(args)
    except (ValueError, FileNotFoundError, ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
