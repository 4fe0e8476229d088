"""The offline prompt corpus (domino_jax.train.corpus): distinctness, mix, determinism, the
held-out split (never a near-duplicate of training), benchmark exclusion, record format,
prompt lengths, the per-process parse of source files, and the self-instruct add-on with a
tiny random target."""

from __future__ import annotations

import ast
import json
import os
import random
import re

import numpy as np
import pytest

from domino_jax.train import corpus as corpus_mod
from domino_jax.train import corpus_parse
from domino_jax.train.corpus import (DEFAULT_MIX, KINDS, RECORD_KEYS, Source, build_corpus,
                                     is_heldout, main, parse_mix, read_corpus,
                                     training_records)
from domino_jax.train.corpus_code import inject_bug, iter_functions
from domino_jax.train.corpus_text import file_documents
from domino_jax.train.corpus_dedup import (BenchmarkFilter, NearDuplicateIndex, jaccard,
                                           normalise, prompt_id)

SMALL = 3000
EVAL_FRACTION = 0.05


@pytest.fixture(scope="module")
def small_corpus():
    return build_corpus(SMALL, seed=0, eval_fraction=EVAL_FRACTION)


def _all(corpus):
    return corpus.train + corpus.heldout


def test_distinct_records_and_format(small_corpus):
    records = _all(small_corpus)
    assert len(records) == SMALL
    assert len({r["id"] for r in records}) == SMALL
    assert len({normalise(r["prompt"]) for r in records}) == SMALL
    for r in records:
        assert set(r) == set(RECORD_KEYS)
        assert re.fullmatch(r"[0-9a-f]{16}", r["id"]) and r["id"] == prompt_id(r["prompt"])
        assert r["kind"] in KINDS and r["source"] and r["prompt"].strip()


def test_mix_across_kinds(small_corpus):
    card = small_corpus.card
    total = card["counts"]["total"]
    for kind, share in DEFAULT_MIX.items():
        assert abs(total[kind] - share * SMALL) <= 1, (kind, total[kind])
    assert total["chat"] / SMALL < 0.25                       # templated chat: a minority
    assert card["templated_fraction"] < 0.5
    families = {s.split(".")[0] for s in card["sources"]}
    assert {"gen", "stdlib", "packages", "docs", "template"} <= families
    code_tasks = {s.split(".")[-1] for s in card["sources"] if ".code." in s}
    assert {"explain", "document", "fix_bug", "complete", "write_from_doc"} <= code_tasks
    assert len([s for s in card["sources"] if s.startswith("gen.math.")]) >= 25


def test_deterministic_given_seed(small_corpus):
    again = build_corpus(SMALL, seed=0, eval_fraction=EVAL_FRACTION)
    assert again.train == small_corpus.train and again.heldout == small_corpus.heldout
    other = build_corpus(300, seed=1, eval_fraction=EVAL_FRACTION)
    first = [r["prompt"] for r in _all(small_corpus)[:300]]
    assert len(set(first) & {r["prompt"] for r in _all(other)}) < 150


def test_heldout_split_by_hash_per_kind(small_corpus):
    train, held = small_corpus.train, small_corpus.heldout
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert all(is_heldout(r["id"], EVAL_FRACTION) for r in held)
    assert not any(is_heldout(r["id"], EVAL_FRACTION) for r in train)
    assert {r["kind"] for r in held} == set(KINDS)            # every kind is represented
    assert 0.5 * EVAL_FRACTION < len(held) / SMALL < 2 * EVAL_FRACTION


def test_heldout_never_near_duplicate_of_train(small_corpus):
    """Exact shingle Jaccard of every (held-out, train) pair, via an inverted index."""
    index = NearDuplicateIndex()
    train = [index.shingles(r["prompt"]) for r in small_corpus.train]
    sizes = np.array([len(t) for t in train])
    postings: dict[int, list[int]] = {}
    for j, shingles in enumerate(train):
        for s in shingles.tolist():
            postings.setdefault(s, []).append(j)
    worst = 0.0
    for record in small_corpus.heldout:
        held = index.shingles(record["prompt"])
        hits = [j for s in held.tolist() for j in postings.get(s, ())]
        if hits:
            inter = np.bincount(hits, minlength=len(train))
            worst = max(worst, float((inter / (len(held) + sizes - inter)).max()))
    assert 0.0 < worst < index.threshold


def test_near_duplicate_index_against_brute_force():
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]
    base = [" ".join(rng.choices(vocab, k=60)) for _ in range(40)]
    texts = []
    for text in base:                        # each base text plus edited copies of it
        words = text.split()
        texts.append(text)
        for edits in (1, 3, 12):
            copy = list(words)
            for i in rng.sample(range(len(copy)), edits):
                copy[i] = rng.choice(vocab)
            texts.append(" ".join(copy))
    index = NearDuplicateIndex(threshold=0.8)
    kept = []
    for text in texts:
        match = index.add(text)
        shingles = index.shingles(text)
        brute = [j for j, k in enumerate(kept) if jaccard(shingles, k) >= 0.8]
        assert (match is None) == (not brute), text[:40]
        if match is None:
            kept.append(shingles)
    assert 40 <= len(kept) < len(texts)
    assert index.query(texts[0]) == 0 and index.query("an unrelated short sentence") is None


def test_benchmark_fingerprints():
    bench = BenchmarkFilter()
    humaneval = ("from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
                 "threshold: float) -> bool:\n    \"\"\" Check if ...\"\"\"")
    assert bench.reason(humaneval) == "fingerprint:humaneval"
    assert bench.reason("Janet\u2019s ducks lay 16 eggs per day. She eats three...") \
        == "fingerprint:gsm8k"
    assert bench.reason("Compose an engaging travel blog post about a recent trip to Hawaii, "
                        "highlighting cultural experiences.") == "fingerprint:mt_bench"
    assert bench.reason("Convert the point $(0,3)$ in rectangular coordinates to polar "
                        "coordinates.") == "fingerprint:math"
    for benign in ("def add(self, item):\n    self.items.append(item)",
                   "Explain how ducks lay eggs.", "def fib(n):\n    return n"):
        assert bench.reason(benign) is None


def _fixed_source(kind, name, prompts):
    return Source(name, kind, 1.0, lambda rng: ((name, p) for p in prompts), False)


def test_exclusion_files_and_fingerprints(tmp_path):
    """Prompts sharing an 8-gram with an --exclude text, or carrying a benchmark fingerprint,
    never reach the corpus, and the card counts them."""
    rng = random.Random(3)
    words = [f"token{i}" for i in range(500)]
    prompts = [" ".join(rng.choices(words, k=30)) for _ in range(60)]
    leaked_jsonl, leaked_txt = prompts[:4], prompts[4:7]
    jsonl = tmp_path / "bench.jsonl"
    with open(jsonl, "w") as f:
        for p in leaked_jsonl:       # a benchmark item that embeds the prompt's middle part
            middle = " ".join(p.split()[10:20])
            f.write(json.dumps({"question": f"Q: {middle.upper()}!", "answer": "42",
                                "turns": ["x", "y"]}) + "\n")
    txt = tmp_path / "bench.txt"
    txt.write_text("\n".join(" ".join(p.split()[5:14]) for p in leaked_txt) + "\nab cd\n")
    fingerprinted = ["Please solve: def separate_paren_groups(paren_string: str) -> List[str]:",
                     "Every day, Wendi feeds each of her chickens three cups of feed."]
    sources = [_fixed_source("chat", "test.chat", fingerprinted + prompts)]
    corpus = build_corpus(len(prompts) - 7, seed=0, mix={"chat": 1.0}, sources=sources,
                          exclude_files=[str(jsonl), str(txt)], eval_fraction=0.0)
    kept = {r["prompt"] for r in corpus.train}
    assert kept == set(prompts[7:])
    exclusion = corpus.card["exclusion"]
    assert exclusion["exclude_file_hits"] == {str(jsonl): 4, str(txt): 3}
    assert exclusion["fingerprint_hits"] == {"humaneval": 1, "gsm8k": 1}
    assert exclusion["exclude_texts_too_short"] == 3 * 4 + 1      # "42", "x", "y"; "ab cd"
    assert [f["texts"] for f in exclusion["exclude_files"]] == [16, 4]


_MODULE = '''"""A module docstring long enough to read as prose, with more than eighteen words in
one paragraph, so that the text pool keeps it as a document."""


def first(values):
    """The first item of a list, or None for an empty one."""
    if not values:
        return None
    return values[0]
'''


def test_parse_cache_parses_each_file_once(tmp_path, monkeypatch):
    """Functions and documents of a file come from one parse, kept until the file changes; a
    file that does not parse gives neither; a cold cache reads what a warm one does."""
    monkeypatch.setattr(corpus_parse, "_FACTS", {})
    parses = []
    real_parse = corpus_parse._parse
    monkeypatch.setattr(corpus_parse, "_parse",
                        lambda path, known: parses.append(path) or real_parse(path, known))
    path = tmp_path / "mod.py"
    path.write_text(_MODULE)
    (tmp_path / "broken.py").write_text("def broken(:\n    pass\n")
    roots = [("pkg", str(tmp_path))]
    functions = list(iter_functions(roots))
    documents = file_documents(str(path))
    assert [(f.module, f.qualname, f.docstring) for f in functions] == [
        ("pkg.mod", "first", "The first item of a list, or None for an empty one.")]
    assert len(documents) == 1 and documents[0][0].startswith("A module docstring")
    assert list(iter_functions(roots)) == functions and file_documents(str(path)) == documents
    assert file_documents(str(tmp_path / "broken.py")) == []
    assert sorted(os.path.basename(p) for p in parses) == ["broken.py", "mod.py"]
    path.write_text(_MODULE.replace("return values[0]", "return values[0] if values else None"))
    edited = list(iter_functions(roots))              # a new size: parsed again
    assert "if values else None" in edited[0].source and len(parses) == 3
    corpus_parse._FACTS.clear()
    assert list(iter_functions(roots)) == edited and file_documents(str(path)) == documents


def test_bug_injection_changes_code_and_parses():
    functions = [fn for _, fn in zip(range(60), iter_functions())]
    changed = 0
    for fn in functions:
        buggy = inject_bug(fn.source, random.Random(fn.qualname))
        if buggy is None:
            continue
        ast.parse(buggy)
        assert ast.unparse(ast.parse(buggy)) != ast.unparse(ast.parse(fn.source))
        assert buggy == inject_bug(fn.source, random.Random(fn.qualname))
        changed += 1
    assert changed >= 40


def test_prompt_lengths(small_corpus):
    records = _all(small_corpus)
    for r in records:
        for block in re.findall(r"```python\n(.*?)```", r["prompt"], re.S):
            assert block.count("\n") <= 40, r["source"]
    chars = np.array([len(r["prompt"]) for r in records])
    assert np.percentile(chars, 90) < 800 and chars.max() <= corpus_mod.MAX_CHARS


def test_prompt_tokens_with_smollm2_tokenizer(small_corpus):
    from domino_jax.demo_model import demo_target_dir

    folder = demo_target_dir()
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        pytest.skip("demo SmolLM2 tokenizer not converted on this machine")
    from domino_jax.decode.loading import load_tokenizer

    stats = corpus_mod.token_length_stats(_all(small_corpus), load_tokenizer(folder))
    assert stats["share_under_200"] >= 0.9 and stats["p50"] < 100, stats


def test_cli_writes_files_and_read_corpus(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert main(["--out", str(out), "--num-prompts", "400", "--seed", "0",
                 "--eval-fraction", "0.1"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    train, held = read_corpus(str(out)), read_corpus(str(out / "heldout.jsonl"))
    assert len(train) + len(held) == 400 == summary["train"] + summary["heldout"]
    card = json.loads((out / "card.json").read_text())
    for key in ("corpus_version", "seed", "counts", "sources", "exclusion", "dedup", "versions",
                "build_seconds"):
        assert key in card
    assert sum(card["counts"]["heldout"].values()) == len(held)
    with open(out / "train.jsonl") as f:
        assert list(json.loads(f.readline())) == list(RECORD_KEYS)
    # a follow-on corpus: new prompts only, far from every earlier one; the same held-out file
    more = tmp_path / "more"
    assert main(["--out", str(more), "--num-prompts", "400", "--seed", "0",
                 "--eval-fraction", "0.1", "--extends", str(out)]) == 0
    new = read_corpus(str(more))
    assert read_corpus(str(more / "heldout.jsonl")) == held
    assert len(new) > 300 and not {r["id"] for r in new} & {r["id"] for r in train + held}
    index = NearDuplicateIndex()
    for r in train + held:
        index.add(r["prompt"])
    assert all(index.add(r["prompt"]) is None for r in new)
    extends = json.loads((more / "card.json").read_text())["extends"]
    assert extends["earlier_prompts"] == 400 and extends["heldout"] == len(held)
    # a third build follows both earlier ones: far from every prompt either holds
    third = tmp_path / "third"
    assert main(["--out", str(third), "--num-prompts", "200", "--seed", "2",
                 "--eval-fraction", "0.1", "--extends", str(out), "--extends", str(more)]) == 0
    newer = read_corpus(str(third))
    assert read_corpus(str(third / "heldout.jsonl")) == held and len(newer) > 150
    assert all(index.add(r["prompt"]) is None for r in newer)
    extends = json.loads((third / "card.json").read_text())["extends"]
    assert extends["dirs"] == [str(out), str(more)]
    assert extends["earlier_prompts"] == len(train) + len(new) + len(held)
    # builds with different held-out splits cannot be followed together
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.jsonl").write_text((more / "train.jsonl").read_text())
    (other / "heldout.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in held[1:]))
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--num-prompts", "10", "--extends", str(out),
              "--extends", str(other)])
    assert "differs" in capsys.readouterr().err


def test_read_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_corpus(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "00", "kind": "chat", "prompt": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*source"):
        read_corpus(str(bad))


@pytest.mark.parametrize("argv, message", [
    (["--mix", "math=0.5,poetry=0.5"], "unknown kind 'poetry'"),
    (["--exclude", "/nonexistent.jsonl"], "not found"),
    (["--self-instruct", "10"], "needs --target"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--eval-fraction", "1.5"], "--eval-fraction"),
])
def test_cli_bad_input_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "x")] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_parse_mix():
    assert parse_mix("math=3,code=1") == {"chat": 0.0, "math": 0.75, "code": 0.25,
                                          "continuation": 0.0, "summarize": 0.0}
    with pytest.raises(ValueError, match="KIND=NUMBER"):
        parse_mix("math=lots")


def test_extra_records_pass_the_same_filters():
    extra = [{"kind": "chat", "source": "self_instruct", "prompt": "Tell me a story about a fox."},
             {"kind": "chat", "source": "self_instruct", "prompt": "tell me a story about a  FOX."},
             {"kind": "code", "source": "self_instruct",
              "prompt": "Write def has_close_elements(numbers, threshold) in Python."}]
    corpus = build_corpus(50, seed=0, extra=extra, eval_fraction=0.0,
                          mix={"math": 1.0})
    mine = [r for r in corpus.train if r["source"] == "self_instruct"]
    assert [r["prompt"] for r in mine] == ["Tell me a story about a fox."]
    assert len(corpus.train) == 51


def test_training_records_take_what_a_corpus_would():
    """New prompts beside a corpus (a campaign round's self-instruct requests): the corpus's
    filters against ``taken``'s prompts, and the held-out rule."""
    taken = [{"prompt": "Tell me a story about a fox."}]
    texts = ["tell me a story about a  FOX.", "Write def has_close_elements(numbers, threshold) "
             "in Python.", "Write a short poem about the sea and its waves.", "Too short"]
    records = [{"kind": "chat", "source": "self_instruct", "prompt": t} for t in texts]
    kept, rejected = training_records(records, taken, eval_fraction=0.0)
    assert [r["prompt"] for r in kept] == [texts[2]] and kept[0]["id"] == prompt_id(texts[2])
    assert rejected["exact_duplicate"] == 1 and rejected["length"] == 1
    assert any(k.startswith("fingerprint:") for k in rejected)
    # everything held out by the rule at eval_fraction 1 - tiny
    kept, rejected = training_records(records[2:3], [], eval_fraction=0.999999)
    assert kept == [] and rejected == {"heldout": 1}


@pytest.mark.slow
def test_full_size_corpus():
    """The default build: 60,000 distinct prompts, every kind at its share."""
    corpus = build_corpus(60000, seed=0)
    records = _all(corpus)
    assert len({r["id"] for r in records}) == len(records) == 60000
    assert corpus.card["shortfall"] == {}
    for kind, share in DEFAULT_MIX.items():
        assert abs(corpus.card["counts"]["total"][kind] - share * 60000) <= 1
    print(f"full build: {corpus.card['build_seconds']} s")


# ---------------------------------------------------------------- self-instruct

_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """A character-level HF tokenizer (34 tokens) with a ChatML-style chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz ?.,\n"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = _TEMPLATE
    return fast


def test_user_turn_prefix_and_filters():
    from domino_jax.train.self_instruct import (end_of_turn_ids, guess_kind,
                                                is_plausible_request, user_turn_prefix)

    tok = char_tokenizer()
    prefix, suffix = user_turn_prefix(tok)
    assert prefix == "<|im_start|>user\n" and suffix == "<|im_end|>\n"
    assert end_of_turn_ids(tok, suffix) == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert is_plausible_request("How do I keep basil alive on a windowsill?")
    for bad in ("hi", "<|im_start|>assistant hello there friend", "1234 5678 9012 3456 7890",
                "the the the the the the the the the the"):
        assert not is_plausible_request(bad), bad
    assert guess_kind("Write a Python function that sorts a list") == "code"
    assert guess_kind("How many apples are left if I eat 3 of 10?") == "math"
    assert guess_kind("Please summarize this article for me") == "summarize"
    assert guess_kind("What should I cook tonight?") == "chat"


def test_self_instruct_with_tiny_target():
    from decode_helpers import tiny_target

    from domino_jax.train.self_instruct import is_plausible_request, self_instruct_prompts

    tok = char_tokenizer()
    target, params = tiny_target(0, vocab=len(tok))
    kwargs = dict(batch_size=8, max_new_tokens=8, require_stop=False, min_words=1, seed=0)
    out = self_instruct_prompts(target, params, tok, 5, **kwargs)
    assert 1 <= len(out) <= 5
    texts = [r["prompt"] for r in out]
    assert len({normalise(t) for t in texts}) == len(texts)
    assert all(r["source"] == "self_instruct" and r["kind"] in KINDS for r in out)
    assert all(is_plausible_request(t, min_words=1) and "<|" not in t for t in texts)
    assert self_instruct_prompts(target, params, tok, 5, **kwargs) == out


def test_cli_self_instruct_with_saved_tiny_target(tmp_path, capsys):
    """``--self-instruct N --target DIR`` loads an HF folder, generates, and records what it
    wrote in the card (a random model's texts mostly fail the filter: the count may be 0)."""
    from conftest import build_hf_model, save_hf

    folder = save_hf(build_hf_model("llama", tied=False), tmp_path / "target")
    char_tokenizer().save_pretrained(folder)
    out = tmp_path / "corpus"
    assert main(["--out", str(out), "--num-prompts", "60", "--self-instruct", "3",
                 "--target", folder, "--self-instruct-batch", "4",
                 "--self-instruct-max-new-tokens", "8", "--dtype", "float32"]) == 0
    card = json.loads((out / "card.json").read_text())
    records = read_corpus(str(out)) + read_corpus(str(out / "heldout.jsonl"))
    kept = sum(r["source"] == "self_instruct" for r in records)
    info = card["self_instruct"]
    assert (info["requested"], info["kept"], info["target"]) == (3, kept, folder)
    assert kept <= info["written"] <= 3 and len(records) == 60 + kept


def test_self_instruct_command_keeps_requests_against_a_held_out_file(tmp_path, monkeypatch,
                                                                     capsys):
    """``python -m domino_jax.train.user_requests``: what the target wrote, kept as training
    prompts would be against ``--against``, the first ``--keep``, relabelled ``--kind``."""
    from domino_jax.train import self_instruct, user_requests
    from domino_jax.train.self_instruct import guess_kind

    held = tmp_path / "heldout.jsonl"
    held.write_text(json.dumps({"id": "h", "kind": "chat",
                                "prompt": "How do I keep basil alive on a windowsill?"}) + "\n")
    texts = ["How do I keep basil alive on a windowsill?", "Write a short poem about a fox.",
             "Can you plan a picnic for six people by the lake?", "Suggest a name for my cat."]
    calls = []
    monkeypatch.setattr(self_instruct, "self_instruct_from_dir", lambda target, num, **kw: (
        calls.append((target, num, kw)) or
        [{"kind": guess_kind(t), "source": "self_instruct", "prompt": t} for t in texts]))
    out = tmp_path / "requests.jsonl"
    assert user_requests.main(["--out", str(out), "--num", "4", "--keep", "2", "--seed", "7",
                               "--against", str(held), "--kind", "request", "--target",
                               "T", "--dtype", "float32"]) == 0
    (target, num, kw), = calls
    assert (target, num, kw["seed"], kw["dtype"]) == ("T", 4, 7, "float32")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == texts[1:3]              # the held-out one dropped
    assert all(r["kind"] == "request" and r["guessed_kind"] == "chat" for r in records)
    assert [r["id"] for r in records] == [prompt_id(t) for t in texts[1:3]]
    assert json.loads(capsys.readouterr().out)["kept"] == 2
    with pytest.raises(SystemExit):
        user_requests.main(["--out", str(out), "--num", "1", "--against", str(tmp_path / "x")])
