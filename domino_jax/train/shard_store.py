"""Self-distillation shards on disk: packed token arrays + a manifest, read memory-mapped.

    with ShardWriter("shards/", target_info) as writer:     # lock, clean, what is done
        writer.write_shard(examples, settings)                # one shard, atomically
    ds = ShardDataset("shards/", kinds=["math"], modes=["greedy"])
    ds[0] -> {"input_ids": int32 [n], "loss_mask": int32 [n]}; ds.response_lengths [len(ds)]
    merge_shards("shards/", ["from_machine_b/"])            # dedup (id, mode)

Layout of a shards directory::

    manifest.json                 the committed shards (nothing else is part of the data)
    shard-<run>-<seq>/            one shard (<run>: 8 random hex, unique per writer)
        tokens.npy   [T]          prompt + response tokens of every example, packed
                                  (uint16 when the vocabulary has <= 65535 ids, else int32)
        index.npy    [n]          structured: start (int64, into tokens), prompt_len,
                                  response_len (int32), stopped (bool: ended at a stop token)
        meta.json                 {"ids", "kinds", "sources", "modes"}: lists of n strings

Writes are atomic: a shard is written under ``.tmp-<name>/``, its files fsynced, renamed to
``<name>/``, then the manifest is rewritten (``manifest.json.tmp`` + ``os.replace``); a
crash leaves at worst a shard directory the manifest does not list, which readers ignore and
the next writer deletes. One writer at a time per directory (``.lock``, ``flock``). The
manifest records each file's sha256 (checked by :func:`verify_shards` and before a merge),
the target's fingerprint (appending or merging data from another target is refused) and
each shard's generation settings.
"""

from __future__ import annotations

import collections.abc
import datetime
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
from typing import Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "domino_jax.shards"
VERSION = 1
MANIFEST = "manifest.json"
SHARD_FILES = ("tokens.npy", "index.npy", "meta.json")
INDEX_DTYPE = np.dtype([("start", "<i8"), ("prompt_len", "<i4"), ("response_len", "<i4"),
                        ("stopped", "?")])
META_KEYS = ("ids", "kinds", "sources", "modes")


class ShardError(ValueError):
    """A shards directory (or its manifest, or a shard file) is missing, corrupt or
    incompatible; the message names the path."""


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65535), else ``int32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


def is_shard_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(root: str) -> dict:
    path = os.path.join(root, MANIFEST)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"shards directory {root!r} not found")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{root!r} has no {MANIFEST} (not a shards directory; write "
                                "one with `python -m domino_jax.train.shards generate`)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: not valid JSON ({e})") from e
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ShardError(f"{path}: version {manifest.get('version')!r}, this code reads "
                         f"version {VERSION}")
    return manifest


def read_shard_meta(root: str, name: str) -> dict:
    path = os.path.join(root, name, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: unreadable shard metadata ({e})") from e
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ShardError(f"{path}: missing key(s) {missing}")
    return meta


def verify_shards(root: str) -> int:
    """Check every committed shard file against the manifest's sha256; returns the number
    of shards checked, raises :class:`ShardError` naming the first bad file."""
    manifest = read_manifest(root)
    for entry in manifest["shards"]:
        for file, digest in entry["sha256"].items():
            path = os.path.join(root, entry["name"], file)
            if not os.path.isfile(path):
                raise ShardError(f"{path}: missing (listed in {MANIFEST})")
            if file_sha256(path) != digest:
                raise ShardError(f"{path}: sha256 mismatch (corrupt or truncated copy)")
    return len(manifest["shards"])


def pack_examples(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                  dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [T], index [n])`` for examples ``prompt_i + response_i`` (``stopped`` False;
    callers set it)."""
    lengths = np.asarray([len(p) + len(r) for p, r in zip(prompts, responses)], np.int64)
    index = np.zeros(len(lengths), INDEX_DTYPE)
    index["start"] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else []
    index["prompt_len"] = [len(p) for p in prompts]
    index["response_len"] = [len(r) for r in responses]
    pieces = [np.asarray(x, np.int64) for pair in zip(prompts, responses) for x in pair]
    tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids outside [0, {np.iinfo(dtype).max}] cannot be stored as "
                         f"{dtype}")
    return tokens.astype(dtype), index


# ----------------------------------------------------------------------------- writing

def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Exclusive writer of one shards directory (context manager).

    On enter: takes ``.lock`` (another live writer -> :class:`ShardError`), creates the
    directory and manifest if new (else checks ``target_info["fingerprint"]`` against the
    manifest's), deletes uncommitted leftovers (``.tmp-*``, ``shard-*`` directories the
    manifest does not list) and loads :attr:`done`, the ``(id, mode)`` pairs already
    written. :meth:`write_shard` commits one shard; nothing is buffered here.
    """

    def __init__(self, root: str, target_info: dict):
        if "fingerprint" not in target_info or "vocab_size" not in target_info:
            raise ValueError("target_info needs 'fingerprint' and 'vocab_size'")
        self.root, self.target_info = root, dict(target_info)
        self.run = secrets.token_hex(4)
        self._seq, self._lock = 0, None
        self.done: set[tuple[str, str]] = set()
        self.manifest: dict = {}

    def __enter__(self) -> "ShardWriter":
        os.makedirs(self.root, exist_ok=True)
        self._lock = open(os.path.join(self.root, ".lock"), "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._lock.close()
            raise ShardError(f"{self.root!r} is being written by another process "
                             "(.lock is held)") from e
        if os.path.isfile(os.path.join(self.root, MANIFEST)):
            self.manifest = read_manifest(self.root)
            mine, theirs = self.target_info["fingerprint"], self.manifest["target"]["fingerprint"]
            if mine != theirs:
                raise ShardError(
                    f"{self.root!r} holds data of another target (fingerprint {theirs[:12]}, "
                    f"name {self.manifest['target'].get('name')!r}); this one is "
                    f"{mine[:12]} ({self.target_info.get('name')!r}): use a new --out")
        else:
            self.manifest = {"format": FORMAT, "version": VERSION, "target": self.target_info,
                             "token_dtype": token_dtype(self.target_info["vocab_size"]).name,
                             "shards": []}
            self._write_manifest()
        self._clean()
        for entry in self.manifest["shards"]:
            meta = read_shard_meta(self.root, entry["name"])
            self.done.update(zip(meta["ids"], meta["modes"]))
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["token_dtype"])

    def _clean(self) -> None:
        listed = {e["name"] for e in self.manifest["shards"]}
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.startswith(".tmp-") or (name.startswith("shard-") and name not in listed) \
                    or name == MANIFEST + ".tmp":
                log.warning("removing uncommitted %s (a previous run stopped while writing)",
                            path)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def _write_manifest(self) -> None:
        shards = self.manifest["shards"]
        self.manifest["totals"] = {
            "shards": len(shards), "examples": sum(e["examples"] for e in shards),
            "tokens": sum(e["tokens"] for e in shards),
            "response_tokens": sum(e["response_tokens"] for e in shards)}
        tmp = os.path.join(self.root, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, MANIFEST))
        _fsync_dir(self.root)

    def _next_name(self) -> str:
        listed = {e["name"] for e in self.manifest["shards"]}
        while True:
            name = f"shard-{self.run}-{self._seq:05d}"
            self._seq += 1
            if name not in listed:
                return name

    def write_shard(self, tokens: np.ndarray, index: np.ndarray, meta: dict,
                    settings: dict) -> str | None:
        """Commit one shard: ``tokens [T]`` (this directory's token dtype), ``index [n]``
        (:data:`INDEX_DTYPE`), ``meta`` (:data:`META_KEYS`, lists of n strings),
        ``settings`` (how it was generated, recorded in the manifest). An ``(id, mode)``
        already in :attr:`done` (or twice in the shard) is an error: callers skip those.
        Returns the shard's name (``None`` when ``n == 0``)."""
        n = len(index)
        if n == 0:
            return None
        if any(len(meta[k]) != n for k in META_KEYS):
            raise ValueError(f"meta lists must all have {n} entries")
        pairs = list(zip(meta["ids"], meta["modes"]))
        already = self.done.intersection(pairs)
        if already:
            raise ValueError(f"(id, mode) pairs already written: {sorted(already)[:3]}")
        if len(set(pairs)) != n:
            raise ValueError("an (id, mode) pair appears twice in one shard")
        name = self._next_name()
        tmp = os.path.join(self.root, ".tmp-" + name)
        os.makedirs(tmp)
        np.save(os.path.join(tmp, "tokens.npy"), np.ascontiguousarray(tokens, self.dtype))
        np.save(os.path.join(tmp, "index.npy"), np.ascontiguousarray(index, INDEX_DTYPE))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({k: list(meta[k]) for k in META_KEYS}, f)
        self._commit_dir(tmp, name, self._entry(name, tmp, index, meta, settings))
        self.done.update(pairs)
        return name

    def _entry(self, name: str, folder: str, index: np.ndarray, meta: dict,
               settings: dict) -> dict:
        counts: dict = {}
        for mode, kind in zip(meta["modes"], meta["kinds"]):
            counts.setdefault(mode, {}).setdefault(kind, 0)
            counts[mode][kind] += 1
        return {"name": name, "examples": int(len(index)),
                "tokens": int(index["prompt_len"].sum() + index["response_len"].sum()),
                "response_tokens": int(index["response_len"].sum()), "counts": counts,
                "settings": settings,
                "sha256": {f: file_sha256(os.path.join(folder, f)) for f in SHARD_FILES},
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "host": socket.gethostname()}

    def _commit_dir(self, tmp: str, name: str, entry: dict) -> None:
        for file in SHARD_FILES:
            with open(os.path.join(tmp, file), "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.root, name))
        _fsync_dir(self.root)
        self.manifest["shards"].append(entry)
        self._write_manifest()

    def copy_shard(self, source_root: str, entry: dict) -> str:
        """Commit a copy of another directory's committed shard ``entry`` (files checked
        against its sha256); its pairs must all be new here."""
        meta = read_shard_meta(source_root, entry["name"])
        pairs = list(zip(meta["ids"], meta["modes"]))
        if self.done.intersection(pairs):
            raise ValueError("copy_shard: some (id, mode) pairs are already written")
        name = self._next_name()
        tmp = os.path.join(self.root, ".tmp-" + name)
        os.makedirs(tmp)
        for file in SHARD_FILES:
            shutil.copyfile(os.path.join(source_root, entry["name"], file),
                            os.path.join(tmp, file))
            if file_sha256(os.path.join(tmp, file)) != entry["sha256"][file]:
                raise ShardError(f"{os.path.join(source_root, entry['name'], file)}: sha256 "
                                 "mismatch (corrupt or truncated copy)")
        self._commit_dir(tmp, name, dict(entry, name=name, merged_from=entry["name"]))
        self.done.update(pairs)
        return name


def merge_shards(dest: str, sources: Iterable[str]) -> dict:
    """Add every ``(id, mode)`` of ``sources`` that ``dest`` lacks (``dest`` is created if
    needed; the first occurrence wins, in the order given). Whole shards without duplicates
    are copied (checksums verified); shards with some are rewritten without them. All
    directories must hold data of one target. Returns counts."""
    sources = list(sources)
    if not sources:
        raise ValueError("merge needs at least one source directory")
    manifests = []
    for src in sources:
        if os.path.abspath(src) == os.path.abspath(dest):
            raise ValueError(f"source {src!r} is the destination")
        manifests.append(read_manifest(src))
        verify_shards(src)
    copied = rewritten = added = dropped = 0
    with ShardWriter(dest, manifests[0]["target"]) as writer:
        for src, manifest in zip(sources, manifests):
            if manifest["target"]["fingerprint"] != writer.target_info["fingerprint"]:
                raise ShardError(f"{src!r} holds data of another target than {dest!r}")
            for entry in manifest["shards"]:
                meta = read_shard_meta(src, entry["name"])
                pairs = list(zip(meta["ids"], meta["modes"]))
                keep, seen = [], set(writer.done)
                for i, pair in enumerate(pairs):
                    if pair not in seen:
                        keep.append(i)
                        seen.add(pair)
                dropped += len(pairs) - len(keep)
                added += len(keep)
                if len(keep) == len(pairs):
                    writer.copy_shard(src, entry)
                    copied += 1
                elif keep:
                    tokens = np.load(os.path.join(src, entry["name"], "tokens.npy"),
                                     mmap_mode="r")
                    index = np.load(os.path.join(src, entry["name"], "index.npy"))[keep]
                    pieces = [tokens[s:s + p + r] for s, p, r in
                              zip(index["start"], index["prompt_len"], index["response_len"])]
                    lengths = index["prompt_len"].astype(np.int64) + index["response_len"]
                    index["start"] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
                    writer.write_shard(np.concatenate(pieces), index,
                                       {k: [meta[k][i] for i in keep] for k in META_KEYS},
                                       entry["settings"])
                    rewritten += 1
    return {"added": added, "duplicates_dropped": dropped, "shards_copied": copied,
            "shards_rewritten": rewritten}


# ----------------------------------------------------------------------------- reading

class _ShardIndex:
    """Everything about a shards directory except the tokens: per-example arrays over all
    committed shards (``shard`` / ``start`` / lengths / stopped) and the string metadata;
    token files are memory-mapped on first use."""

    def __init__(self, root: str):
        manifest = read_manifest(root)
        self.root, self.names = root, [e["name"] for e in manifest["shards"]]
        shard, index, meta = [], [], {k: [] for k in META_KEYS}
        for s, name in enumerate(self.names):
            path = os.path.join(root, name, "index.npy")
            try:
                part = np.load(path)
            except (OSError, ValueError) as e:
                raise ShardError(f"{path}: unreadable ({e})") from e
            part_meta = read_shard_meta(root, name)
            if part.dtype != INDEX_DTYPE or any(len(part_meta[k]) != len(part)
                                                for k in META_KEYS):
                raise ShardError(f"{os.path.join(root, name)}: index.npy and meta.json "
                                 "disagree (corrupt shard)")
            index.append(part)
            shard.append(np.full(len(part), s, np.int32))
            for k in META_KEYS:
                meta[k] += part_meta[k]
        self.index = np.concatenate(index) if index else np.zeros((0,), INDEX_DTYPE)
        self.shard = np.concatenate(shard) if shard else np.zeros((0,), np.int32)
        self.meta = {k: np.asarray(v, dtype=object) for k, v in meta.items()}
        self._tokens: dict[int, np.ndarray] = {}

    def tokens(self, shard: int) -> np.ndarray:
        if shard not in self._tokens:
            path = os.path.join(self.root, self.names[shard], "tokens.npy")
            self._tokens[shard] = np.load(path, mmap_mode="r")
        return self._tokens[shard]


class ShardDataset(collections.abc.Sequence):
    """The examples of a shards directory, read lazily (token files memory-mapped).

    ``ds[i] -> {"input_ids": int32 [n], "loss_mask": int32 [n]}`` (prompt then response;
    the mask is 1 on the response), ``len(ds)``. ``kinds`` / ``modes`` keep only those
    examples (unknown names raise, listing the ones present). Per-example arrays
    (:attr:`prompt_lengths`, :attr:`response_lengths`, :attr:`stopped`) and strings
    (:attr:`ids`, :attr:`kinds`, :attr:`modes`, :attr:`sources`) need no token reads;
    :meth:`select` and :meth:`filter` return views (index arrays), never copies of tokens.
    """

    def __init__(self, root: str, kinds: Sequence[str] | None = None,
                 modes: Sequence[str] | None = None, *, _index: _ShardIndex | None = None,
                 _rows: np.ndarray | None = None):
        self._index = _index if _index is not None else _ShardIndex(root)
        self.root = self._index.root
        rows = np.arange(len(self._index.index)) if _rows is None else _rows
        for key, wanted in (("kinds", kinds), ("modes", modes)):
            if wanted is None:
                continue
            wanted = [wanted] if isinstance(wanted, str) else list(wanted)
            present = set(self._index.meta[key])
            unknown = [w for w in wanted if w not in present]
            if unknown:
                raise ValueError(f"{root}: no example has {key[:-1]} {unknown}; present: "
                                 f"{sorted(present)}")
            rows = rows[np.isin(self._index.meta[key][rows], wanted)]
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(np.arange(len(self))[i])
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} out of range for {len(self)} examples")
        row = self._rows[i]
        entry = self._index.index[row]
        prompt_len, response_len = int(entry["prompt_len"]), int(entry["response_len"])
        start = int(entry["start"])
        tokens = self._index.tokens(int(self._index.shard[row]))
        input_ids = np.asarray(tokens[start:start + prompt_len + response_len], np.int32)
        loss_mask = np.zeros(prompt_len + response_len, np.int32)
        loss_mask[prompt_len:] = 1
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    def _field(self, name: str) -> np.ndarray:
        return self._index.index[name][self._rows]

    @property
    def prompt_lengths(self) -> np.ndarray:
        return self._field("prompt_len").astype(np.int64)

    @property
    def response_lengths(self) -> np.ndarray:
        return self._field("response_len").astype(np.int64)

    @property
    def stopped(self) -> np.ndarray:
        return self._field("stopped")

    def _meta(self, key: str) -> list[str]:
        return list(self._index.meta[key][self._rows])

    ids = property(lambda self: self._meta("ids"))
    kinds = property(lambda self: self._meta("kinds"))
    modes = property(lambda self: self._meta("modes"))
    sources = property(lambda self: self._meta("sources"))

    def loss_tokens(self, max_length: int | None = None) -> np.ndarray:
        """Response tokens inside the first ``max_length`` tokens of each example."""
        prompt, response = self.prompt_lengths, self.response_lengths
        if max_length is None:
            return response
        return np.clip(np.minimum(prompt + response, max_length) - prompt, 0, None)

    def select(self, positions) -> "ShardDataset":
        """A view of ``self[p] for p in positions`` (integer positions or a boolean mask)."""
        positions = np.asarray(positions)
        if positions.dtype == bool:
            positions = np.flatnonzero(positions)
        return ShardDataset(self.root, _index=self._index, _rows=self._rows[positions])

    def filter(self, min_loss_tokens: int, max_length: int) -> "ShardDataset":
        """Examples with at least ``min_loss_tokens`` response tokens within ``max_length``."""
        return self.select(self.loss_tokens(max_length) >= min_loss_tokens)

    def summary(self) -> dict:
        """Counts per (mode, kind), examples, tokens, response tokens."""
        counts: dict = {}
        for mode, kind in zip(self.modes, self.kinds):
            counts.setdefault(mode, collections.Counter())[kind] += 1
        return {"examples": len(self), "counts": {m: dict(c) for m, c in counts.items()},
                "tokens": int((self.prompt_lengths + self.response_lengths).sum()),
                "response_tokens": int(self.response_lengths.sum())}
