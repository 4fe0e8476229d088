"""The decode CLI's run and report: compile lines, generation progress, the summary table and
the ``--json`` record.

    record = decode_and_report(target, target_params, drafter, draft_params, prompts, texts,
                               tokenizer, config, compare_ar=True)

On stderr (human mode): one line per compiled method (``compiling domino (prefill + round
loop, batch 1, prompt 64) ... 9.2 s``), then the text streams on stdout (batch 1) or a tqdm
bar counts tokens (batch > 1), then a table::

    method  tokens  rounds   tau  tok/s  speedup  verify widths  output
    domino      32      28  1.11    2.4    0.98x  1:25 3:3       identical to AR
    ar          32      31  1.00    2.5    1.00x  1:31           reference

(``verify widths``: rows verified per round, and how many rounds ran at each; an adaptive
run chooses them per round, ``decode/adaptive.py``.)

With ``as_json`` nothing but one JSON object goes to stdout (:func:`decode_and_report`'s
return value: the outputs and :func:`method_stats` per method); the compile lines stay on
stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Sequence

from domino_jax.console import step


def method_stats(method: str, result, ar=None) -> dict[str, Any]:
    """One method's numbers (JSON-ready) from a ``GenerateResult``; with ``ar`` (the AR
    result on the same prompts) also ``speedup_over_ar`` (decode tokens/s ratio) and
    ``identical_to_ar`` (every row token for token)."""
    stats = dict(method=method, new_tokens=result.new_tokens, rounds=int(result.rounds.sum()),
                 tau=round(result.tau, 4), verify_width=int(result.verify_width),
                 verify_widths={str(w): n for w, n in sorted(result.verify_widths.items())},
                 arm_rounds=dict(getattr(result, "arm_rounds", {}) or {}),
                 cost_model=result.cost_source or None,
                 tokens_per_second=round(result.tokens_per_second, 2),
                 prefill_seconds=round(result.prefill_seconds, 4),
                 decode_seconds=round(result.decode_seconds, 4))
    if ar is not None:
        stats["speedup_over_ar"] = round(result.tokens_per_second
                                         / max(ar.tokens_per_second, 1e-9), 3)
        stats["identical_to_ar"] = result.tokens == ar.tokens
    return stats


def summary_table(rows: Sequence[dict], temperature: float = 0.0) -> str:
    """The human summary of :func:`method_stats` rows (the AR row, if any, last)."""
    compared = any("speedup_over_ar" in r for r in rows)
    head = (["method", "tokens", "rounds", "tau", "tok/s"] + (["speedup"] if compared else [])
            + ["verify widths"] + (["output"] if compared else []))
    lines = [head]
    for r in rows:
        line = [r["method"], str(r["new_tokens"]), str(r["rounds"]), f"{r['tau']:.2f}",
                f"{r['tokens_per_second']:.1f}"]
        widths = " ".join(f"{w}:{n}" for w, n in r.get("verify_widths", {}).items()) or "-"
        lookups = [f"{a}:{n}" for a, n in r.get("arm_rounds", {}).items()
                   if a.startswith("lookup")]
        if lookups:                       # adaptive lookup arms (counted in their widths)
            widths += " (" + " ".join(lookups) + ")"
        if compared:
            if "speedup_over_ar" in r:
                same = r["identical_to_ar"]
                line += [f"{r['speedup_over_ar']:.2f}x", widths,
                         "identical to AR" if same else
                         "differs from AR" + ("" if temperature == 0 else
                                              " (expected at T > 0)")]
            else:
                line += ["1.00x" if r["method"] == "ar" else "-", widths, "reference"
                         if r["method"] == "ar" else "-"]
        else:
            line.append(widths)
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    left = {0, len(head) - 2, len(head) - 1} if compared else {0, len(head) - 1}   # text
    fmt = lambda line: "  ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(line, widths))).rstrip()
    return "\n".join(fmt(line) for line in lines)


def compile_methods(target, target_params, prompts, runs, seed: int = 0, err=None) -> None:
    """Compile every ``(name, config, drafter, draft_params)`` run, one stderr line each
    with its compile time (``cached`` when this process compiled it already)."""
    from domino_jax.decode.speculative import pad_prompts, precompile

    shape = pad_prompts(prompts)[0].shape
    for name, config, drafter, draft_params in runs:
        with step(f"compiling {name}", f"(prefill + round loop, batch {shape[0]}, prompt "
                  f"{shape[1]})", stream=err) as note:
            if precompile(target, target_params, prompts, config, drafter, draft_params,
                          seed=seed) == 0.0:
                note("cached")


class Streamer:
    """``on_chunk`` for batch 1: prints the decoded text of the committed tokens as chunks
    arrive."""

    def __init__(self, tokenizer, stream=None):
        self.tokenizer, self.printed, self.stream = tokenizer, "", stream or sys.stdout

    def __call__(self, tokens: list[list[int]]):
        text = self.tokenizer.decode(tokens[0], skip_special_tokens=True)
        if text.startswith(self.printed):
            self.stream.write(text[len(self.printed):])
            self.stream.flush()
            self.printed = text

    def finish(self, tokens: list[list[int]]):
        self(tokens)
        self.stream.write("\n")


class TokenBar:
    """``on_chunk`` for batches: a tqdm bar (stderr) of tokens generated over all rows."""

    def __init__(self, rows: int, max_new_tokens: int, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=rows * max_new_tokens, unit="tok", desc=desc, leave=False,
                        dynamic_ncols=True)

    def __call__(self, tokens: list[list[int]]):
        self.bar.update(sum(map(len, tokens)) - self.bar.n)

    def finish(self, tokens: list[list[int]]):
        self.bar.close()


def decode_and_report(target, target_params, drafter, draft_params, prompts: Sequence,
                      texts: Sequence[str], tokenizer, config, seed: int = 0,
                      compare_ar: bool = False, stream_rounds: int = 8,
                      as_json: bool = False, out=None, err=None, cost_model=None,
                      timing_reps: int = 2, slots: int | None = None) -> dict[str, Any]:
    """Compile, generate (streaming / progress bar), optionally compile and time AR, print
    and return the
    record ``{"outputs": [{"prompt", "text", "tokens"}], "methods": [method_stats...],
    "config": ...}``.

    With ``compare_ar`` (and a method other than AR): AR runs on the same prompts with the
    same sampling, then the method once more without streaming, ``timing_reps`` times
    alternately, and the faster run of each is reported (warm, unstreamed loops; a busy
    machine only ever slows a run down). ``stream_rounds`` = rounds per progress chunk (0 =
    none). ``cost_model``: where an adaptive run's round costs come from
    (:class:`~domino_jax.decode.cost_model.CostModel`; default: the cached table).
    ``slots``: serve the prompts as a queue through that many rows, refilling finished ones
    (:func:`~domino_jax.decode.serving.serve`: continuous batching; no streaming; tokens/s
    over the queue's wall time, prefills included, AR's too); ``None``: one static batch.
    """
    from domino_jax.decode.serving import serve
    from domino_jax.decode.speculative import generate

    def run(config, drafter, draft_params, announce=False, **kw):
        if slots is None:
            return generate(target, target_params, prompts, config, drafter, draft_params,
                            seed=seed, **kw)
        kw.pop("chunk_rounds", None), kw.pop("on_chunk", None)
        served = lambda: serve(target, target_params, prompts, config, drafter, draft_params,
                               slots=slots, seed=seed, **kw)
        if not announce:
            return served()
        with step(f"serving {config.method}", f"({len(prompts)} prompts through {slots} "
                  "slots, compiling on first use)", stream=err):
            return served()

    out, err = out or sys.stdout, err or sys.stderr
    method = config.method
    ar_config = dataclasses.replace(config, method="ar", adaptive=None)
    compare = compare_ar and method != "ar"
    if slots is None:                 # serve compiles its own programs on its first run
        compile_methods(target, target_params, prompts,
                        [(method, config, drafter, draft_params)], seed, err)

    progress = None
    if stream_rounds > 0 and slots is None:
        progress = (Streamer(tokenizer, out) if len(prompts) == 1 and not as_json else
                    TokenBar(len(prompts), config.max_new_tokens, method))
    result = run(config, drafter, draft_params, announce=True,
                 chunk_rounds=stream_rounds or None, on_chunk=progress, cost_model=cost_model)
    if progress is not None:
        progress.finish(result.tokens)
    outputs = [dict(prompt=text, text=tokenizer.decode(toks, skip_special_tokens=True),
                    tokens=list(map(int, toks))) for text, toks in zip(texts, result.tokens)]
    if not as_json and not isinstance(progress, Streamer):
        for o in outputs:
            print(f"### {o['prompt']}\n{o['text']}\n", file=out)
    rows = [method_stats(method, result)]
    if compare:                       # AR compiles after the text is out: it shows sooner
        if slots is None:
            compile_methods(target, target_params, prompts, [("ar", ar_config, None, None)],
                            seed, err)
        else:
            run(ar_config, None, None, announce=True)     # compiles serve's AR programs
        with step("timing", method, "against ar (warm, unstreamed)", stream=err):
            ars, runs = [], []
            for _ in range(max(timing_reps, 1)):
                ars.append(run(ar_config, None, None))
                runs.append(run(config, drafter, draft_params, cost_model=cost_model))
            fastest = lambda rs: max(rs, key=lambda r: r.tokens_per_second)
            ar, result = fastest(ars), fastest(runs)
        rows = [method_stats(method, result, ar), method_stats("ar", ar)]
    record = dict(outputs=outputs, methods=rows,
                  config=json.loads(json.dumps(dataclasses.asdict(config), default=str)))
    if as_json:
        print(json.dumps(record), file=out)
    else:
        print(summary_table(rows, config.sampling.temperature), file=err)
    return record
