"""A directory as checksummed parts of at most N MiB, and back (moving runs between machines).

    manifest = split_directory("runs/domino", "parts/", part_mib=15, group_files=8,
                               group_mib=64)
    join_parts("parts/", "runs/domino-copy")        # verified, then restored

The source directory (an orbax checkpoint folder, or a whole run folder: ``checkpoints/``,
``metrics.jsonl``, ``curve.json``, ``train_config.json``, ``draft/``) (less any
``exclude`` globs, e.g. all but the latest checkpoint) is written as one uncompressed tar
stream (entries sorted, owners cleared) cut into ``part-NNNNN.bin`` files of
at most ``part_mib`` MiB each. ``manifest.json`` records, for every part, its size and
sha256, the whole stream's size and sha256, and every file's relative path and size. Nothing
is held in memory whole: parts are written and read in 1 MiB chunks.

Transfers limited in files and bytes per call (the lent GPU machine returns at most 8 files
of 16 MiB, 64 MiB together, per call): ``group_files`` / ``group_mib`` put the parts into
``transfer-NN/`` folders that each fit one transfer; ``transfer-00/`` also holds the
manifest (it counts as one file). :func:`plan_split` says how many parts and transfers a
directory needs without writing anything.

:func:`join_parts` finds the manifest and parts anywhere up to two folders below the parts
folder (so the transfer folders may be fetched into one folder or kept apart), checks every
part's size and sha256 before anything is written (a missing or corrupt part raises
:class:`PartsError` naming it), extracts into a temporary sibling of ``dest``, checks the
whole stream's sha256 and the file list, then renames it into place.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from typing import Iterator, Sequence

FORMAT = "domino_jax.checkpoint_parts/1"
MANIFEST = "manifest.json"
MIB = 1 << 20
_CHUNK = MIB
_MANIFEST_RESERVE = MIB         # bytes kept free in transfer-00 for the manifest


class PartsError(ValueError):
    """A bad split/join request or a missing / corrupt part (the message names it)."""


def part_name(index: int) -> str:
    return f"part-{index:05d}.bin"


def group_name(index: int) -> str:
    return f"transfer-{index:02d}"


# ----------------------------------------------------------------------------- streams

class _PartWriter(io.RawIOBase):
    """A write-only stream cut into files of at most ``part_bytes`` under ``out_dir``,
    hashing each part and the whole stream as it goes."""

    def __init__(self, out_dir: str | None, part_bytes: int):
        self.out_dir, self.part_bytes = out_dir, part_bytes
        self.parts: list[dict] = []
        self.total = hashlib.sha256()
        self.size = 0
        self._file = None
        self._hash = None
        self._filled = 0

    def writable(self) -> bool:
        return True

    def _rotate(self) -> None:
        self._finish_part()
        name = part_name(len(self.parts))
        self._file = open(os.path.join(self.out_dir, name), "wb") if self.out_dir else None
        self._hash, self._filled = hashlib.sha256(), 0
        self.parts.append({"name": name})

    def _finish_part(self) -> None:
        if self._hash is None:
            return
        if self._file is not None:
            self._file.close()
        self.parts[-1].update(size=self._filled, sha256=self._hash.hexdigest())
        self._file = self._hash = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._hash is None or self._filled == self.part_bytes:
                self._rotate()
            piece = view[done:done + self.part_bytes - self._filled]
            if self._file is not None:
                self._file.write(piece)
            self._hash.update(piece)
            self.total.update(piece)
            self._filled += len(piece)
            done += len(piece)
        self.size += done
        return done

    def close(self) -> None:
        self._finish_part()
        super().close()


class _PartReader(io.RawIOBase):
    """The concatenation of ``paths`` as one read-only stream, hashing what it reads."""

    def __init__(self, paths: list[str]):
        self._paths = iter(paths)
        self._file = None
        self.total = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:
                    return 0
                self._file = open(path, "rb")
            n = self._file.readinto(buffer)
            if n:
                self.total.update(memoryview(buffer)[:n])
                self.size += n
                return n
            self._file.close()
            self._file = None

    def drain(self) -> None:
        """Read to the end (tar's zero padding after the last member counts in the hash)."""
        buffer = bytearray(_CHUNK)
        while self.readinto(buffer):
            pass

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _clear_owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    """Whether ``rel`` (``/``-separated) or a folder above it matches a glob of ``patterns``."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(prefix, p) for prefix in prefixes for p in patterns)


def _listing(src: str, exclude: Sequence[str] = ()) -> list[dict]:
    """Every regular file under ``src`` not excluded: relative path (``/``-separated) and
    size, sorted."""
    files = []
    for root, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            if os.path.isfile(path) and not os.path.islink(path) and not _excluded(rel, exclude):
                files.append({"path": rel, "size": os.path.getsize(path)})
    return files


def _write_tar(src: str, sink: _PartWriter, exclude: Sequence[str] = ()) -> None:
    def member(info: tarfile.TarInfo):
        return None if _excluded(info.name, exclude) else _clear_owner(info)

    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(src)):
            tar.add(os.path.join(src, name), arcname=name, filter=member)
    sink.close()


def latest_only_excludes(src: str) -> list[str]:
    """Globs that keep only the latest orbax step of a run folder (``checkpoints/<step>``,
    ``best/`` dropped) or of a checkpoint folder: what resuming elsewhere needs."""
    def older_steps(folder: str, prefix: str) -> list[str]:
        if not os.path.isdir(folder):
            return []
        steps = sorted((int(n) for n in os.listdir(folder)
                        if n.isdigit() and os.path.isdir(os.path.join(folder, n))))
        return [f"{prefix}{s}" for s in steps[:-1]]

    inner = os.path.join(src, "checkpoints")
    if os.path.isdir(inner):
        return older_steps(inner, "checkpoints/") + ["best"]
    return older_steps(src, "")


# ----------------------------------------------------------------------------- split

@dataclasses.dataclass(frozen=True)
class Grouping:
    """How parts are put into transfers: at most ``files`` files and ``mib`` MiB each
    (``None``: unlimited); the manifest counts as one file of transfer 0."""

    files: int | None = None
    mib: float | None = None

    @property
    def enabled(self) -> bool:
        return self.files is not None or self.mib is not None

    def assign(self, sizes: list[int]) -> list[int]:
        """The transfer index of each part (parts kept in order)."""
        groups, group, files, used = [], 0, 1, _MANIFEST_RESERVE      # group 0: the manifest
        for size in sizes:
            full = (self.files is not None and files + 1 > self.files) or \
                   (self.mib is not None and used + size > self.mib * MIB)
            if full and files > (1 if group == 0 else 0):
                group, files, used = group + 1, 0, 0
            groups.append(group)
            files, used = files + 1, used + size
        return groups


def _check_request(src: str, part_mib: float, grouping: Grouping) -> int:
    if not os.path.isdir(src):
        raise PartsError(f"source {src!r} is not a directory")
    if not part_mib > 0:
        raise PartsError(f"--part-mib must be > 0, got {part_mib}")
    part_bytes = int(part_mib * MIB)
    if part_bytes < 512 * 20:
        raise PartsError(f"--part-mib {part_mib} is below one tar record (10 KiB)")
    if grouping.files is not None and grouping.files < 2:
        raise PartsError(f"--group-files must be >= 2 (the manifest + a part), got "
                         f"{grouping.files}")
    if grouping.mib is not None and grouping.mib * MIB < part_bytes + _MANIFEST_RESERVE:
        raise PartsError(f"--group-mib {grouping.mib} cannot hold one part of --part-mib "
                         f"{part_mib} beside the manifest")
    return part_bytes


def plan_split(src: str, part_mib: float = 16.0, group_files: int | None = None,
               group_mib: float | None = None, exclude: Sequence[str] = ()) -> dict:
    """What :func:`split_directory` would write, without writing: ``{"stream_bytes",
    "parts", "transfers", "files"}`` (the tar stream is generated and counted, not stored)."""
    grouping = Grouping(group_files, group_mib)
    part_bytes = _check_request(src, part_mib, grouping)
    sink = _PartWriter(None, part_bytes)
    _write_tar(src, sink, exclude)
    groups = grouping.assign([p["size"] for p in sink.parts])
    return {"stream_bytes": sink.size, "parts": len(sink.parts),
            "transfers": (max(groups) + 1) if groups else 1,
            "files": len(_listing(src, exclude)), "excluded": list(exclude)}


def split_directory(src: str, out_dir: str, part_mib: float = 16.0,
                    group_files: int | None = None, group_mib: float | None = None,
                    exclude: Sequence[str] = ()) -> dict:
    """Write ``src`` as parts + ``manifest.json`` into ``out_dir`` (new or empty); returns
    the manifest. With ``group_files`` / ``group_mib`` the parts go into ``transfer-NN/``
    folders (the manifest into ``transfer-00/``), each within those limits. ``exclude``:
    globs of relative paths left out (a matching folder drops all below it), e.g.
    :func:`latest_only_excludes`."""
    grouping = Grouping(group_files, group_mib)
    part_bytes = _check_request(src, part_mib, grouping)
    if os.path.abspath(out_dir).startswith(os.path.abspath(src) + os.sep):
        raise PartsError(f"output {out_dir!r} is inside the source {src!r}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise PartsError(f"output {out_dir!r} exists and is not an empty directory")
    os.makedirs(out_dir, exist_ok=True)
    files = _listing(src, exclude)
    sink = _PartWriter(out_dir, part_bytes)
    _write_tar(src, sink, exclude)
    groups = grouping.assign([p["size"] for p in sink.parts]) if grouping.enabled else None
    manifest_dir = out_dir
    for i, part in enumerate(sink.parts):
        path = part["name"]
        if groups is not None:
            path = f"{group_name(groups[i])}/{part['name']}"
            os.makedirs(os.path.join(out_dir, group_name(groups[i])), exist_ok=True)
            os.replace(os.path.join(out_dir, part["name"]), os.path.join(out_dir, path))
        part["path"] = path
    if groups is not None:
        manifest_dir = os.path.join(out_dir, group_name(0))
        os.makedirs(manifest_dir, exist_ok=True)
    manifest = {"format": FORMAT, "source": os.path.basename(os.path.abspath(src)),
                "part_bytes": part_bytes, "stream_bytes": sink.size,
                "stream_sha256": sink.total.hexdigest(), "num_parts": len(sink.parts),
                "num_transfers": (max(groups) + 1) if groups else 1,
                "grouping": dataclasses.asdict(grouping), "excluded": list(exclude),
                "parts": sink.parts,
                "files": files}
    tmp = os.path.join(manifest_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(manifest_dir, MANIFEST))
    return manifest


# ----------------------------------------------------------------------------- join

def _walk_limited(root: str, depth: int = 2) -> Iterator[str]:
    """Files under ``root`` at most ``depth`` folders down."""
    for dirpath, dirs, names in os.walk(root):
        level = os.path.relpath(dirpath, root).count(os.sep) + (dirpath != root)
        if level >= depth:
            dirs[:] = []
        for name in names:
            yield os.path.join(dirpath, name)


def find_manifest(parts_dir: str) -> str:
    """The one ``manifest.json`` at most two folders below ``parts_dir``."""
    if not os.path.isdir(parts_dir):
        raise PartsError(f"parts folder {parts_dir!r} is not a directory")
    found = sorted(p for p in _walk_limited(parts_dir) if os.path.basename(p) == MANIFEST)
    if not found:
        raise PartsError(f"no {MANIFEST} in {parts_dir!r} (nor up to two folders below): "
                         "fetch transfer-00 (it holds the manifest)")
    if len(found) > 1:
        raise PartsError(f"several manifests under {parts_dir!r}: {found}; join one split "
                         "at a time")
    return found[0]


def read_manifest(path: str) -> dict:
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PartsError(f"{path}: not a readable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PartsError(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}"
                         f" is not {FORMAT!r}")
    for key in ("parts", "stream_sha256", "stream_bytes", "files"):
        if key not in manifest:
            raise PartsError(f"{path}: missing key {key!r}")
    return manifest


def verify_parts(parts_dir: str) -> tuple[dict, list[str]]:
    """``(manifest, part paths in order)`` after checking each part's size and sha256;
    raises :class:`PartsError` naming the first missing or corrupt part."""
    manifest_path = find_manifest(parts_dir)
    manifest = read_manifest(manifest_path)
    by_name: dict[str, list[str]] = {}
    for path in _walk_limited(parts_dir):
        by_name.setdefault(os.path.basename(path), []).append(path)
    paths = []
    total = len(manifest["parts"])
    for i, part in enumerate(manifest["parts"]):
        name = part["name"]
        expected = os.path.join(parts_dir, part.get("path", name))
        where = expected if os.path.isfile(expected) else None
        if where is None:
            candidates = by_name.get(name, [])
            if len(candidates) > 1:
                raise PartsError(f"part {name} ({i + 1} of {total}) is present several "
                                 f"times under {parts_dir!r}: {sorted(candidates)}")
            where = candidates[0] if candidates else None
        if where is None:
            raise PartsError(f"part {name} ({i + 1} of {total}, {part['size']} bytes) is "
                             f"missing under {parts_dir!r} (expected at {part.get('path', name)})")
        size = os.path.getsize(where)
        if size != part["size"]:
            raise PartsError(f"part {name} ({i + 1} of {total}) at {where} is corrupt: "
                             f"{size} bytes, the manifest says {part['size']}")
        digest = _file_sha256(where)
        if digest != part["sha256"]:
            raise PartsError(f"part {name} ({i + 1} of {total}) at {where} is corrupt: "
                             f"sha256 {digest}, the manifest says {part['sha256']}")
        paths.append(where)
    return manifest, paths


def join_parts(parts_dir: str, dest: str) -> dict:
    """Restore the directory of ``parts_dir``'s split into ``dest`` (new, or an empty
    folder); returns the manifest. Every part is verified before anything is written."""
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise PartsError(f"destination {dest!r} exists and is not an empty directory")
    manifest, paths = verify_parts(parts_dir)
    parent = os.path.dirname(os.path.abspath(dest))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".join-", dir=parent)
    try:
        reader = _PartReader(paths)
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            tar.extractall(staging, filter="data")
        reader.drain()
        if reader.total.hexdigest() != manifest["stream_sha256"] \
                or reader.size != manifest["stream_bytes"]:
            raise PartsError(f"{parts_dir}: the joined stream's sha256 "
                             f"{reader.total.hexdigest()} ({reader.size} bytes) is not the "
                             f"manifest's {manifest['stream_sha256']}")
        listing = _listing(staging)
        if listing != manifest["files"]:
            want = {f["path"]: f["size"] for f in manifest["files"]}
            got = {f["path"]: f["size"] for f in listing}
            diff = sorted(set(want.items()) ^ set(got.items()))[:5]
            raise PartsError(f"{parts_dir}: restored files differ from the manifest's list "
                             f"(first differences: {diff})")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)              # mkdtemp made it 0700
        if os.path.isdir(dest):
            os.rmdir(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest
