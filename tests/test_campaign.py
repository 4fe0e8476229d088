"""The campaign runner (domino_jax/train/campaign.py): two rounds on a tiny random target,
each generating fresh data, training from the last round's bf16 drafter, evaluating and
returning the drafter in checksummed parts; the curve's running totals; the prompt slices."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest

from domino_jax.train import campaign
from domino_jax.train.config import make_draft_config
from domino_jax.train.loss import init_draft_params
from test_shards import RECORDS, save_char_tokenizer
from test_train import TARGET, random_target_params


def test_round_prompts_are_fresh_slices():
    records = [{"id": f"{i:04d}", "prompt": str(i)} for i in range(10)]
    r0, r1, r2 = (campaign.round_prompts(records, r, 4) for r in range(3))
    ids = lambda rp: [r["id"] for r in rp.greedy]
    assert not set(ids(r0)) & set(ids(r1))                       # new prompts each round
    assert len(set(ids(r0) + ids(r1) + ids(r2))) == 10           # wraps over the corpus
    # the wrapped tail is counted: round 2 takes prompts 8, 9, then 0 and 1 again
    assert (r0.wrapped, r1.wrapped, r2.wrapped) == (0, 0, 2)
    assert ids(r2)[2:] == ids(r0)[:2]
    assert campaign.round_prompts(records, 3, 4).wrapped == 4
    assert [r["prompt"] for r in r1.sampled] == [r["prompt"] for r in r1.greedy]
    assert all(s["id"] == f"{g['id']}~r1" for s, g in zip(r1.sampled, r1.greedy))
    assert ids(campaign.round_prompts(records, 1, 4)) == ids(r1)  # deterministic
    with pytest.raises(ValueError, match="per_round"):
        campaign.round_prompts(records, 0, 0)


def test_top_up_fills_the_short_kinds_from_the_earlier_corpus():
    greedy = [{"id": f"m{i}", "kind": "math", "prompt": "m"} for i in range(8)] + [
        {"id": "c0", "kind": "code", "prompt": "c"}]
    earlier = [{"id": f"e{k}{i}", "kind": k, "prompt": k} for k in ("code", "summarize")
               for i in range(3)]
    mix = {"math": 0.5, "code": 0.3, "summarize": 0.2}
    extra = campaign.top_up(greedy, earlier, mix, round_index=2)
    kinds = [r["kind"] for r in extra]
    # 9 greedy prompts: code wants round(2.7) = 3 (has 1), summarize round(1.8) = 2; math is over
    assert sorted(kinds) == ["code", "code", "summarize", "summarize"]
    assert all(r in earlier for r in extra)                        # the records as they are
    assert len({r["id"] for r in extra}) == 4                      # without repeats
    assert campaign.top_up(greedy, earlier, mix, round_index=2) == extra   # deterministic
    assert campaign.top_up(greedy, [], mix, round_index=2) == []


def test_top_up_by_source_brings_back_the_sources_a_kind_at_its_share_lacks(tmp_path,
                                                                            monkeypatch):
    # a follow-on slice whose chat is all one template; the earlier corpus splits chat 4:4:2
    greedy = [{"id": f"g{i}", "kind": "chat", "source": "a", "prompt": "g"} for i in range(10)]
    earlier = [{"id": f"e{s}{i}", "kind": "chat", "source": s, "prompt": s}
               for s, n in (("a", 4), ("b", 4), ("c", 2)) for i in range(n)]
    mix = {"chat": 1.0}
    assert campaign.top_up(greedy, earlier, mix, round_index=1) == []       # the kind is full
    extra = campaign.top_up(greedy, earlier, mix, round_index=1, by_source=True)
    # chat wants 10: a 4 (has 10), b 4 (has 0), c 2 (has 0)
    assert sorted(r["source"] for r in extra) == ["b"] * 4 + ["c"] * 2
    assert len({r["id"] for r in extra}) == 6

    # the flag reaches top_up from the command line
    from domino_jax.train import shards
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in greedy))
    seen = []
    real_top_up = campaign.top_up
    monkeypatch.setattr(campaign, "top_up", lambda *a, **k: seen.append(k) or real_top_up(*a, **k))
    monkeypatch.setattr(shards, "_generate", lambda a: {"written": 0})
    for flags, by_source in (([], False), (["--top-up-by-source"], True)):
        campaign.generate_phase(campaign.parse_args(
            ["--round", "1", "--corpus", str(tmp_path), "--work", "w", "--out", "o",
             "--phases", "generate", "--top-up", str(tmp_path), *flags]), str(tmp_path))
        assert seen.pop()["by_source"] is by_source


def test_generate_phase_runs_top_up_first_within_the_sampled_reserve(tmp_path, monkeypatch):
    from domino_jax.train import shards
    corpus, earlier = tmp_path / "corpus", tmp_path / "earlier"
    for folder, kind, n in ((corpus, "math", 6), (earlier, "code", 4)):
        folder.mkdir()
        with open(folder / "train.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"id": f"{kind}{i}", "kind": kind, "source": "t",
                                    "prompt": kind}) + "\n")
    (corpus / "card.json").write_text(json.dumps({"mix": {"math": 0.5, "code": 0.5}}))
    calls = []

    def fake_generate(a):
        with open(a.corpus) as f:
            calls.append((a.modes, float(a.seconds), [json.loads(line)["id"] for line in f]))
        return {"written": 0}

    monkeypatch.setattr(shards, "_generate", fake_generate)
    args = campaign.parse_args(["--round", "1", "--corpus", str(corpus), "--work", "w",
                                "--out", "o", "--prompts-per-round", "3", "--phases", "generate",
                                "--top-up", str(earlier), "--gen-seconds", "100"])
    campaign.generate_phase(args, str(tmp_path))
    (g_mode, g_seconds, g_ids), (s_mode, s_seconds, s_ids) = calls
    assert g_mode == "greedy" and len(g_ids) == 3 and 69 < g_seconds <= 70  # 30 s kept
    assert s_mode == "sampled" and s_seconds > 99                  # the fake took no time
    assert [i[:4] for i in s_ids[:2]] == ["code", "code"]          # the top-up goes first
    assert s_ids[2:] == [f"{i}~r1" for i in g_ids]
    assert len({i for i in s_ids[:2]}) == 2 and all(i.endswith("~r1") for i in s_ids[:2])

    # --top-up-greedy: the top-up prompts are answered greedily first, under their own ids,
    # and their responses do not count as distinct examples
    calls.clear()
    campaign.generate_phase(campaign.parse_args(
        ["--round", "1", "--corpus", str(corpus), "--work", "w", "--out", "o",
         "--prompts-per-round", "3", "--phases", "generate", "--top-up", str(earlier),
         "--top-up-greedy", "--gen-seconds", "100"]), str(tmp_path))
    (r_mode, _, r_ids), (g_mode, _, g_ids2), (s_mode, _, s_ids2) = calls
    assert r_mode == g_mode == "greedy" and s_mode == "sampled" and g_ids2 == g_ids
    assert [f"{i}~r1" for i in r_ids] == s_ids2[:2] and all(i[:4] == "code" for i in r_ids)
    with open(tmp_path / "round-1-generate.json") as f:
        assert set(json.load(f)) == {"rehearsal", "greedy", "sampled"}
    # a slice past the corpus's end: the wrapped prompts are a "repeat" pass, after the new
    calls.clear()
    campaign.generate_phase(campaign.parse_args(
        ["--round", "1", "--corpus", str(corpus), "--work", "w", "--out", "o",
         "--prompts-per-round", "4", "--phases", "generate", "--modes", "greedy",
         "--gen-seconds", "100"]), str(tmp_path))
    ((_, _, new_ids), (_, _, repeat_ids)) = calls                  # 6 prompts: 4, 5, then 0, 1
    assert len(new_ids) == len(repeat_ids) == 2 and not set(new_ids) & set(repeat_ids)
    assert campaign.new_examples({"rehearsal": {"written": 5}, "greedy": {"written": 3},
                                  "repeat": {"written": 4}, "sampled": {"written": 2}}) == 5
    assert campaign.new_examples({"sampled": {"skipped": "no time left"}}) == 0


def test_self_instruct_requests_join_the_round_as_a_corpus_would_take_them(tmp_path,
                                                                          monkeypatch):
    """``--self-instruct N``: the target's requests, filtered as a corpus's training prompts
    and against the held-out split, are answered in the round's greedy and sampled passes
    under their corpus ids, and counted as new examples through those passes only."""
    from domino_jax.train import self_instruct, shards
    from domino_jax.train.corpus import is_heldout
    from domino_jax.train.corpus_dedup import prompt_id

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "train.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"m{i}", "kind": "math", "source": "t",
                                "prompt": f"what is {i} plus {i}"}) + "\n")
    held = "Tell me three surprising facts about the ocean tides and the moon, please."
    (corpus / "heldout.jsonl").write_text(json.dumps({"id": "h0", "kind": "chat",
                                                      "prompt": held}) + "\n")
    (corpus / "card.json").write_text(json.dumps({"eval_fraction": 0.02}))
    good = ["How do I keep basil alive on a sunny windowsill in winter?",
            "Can you help me plan a birthday party for my grandmother?"]
    ruled_out = "Could you suggest a weekend plan number 15 for a small garden?"
    assert is_heldout(prompt_id(ruled_out), 0.02)                 # the held-out rule's
    evaluated = "Please write me a haiku about the autumn leaves falling down today."
    (tmp_path / "eval.txt").write_text(evaluated + "\n")           # an evaluation set
    written = [good[0], held.replace("please", "please!"), good[0].upper(), ruled_out,
               "Hi there?", evaluated.lower(), good[1]]
    asked = []

    def fake_self_instruct(target, num, **options):
        asked.append((target, num, options))
        return [{"kind": "chat", "source": "self_instruct", "prompt": t} for t in written]

    calls = []

    def fake_generate(a):
        with open(a.corpus) as f:
            calls.append((a.modes, [json.loads(line)["id"] for line in f]))
        return {"written": len(calls[-1][1])}

    monkeypatch.setattr(self_instruct, "self_instruct_from_dir", fake_self_instruct)
    monkeypatch.setattr(shards, "_generate", fake_generate)
    work = tmp_path / "work"
    work.mkdir()
    args = campaign.parse_args(["--round", "3", "--corpus", str(corpus), "--work", str(work),
                                "--out", "o", "--target", "T", "--prompts-per-round", "2",
                                "--first-round", "3", "--phases", "generate",
                                "--self-instruct", "6", "--exclude", str(tmp_path / "eval.txt"),
                                "--self-instruct-batch", "8", "--prompt-seed", "5"])
    generated = campaign.generate_phase(args, str(work))
    (target, num, options), = asked
    assert (target, num) == ("T", 6) and options["seed"] == 3005            # 1000 r + seed
    assert options["batch_size"] == 8 and options["max_new_tokens"] == 96
    ids = [prompt_id(t) for t in good]
    summary = generated["self_instruct"]
    assert summary["kept"] == 2 and summary["generated"] == 7 and summary["requested"] == 6
    assert summary["kinds"] == {"chat": 2} and summary["rejected"]["heldout"] == 1
    # a held-out near copy, a repeat, a short one, the evaluation set's
    assert sum(summary["rejected"].values()) == 5
    assert any(reason.startswith("exclude:") for reason in summary["rejected"])
    kept = [json.loads(line) for line in open(work / "round-3-self-instruct.jsonl")]
    assert [r["id"] for r in kept] == ids and all(r["kind"] == "chat" for r in kept)
    (g_mode, g_ids), (s_mode, s_ids) = calls
    assert g_mode == "greedy" and len(g_ids) == 4 and set(ids) <= set(g_ids)  # 2 + 2 slice
    # the slice's samples are marked with its index in the corpus (0), the requests' with
    # the round
    assert s_mode == "sampled" and sorted(s_ids) == sorted(
        f"{i}~r3" if i in ids else f"{i}~r0" for i in g_ids)
    assert campaign.new_examples(generated) == 8                     # both passes, no summary
    with pytest.raises(SystemExit):
        campaign.parse_args(["--round", "0", "--corpus", str(corpus), "--work", "w", "--out",
                             "o", "--self-instruct", "-1"])
    with pytest.raises(SystemExit):
        campaign.parse_args(["--round", "0", "--corpus", str(corpus), "--work", "w", "--out",
                             "o", "--exclude", str(tmp_path / "missing.jsonl")])


def test_a_pass_the_device_fails_keeps_what_it_wrote(setup, monkeypatch):
    """A generate pass that dies on the device (out of memory) after committing shards: the
    round goes on (the next pass, training), and its committed examples count as new."""
    import jax

    from domino_jax.train import shards

    root, real = setup, shards._generate

    def failing_sampled(a):
        if a.modes != "sampled":
            return real(a)
        a.limit = 2                                  # commits 2 examples, then the device fails
        real(a)
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    monkeypatch.setattr(shards, "_generate", failing_sampled)
    out = _round(root, 0, root / "init", work="work-failing", out="out-failing")
    with open(out / "round.json") as f:
        record = json.load(f)
    sampled = record["generate"]["sampled"]
    assert sampled["written"] == 2 and sampled["failed"].startswith("JaxRuntimeError: RESOURCE")
    assert record["generate"]["greedy"]["written"] == 4
    assert record["point"]["distinct_examples"] == record["point"]["distinct_examples_total"] == 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from converters.hf_draft import export_draft
    from converters.hf_target import export_target

    root = tmp_path_factory.mktemp("campaign")
    config = dataclasses.replace(TARGET, vocab_size=128, eos_token_ids=(2,))
    export_target(config, random_target_params(config, 1), str(root / "target"))
    save_char_tokenizer(root / "target")
    corpus = root / "corpus"
    corpus.mkdir()
    usable = [r for r in RECORDS if len(r["prompt"]) <= 20]
    with open(corpus / "train.jsonl", "w") as f:
        for r in usable[:10]:
            f.write(json.dumps(r) + "\n")
    with open(corpus / "heldout.jsonl", "w") as f:
        for r in usable[10:12]:
            f.write(json.dumps(r) + "\n")
    draft = make_draft_config(config, "domino", 1, 4, 16, 8, mask_token_id=5)
    params = jax.jit(lambda k: init_draft_params(draft, k, False))(jax.random.PRNGKey(2))
    export_draft(draft, jax.tree_util.tree_map(np.asarray, params), str(root / "init"))
    return root


def _round(root, index, init, curve=None, max_seconds=600, extra=(), train_args="",
           work="work", out=None):
    out = root / (out or f"out{index}")
    argv = ["--round", str(index), "--corpus", str(root / "corpus"), "--work",
            str(root / work), "--out", str(out), "--init", str(init),
            "--target", str(root / "target"), "--prompts-per-round", "4",
            "--max-new-tokens", "12", "--gen-batch-size", "2", "--gen-queue", "2",
            "--steps", "2", "--batch-size", "2", "--max-length", "128", "--num-anchors", "4",
            "--eval-methods", "dflash,domino,domino:T1", "--eval-num-prompts", "1",
            "--eval-max-new-tokens", "4", "--part-mib", "0.02",
            # --seed 0 after the round's own --seed: every round trains with one compiled
            # step (the seed is part of the step's program)
            "--train-args",
            f"--dtype float32 --no-progress --max-seconds {max_seconds} --seed 0 {train_args}"]
    if curve:
        argv += ["--curve", str(curve)]
    assert campaign.main(argv + list(extra)) == 0
    return out


def test_two_rounds(setup):
    from domino_jax.train.checkpoint_parts import join_parts
    from domino_jax.train.shard_store import ShardDataset, read_manifest

    root = setup
    out0 = _round(root, 0, root / "init", extra=["--initial-eval"])
    distinct0 = len(ShardDataset(str(root / "work" / "shards")))
    assert distinct0 == 8                                   # 4 greedy + 4 sampled
    # round 1 in two calls, the second on a deadline that leaves no time for training: it
    # ends after its first step, evaluated and exported all the same; the first call's
    # responses still count as the round's new examples
    init1 = root / "work" / "round-0" / "draft-bf16"
    _round(root, 1, init1, out0 / "curve.json",
           extra=["--phases", "generate", "--gen-widths", "128"])
    out1 = _round(root, 1, init1, out0 / "curve.json",
                  extra=["--phases", "train", "--deadline-seconds", "1", "--export-shards",
                         "--eval-ahead"])
    with open(out1 / "curve.json") as f:
        curve = json.load(f)
    assert [p["round"] for p in curve] == [0, 1]
    assert [p["steps_total"] for p in curve] == [2, 3]
    assert [p["examples_seen_total"] for p in curve] == [4, 6]
    assert [p["distinct_examples"] for p in curve] == [8, 16]
    assert [p["distinct_examples_total"] for p in curve] == [8, 16]      # fresh each round
    for p in curve:
        assert set(p["tau"]) == {"dflash", "domino", "domino:T1"}
        assert all(1.0 <= t <= 4.0 for t in p["tau"]["domino"].values())
    # round 0 evaluated its init before training, round 1 on a thread beside it
    assert curve[0]["tau_before"] is not None and curve[1]["tau_before"] is not None
    # the parts restore the round's bf16 drafter byte for byte
    restored = root / "restored"
    join_parts(str(out1 / "draft"), str(restored))
    bf16 = root / "work" / "round-1" / "draft-bf16"
    assert sorted(os.listdir(restored)) == sorted(os.listdir(bf16))
    # with the token ranking of the round's training responses (--draft-vocab)
    ranking = np.load(restored / "draft_vocab.npy")
    assert sorted(ranking.tolist()) == list(range(128))
    for name in os.listdir(bf16):
        assert (restored / name).read_bytes() == (bf16 / name).read_bytes()
    parts = [f for f in (out1 / "draft").rglob("part-*")]
    assert len(parts) >= 2 and all(f.stat().st_size <= 0.02 * 2 ** 20 for f in parts)
    with open(out1 / "round.json") as f:
        record = json.load(f)
    assert record["point"] == curve[-1] and record["phases"] == ["train"]
    with open(root / "work" / "round-1-generate.json") as f:
        assert json.load(f)["greedy"]["written"] == 4
    # round 0 answered with the default widths, round 1 with --gen-widths alone
    widths = [entry["settings"]["widths"]
              for entry in read_manifest(str(root / "work" / "shards"))["shards"]]
    assert widths[0] == [64, 128, 256, 512] and widths[-1] == [128], widths
    # the exported shards, joined, replay into a new machine's work folder: round 0's prompts
    # are not answered again there
    join_parts(str(out1 / "shards"), str(root / "carried"))
    assert len(ShardDataset(str(root / "carried"))) == 16
    argv = ["--round", "0", "--corpus", str(root / "corpus"), "--work", str(root / "work2"),
            "--out", str(root / "out2"), "--target", str(root / "target"), "--phases",
            "generate", "--prompts-per-round", "4", "--max-new-tokens", "12",
            "--gen-batch-size", "2", "--replay", str(root / "carried"), "--replay-new"]
    assert campaign.main(argv) == 0
    assert len(ShardDataset(str(root / "work2" / "shards"))) == 16
    with open(root / "out2" / "round.json") as f:
        record = json.load(f)
    assert record["replay"]["added"] == 16
    with open(root / "work2" / "round-0-generate.json") as f:   # for the train call's point
        assert campaign.new_examples(json.load(f)) == 16
    assert all(g["written"] == 0 for name, g in record["generate"].items()
               if name != "replay"), record["generate"]
    # --init fresh: a new drafter of the --train-args shape trains on what the machine holds;
    # its curve point counts from zero
    out3 = _round(root, 5, "fresh", out1 / "curve.json", work="work2",
                  extra=["--phases", "train"], train_args="--draft-layers 1 --block-size 4 "
                  "--gru-hidden-dim 16 --emb-dim 8 --mask-token-id 5")
    with open(out3 / "curve.json") as f:
        point = json.load(f)[-1]
    assert point["init"] == "fresh" and point["steps_total"] == point["steps_round"] == 2
    assert point["distinct_examples_total"] == point["distinct_examples"] == 16
    with open(root / "work2" / "round-5" / "draft-bf16" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 1


def test_bad_arguments(setup, capsys):
    root = setup
    base = ["--round", "0", "--corpus", str(root / "corpus"), "--work", str(root / "w"),
            "--out", str(root / "o")]
    generate = ["--phases", "generate"]
    for extra, message in ((["--phases", "train"], "needs --init"),
                           (["--phases", "train", "--init", str(root / "nothing")],
                            "no config.json"),
                           (["--phases", "eval"], "choose from generate,train"),
                           (generate + ["--first-round", "1"], "--first-round"),
                           (generate + ["--top-up", str(root / "nothing")], "--top-up"),
                           (generate + ["--sampled-share", "1.5"], "--sampled-share"),
                           (generate + ["--replay", str(root / "nothing")],
                            "not a shards directory")):
        with pytest.raises(SystemExit) as e:
            campaign.parse_args(base + extra)
        error = capsys.readouterr().err.strip().splitlines()[-1]     # not the usage lines
        assert e.value.code == 2 and message in error, error
    with pytest.raises(SystemExit):
        campaign.parse_args(base[:3] + [str(root / "nothing")] + base[4:])


def test_a_branch_continues_its_parents_totals(setup, capsys):
    """--init-round: the point continues the totals of the round its drafter came from, not
    the last round's (a dead branch); --replay-new counts a replayed dead branch's examples."""
    curve = [{"round": 10, "steps_total": 6149, "examples_seen_total": 393536,
              "distinct_examples_total": 82981, "tau": {}},
             {"round": 11, "steps_total": 7684, "examples_seen_total": 491776,
              "distinct_examples_total": 107557, "tau": {}}]
    assert campaign.totals(curve)["steps"] == 7684
    assert campaign.totals(curve, "10") == {"steps": 6149, "examples_seen": 393536,
                                            "distinct": 82981}
    with pytest.raises(ValueError, match="no round 9 in the curve"):
        campaign.totals(curve, 9)
    generated = {"rehearsal": {"written": 7329}, "greedy": {"written": 8910},
                 "sampled": {"written": 9216}}
    assert campaign.new_examples(generated) == 18126
    generated["replay"] = {"added": 24576, "duplicates_dropped": 0}    # --replay-new's
    assert campaign.new_examples(generated) == 18126 + 24576
    root = setup
    path = root / "curve-branch.json"
    path.write_text(json.dumps(curve))
    base = ["--round", "12", "--corpus", str(root / "corpus"), "--work", str(root / "w"),
            "--out", str(root / "o"), "--phases", "generate", "--curve", str(path)]
    assert campaign.parse_args(base + ["--init-round", "10"]).init_round == "10"
    for extra, message in ((["--init-round", "9"], "--init-round 9: no round 9"),
                           (["--replay-new"], "give --replay too")):
        with pytest.raises(SystemExit):
            campaign.parse_args(base + extra)
        assert message in capsys.readouterr().err


def test_campaign_curve_reads_as_curve_points(tmp_path, capsys):
    """``python -m domino_jax.train.curve FILE`` takes a campaign curve: one point per round at
    its running totals (the shipped drafter's point counts its own distinct examples)."""
    from domino_jax.train import curve as curve_cli

    rounds = [{"round": "base", "steps_total": 3000, "examples_seen_total": 192000,
               "distinct_examples": 63941, "tau": {"domino": {"all": 2.21}}},
              {"round": 0, "steps_total": 3880, "examples_seen_total": 248320,
               "distinct_examples": 9893, "distinct_examples_total": 73834, "loss": 2.62,
               "tau": {"domino": {"all": 2.27, "chat": 1.89}}}]
    path = tmp_path / "campaign_curve.json"
    path.write_text(json.dumps(rounds))
    points = curve_cli.campaign_points(str(path))
    assert [p["step"] for p in points] == [3000, 3880]
    assert [p["distinct_examples"] for p in points] == [63941, 73834]
    assert [p["examples_seen"] for p in points] == [192000, 248320]
    curve_cli.main([str(path), "--x", "distinct_examples", "--out", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "| 3880 | - | 2.6200 | - | 2.270 | - |" in out, out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": []}))
    with pytest.raises(SystemExit) as e:
        curve_cli.main([str(bad)])
    assert e.value.code == 2 and "not a campaign curve" in capsys.readouterr().err


def test_curve_slope_per_doubling(tmp_path, capsys):
    """``--slope-rounds``: the least-squares slope of tau against log2(distinct examples) over
    the named rounds only (a branch between them, far off the line, left out); an unknown
    round is a clear error."""
    from domino_jax.train import curve as curve_cli

    # tau = 1.2 + 0.1 log2(x) exactly, but for +-0.05 at the middle points: slope 0.1 - 0.01
    xs = [1000, 2000, 4000, 8000]
    taus = [1.2 + 0.1 * math.log2(x) + d for x, d in zip(xs, [0.0, 0.05, -0.05, 0.0])]
    rounds = [{"round": i, "distinct_examples_total": x, "steps_total": i,
               "tau": {"domino": {"all": t}, "ngram": {"chat": 1.0}}}
              for i, (x, t) in enumerate(zip(xs, taus))]
    rounds.insert(2, {"round": "dead", "distinct_examples_total": 3000, "steps_total": 0,
                      "tau": {"domino": {"all": 9.0}}})
    path = tmp_path / "campaign_curve.json"
    path.write_text(json.dumps(rounds))
    points = curve_cli.select_rounds(curve_cli.campaign_points(str(path)), ["0", "1", "2", "3"])
    want = 0.1 - 0.01     # sum((x - mean) dy) / sum((x - mean)^2) = (-0.025 - 0.025) / 5
    assert curve_cli.slope_per_doubling(points, "domino") == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="fewer than two points"):
        curve_cli.slope_per_doubling(points, "ngram")
    curve_cli.main([str(path), "--slope-rounds", "0,1,2,3", "--out", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert f"domino: {want:+.3f}" in out and "rounds 0, 1, 2, 3 (1,000 to 8,000)" in out, out
    with pytest.raises(SystemExit) as e:
        curve_cli.main([str(path), "--slope-rounds", "0,7"])
    assert e.value.code == 2 and "no round 7" in capsys.readouterr().err


def test_campaign_lineages_split_at_branches():
    """A point whose step total is not above the last one's is a branch from an earlier
    drafter: it starts a new line, led by the point with the largest step total below it."""
    from domino_jax.train.curve import campaign_lineages

    steps = {"base": 3000, 0: 3880, 1: 4760, 2: 5750, 4: 8457, 5: 9136, 6: 8939, 8: 11437,
             9: 5669, 10: 6149}
    points = [{"round": r, "step": s} for r, s in steps.items()]
    lines = [[p["round"] for p in line] for line in campaign_lineages(points)]
    assert lines == [["base", 0, 1, 2, 4, 5], [4, 6, 8], [1, 9, 10]]
    assert campaign_lineages(points[:3]) == [points[:3]]
    # a named parent wins over the step totals: round 12, trained from round 10 after the
    # dead branch 11, starts its own line although its step total is above round 11's
    points += [{"round": 11, "step": 7684, "parent": 10}, {"round": 12, "step": 8020,
                                                           "parent": 10}]
    lines = [[p["round"] for p in line] for line in campaign_lineages(points)]
    assert lines[2:] == [[1, 9, 10, 11], [10, 12]]
