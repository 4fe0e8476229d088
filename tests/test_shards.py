"""Self-distillation shards: batching plan, resume after an interruption, --limit then
append, merge with dedup, atomic commits, ShardDataset vs in-memory generation, training
from a shards directory, the one prompt encoder (thinking off), the CLI and bad inputs
(tiny random target, CPU, float32)."""

from __future__ import annotations

import json
import os
import string

import jax.numpy as jnp
import numpy as np
import pytest

from domino_jax.decode.loading import encode_prompt
from domino_jax.decode.speculative import DecodeConfig, generate
from domino_jax.models.qwen3 import TargetLM
from domino_jax.train import data as data_lib
from domino_jax.train import shard_store
from domino_jax.train.shard_store import ShardDataset, ShardError, ShardWriter, merge_shards
from domino_jax.train.shards import (GenerationSettings, generate_shards, main, plan_batches,
                                     read_records)
from test_train import SMALL, TARGET, TINY_TASK, random_target_params, synthetic_examples

SETTINGS = GenerationSettings(max_new_tokens=6, batch_size=4, widths=(16, 32), seed=3,
                              stop_token_ids=(7,))
INFO = {"name": "tiny", "vocab_size": TARGET.vocab_size, "fingerprint": "f" * 64}
KINDS = ("chat", "math", "code")


def encode(text: str) -> list[int]:
    return [1 + ord(c) % 60 for c in text]


def make_records(num: int = 18) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(num):
        length = int(rng.integers(3, 31)) if i != 5 else 40          # record 5: too long
        out.append({"id": f"{i:016x}", "kind": KINDS[i % 3], "source": "test",
                    "prompt": "".join(rng.choice(list(string.ascii_lowercase), length))})
    return out


RECORDS = make_records()


@pytest.fixture(scope="module")
def model():
    return TargetLM(TARGET, dtype=jnp.float32, param_dtype=jnp.float32), random_target_params()


def run(model, out, records=RECORDS, modes=("greedy", "sampled"), **kw):
    kw.setdefault("progress", False)
    return generate_shards(records, str(out), *model, encode, INFO, SETTINGS, modes, **kw)


def content(path) -> dict:
    """``(id, mode) -> (input_ids, loss_mask, kind)`` of a shards directory; asserts every
    pair appears once."""
    ds = ShardDataset(str(path))
    pairs = list(zip(ds.ids, ds.modes))
    assert len(pairs) == len(set(pairs)), "an (id, mode) pair was written twice"
    return {p: (tuple(ds[i]["input_ids"]), tuple(ds[i]["loss_mask"]), ds.kinds[i])
            for i, p in enumerate(pairs)}


def greedy_only(pairs: dict) -> dict:
    return {k: v for k, v in pairs.items() if k[1] == "greedy"}


@pytest.fixture(scope="module")
def full(model, tmp_path_factory):
    """An uninterrupted run over RECORDS, both modes."""
    out = tmp_path_factory.mktemp("full")
    summary = run(model, out)
    return out, summary, content(out)


def test_plan_batches():
    lengths = [10, 20, 3, 40, 30, 12, 17, 5, 9]
    batches, too_long = plan_batches(lengths, (16, 32), 3)
    assert too_long == [3]
    # corpus order within a width; the widths interleaved in proportion (16 at 1/4 and 3/4)
    assert batches == [(16, [0, 2, 5]), (32, [1, 4, 6]), (16, [7, 8])]
    # a run stopped after any prefix of the batches has answered each width's share
    lengths = [5] * 40 + [20] * 20 + [50] * 10
    order = [w for w, _ in plan_batches(lengths, (16, 32, 64), 5)[0]]
    assert order[:7] == [16, 32, 16, 64, 16, 32, 16]
    for k in range(2, len(order) + 1):
        for width, total in ((16, 8), (32, 4), (64, 2)):
            assert abs(order[:k].count(width) - total * k / len(order)) <= 1, (k, order)


def test_plan_batches_of_what_is_left_are_the_rest_of_the_plan():
    """A resumed run plans only the prompts not yet answered: its batches must be the
    uninterrupted plan's remaining batches, row for row (a batch's sampling seed is a hash of
    its ids), wherever the first run stopped."""
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, 60, 57)]
    full, _ = plan_batches(lengths, (16, 32, 64), 4)
    for k in range(len(full) + 1):
        done = {p for _, chunk in full[:k] for p in chunk}
        left = [p for p in range(len(lengths)) if p not in done]
        rest, _ = plan_batches([lengths[p] for p in left], (16, 32, 64), 4)
        rest = sorted((w, [left[i] for i in chunk]) for w, chunk in rest)
        assert rest == sorted(full[k:]), k
    # a full batch that would pad narrower than its width gives up a row to a filler
    assert plan_batches([3, 5, 9, 20, 4], (32,), 3)[0] == [(32, [0, 1]), (32, [2, 3, 4])]
    assert plan_batches([3, 4], (16,), 1)[0] == [(16, [0]), (16, [1])]
    with pytest.raises(ValueError, match="bad prompt width"):
        plan_batches([3], (100,), 2)


def test_full_run_counts_and_labels(full):
    out, summary, got = full
    assert summary["skipped_too_long"] == 2                # record 5, once per mode
    assert summary["written"] == 2 * (len(RECORDS) - 1) == len(got)
    assert summary["response_tokens"] > 0 and summary["tokens_per_second"] > 0
    for (rid, mode), (ids, mask, kind) in got.items():
        record = next(r for r in RECORDS if r["id"] == rid)
        prompt = encode(record["prompt"])
        assert list(ids[:len(prompt)]) == prompt and kind == record["kind"]
        assert list(mask) == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        assert 1 <= len(ids) - len(prompt) <= SETTINGS.max_new_tokens
    greedy = {k[0]: v[0] for k, v in got.items() if k[1] == "greedy"}
    sampled = {k[0]: v[0] for k, v in got.items() if k[1] == "sampled"}
    assert greedy.keys() == sampled.keys() and greedy != sampled
    manifest = shard_store.read_manifest(str(out))
    assert manifest["token_dtype"] == "uint16" and manifest["totals"]["examples"] == len(got)
    assert shard_store.verify_shards(str(out)) == len(manifest["shards"])


def test_resume_after_interrupt_equals_uninterrupted(model, full, tmp_path):
    def crash(batches_done):
        if batches_done == 5:
            raise KeyboardInterrupt("machine lost")

    with pytest.raises(KeyboardInterrupt):
        run(model, tmp_path, shard_examples=6, on_batch=crash)
    flushed = len(ShardDataset(str(tmp_path)))
    assert 0 < flushed < len(full[2])                      # some batches were not flushed
    resumed = run(model, tmp_path, shard_examples=6)
    assert resumed["already_done"] == flushed
    assert resumed["written"] == len(full[2]) - flushed    # each pair generated once more
    assert content(tmp_path) == full[2]                    # sampled ones included
    again = run(model, tmp_path)                           # nothing left to do
    assert again["written"] == 0 and content(tmp_path) == full[2]


def test_limit_then_append(model, full, tmp_path):
    first = run(model, tmp_path, RECORDS[:7], modes=("greedy",))
    assert first["written"] == 6                           # record 5 is too long
    run(model, tmp_path)
    got = content(tmp_path)
    assert got.keys() == full[2].keys()
    assert greedy_only(got) == greedy_only(full[2])


def test_merge_dedups_and_checks(model, full, tmp_path):
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    run(model, a, RECORDS[:12])
    run(model, b, RECORDS[8:])                             # overlaps a on records 8..11
    counts = merge_shards(str(dest), [str(a), str(b)])
    assert counts["shards_copied"] >= 1 and counts["shards_rewritten"] >= 1
    assert counts["duplicates_dropped"] == 2 * 4
    merged, first_wins = content(dest), {**content(b), **content(a)}
    assert merged == first_wins and merged.keys() == full[2].keys()
    assert greedy_only(merged) == greedy_only(full[2])   # sampled ones depend on the batch's seed
    assert merge_shards(str(dest), [str(b)])["added"] == 0           # idempotent
    tokens = a / shard_store.read_manifest(str(a))["shards"][0]["name"] / "tokens.npy"
    raw = bytearray(tokens.read_bytes())
    raw[-1] ^= 1
    tokens.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="sha256 mismatch"):
        merge_shards(str(tmp_path / "other"), [str(a)])
    run(model, tmp_path / "alien", RECORDS[:2], modes=("greedy",))
    manifest = json.loads((tmp_path / "alien" / "manifest.json").read_text())
    manifest["target"]["fingerprint"] = "0" * 64
    (tmp_path / "alien" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="another target"):
        merge_shards(str(dest), [str(tmp_path / "alien")])


def test_uncommitted_shards_are_ignored_and_cleaned(model, full, tmp_path, monkeypatch):
    real = ShardWriter._write_manifest
    calls = []

    def fail_second(self):                 # 1st: the new manifest; 2nd: after shard 1
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        real(self)

    monkeypatch.setattr(ShardWriter, "_write_manifest", fail_second)
    with pytest.raises(OSError, match="disk full"):
        run(model, tmp_path, shard_examples=4)
    monkeypatch.setattr(ShardWriter, "_write_manifest", real)
    orphans = [n for n in os.listdir(tmp_path) if n.startswith("shard-")]
    assert len(orphans) == 1 and len(ShardDataset(str(tmp_path))) == 0
    os.makedirs(tmp_path / ".tmp-shard-x")
    (tmp_path / ".tmp-shard-x" / "tokens.npy").write_bytes(b"half")
    run(model, tmp_path)
    assert not os.path.exists(tmp_path / ".tmp-shard-x")
    assert not os.path.exists(tmp_path / orphans[0])
    assert content(tmp_path) == full[2]


def test_shard_dataset_matches_reference_generation(model, full):
    """Shard examples == plain one-prompt ``generate`` calls (greedy) == the in-memory
    ``generate_dataset``; labels, lengths and views."""
    out, _, _ = full
    target, params = model
    ds = ShardDataset(str(out), modes=["greedy"])
    assert set(ds.modes) == {"greedy"} and len(ds) == len(RECORDS) - 1
    config = DecodeConfig("ar", max_new_tokens=SETTINGS.max_new_tokens,
                          stop_token_ids=SETTINGS.stop_token_ids)
    by_id = {r["id"]: r for r in RECORDS}
    for i in range(0, len(ds), 4):
        prompt = encode(by_id[ds.ids[i]]["prompt"])
        response = generate(target, params, [prompt], config).tokens[0]
        np.testing.assert_array_equal(ds[i]["input_ids"], prompt + response)
        assert ds.stopped[i] == (response[-1] in SETTINGS.stop_token_ids)
    kept = [r for r in RECORDS if len(encode(r["prompt"])) <= 32]
    memory = data_lib.generate_dataset(target, params, encode, [r["prompt"] for r in kept],
                                       SETTINGS.max_new_tokens, 4, max_prompt_len=32,
                                       stop_token_ids=SETTINGS.stop_token_ids)
    position = {rid: i for i, rid in enumerate(ds.ids)}
    for record, ex in zip(kept, memory):
        mine = ds[position[record["id"]]]
        np.testing.assert_array_equal(mine["input_ids"], ex["input_ids"])
        np.testing.assert_array_equal(mine["loss_mask"], ex["loss_mask"])
        assert mine["input_ids"].dtype == mine["loss_mask"].dtype == np.int32
    np.testing.assert_array_equal(ds.response_lengths,
                                  [int(ds[i]["loss_mask"].sum()) for i in range(len(ds))])
    math = ShardDataset(str(out), kinds="math", modes=["greedy", "sampled"])
    assert set(math.kinds) == {"math"} and len(math) == 2 * 6
    short = data_lib.filter_examples(math, 3, 20)
    assert isinstance(short, ShardDataset) and 0 < len(short) <= len(math)
    assert all(int(ex["loss_mask"][:20].sum()) >= 3 for ex in short)
    assert np.array_equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    assert len(ds[1:3]) == 2 and ds[1:3].ids == ds.ids[1:3]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="no example has kind"):
        ShardDataset(str(out), kinds=["poetry"])


def test_continuous_batching_gives_the_static_greedy_examples(model, full, tmp_path):
    """``queue > 1`` (prompts through ``batch_size`` slots, refilled as rows finish): the
    greedy examples equal the static batches' token for token; sampled ones are complete."""
    import dataclasses

    settings = dataclasses.replace(SETTINGS, queue=3, batch_size=2)
    out = tmp_path / "queued"
    summary = generate_shards(RECORDS, str(out), *model, encode, INFO, settings,
                              ("greedy", "sampled"), progress=False, compile_workers=2)
    # each mode's and width's queue: its first programs and its middle refill (size 1)
    assert summary["compile_ahead_jobs"] == 2 * 2 * 2 and summary["compile_ahead_failed"] == 0
    _, static_summary, static = full
    queued = content(out)
    assert greedy_only(queued) == greedy_only(static)
    assert set(queued) == set(static)
    assert summary["written"] == static_summary["written"]
    assert summary["batches"] < static_summary["batches"]      # 6 prompts a call, not 4
    shards = shard_store.read_manifest(str(out))["shards"]
    assert shards and all(entry["settings"]["queue"] == 3 for entry in shards)


def test_batch_tokens_give_wide_prompts_fewer_rows(model, full, tmp_path):
    """``batch_tokens``: a width's batches hold at most ``batch_tokens // width`` prompts
    (``plan_batches`` with sizes per width); greedy examples are the full run's."""
    import dataclasses

    assert plan_batches([3, 20, 25, 4, 30], (16, 32), {16: 2, 32: 1})[0] == [
        (32, [1]), (16, [0, 3]), (32, [2]), (32, [4])]                # interleaved
    settings = dataclasses.replace(SETTINGS, batch_tokens=64)        # 16: 4 rows, 32: 2
    assert [settings.rows(w) for w in (16, 32, 64, 128)] == [4, 2, 1, 1]
    out = tmp_path / "narrow"
    summary = generate_shards(RECORDS, str(out), *model, encode, INFO, settings,
                              ("greedy", "sampled"), progress=False)
    assert greedy_only(content(out)) == greedy_only(full[2]) and set(content(out)) == set(full[2])
    assert summary["batches"] > full[1]["batches"]
    shards = shard_store.read_manifest(str(out))["shards"]
    assert all(entry["settings"]["batch_tokens"] == 64 for entry in shards)
    with pytest.raises(ValueError, match="batch_tokens must be >= 0"):
        GenerationSettings(batch_tokens=-1)


def test_compiling_ahead_writes_the_same_shards(model, full, tmp_path):
    """``compile_workers``: the static batches' programs compiled on threads from the
    start; the examples are the uninterrupted run's, sampled ones included."""
    summary = run(model, tmp_path / "ahead", compile_workers=3)
    assert content(tmp_path / "ahead") == full[2]
    assert summary["compile_ahead_jobs"] == 2 * 2 and summary["compile_ahead_failed"] == 0
    assert "compile_ahead_jobs" not in full[1]                    # off by default


def test_time_limit_stops_between_batches_and_resumes(model, full, tmp_path):
    """``seconds=0``: no batch starts, nothing is lost; a later call finishes the same set."""
    out = tmp_path / "timed"
    first = run(model, out, seconds=0.0)
    assert first["stopped"] and first["written"] == 0 and first["batches"] == 0
    second = run(model, out)
    assert not second["stopped"] and content(out) == full[2]


def test_int32_tokens_for_large_vocab(tmp_path):
    info = dict(INFO, vocab_size=70000)
    tokens, index = shard_store.pack_examples([[1, 69999]], [[65536, 2]], np.dtype(np.int32))
    with ShardWriter(str(tmp_path), info) as writer:
        assert writer.dtype == np.int32
        writer.write_shard(tokens, index, {"ids": ["x"], "kinds": ["k"], "sources": ["s"],
                                           "modes": ["greedy"]}, {})
        with pytest.raises(ValueError, match="already written"):
            writer.write_shard(tokens, index, {"ids": ["x"], "kinds": ["k"], "sources": ["s"],
                                               "modes": ["greedy"]}, {})
        with pytest.raises(ShardError, match="another process"):
            ShardWriter(str(tmp_path), info).__enter__()
    np.testing.assert_array_equal(ShardDataset(str(tmp_path))[0]["input_ids"],
                                  [1, 69999, 65536, 2])
    with pytest.raises(ValueError, match="cannot be stored as uint16"):
        shard_store.pack_examples([[1]], [[70000]], np.dtype(np.uint16))
    with pytest.raises(ShardError, match="another target"):
        ShardWriter(str(tmp_path), dict(info, fingerprint="0" * 64)).__enter__()


def write_examples(path, examples):
    """Synthetic examples as one shard (no generation)."""
    prompts = [list(ex["input_ids"][ex["loss_mask"] == 0]) for ex in examples]
    responses = [list(ex["input_ids"][ex["loss_mask"] == 1]) for ex in examples]
    tokens, index = shard_store.pack_examples(prompts, responses, np.dtype(np.uint16))
    n = len(examples)
    with ShardWriter(str(path), INFO) as writer:
        writer.write_shard(tokens, index, {"ids": [str(i) for i in range(n)],
                                           "kinds": ["chat"] * n, "sources": ["s"] * n,
                                           "modes": ["greedy"] * n}, {})


def test_training_streams_from_shards(model, tmp_path):
    from domino_jax.train.config import TrainConfig
    from domino_jax.train.loop import train

    examples = synthetic_examples(16)
    examples[3] = {"input_ids": examples[3]["input_ids"][:12],       # 4 loss tokens: dropped
                   "loss_mask": examples[3]["loss_mask"][:12]}
    write_examples(tmp_path / "shards", examples)
    loaded = data_lib.load_dataset(str(tmp_path / "shards"))
    assert isinstance(loaded, ShardDataset) and len(loaded) == 16
    for a, b in zip(examples, loaded):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    assert len(data_lib.filter_examples(loaded, 8, 48)) == 15
    # test_train's tiny-task settings (one compiled step for both), 3 steps of them
    cfg = TrainConfig(drafter="dflash", **TINY_TASK)
    common = dict(target=model[0], target_params=model[1], export=False, progress=False,
                  stop_after=3, **SMALL)
    streamed = train(cfg, None, str(tmp_path / "shards"), str(tmp_path / "a"), **common)
    in_memory = train(cfg, None, None, str(tmp_path / "b"),
                      examples=data_lib.filter_examples(examples, 8, 48), **common)
    assert [h["loss"] for h in streamed.history] == [h["loss"] for h in in_memory.history]
    with open(tmp_path / "a" / "train_config.json") as f:
        assert json.load(f)["examples"] == 15


def test_bad_inputs(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        read_records(str(tmp_path / "nowhere.jsonl"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "a", "kind": "chat", "source": "s", "prompt": "hi"}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:3: not valid JSON"):
        read_records(str(corpus))
    corpus.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "kind": "chat"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: key 'prompt'"):
        read_records(str(corpus))
    corpus.write_text('["a", "b"]\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:1: expected a JSON object"):
        read_records(str(corpus))
    corpus.write_text('{"id": "a", "prompt": "hi"}\n')
    assert read_records(str(corpus)) == [{"id": "a", "kind": "unknown", "source": "unknown",
                                          "prompt": "hi"}]
    for argv, message in (
            (["--corpus", str(tmp_path / "nowhere.jsonl")], "nowhere.jsonl"),
            (["--corpus", str(corpus), "--modes", "greedy,beam"], "unknown mode"),
            (["--corpus", str(corpus), "--limit", "0"], "--limit"),
            (["--corpus", str(corpus), "--widths", "64,x"], "--widths")):
        assert main(["generate", "--out", str(tmp_path / "s")] + argv) == 2
        assert message in capsys.readouterr().err
    assert main(["info", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        data_lib.load_dataset(str(tmp_path))
    with pytest.raises(ValueError, match="finite temperature"):
        GenerationSettings(temperature=float("nan"))
    with pytest.raises(ValueError, match="bad prompt width"):
        GenerationSettings(widths=(48,))
    with pytest.raises(ValueError, match="unknown mode"):
        generate_shards([], str(tmp_path / "s"), None, None, encode, INFO, SETTINGS, ["beam"])


# ----------------------------------------------------------------------------- CLI + encoder

QWEN3_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def save_char_tokenizer(path) -> None:
    """A character-level tokenizer (< 128 ids) with a Qwen3-style thinking switch."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = QWEN3_LIKE_TEMPLATE
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def hf_target_dir(tmp_path_factory):
    """A tiny random target folder (config, safetensors, tokenizer), vocab 128."""
    import dataclasses

    from converters.hf_target import export_target

    path = tmp_path_factory.mktemp("hf_target")
    config = dataclasses.replace(TARGET, vocab_size=128, eos_token_ids=(2,))
    export_target(config, random_target_params(config, 1), str(path))
    save_char_tokenizer(path)
    return str(path)


def test_one_prompt_encoder_turns_thinking_off(hf_target_dir, monkeypatch):
    from domino_jax.decode import __main__ as decode_cli
    from domino_jax.decode import loading
    from domino_jax.decode.loading import load_tokenizer

    tokenizer = load_tokenizer(hf_target_dir)
    ids = encode_prompt(tokenizer, "hi")
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), text
    thinking = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             add_generation_prompt=True, tokenize=False)
    assert "<think>" not in thinking                   # the template's default differs
    assert encode_prompt(tokenizer, "hi", chat=False) == tokenizer.encode("hi")
    assert data_lib.chat_ids is encode_prompt          # training data: the same function
    seen = []                                          # decode CLI: the same function

    def spy(tokenizer, text, chat=True):
        seen.append(text)
        return encode_prompt(tokenizer, text, chat)

    monkeypatch.setattr(loading, "encode_prompt", spy)
    assert decode_cli.main(["--target", hf_target_dir, "--prompt", "hi", "--dtype", "float32",
                            "--max-new-tokens", "2", "--stream-rounds", "0"]) == 0
    assert seen == ["hi"]


def test_cli_generate_info_merge(hf_target_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    records = RECORDS[:5] + RECORDS[6:7]                 # record 5 is too long
    with open(corpus, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    common = ["--corpus", str(corpus), "--target", hf_target_dir, "--modes", "greedy",
              "--max-new-tokens", "4", "--batch-size", "4", "--widths", "64",
              "--dtype", "float32", "--no-progress"]
    assert main(["generate", "--out", str(tmp_path / "a"), "--limit", "3"] + common) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["written"] == 3 and first["tokens_per_second"] > 0
    assert main(["generate", "--out", str(tmp_path / "a")] + common) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["written"] == 3 and second["already_done"] == 3
    assert main(["info", str(tmp_path / "a"), "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    kinds = [r["kind"] for r in records]
    assert info["examples"] == 6 and info["counts"]["greedy"] == {k: kinds.count(k)
                                                                  for k in set(kinds)}
    assert info["verified_shards"] == 2 and info["token_dtype"] == "uint16"
    assert main(["merge", "--out", str(tmp_path / "b"), str(tmp_path / "a")]) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 6
    from domino_jax.decode.loading import load_tokenizer

    tokenizer = load_tokenizer(hf_target_dir)
    ds = ShardDataset(str(tmp_path / "b"))
    by_id = {r["id"]: r for r in RECORDS}
    for i in range(len(ds)):
        prompt = encode_prompt(tokenizer, by_id[ds.ids[i]]["prompt"])
        assert list(ds[i]["input_ids"][:len(prompt)]) == prompt
