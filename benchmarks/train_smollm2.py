"""Self-distil SmolLM2-135M-Instruct, train a DFlash and a Domino drafter on the same data
for the same steps, and measure tau on held-out prompts (ar / dflash / domino, T=0 and T=1).

One process, three stages, sized for ~8 minutes of one H200 (data generation included):

  (a) data:  batched AR generation by the target (``domino_jax.train.data``) on offline
             prompts (chat / arithmetic / stdlib code), held-out split by prompt hash;
  (b) train: ``domino_jax.train.loop.train`` for ``dflash`` then ``domino`` (identical
             data, steps, seed; 2 draft layers, block 16, G=256, E=64, the default mask
             token: a row of the target, train/README.md);
             each drafter is exported to HF format and loaded back for (c);
  (c) eval:  ``generate`` on held-out prompts for each method and temperature.

Results (timings, tokens/s, MFU, losses, per-position accuracy, tau, speedups) go to
``$OUT/train_smollm2.json`` when ``$OUT`` is set (the remote runner), else
``benchmarks/results/train_smollm2.json``; they are rewritten after every stage so a
time-out still leaves what finished. A stage that would start after ``--deadline`` seconds
is skipped (recorded as such). The equivalent CLI commands, stage by stage::

    python -m domino_jax.train.data --out $W/data.npz --num-prompts 3000 --max-new-tokens 160
    python -m domino_jax.train --data $W/data.npz --out $W/dflash --drafter dflash \\
        --draft-layers 2 --block-size 16 --steps 1200 --batch-size 32 --max-length 320
    python -m domino_jax.train --data $W/data.npz --out $W/domino --drafter domino \\
        --draft-layers 2 --block-size 16 --gru-hidden-dim 256 --emb-dim 64 --steps 1200 ...

CPU smoke test of the whole pipeline: ``python benchmarks/train_smollm2.py --tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF target folder (default: demo SmolLM2)")
    p.add_argument("--work", default=None, help="work folder (default: $OUT/work or /tmp)")
    p.add_argument("--num-prompts", type=int, default=3000)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-prompt-len", type=int, default=160)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--data-temperature", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=320)
    p.add_argument("--num-anchors", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gru-hidden-dim", type=int, default=256)
    p.add_argument("--emb-dim", type=int, default=64)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--deadline", type=float, default=460.0,
                   help="seconds after which no new stage starts")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: 8 prompts, 24 new tokens, block 8, 3 steps, tiny batches")
    args = p.parse_args()
    if args.tiny:
        args.num_prompts, args.max_new_tokens, args.gen_batch = 8, 24, 4
        args.block_size = 8                       # examples need >= 2 * block response tokens
        args.steps, args.batch_size, args.max_length, args.num_anchors = 3, 2, 192, 8
        args.eval_prompts, args.eval_max_new_tokens = 2, 8
        args.dtype = "float32"
    return args


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from converters.hf_target import load_target
    from domino_jax.decode.methods import make_drafter
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig, generate
    from domino_jax.models.qwen3 import TargetLM
    from domino_jax.text import load_tokenizer
    from domino_jax.train import data as data_lib
    from domino_jax.train.config import TrainConfig
    from domino_jax.train.loop import load_trained_draft, train

    out_root = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "results")
    os.makedirs(out_root, exist_ok=True)
    result_file = os.path.join(out_root, "train_smollm2" + ("_tiny" if args.tiny else "") + ".json")
    work = args.work or (os.path.join(os.environ["OUT"], "work") if os.environ.get("OUT")
                         else "/tmp/train_smollm2")
    os.makedirs(work, exist_ok=True)
    results: dict = {"args": vars(args), "devices": [str(d) for d in jax.devices()],
                     "stages": {}}

    def save():
        results["elapsed_seconds"] = round(time.perf_counter() - T_START, 1)
        with open(result_file, "w") as f:
            json.dump(results, f, indent=1)

    def over_deadline(stage: str) -> bool:
        if time.perf_counter() - T_START > args.deadline:
            results["stages"][stage] = {"skipped": "time budget (--deadline)"}
            log(f"skip {stage}: past the deadline")
            save()
            return True
        return False

    log(f"devices: {jax.devices()}")
    target_dir = args.target
    if target_dir is None:
        from domino_jax.demo_model import demo_target_dir
        target_dir = demo_target_dir()
    dtype = jnp.dtype(args.dtype)
    target_config, target_params = load_target(target_dir, dtype)
    target = TargetLM(target_config, dtype=dtype, param_dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    stop_ids = data_lib.stop_ids_of(tokenizer, target_config)
    log(f"target {target_dir}: {target_config.num_layers} layers, hidden "
        f"{target_config.hidden_size}, vocab {target_config.vocab_size}; stop ids {stop_ids}")

    # (a) data ---------------------------------------------------------------------------
    pool = data_lib.build_prompts(int(args.num_prompts / 0.95 * 1.05) + 40, seed=0)
    train_prompts, eval_prompts = data_lib.split_prompts(pool, 0.05)
    train_prompts = train_prompts[:args.num_prompts]
    eval_prompts = eval_prompts[:args.eval_prompts]
    data_path = os.path.join(work, "data.npz")
    t0 = time.perf_counter()
    examples = data_lib.generate_dataset(target, target_params, tokenizer, train_prompts,
                                         args.max_new_tokens, args.gen_batch,
                                         args.data_temperature, 0, args.max_prompt_len, stop_ids)
    seconds = time.perf_counter() - t0
    data_lib.save_dataset(data_path, examples)
    new_tokens = int(sum(int(ex["loss_mask"].sum()) for ex in examples))
    results["stages"]["data"] = {
        "examples": len(examples), "response_tokens": new_tokens, "seconds": round(seconds, 2),
        "tokens_per_second": round(new_tokens / max(seconds, 1e-9), 1),
        "mean_length": float(np.mean([len(ex["input_ids"]) for ex in examples])),
        "eval_prompts": len(eval_prompts)}
    log(f"data: {results['stages']['data']}")
    save()

    # (b) train --------------------------------------------------------------------------
    drafters = {}
    for kind in ("dflash", "domino"):
        if over_deadline(f"train_{kind}"):
            continue
        try:
            cfg = TrainConfig(drafter=kind, steps=args.steps, batch_size=args.batch_size,
                              max_length=args.max_length, num_anchors=args.num_anchors,
                              lr=args.lr, compute_dtype=args.dtype, seed=0,
                              checkpoint_every=max(args.steps, 1), log_every=max(1, args.steps // 20))
            t0 = time.perf_counter()
            res = train(cfg, None, None, os.path.join(work, kind), args.draft_layers,
                        args.block_size, args.gru_hidden_dim, args.emb_dim, None,
                        examples=examples, target=target, target_params=target_params,
                        progress=False)
            seconds = time.perf_counter() - t0
            last = res.history[-1]
            steady = [h for h in res.history[1:]] or res.history
            step_time = float(np.median([h["step_time"] for h in steady]))
            results["stages"][f"train_{kind}"] = {
                "seconds": round(seconds, 1), "compile_seconds": round(last["compile_seconds"], 1),
                "step_time": step_time, "first_loss": res.history[0]["loss"],
                "final_loss": last["loss"], "final_acc": last["acc"],
                "acc_mean": last["acc_mean"], "lambda_final": last["lambda"],
                "tokens_per_second": float(np.median([h["tokens_per_second"] for h in steady])),
                "model_flops_per_step": last["model_flops_per_step"],
                "xla_flops_per_step": last["xla_flops_per_step"],
                "mfu": last["model_flops_per_step"] / step_time / cfg.peak_flops,
                "export_dir": res.export_dir,
                "loss_curve": [(h["step"], round(h["loss"], 4)) for h in res.history]}
            log(f"train {kind}: " + json.dumps({k: v for k, v in
                                                 results["stages"][f"train_{kind}"].items()
                                                 if k != "loss_curve"}))
            draft_config, draft_params = load_trained_draft(res.export_dir, dtype)
            drafters[kind] = (make_drafter(draft_config, target, kind), draft_params)
        except Exception as e:  # noqa: BLE001  (keep going: other stages still report)
            results["stages"][f"train_{kind}"] = {"error": repr(e),
                                                 "traceback": traceback.format_exc()}
            log(f"train {kind} FAILED: {e!r}")
        save()

    # (c) eval ---------------------------------------------------------------------------
    prompts = [data_lib.chat_ids(tokenizer, p) for p in eval_prompts]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_len] or prompts[:1]
    temps = [float(t) for t in args.temperatures.split(",")]
    evals = results["stages"].setdefault("eval", {})
    for temp in temps:
        for method in ("ar", "dflash", "domino"):
            name = f"{method}_T{temp:g}"
            if time.perf_counter() - T_START > args.deadline:
                evals[name] = {"skipped": "time budget (--deadline)"}
                continue
            if method != "ar" and method not in drafters:
                evals[name] = {"skipped": "no trained drafter"}
                continue
            try:
                config = DecodeConfig(method=method, max_new_tokens=args.eval_max_new_tokens,
                                      sampling=SamplingConfig(temperature=temp),
                                      stop_token_ids=stop_ids)
                drafter, dparams = drafters.get(method, (None, None))
                res = generate(target, target_params, prompts, config, drafter, dparams, seed=1)
                evals[name] = {"tau": res.tau, "tokens_per_second": res.tokens_per_second,
                               "new_tokens": res.new_tokens,
                               "decode_seconds": res.decode_seconds,
                               "compile_seconds": res.compile_seconds,
                               "verify_width": res.verify_width}
                ar = evals.get(f"ar_T{temp:g}", {})
                if method != "ar" and ar.get("tokens_per_second"):
                    speedup = res.tokens_per_second / ar["tokens_per_second"]
                    evals[name]["speedup_vs_ar"] = speedup
                    evals[name]["round_cost_c"] = res.tau / speedup
                log(f"eval {name}: {evals[name]}")
            except Exception as e:  # noqa: BLE001
                evals[name] = {"error": repr(e), "traceback": traceback.format_exc()}
                log(f"eval {name} FAILED: {e!r}")
            save()
    save()
    log(f"done; results in {result_file}")
    print(json.dumps({"tau": {m: v.get("tau") for m, v in evals.items()}}))


if __name__ == "__main__":
    main()
