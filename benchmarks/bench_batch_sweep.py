"""Throughput at batch 1-64: AR against each speculative method, fixed width and adaptive.

Two modes, any device:

* ``--mode forced`` (random weights at ``--shape smollm2 | qwen3-8b | tiny``): nothing would
  be accepted, so the rounds accept drafts at a forced rate
  (:class:`~domino_jax.decode.verify.ForcedAcceptance`, timing only): for each ``tau`` in
  ``--taus`` (mean tokens per round at 16 drafts), row ``r`` of a batch has its own rate
  (``--spread``: the row taus run from ``tau (1 - spread/2)`` to ``tau (1 + spread/2)``) and
  each draft is accepted with that row's conditional rate, so a round of ``k`` drafts
  commits fewer tokens than one of 16, as with real drafters.
* ``--mode real``: the SmolLM2-135M-Instruct demo pair with our trained Domino drafter,
  ``B`` distinct held-out prompts per batch (one padding bucket), greedy, natural acceptance.

``--serve R``: continuous batching (``decode/serving.py``) instead of one static batch: a
queue of ``R * B`` requests through ``B`` slots, a slot refilled when its request is done
(tokens/s over the queue's wall time, prefills included, for AR too).

Methods (``--methods``): ``ar``, ``ngram`` (the prompt lookup at the CLI defaults, no
drafter: the floor line; always natural acceptance, also in forced mode, where it accepts
what the lookup predicts of the random model), ``dflash`` / ``domino`` (16 drafts),
``ddtree`` / ``dominotree`` (budget ``--budget``), and ``<method>-auto``: the same drafter
with adaptive widths (``decode/adaptive.py``: chains 0/2/4/8/16 drafts, trees budgets
0/4/8/16; the cost table is calibrated on first use, excluded from the timings, in
``--cost-table``); ``dflash-auto+lookup`` / ``domino-auto+lookup``: adaptive with the
prompt-lookup arms too (``--adaptive-lookup on``, ``decode/lookup_arm.py``);
``dflash@N`` / ``domino@N``: the chain drafter at a fixed ``N`` drafts a round
(``--draft-length N``), e.g. to compare the adaptive policy with the width it settles on.

Per batch every task is compiled and run once untimed (warm-up; the adaptive runs' cost
calibration), then timed ``--reps`` times, the tasks interleaved rep by rep (AR first); reported: decode tokens/s over the batch (medians), ms per
loop round, ``c`` = round ms / AR step ms, the speedup over AR, tau, and the adaptive runs'
width histograms. JSON, Markdown and a plot (speedup against batch, one line per method
and tau) are rewritten after every batch.

    python benchmarks/bench_batch_sweep.py --mode real --batches 1,4,16,32,64      # CPU
    python benchmarks/bench_batch_sweep.py --mode real --batches 16,32 --serve 3 \
        --methods ar,domino-auto+lookup                            # continuous batching
    python benchmarks/bench_batch_sweep.py --mode forced --shape qwen3-8b \\
        --batches 1,4,16,32,64 --taus 2,4,6,8                                      # H200
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
T0 = time.perf_counter()
CHAIN, TREE = ("dflash", "domino"), ("ddtree", "dominotree")
LOOKUP = "-auto+lookup"              # chain methods: adaptive with the lookup arms


def split_method(method: str) -> tuple[str, bool, bool]:
    """``(base method, adaptive, lookup arms)`` of a ``--methods`` entry; ``ValueError``
    naming an unknown one."""
    if method in ("ar", "ngram"):
        return method, False, False
    if method.endswith(LOOKUP) and method.removesuffix(LOOKUP) in CHAIN:
        return method.removesuffix(LOOKUP), True, True
    base = method.removesuffix("-auto")
    if base not in CHAIN + TREE:
        raise ValueError(f"unknown method {method!r} in --methods (ar, ngram, "
                         f"{', '.join(CHAIN + TREE)}, <method>-auto, <chain>{LOOKUP})")
    return base, method.endswith("-auto"), False


def fixed_width(method: str) -> tuple[str, int]:
    """``("domino@4") -> ("domino", 4)``: a chain method at a fixed draft length
    (``--draft-length N``); any other entry comes back with width 0 (the method's default)."""
    base, sep, width = method.partition("@")
    if not sep:
        return method, 0
    if base not in CHAIN or not width.isdigit() or int(width) < 1:
        raise ValueError(f"bad fixed width {method!r} in --methods: <chain>@N with N >= 1 "
                         f"and chain one of {', '.join(CHAIN)}")
    return base, int(width)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("forced", "real"), default="real")
    p.add_argument("--shape", choices=("smollm2", "qwen3-8b", "tiny"), default="smollm2")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--taus", default="2,4,6,8")
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--methods", default="ar,ngram,dflash,domino,ddtree,dominotree,dflash-auto,"
                   "domino-auto,ddtree-auto,dominotree-auto")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--trim-block", action="store_true",
                   help="chain methods: the backbone runs over only the block slots a round's "
                        "drafts read (BlockOptions.trim_block; the drafts change: with --mode "
                        "forced the acceptance does not, so this times what a drafter trained "
                        "on trimmed blocks would cost)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="forced mode: prompt tokens")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--serve", type=int, default=0, metavar="R",
                   help="continuous batching (decode/serving.py): a queue of R requests per "
                        "slot through B slots, finished slots refilled; tokens/s over the "
                        "queue's wall time, prefills included (default 0: one static batch)")
    p.add_argument("--cost-table", default=None,
                   help="adaptive runs' cost table (default: OUT/batch_sweep_costs.json)")
    p.add_argument("--cost-rounds", type=int, default=3)
    p.add_argument("--cost-reps", type=int, default=2)
    p.add_argument("--compile-threads", type=int, default=1)
    p.add_argument("--time-budget-s", type=float, default=1e9)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.taus = [float(t) for t in args.taus.split(",")] if args.mode == "forced" else [None]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        try:
            split_method(fixed_width(m)[0])
        except ValueError as e:
            p.error(str(e))
    return args


class Models:
    """Target, draft parameters and one drafter per method (shared weights)."""

    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        from domino_jax.decode.loading import DEMO_DRAFT_DIR, default_models, load_pair
        from domino_jax.decode.methods import make_drafter, method_options

        self.args = args
        self.dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        if args.mode == "real":
            target_dir, draft_dir = default_models(None, None)
            self.target, self.tp, base, self.dp = load_pair(target_dir, draft_dir, "domino",
                                                            self.dtype)
            self.target_dir = target_dir
        else:
            self.target, self.tp, base, self.dp = self._random(args.shape, DEMO_DRAFT_DIR)
        self.draft_config = base.config
        self.make = lambda method, **kw: make_drafter(self.draft_config, self.target, method,
                                                      method_options(method, **kw))

    def _random(self, shape, demo_draft_dir):
        import jax

        from bench_util import random_params
        from domino_jax.config import (QWEN3_8B, QWEN3_8B_DOMINO_DRAFT, DraftConfig,
                                       TargetConfig)
        from domino_jax.decode.methods import make_drafter
        from domino_jax.models import dflash, domino_head, qwen3
        from domino_jax.models.qwen3 import TargetLM

        if shape == "qwen3-8b":
            tcfg, dcfg = QWEN3_8B, QWEN3_8B_DOMINO_DRAFT
        else:
            from domino_jax.demo_model import demo_target_dir
            tcfg = TargetConfig.from_path(demo_target_dir())
            dcfg = DraftConfig.from_path(demo_draft_dir)
            if shape == "tiny":
                tcfg = dataclasses.replace(tcfg, num_layers=2, vocab_size=512, hidden_size=64,
                                           num_heads=4, num_kv_heads=2, head_dim=16,
                                           intermediate_size=128)
                dcfg = dataclasses.replace(dcfg, vocab_size=512, hidden_size=64, num_heads=4,
                                           num_kv_heads=2, head_dim=16, intermediate_size=128,
                                           num_target_layers=2, target_layer_ids=(0, 1),
                                           mask_token_id=511, emb_dim=16, gru_hidden_dim=32,
                                           block_size=8)
        tcfg = dataclasses.replace(tcfg, fused_projections=True)
        dcfg = dataclasses.replace(dcfg, fused_projections=True)
        target = TargetLM(tcfg, dtype=self.dtype, param_dtype=self.dtype)
        tp = random_params(qwen3.param_shapes(tcfg, self.dtype), 0)
        backbone = random_params(dflash.param_shapes(dcfg, self.dtype), 1)
        head = random_params(domino_head.head_param_shapes(dcfg, self.dtype), 2)
        head = domino_head.decode_head(head, tp["embed_tokens"]["embedding"])
        jax.block_until_ready((tp, backbone, head))
        return target, tp, make_drafter(dcfg, target, "domino"), {"backbone": backbone,
                                                                  "head": head}

    def prompts(self, batch: int) -> list[list[int]]:
        if self.args.mode == "forced":
            from bench_util import random_prompt
            return [random_prompt(self.args.prompt_len, self.target.config.vocab_size, 100 + r)
                    for r in range(batch)]
        if not hasattr(self, "_pool"):
            from domino_jax.decode.loading import encode_prompt, load_tokenizer
            from domino_jax.decode.speculative import prompt_bucket
            from domino_jax.train.data import build_prompts, is_eval_prompt

            tokenizer = load_tokenizer(self.target_dir)
            texts = [q for q in build_prompts(4000, seed=123) if is_eval_prompt(q)][:400]
            ids = [encode_prompt(tokenizer, q) for q in texts]
            buckets = [prompt_bucket(len(x)) for x in ids]
            common = max(set(buckets), key=buckets.count)
            self._pool = [x for x, b in zip(ids, buckets) if b == common]
            self._stops = (tokenizer.eos_token_id,)
        return [self._pool[r % len(self._pool)] for r in range(batch)]

    def stops(self) -> tuple[int, ...]:
        return getattr(self, "_stops", ())


def task_config(models, method: str, tau):
    """``(config, drafter, draft_params)`` of one task."""
    from domino_jax.decode.adaptive import AdaptiveConfig
    from domino_jax.decode.speculative import DecodeConfig
    from domino_jax.decode.verify import ForcedAcceptance

    from domino_jax.decode.lookup_arm import DEFAULT_LOOKUP_ARMS

    args = models.args
    method, width = fixed_width(method)
    base, auto, lookup = split_method(method)
    forced = (ForcedAcceptance(tau, width=16, spread=args.spread)
              if tau is not None and base not in ("ar", "ngram") else None)
    adaptive = AdaptiveConfig(lookup=DEFAULT_LOOKUP_ARMS if lookup else ()) if auto else None
    config = DecodeConfig(method=base, max_new_tokens=args.new_tokens,
                          stop_token_ids=models.stops(), verify=forced or "match",
                          adaptive=adaptive)
    if base in ("ar", "ngram"):                    # no drafter checkpoint
        return config, None, None
    options = dict(budget=args.budget) if base in TREE else {}
    if args.trim_block and base in CHAIN:
        options["trim_block"] = True
    if width:
        options["draft_length"] = width
    return config, models.make(base, **options), models.dp


def run_task(models, args, batch, prompts, config, drafter, dp, cost_model):
    """One timed run: ``generate`` on the static batch, or with ``--serve`` the queue
    through ``batch`` slots (``decode/serving.py``)."""
    from domino_jax.decode.serving import serve
    from domino_jax.decode.speculative import generate

    if args.serve:
        return serve(models.target, models.tp, prompts, config, drafter, dp, slots=batch,
                     cost_model=cost_model)
    return generate(models.target, models.tp, prompts, config, drafter, dp,
                    cost_model=cost_model)


def sample(result) -> dict:
    """A run's figures: tokens/s, tau, ms per loop round (serving: the queue's time less
    its prefills, per round of the slots' loop, and the calls' per-round / per-call split),
    the adaptive histograms."""
    from domino_jax.decode.serving import call_split

    if hasattr(result, "loop_rounds"):                    # serving.ServeResult
        loop_ms = 1e3 * (result.seconds - result.prefill_seconds)
        rounds, extra = result.loop_rounds, dict(decode_tokens_per_s=
                                                 result.decode_tokens_per_second,
                                                 loop_calls=result.loop_calls,
                                                 refills=result.refills,
                                                 prefill_s=result.prefill_seconds,
                                                 timings=result.timings, calls=result.calls,
                                                 ms_per_round_and_per_call=call_split(
                                                     result.calls))
    else:
        loop_ms = 1e3 * result.decode_seconds
        rounds, extra = sum(result.verify_widths.values()), {}
    return dict(tokens_per_s=result.tokens_per_second, tau=result.tau,
                ms_per_round=loop_ms / max(rounds, 1), width_hist=result.verify_widths,
                arms=result.arm_rounds, cost_source=result.cost_source, **extra)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Batch sweep {meta['date']} ({meta['device']}, mode {meta['mode']}"
             + (f", shape {meta['shape']}" if meta["mode"] == "forced" else ", SmolLM2 pair")
             + f", {meta['new_tokens']} new tokens"
             + (", trimmed blocks" if meta.get("trim_block") else "")
             + f", commit {meta['git_commit']})", "",
             f"Medians of {meta['reps']} interleaved runs per task. load average at the start "
             f"{meta['load_start']}. Adaptive widths: verify width:rounds.", "",
             (f"Continuous batching: {meta['serve']} requests per slot, batch = slots; tok/s "
              "over the queue's wall time, prefills included; loops only: the speedup "
              "of the round loops' throughput, prefills left out (what a static batch "
              "reports)." if meta.get("serve")
              else "Static batches: one batch of B requests, the loop until its last row."), "",
             "| batch | method | tau (forced) | tok/s | ms / round | c | tau | speedup over AR "
             "| verify widths |", "|---|---|---|---|---|---|---|---|---|"]
    if meta.get("serve"):
        lines[-2] = lines[-2].replace("| verify widths |", "| loops only | verify widths |")
        lines[-1] += "---|"
    for r in rows:
        hist = " ".join(f"{w}:{n}" for w, n in sorted(r["width_hist"].items(), key=lambda x:
                                                      int(x[0])))
        if len(r.get("arms") or {}) and any(a.startswith("lookup") for a in r["arms"]):
            hist += " (" + " ".join(f"{a}:{n}" for a, n in r["arms"].items()) + ")"
        forced = "-" if r["forced_tau"] is None else f"{r['forced_tau']:g}"
        lines.append(f"| {r['batch']} | {r['method']} | {forced} | "
                     f"{r['tokens_per_s']:.1f} | {r['ms_per_round']:.1f} | {r['c']:.2f} | "
                     f"{r['tau']:.2f} | **{r['speedup']:.2f}x** | "
                     + (f"{r['decode_speedup']:.2f}x | " if "decode_speedup" in r else "")
                     + f"{hist} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = {}
    for r in rows:
        if r["method"] == "ar":
            continue
        key = r["method"] + ("" if r["forced_tau"] is None else f" tau {r['forced_tau']:g}")
        lines.setdefault(key, []).append((r["batch"], r["speedup"]))
    for key, pts in sorted(lines.items()):
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", linestyle="--" if "auto" not in key else "-", label=key)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("speedup over AR")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    args = parse_args(argv)
    import jax

    from bench_util import git_commit, versions
    from domino_jax.decode.cost_model import CostModel
    from domino_jax.decode.speculative import precompile

    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    cost_model = CostModel(path=args.cost_table or os.path.join(args.out,
                                                                "batch_sweep_costs.json"),
                           rounds=args.cost_rounds, reps=args.cost_reps)
    models = Models(args)
    dev = jax.devices()[0]
    meta = dict(date=stamp, git_commit=git_commit(args.git_commit), versions=versions(),
                device=f"{dev.platform}:{dev.device_kind}", mode=args.mode, shape=args.shape,
                argv=sys.argv[1:], new_tokens=args.new_tokens, reps=args.reps,
                serve=args.serve, trim_block=args.trim_block,
                spread=args.spread, budget=args.budget, cost_table=cost_model.path,
                load_start=[round(x, 1) for x in os.getloadavg()], skipped=[],
                calibration={})
    rows: list[dict] = []
    base_name = os.path.join(args.out, f"batch_sweep_{stamp}")

    def write():
        with open(base_name + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(base_name + ".md", "w") as f:
            f.write(markdown(meta, rows))
        plot(rows, base_name + ".png")

    for batch in args.batches:
        if time.perf_counter() - T0 > args.time_budget_s:
            meta["skipped"].append(f"batch {batch}")
            continue
        prompts = models.prompts(batch * max(args.serve, 1))
        natural = [("ngram", None)] if "ngram" in args.methods else []   # no forced tau
        tasks = [("ar", None)] + natural + [(m, t) for t in args.taus for m in args.methods
                                            if m not in ("ar", "ngram")]
        specs = {task: task_config(models, *task) for task in tasks}
        for task, (config, drafter, dp) in specs.items() if not args.serve else ():
            # (with --serve, serve's own programs are compiled by the warm-up run)
            seconds = precompile(models.target, models.tp, prompts[:batch], config, drafter, dp)
            log(f"batch {batch}: compiled {task} in {seconds:.1f} s")
        for task, (config, drafter, dp) in specs.items():      # untimed: warm, calibrated
            result = run_task(models, args, batch, prompts, config, drafter, dp, cost_model)
            log(f"batch {batch}: warm-up {task}, compiled in {result.compile_seconds:.1f} s")
            if result.calibration_seconds:
                meta["calibration"][f"B={batch} {task[0]}"] = result.calibration_seconds
        samples = {task: [] for task in tasks}
        for rep in range(args.reps):
            for task, (config, drafter, dp) in specs.items():
                result = run_task(models, args, batch, prompts, config, drafter, dp,
                                  cost_model)
                samples[task].append(sample(result))
                log(f"batch {batch} rep {rep} {task}: {result.tokens_per_second:.1f} tok/s, "
                    f"tau {result.tau:.2f}, widths {result.verify_widths}")
        ar = statistics.median(s["tokens_per_s"] for s in samples[("ar", None)])
        ar_ms = statistics.median(s["ms_per_round"] for s in samples[("ar", None)])
        ar_loop = (statistics.median(s["decode_tokens_per_s"] for s in samples[("ar", None)])
                   if args.serve else None)
        for (method, tau), runs in samples.items():
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            ms = statistics.median(r["ms_per_round"] for r in runs)
            rows.append(dict(batch=batch, method=method, forced_tau=tau, tokens_per_s=tps,
                             ms_per_round=ms, c=ms / ar_ms, speedup=tps / ar,
                             tau=statistics.median(r["tau"] for r in runs),
                             width_hist={str(k): v for k, v in runs[-1]["width_hist"].items()},
                             arms=runs[-1]["arms"],
                             runs=runs))
            if args.serve:               # the loops alone, prefills left out
                rows[-1]["decode_speedup"] = statistics.median(
                    r["decode_tokens_per_s"] for r in runs) / ar_loop
        write()
        log(f"batch {batch} done")
    meta["seconds"] = time.perf_counter() - T0
    write()
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
