"""Training built for long runs: checkpoint parts (split / join with checksums), exact resume
(bitwise, through split -> join), held-out tau with the real decode loop, the curve, the
checkpoints kept (tiny random target, CPU, float32)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.models.qwen3 import TargetLM
from domino_jax.train import checkpoint_parts as parts
from domino_jax.train.config import TrainConfig, make_draft_config
from domino_jax.train.curve import read_curve
from domino_jax.train.evaluate import (ALL, EvalConfig, HeldoutEvaluator, heldout_tau,
                                       read_eval_prompts)
from test_train import (SMALL, TARGET, random_target_params,  # the tiny target and data
                        synthetic_examples)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"chat": ["hello there", "tell me a story", "why is the sky blue"],
         "math": ["1 + 2 =", "what is 7 times 8"], "code": ["def f(x):"]}


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character (the tiny target has 64 ids)."""
    return [1 + (ord(c) % 60) for c in text]


@pytest.fixture(scope="module")
def target_params():
    return random_target_params()


def write_prompts(path, kinds=KINDS) -> str:
    with open(path, "w") as f:
        for kind, texts in kinds.items():
            for t in texts:
                f.write(json.dumps({"id": t[:4], "kind": kind, "prompt": t}) + "\n")
    return str(path)


def run(out, target_params, cfg, **kw):
    from domino_jax.train.loop import train

    return train(cfg, None, None, str(out), examples=synthetic_examples(),
                 target=TargetLM(TARGET), target_params=target_params, export=False,
                 progress=False, encode=encode, **SMALL, **kw)


def assert_trees_equal(a, b):
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def make_tree(root, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def same_tree(a, b) -> bool:
    listing = lambda root: {os.path.relpath(os.path.join(d, n), root):
                            open(os.path.join(d, n), "rb").read()
                            for d, _, names in os.walk(root) for n in names}
    return listing(a) == listing(b)


# ----------------------------------------------------------------------------- parts

def test_split_join_round_trip_and_groups(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "run"
    make_tree(src, {"checkpoints/4/state/d/blob": rng.bytes(300_000),
                    "checkpoints/4/meta/metadata": b'{"tokens_seen": 7}',
                    "metrics.jsonl": b'{"step": 1}\n', "empty.txt": b"",
                    "curve.json": b'{"points": []}'})
    part_mib, group_mib = 0.05, 0.25 + 1.0           # ~52 KB parts; 1 MiB manifest reserve
    plan = parts.plan_split(str(src), part_mib, group_files=3, group_mib=group_mib)
    manifest = parts.split_directory(str(src), str(tmp_path / "parts"), part_mib,
                                     group_files=3, group_mib=group_mib)
    assert plan["parts"] == manifest["num_parts"] >= 6
    assert plan["transfers"] == manifest["num_transfers"] >= 3
    assert len(manifest["files"]) == 5
    for group in sorted(os.listdir(tmp_path / "parts")):
        names = os.listdir(tmp_path / "parts" / group)
        sizes = [os.path.getsize(tmp_path / "parts" / group / n) for n in names]
        assert len(names) <= 3 and sum(sizes) <= group_mib * parts.MIB
        assert all(s <= part_mib * parts.MIB for s in sizes)
        assert (parts.MANIFEST in names) == (group == "transfer-00")
    # fetched into one flat folder (as transfers arrive), the join still finds every part
    flat = tmp_path / "fetched"
    flat.mkdir()
    for group in os.listdir(tmp_path / "parts"):
        for name in os.listdir(tmp_path / "parts" / group):
            os.link(tmp_path / "parts" / group / name, flat / name)
    parts.join_parts(str(flat), str(tmp_path / "back"))
    assert same_tree(src, tmp_path / "back")
    with pytest.raises(parts.PartsError, match="not an empty directory"):
        parts.join_parts(str(flat), str(tmp_path / "back"))


def test_join_names_missing_and_corrupt_parts(tmp_path):
    src = tmp_path / "ckpt"
    make_tree(src, {"a/b": np.random.default_rng(1).bytes(200_000)})
    out = tmp_path / "parts"
    manifest = parts.split_directory(str(src), str(out), 0.05)
    assert manifest["num_parts"] == 4
    victim = out / "part-00002.bin"
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(parts.PartsError, match=r"part-00002\.bin \(3 of 4\).*corrupt: sha256"):
        parts.join_parts(str(out), str(tmp_path / "dest"))
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(parts.PartsError, match=r"part-00002\.bin .*corrupt: 52427 bytes"):
        parts.join_parts(str(out), str(tmp_path / "dest"))
    victim.unlink()
    with pytest.raises(parts.PartsError, match=r"part-00002\.bin \(3 of 4, 52428 bytes\) is "
                                                r"missing"):
        parts.join_parts(str(out), str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".join-")]
    cli = [sys.executable, "-m", "domino_jax.train.parts"]
    proc = subprocess.run(cli + ["join", str(out), str(tmp_path / "dest")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "part-00002.bin" in proc.stderr, proc.stderr
    proc = subprocess.run(cli + ["split", str(src), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not an empty directory" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- resume

CFG = TrainConfig(drafter="domino", steps=6, batch_size=4, micro_batches=2, max_length=48,
                  num_anchors=8, lr=3e-2, compute_dtype="float32", log_every=1,
                  checkpoint_every=2)


@pytest.fixture(scope="module")
def runs(target_params, tmp_path_factory):
    """One uninterrupted run; the same run interrupted after step 3 (its last checkpoint:
    step 2; an older step 1 planted beside it), split into parts (``--latest-only``: the
    older step and best/ stay behind), joined elsewhere and resumed there (``--resume``); and a
    second join resumed with ``resume_from`` its checkpoint folder into a new run folder.
    Held-out evaluations every 3 steps (not on a checkpoint step: the resumed run's point at
    step 3 averages steps 1-3 as the uninterrupted one's does), the last 2 checkpoints and
    the best kept."""
    from domino_jax.decode import speculative

    tmp = tmp_path_factory.mktemp("longrun")
    programs = speculative._PROGRAMS.builds
    ev = EvalConfig(prompts=write_prompts(tmp / "heldout.jsonl"), every=3, max_new_tokens=8,
                    num_prompts=2)
    kw = dict(eval_config=ev, keep_checkpoints=2, keep_best=True)
    full = run(tmp / "full", target_params, CFG, **kw)
    run(tmp / "cut", target_params, CFG, stop_after=3, **kw)
    cut_curve = read_curve(str(tmp / "cut"))
    shutil.copytree(tmp / "cut" / "checkpoints" / "2", tmp / "cut" / "checkpoints" / "1")
    proc = subprocess.run([sys.executable, "-m", "domino_jax.train.parts", "split",
                           str(tmp / "cut"), str(tmp / "parts"), "--part-mib", "0.05",
                           "--group-files", "3", "--group-mib", "1.5", "--latest-only"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["transfers"] >= 2
    files = parts.read_manifest(str(tmp / "parts" / "transfer-00" / parts.MANIFEST))["files"]
    assert not [f for f in files if f["path"].startswith(("best/", "checkpoints/1/"))]
    parts.join_parts(str(tmp / "parts"), str(tmp / "moved"))
    resumed = run(tmp / "moved", target_params, CFG, resume=True, **kw)
    parts.join_parts(str(tmp / "parts"), str(tmp / "moved2"))
    again = run(tmp / "elsewhere", target_params, CFG,
                resume_from=str(tmp / "moved2" / "checkpoints"), **kw)
    return dict(tmp=tmp, ev=ev, full=full, resumed=resumed, again=again, cut_curve=cut_curve,
                decode_programs=speculative._PROGRAMS.builds - programs)


def _strip(curve):
    return [{k: v for k, v in p.items() if k not in ("wall_seconds", "eval_seconds")}
            for p in curve]


def test_start_evaluation_on_a_thread(runs, target_params, tmp_path):
    """``start_in_background``: the step-0 evaluation runs beside training, and the curve is
    the one evaluated in line: the same tau at step 0 and at the end (greedy decode, the same
    params), the step-0 point first, no loss yet; training is the same."""
    ev = dataclasses.replace(runs["ev"], every=0, start_in_background=True)
    result = run(tmp_path / "ahead", target_params, CFG, eval_config=ev)
    full = runs["full"]
    assert [p["step"] for p in result.curve] == [0, 6]
    assert result.curve[0]["tau"] == full.curve[0]["tau"]
    assert result.curve[0]["loss"] is None and result.curve[0]["eval_seconds"] > 0
    assert result.curve[-1]["tau"] == full.curve[-1]["tau"]
    assert_trees_equal(full.state, result.state)
    assert [p["step"] for p in read_curve(str(tmp_path / "ahead"))] == [0, 6]


def test_exact_resume_through_split_and_join(runs):
    """Params, optimizer state, losses, tokens seen and held-out tau of the resumed runs are
    bitwise the uninterrupted run's (two micro-batches, evaluations along the way)."""
    full, tmp = runs["full"], runs["tmp"]
    assert [p["step"] for p in runs["cut_curve"]] == [0, 3]
    by_step = {h["step"]: h for h in full.history}
    for resumed in (runs["resumed"], runs["again"]):
        assert [h["step"] for h in resumed.history] == [3, 4, 5, 6]
        assert_trees_equal(full.state, resumed.state)
        for h in resumed.history:
            assert h["loss"] == by_step[h["step"]]["loss"]
            assert h["tokens_seen"] == by_step[h["step"]]["tokens_seen"]
        assert _strip(resumed.curve) == _strip(full.curve)
    # 10 evaluations in 4 runs, 2 methods, one batch shape: one prefill and one round loop
    # per method
    assert runs["decode_programs"] == 4
    for name in ("moved", "elsewhere"):                # history carried on, step 3 once
        lines = open(tmp / name / "metrics.jsonl").read().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
        assert _strip(read_curve(str(tmp / name))) == _strip(full.curve)


def test_resume_refuses_changed_settings(runs, target_params, caplog):
    from domino_jax.train.checkpoints import RunError, check_resume_settings

    changed = TrainConfig(**dict(vars(CFG), lr=1e-2, log_every=3))
    with pytest.raises(RunError, match=r"train\.lr: saved 0\.03, now 0\.01") as info:
        run(runs["tmp"] / "moved", target_params, changed, resume=True)
    assert "log_every" not in str(info.value)
    with pytest.raises(RunError, match="holds no orbax checkpoint"):
        run(runs["tmp"] / "s", target_params, CFG, resume_from=str(runs["tmp"]))
    saved = json.load(open(runs["tmp"] / "moved" / "train_config.json"))
    with caplog.at_level("WARNING"):
        check_resume_settings(str(runs["tmp"] / "moved"), saved, saved["examples"] + 1)
    assert "batches from here on differ" in caplog.text        # data appended: allowed


def test_training_bar_shows_the_last_heldout_tau(runs, target_params, monkeypatch):
    """Every logged step's bar postfix carries the latest held-out tau (issue 22)."""
    from domino_jax.train import loop
    from domino_jax.train.evaluate import best_metric

    seen = []
    real = loop.train_postfix
    monkeypatch.setattr(loop, "train_postfix",
                        lambda m, tau=None: seen.append((m["step"], tau)) or real(m, tau))
    result = run(runs["tmp"] / "bar", target_params, CFG, eval_config=runs["ev"], stop_after=4)
    by_step = {p["step"]: best_metric(p["tau"], result.draft_config) for p in result.curve}
    assert [s for s, _ in seen] == [1, 2, 3, 4]
    assert [t for _, t in seen] == [by_step[0]] * 3 + [by_step[3]], (seen, by_step)


def test_curve_and_checkpoints_kept(runs):
    full, tmp = runs["full"], runs["tmp"]
    curve = read_curve(str(tmp / "full"))
    assert curve == full.curve and [p["step"] for p in curve] == [0, 3, 6]
    assert curve[0]["loss"] is None and curve[0]["tokens_seen"] == 0
    for p, q in zip(curve, curve[1:]):
        assert q["tokens_seen"] > p["tokens_seen"] and q["wall_seconds"] > p["wall_seconds"]
        assert q["examples_seen"] == q["step"] * 4 and q["loss"] > 0 and q["lr"] >= 0
        assert set(q["tau"]) == {"dflash", "domino"}
        assert set(q["tau"]["domino"]) == {"chat", "code", "math", ALL}
    assert sorted(os.listdir(tmp / "full" / "checkpoints")) == ["4", "6"]
    scores = [p["tau"]["domino"][ALL] for p in curve]
    best_step = curve[int(np.argmax(scores))]["step"]          # the first of tied bests
    assert os.listdir(tmp / "full" / "best") == [str(best_step)]


def test_curve_cli(runs):
    tmp = runs["tmp"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "domino_jax.train.curve", str(tmp / "full"),
                           str(tmp / "moved"), "--x", "tokens_seen", "--out",
                           str(tmp / "cmp.png")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| step | tokens_seen | loss | lr | tau dflash | tau domino | wall s |" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in proc.stderr
    else:
        assert (tmp / "cmp.png").stat().st_size > 0
        assert (tmp / "full" / "curve.png").stat().st_size > 0
    proc = subprocess.run([sys.executable, "-m", "domino_jax.train.curve", str(tmp)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "curve.json not found" in proc.stderr


# ----------------------------------------------------------------------------- eval

def test_read_eval_prompts(tmp_path):
    got = read_eval_prompts(write_prompts(tmp_path / "h.jsonl"), 2)
    assert got == {"chat": KINDS["chat"][:2], "code": KINDS["code"], "math": KINDS["math"]}
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert read_eval_prompts(str(plain)) == {ALL: ["a", "b"]}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a"}\n{"prompt": "b", "kind": "math"}\n')
    with pytest.raises(ValueError, match="some lines have no \"kind\""):
        read_eval_prompts(str(mixed))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected an object"):
        read_eval_prompts(str(bad))


def test_heldout_tau_is_the_decode_loop_of_the_exported_drafter(runs, target_params, tmp_path):
    """The evaluator's tau per kind equals tau computed here from ``load_pair`` +
    ``generate`` on the trained drafter exported and reloaded as a checkpoint (the same
    decode programs: nothing new is compiled)."""
    from converters.hf_target import export_target
    from domino_jax.decode import speculative
    from domino_jax.decode.loading import load_pair
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.train.loop import export_trained_draft

    full = runs["full"]
    texts = read_eval_prompts(runs["ev"].prompts, 2)
    prompts = {k: [encode(t) for t in v] for k, v in texts.items()}
    target = TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32)
    programs = speculative._PROGRAMS.builds
    evaluator = HeldoutEvaluator(target, target_params, full.draft_config, prompts,
                                 max_new_tokens=8)
    taus = evaluator(full.params)
    assert taus == full.curve[-1]["tau"]                # what the run measured at the end
    export_target(TARGET, target_params, str(tmp_path / "target"))
    export_trained_draft(full.draft_config, full.params, str(tmp_path / "draft"))
    for method in ("dflash", "domino"):
        # np.dtype as the evaluator uses (the program cache key hashes the dtype object)
        t, tp, drafter, dp = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"),
                                       method, jnp.dtype("float32"))
        hists = []
        for rows, real in evaluator._batches():
            out = generate(t, tp, rows, DecodeConfig(method=method, max_new_tokens=8),
                           drafter, dp)
            hists.append(out.accept_hist[:real])
        hist = np.concatenate(hists)
        kinds = np.asarray(evaluator.kinds)
        for kind in list(prompts) + [ALL]:
            rows_hist = hist if kind == ALL else hist[kinds == kind]
            committed = (rows_hist * np.arange(rows_hist.shape[1])).sum()
            assert taus[method][kind] == committed / rows_hist.sum(), (method, kind)
        assert 1.0 <= taus[method][ALL] <= drafter.max_commit
    assert speculative._PROGRAMS.builds == programs   # no program compiled in this test
    assert heldout_tau(target, target_params, full.draft_config, full.params, prompts,
                       ("dflash",), max_new_tokens=8) == {"dflash": taus["dflash"]}
    with pytest.raises(ValueError, match="needs a Domino drafter"):
        HeldoutEvaluator(target, target_params, make_draft_config(TARGET, "dflash", 1, 4),
                         prompts, ("domino",))


@pytest.mark.slow
def test_heldout_tau_tree_method(target_params):
    """A tree method evaluates too (``dominotree@BUDGET``)."""
    from domino_jax.train.loss import init_draft_params

    config = make_draft_config(TARGET, "domino", 1, 4, 16, 8)
    params = init_draft_params(config, jax.random.PRNGKey(3), True, target_params)
    target = TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32)
    taus = heldout_tau(target, target_params, config, params,
                       {"chat": [encode("hi"), encode("hello there")]}, ("dominotree@3",),
                       max_new_tokens=6)
    assert set(taus) == {"dominotree@3"} and 1.0 <= taus["dominotree@3"]["chat"] <= 4.0


def test_heldout_tau_sampled(target_params):
    """``"domino:T1"``: the decode loop at T = 1 (seed = the batch index), its tau equal to a
    direct ``generate`` call's; bad temperatures are refused naming the method."""
    from domino_jax.decode.loading import draft_decode_layout
    from domino_jax.decode.methods import make_drafter, method_options
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.train.evaluate import parse_method, split_temperature
    from domino_jax.train.loss import init_draft_params

    assert split_temperature("domino:T1") == ("domino", 1.0)
    assert split_temperature("dominotree@16:T0.7") == ("dominotree@16", 0.7)
    assert parse_method("dominotree@16:T1") == ("dominotree", {"budget": 16})
    for bad in ("domino:T0", "domino:Tx", "domino:T-1"):
        with pytest.raises(ValueError, match="finite temperature"):
            parse_method(bad)
    config = make_draft_config(TARGET, "domino", 1, 4, 16, 8)
    params = init_draft_params(config, jax.random.PRNGKey(3), False, target_params)
    target = TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32)
    rows = [encode("hi"), encode("hello there")]
    evaluator = HeldoutEvaluator(target, target_params, config, {"chat": rows},
                                 ("domino:T1",), max_new_tokens=6)
    taus = evaluator(params)["domino:T1"]
    dconfig, dparams = draft_decode_layout(config, params, evaluator.target_params, "domino",
                                           True)
    drafter = make_drafter(dconfig, evaluator.target, "domino", method_options("domino"))
    (batch, real), = list(evaluator._batches())
    out = generate(evaluator.target, evaluator.target_params, batch,
                   DecodeConfig(method="domino", max_new_tokens=6,
                                sampling=SamplingConfig(temperature=1.0)),
                   drafter, dparams, seed=0)
    hist = np.asarray(out.accept_hist)[:real]
    assert taus["chat"] == (hist * np.arange(hist.shape[1])).sum() / hist.sum()
    assert 1.0 <= taus["chat"] <= drafter.max_commit


def test_cli_eval_flags_fail_fast(tmp_path):
    from domino_jax.train.__main__ import parse_args

    base = ["--data", "d.npz", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--eval-prompts", str(tmp_path / "missing.jsonl")])
    assert e.value.code == 2
    prompts = write_prompts(tmp_path / "h.jsonl")
    for bad in (["--eval-methods", "domino,nope"], ["--keep-best"],
                ["--drafter", "dflash", "--eval-methods", "domino"]):
        with pytest.raises(SystemExit) as e:
            parse_args(base + ["--eval-prompts", prompts] * ("--keep-best" != bad[0]) + bad)
        assert e.value.code == 2, bad
    args = parse_args(base + ["--eval-prompts", prompts, "--eval-every", "50",
                              "--eval-methods", "dflash,ddtree@8", "--keep-best"])
    assert args.eval_config == EvalConfig(prompts=prompts, every=50,
                                          methods=("dflash", "ddtree@8"))
