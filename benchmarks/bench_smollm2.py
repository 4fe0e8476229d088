"""Real-model speedup at batch 1: SmolLM2-135M-Instruct target + our trained Domino drafter.

For each temperature, runs our jitted AR and Domino on the same held-out prompts (never in
the training split, ``domino_jax.train.data.is_eval_prompt``), one prompt at a time (batch
1), after a warm-up call per method (compile excluded), and reports tau, tokens/s,
speedup over AR, the round cost ``c = tau / speedup`` and, at T = 0, whether every output
is identical to AR's.

    python benchmarks/bench_smollm2.py [--prompts 16] [--max-new-tokens 256] [--out DIR]

Writes ``smollm2_<date>.json`` and ``.md`` into ``--out`` (default ``$OUT`` or
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--git-commit", default="unknown")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from domino_jax.decode.loading import default_models, load_pair, load_tokenizer
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.train.data import build_prompts, chat_ids, is_eval_prompt, stop_ids_of

    target_dir, draft_dir = default_models(args.target, args.draft)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    target, tparams, drafter, dparams = load_pair(target_dir, draft_dir, "domino", dtype)
    tokenizer = load_tokenizer(target_dir)
    prompts = [q for q in build_prompts(4000, seed=123) if is_eval_prompt(q)][:args.prompts]
    ids = [chat_ids(tokenizer, q) for q in prompts]
    stops = stop_ids_of(tokenizer, target.config)
    print(f"{len(ids)} held-out prompts; backend {jax.default_backend()}; draft {draft_dir}",
          flush=True)
    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        per_method = {}
        for method in ("ar", "domino"):
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                                  sampling=SamplingConfig(temp), stop_token_ids=stops)
            dr, dp = (drafter, dparams) if method == "domino" else (None, None)
            generate(target, tparams, [ids[0]], config, dr, dp, seed=0)        # warm-up
            tokens, seconds, rounds, committed, outputs = 0, 0.0, 0, 0, []
            for i, prompt in enumerate(ids):
                r = generate(target, tparams, [prompt], config, dr, dp, seed=i)
                tokens += r.new_tokens - 1          # the first token comes from prefill
                seconds += r.decode_seconds
                hist = r.accept_hist.sum(0)
                rounds += int(hist.sum())
                committed += int((hist * range(len(hist))).sum())
                outputs.append(r.tokens[0])
            per_method[method] = dict(tokens=tokens, seconds=seconds, tau=committed / max(rounds, 1),
                                      tokens_per_second=tokens / seconds, outputs=outputs)
            print(f"T={temp} {method}: tau {per_method[method]['tau']:.2f}, "
                  f"{per_method[method]['tokens_per_second']:.1f} tok/s", flush=True)
        ar, dom = per_method["ar"], per_method["domino"]
        speedup = dom["tokens_per_second"] / ar["tokens_per_second"]
        rows.append(dict(temperature=temp, ar_tokens_per_second=ar["tokens_per_second"],
                         ar_ms_per_token=1e3 / ar["tokens_per_second"],
                         domino_tokens_per_second=dom["tokens_per_second"],
                         domino_tau=dom["tau"], speedup=speedup, round_cost_c=dom["tau"] / speedup,
                         identical_to_ar=(dom["outputs"] == ar["outputs"]) if temp == 0 else None))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    meta = dict(date=stamp, commit=args.git_commit, device=str(jax.devices()[0].device_kind),
                jax=jax.__version__, prompts=len(ids), max_new_tokens=args.max_new_tokens,
                batch=1, verify_width=drafter.num_drafts + 1, target=target_dir, draft=draft_dir)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"smollm2_{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    lines = [f"# SmolLM2-135M-Instruct + trained Domino drafter, batch 1 ({meta['device']}, "
             f"commit {args.git_commit}, {stamp})", "",
             "| T | AR ms/token | Domino tok/s | tau | speedup | c | identical to AR |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']} | {r['ar_ms_per_token']:.2f} | "
                     f"{r['domino_tokens_per_second']:.1f} | {r['domino_tau']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['round_cost_c']:.2f} | {r['identical_to_ar']} |")
    with open(os.path.join(args.out, f"smollm2_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
