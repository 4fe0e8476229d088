"""benchmarks/campaign/device.sh, the lent machine's side of a campaign session: its `fetch`
(what a call may bring back: at most 8 files and 60 MiB, then the next SKIP) and its `stash`
(parts gathered over calls, verified against SHA256SUMS before anything is unpacked)."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "campaign", "device.sh")


def run(args, dj, out, cwd=REPO):
    env = dict(os.environ, DJ=str(dj), OUT=str(out))
    return subprocess.run(["bash", SCRIPT, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def test_fetch_takes_at_most_eight_files_then_the_rest(tmp_path):
    src = tmp_path / "dj" / "out-3" / "shards"
    src.mkdir(parents=True)
    for i in range(11):
        (src / f"part-{i:02d}").write_bytes(bytes([i]) * 1000)
    first = run(["fetch", "out-3/shards"], tmp_path / "dj", tmp_path / "o1")
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(tmp_path / "o1")) == [f"part-{i:02d}" for i in range(8)]
    assert "next: SKIP=8 of 11" in first.stdout
    rest = run(["fetch", "out-3/shards", "8"], tmp_path / "dj", tmp_path / "o2")
    assert sorted(os.listdir(tmp_path / "o2")) == ["part-08", "part-09", "part-10"]
    assert (tmp_path / "o2" / "part-10").read_bytes() == bytes([10]) * 1000


def test_fetch_stops_at_sixty_mib(tmp_path):
    src = tmp_path / "dj" / "xs"
    src.mkdir(parents=True)
    for i in range(3):
        with open(src / f"f{i}", "wb") as f:      # sparse: 25 MiB each, nothing written
            f.truncate(25 * 1024 * 1024)
    res = run(["fetch", "xs"], tmp_path / "dj", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path / "o")) == ["f0", "f1"]
    assert "next: SKIP=2 of 3" in res.stdout


def _carry(root, parts):
    """A checkout-like folder with carry/call-NN/part-NN and SHA256SUMS in each call folder."""
    sums = "".join(f"{hashlib.sha256(data).hexdigest()}  part-{i:02d}\n"
                   for i, data in enumerate(parts))
    for i, data in enumerate(parts):
        call = root / "carry" / f"call-{i:02d}"
        call.mkdir(parents=True)
        (call / f"part-{i:02d}").write_bytes(data)
        (call / "SHA256SUMS").write_text(sums)


def test_stash_waits_for_every_part_and_refuses_a_corrupt_one(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "benchmarks" / "campaign").mkdir(parents=True)
    script = checkout / "benchmarks" / "campaign" / "device.sh"
    script.write_text(open(SCRIPT).read())
    _carry(checkout, [b"first half", b"second half"])
    os.rename(checkout / "carry" / "call-01", tmp_path / "later")     # this call carries call-00
    env = dict(os.environ, DJ=str(tmp_path / "dj"), OUT=str(tmp_path / "o"))
    stash = lambda: subprocess.run(["bash", str(script), "stash"], cwd=checkout, env=env,
                                   capture_output=True, text=True, timeout=60)
    first = stash()
    assert first.returncode == 0 and "waiting for part-01" in first.stdout, first.stdout
    os.rename(tmp_path / "later", checkout / "carry" / "call-01")
    (checkout / "carry" / "call-01" / "part-01").write_bytes(b"second half, damaged")
    second = stash()
    assert second.returncode == 2 and "corrupt" in second.stderr, (second.stdout, second.stderr)
    assert not (tmp_path / "dj" / "ready").exists()
