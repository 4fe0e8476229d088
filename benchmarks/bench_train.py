"""Training-speed benchmark: tokens/s and MFU of one optimizer step, printed beside the
roofline prediction from the step's FLOPs and bytes (``domino_jax/train/cost.py``).

Shapes (random target weights made on the device; one device; sequence length 2048):

* ``smollm2``: the SmolLM2-135M-Instruct target (Llama, 30 layers, H 576, V 49152) and the
  shipped drafter's geometry (2 layers, block 16, G 256, E 64), batch 8;
* ``qwen3-8b``: the Qwen3-8B target and the reference Domino drafter (docs/algorithms.md §3.1:
  5 layers, block 16, G 1024, E 256, target layers 1/9/17/25/33), batch 2.

Both with 256 anchors per sequence (the author's Qwen3-8B Domino recipe, §3.4), bf16
compute on float32 masters, labels ``--labels`` (hard by default). Each shape: compile
(AOT, timed), ``--warmup`` steps, then ``--steps`` synchronised steps; the median step time
gives tokens/s (``batch * seq_len`` sequence tokens per second; draft rows per second
beside it) and MFU (matmul FLOPs as executed / step time / peak). The prediction: each part
of the step (target forward, drafter, attention, LM head, Domino head, optimizer) takes
``max(FLOPs / peak, bytes / bandwidth)``; peaks from the device table (H200: 989 TFLOP/s
bf16 dense, 4.8 TB/s) or, on a device not in it (the CPU), measured here by a matmul and a
copy. Results: ``train_speed_<device>_<date>.json`` and ``.md`` in ``--out`` (rewritten
after each shape, so a run cut short keeps what finished).

    python benchmarks/bench_train.py --out $OUT --git-commit <HASH>     # H200, ~3-5 min
    python benchmarks/bench_train.py --tiny --out /tmp/bench            # CPU, reduced size
    python benchmarks/bench_train.py --predict-only                     # the prediction only

``--trace-steps N`` also traces N warm steps and lists the kernels that take the step's
time (what the roofline parts cannot say: which part runs far from its bound).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T_START = time.perf_counter()

# device kind substring -> (bf16 dense FLOP/s, HBM bytes/s), per device
DEVICE_PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2,qwen3-8b", help="comma list of shapes")
    p.add_argument("--tiny", action="store_true", help="reduced sizes (CPU smoke test)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (tiny 64)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per step (default: smollm2 8, qwen3-8b 2; tiny 2)")
    p.add_argument("--num-anchors", type=int, default=None, help="default 256 (tiny 8)")
    p.add_argument("--labels", default="hard", choices=("hard", "soft", "mix"))
    p.add_argument("--loss-chunk-rows", default="4096",
                   help="comma list: block slots per vocabulary chunk of the loss, each "
                        "timed (0 = the whole [rows, V] logits at once)")
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation")
    p.add_argument("--final-logits", default="joint",
                   help="comma list, each timed: joint (one matmul, docs/design.md §30), sum "
                        "(base logits plus the correction, as before)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per shape")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default=None, help="compute dtype (default bfloat16; tiny float32)")
    p.add_argument("--peak-flops", type=float, default=None, help="override the device peak")
    p.add_argument("--bandwidth", type=float, default=None, help="override, bytes/s")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--git-commit", default=None, help="commit to record (.git may not travel)")
    p.add_argument("--mem-fraction", default="0.92", help="XLA_PYTHON_CLIENT_MEM_FRACTION")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="also trace this many warm steps (jax.profiler, into OUT/trace-SHAPE-"
                        "CHUNK) and report the kernels that take the step's time")
    p.add_argument("--trace-top", type=int, default=25, help="kernels listed per trace")
    p.add_argument("--predict-only", action="store_true",
                   help="print the prediction for --peak-flops/--bandwidth (default H200); "
                        "no device work, nothing written")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- shapes

def shape_specs(tiny: bool) -> dict:
    """name -> (TargetConfig, drafter kwargs of make_draft_config, default batch)."""
    from domino_jax.config import QWEN3_8B, TargetConfig

    if tiny:
        small_llama = TargetConfig("llama", 512, 64, 4, 4, 2, 16, 128, 1e-5, 1e5,
                                   tie_word_embeddings=True, qk_norm=False)
        small_qwen = TargetConfig("qwen3", 512, 64, 6, 4, 2, 16, 128)
        return {"smollm2": (small_llama, dict(num_layers=2, block_size=8, gru_hidden_dim=32,
                                              emb_dim=16, mask_token_id=16), 2),
                "qwen3-8b": (small_qwen, dict(num_layers=3, block_size=8, gru_hidden_dim=64,
                                              emb_dim=32, mask_token_id=511), 2)}
    smollm2 = TargetConfig("llama", 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 1e5,
                           tie_word_embeddings=True, qk_norm=False, max_position_embeddings=8192)
    return {"smollm2": (smollm2, dict(num_layers=2, block_size=16, gru_hidden_dim=256,
                                      emb_dim=64, mask_token_id=16), 8),
            "qwen3-8b": (QWEN3_8B, dict(num_layers=5, block_size=16, gru_hidden_dim=1024,
                                        emb_dim=256, mask_token_id=151669), 2)}


def settings(args, name: str, chunk_rows: int = 4096, final_logits: str | None = None):
    """``(target_config, draft_config, TrainConfig, seq_len)`` of one shape."""
    from domino_jax.train.config import TrainConfig, make_draft_config

    specs = shape_specs(args.tiny)
    if name not in specs:
        raise SystemExit(f"error: --shapes: unknown shape {name!r}; choose from {sorted(specs)}")
    target, drafter, batch = specs[name]
    draft = make_draft_config(target, "domino", **drafter)
    seq_len = args.seq_len or (64 if args.tiny else 2048)
    cfg = TrainConfig(drafter="domino", steps=1000, batch_size=args.batch_size or batch,
                      max_length=seq_len, num_anchors=args.num_anchors or (8 if args.tiny else 256),
                      compute_dtype=args.dtype or ("float32" if args.tiny else "bfloat16"),
                      labels=args.labels, loss_chunk_rows=chunk_rows,
                      micro_batches=args.micro_batches, final_logits=final_logits)
    return target, draft, cfg, seq_len


# --------------------------------------------------------------------------- peaks

def device_peaks(args) -> tuple[float, float, str]:
    """``(flop/s, bytes/s, where from)`` for device 0: the flags, the table, or measured."""
    import jax

    kind = jax.devices()[0].device_kind
    table = next((v for k, v in DEVICE_PEAKS.items() if k in kind), None)
    if args.peak_flops and args.bandwidth:
        return args.peak_flops, args.bandwidth, "flags"
    if table is not None:
        return (args.peak_flops or table[0], args.bandwidth or table[1],
                f"table ({kind}, bf16 dense)")
    flops, bw = measure_peaks(args.dtype or "float32")
    return args.peak_flops or flops, args.bandwidth or bw, f"measured on {kind}"


def measure_peaks(dtype: str) -> tuple[float, float]:
    """Best of a few runs: a square matmul's FLOP/s and an elementwise copy's bytes/s."""
    import jax
    import jax.numpy as jnp

    n = 1024
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    x = jnp.ones((16 * 1024 * 1024,), jnp.float32)
    cp = jax.jit(lambda y: y * 1.0001)

    def best(fn, arg):
        jax.block_until_ready(fn(arg))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - t0)
        return min(times)

    return 2 * n ** 3 / best(mm, a), 2 * x.size * 4 / best(cp, x)


# --------------------------------------------------------------------------- one shape

def measure_shape(args, name: str, peak: float, bandwidth: float, chunk_rows: int,
                  final_logits: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_util import device_peak_bytes, random_params
    from domino_jax.models import qwen3
    from domino_jax.models.qwen3 import TargetLM
    from domino_jax.train.cost import predict_step, step_cost
    from domino_jax.train.loss import init_draft_params
    from domino_jax.train.step import (compile_step, horizon_array, init_state, make_train_mesh,
                                       make_train_step, model_flops, place, shard_batch)

    target_cfg, draft, cfg, seq_len = settings(args, name, chunk_rows, final_logits)
    compute = jnp.dtype(cfg.compute_dtype)
    entry = {"shape": name, "seq_len": seq_len, "batch_size": cfg.batch_size,
             "loss_chunk_rows": cfg.loss_chunk_rows, "micro_batches": cfg.micro_batches,
             "final_logits": cfg.final_logits or "joint",
             "num_anchors": cfg.num_anchors, "compute_dtype": cfg.compute_dtype,
             "labels": cfg.labels, "target": _geometry(target_cfg),
             "drafter": {"num_layers": draft.num_layers, "block_size": draft.block_size,
                         "gru_hidden_dim": draft.gru_hidden_dim, "emb_dim": draft.emb_dim,
                         "target_layer_ids": list(draft.target_layer_ids)}}
    pred = predict_step(step_cost(cfg, draft, target_cfg, seq_len), peak, bandwidth)
    entry["predicted"] = pred
    t0 = time.perf_counter()
    target = TargetLM(target_cfg, dtype=compute, param_dtype=compute)
    tparams = random_params(qwen3.param_shapes(target_cfg, compute), 0)
    params = jax.jit(lambda k: init_draft_params(draft, k, False))(jax.random.PRNGKey(1))
    mesh = make_train_mesh(cfg)
    state, tparams, s_shard, t_shard = place(cfg, mesh, init_state(cfg, params), tparams,
                                             target_cfg)
    del params
    jax.block_until_ready((state, tparams))
    entry["init_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    shape = (cfg.micro_batches, cfg.micro_batch_size, seq_len)
    batch = shard_batch({"input_ids": rng.integers(0, target_cfg.vocab_size, shape, np.int32),
                         "loss_mask": np.ones(shape, np.int32)}, mesh)
    t0 = time.perf_counter()
    step_fn = make_train_step(cfg, draft, target, mesh, s_shard, t_shard)
    compiled, xla_flops = compile_step(step_fn, state, batch, tparams, cfg.steps)
    entry["compile_s"] = time.perf_counter() - t0
    log(f"{name}: compiled in {entry['compile_s']:.1f}s")
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch, tparams, horizon_array(cfg.steps))
        jax.block_until_ready((state, metrics))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    if args.trace_steps > 0:
        from bench_util import load_perfetto, summarise_trace, trace_calls

        folder = os.path.join(args.out, f"trace-{name}-{chunk_rows}-{cfg.final_logits or 'joint'}")
        box = {"state": state}

        def one_step():
            box["state"], out = compiled(box["state"], batch, tparams, horizon_array(cfg.steps))
            return box["state"], out

        trace_calls(one_step, folder, args.trace_steps)
        state = box["state"]
        entry["trace"] = dict(summarise_trace(load_perfetto(folder), args.trace_steps,
                                              top=args.trace_top), folder=folder)
    flops = model_flops(cfg, draft, target_cfg, seq_len)
    rows = cfg.batch_size * min(cfg.num_anchors, seq_len - 1) * draft.block_size
    entry.update(step_ms=1e3 * step_s, step_ms_min=1e3 * min(times), step_ms_max=1e3 * max(times),
                 timed_steps=len(times), tokens_per_second=cfg.batch_size * seq_len / step_s,
                 draft_rows_per_second=rows / step_s, model_flops_per_step=flops,
                 xla_flops_per_step=xla_flops, mfu=flops / (step_s * peak),
                 predicted_step_ms=1e3 * pred["step_s"], predicted_mfu=pred["mfu"],
                 measured_over_predicted=step_s / pred["step_s"],
                 final_loss=float(metrics["loss"]), peak_bytes=device_peak_bytes())
    del state, tparams, compiled, step_fn, batch
    gc.collect()
    return entry


def _geometry(t) -> dict:
    return {"architecture": t.architecture, "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads,
            "num_kv_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "intermediate_size": t.intermediate_size}


def summary_line(e: dict) -> str:
    """The line the test reads: measured MFU beside the predicted one."""
    return (f"{e['shape']} (loss chunk {e.get('loss_chunk_rows', 0)} rows, final logits "
            f"{e.get('final_logits', 'joint')}): "
            f"step {e['step_ms']:.1f} ms, {e['tokens_per_second']:,.0f} tokens/s "
            f"({e['draft_rows_per_second']:,.0f} draft rows/s), MFU {100 * e['mfu']:.1f}% "
            f"(predicted {100 * e['predicted_mfu']:.1f}%: roofline step "
            f"{e['predicted_step_ms']:.1f} ms; measured/predicted "
            f"{e['measured_over_predicted']:.2f}; XLA/analytic FLOPs "
            f"{e['xla_flops_per_step'] / e['model_flops_per_step']:.2f})")


def si(value: float, unit: str) -> str:
    """``1.23 T<unit>`` style (T, G, M, k)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def prediction_lines(name: str, pred: dict) -> list[str]:
    out = [f"{name}: predicted step {1e3 * pred['step_s']:.1f} ms, MFU {100 * pred['mfu']:.1f}% "
           f"({si(pred['flops'], 'FLOP')}, {si(pred['bytes'], 'B')})"]
    for p in pred["parts"]:
        out.append(f"    {p['name']:<28} {si(p['flops'], 'FLOP'):>12} {si(p['bytes'], 'B'):>10}"
                   f"  compute {1e3 * p['compute_s']:8.3f} ms  memory {1e3 * p['memory_s']:8.3f}"
                   f" ms  -> {p['bound']}")
    return out


# --------------------------------------------------------------------------- report

def write_report(results: dict, stem: str) -> None:
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2)
    lines = [f"# Training speed ({results['device']}, {results['date']})", "",
             f"commit `{results['commit']}`; versions {results['versions']}; peaks "
             f"{si(results['peak_flops'], 'FLOP/s')}, {si(results['bandwidth'], 'B/s')} "
             f"({results['peaks_from']}). Command: `{results['command']}`", "",
             "MFU = analytic matmul FLOPs as executed (dense attention; "
             "`domino_jax/train/cost.py`) / median step time / peak. Predicted = the roofline "
             "sum over parts of max(FLOPs / peak, bytes / bandwidth): a lower bound on the step "
             "time, an upper bound on MFU.", "",
             "| shape | batch x seq | anchors | labels | loss chunk rows | final logits | step ms | "
             "tokens/s | draft rows/s | MFU | predicted MFU | predicted step ms | measured / "
             "predicted | compile s | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in results["shapes"]:
        if "error" in e:
            lines.append(f"| {e['shape']} | error: {e['error']} |" + " |" * 13)
            continue
        peak = e.get("peak_bytes")
        lines.append(
            f"| {e['shape']} | {e['batch_size']} x {e['seq_len']} | {e['num_anchors']} | "
            f"{e['labels']} | {e.get('loss_chunk_rows', 0)} | {e.get('final_logits', 'joint')} | "
            f"{e['step_ms']:.1f} | "
            f"{e['tokens_per_second']:,.0f} | "
            f"{e['draft_rows_per_second']:,.0f} | {100 * e['mfu']:.1f}% | "
            f"{100 * e['predicted_mfu']:.1f}% | {e['predicted_step_ms']:.1f} | "
            f"{e['measured_over_predicted']:.2f} | {e['compile_s']:.1f} | "
            f"{peak / 1e9 if peak else float('nan'):.1f} |")
    for e in results["shapes"]:
        if "predicted" not in e:
            continue
        lines += ["", f"## {e['shape']}: predicted parts", "",
                  "| part | GFLOP | GB | compute ms | memory ms | bound |", "|---|---|---|---|---|---|"]
        for p in e["predicted"]["parts"]:
            lines.append(f"| {p['name']} | {p['flops'] / 1e9:.4g} | {p['bytes'] / 1e9:.4g} | "
                         f"{1e3 * p['compute_s']:.3f} | {1e3 * p['memory_s']:.3f} | {p['bound']} |")
    for e in results["shapes"]:
        trace = e.get("trace")
        if not trace or not trace.get("top"):
            continue
        lines += ["", f"## {e['shape']} (loss chunk {e.get('loss_chunk_rows', 0)} rows, final "
                  f"logits {e.get('final_logits', 'joint')}): "
                  f"kernels per step ({trace['source']} events, `{trace['folder']}`)", "",
                  f"{trace['kernels_per_call']:.0f} kernels a step, busy "
                  f"{trace['busy_us_per_call'] / 1e3:.1f} ms of a "
                  f"{trace['window_us_per_call'] / 1e3:.1f} ms window.", "",
                  "| kernel | launches a step | ms a step | share of busy | mean us |",
                  "|---|---|---|---|---|"]
        for k in trace["top"]:
            lines.append(f"| `{k['name']}` | {k['count']:.0f} | {k['us'] / 1e3:.2f} | "
                         f"{100 * k['us'] / trace['busy_us_per_call']:.1f}% | "
                         f"{k['mean_us']:.1f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def device_slug(kind: str) -> str:
    for k in DEVICE_PEAKS:
        if k in kind:
            return k.lower()
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "device"


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    if args.predict_only:
        from domino_jax.train.cost import predict_step, step_cost

        peak, bw = args.peak_flops or DEVICE_PEAKS["H200"][0], args.bandwidth or DEVICE_PEAKS["H200"][1]
        for name in names:
            target, draft, cfg, seq_len = settings(args, name)
            print("\n".join(prediction_lines(
                f"{name} (batch {cfg.batch_size} x {seq_len}, {cfg.num_anchors} anchors, "
                f"{cfg.labels})", predict_step(step_cost(cfg, draft, target, seq_len), peak, bw))))
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    import jax

    from bench_util import git_commit, versions

    kind = jax.devices()[0].device_kind
    peak, bandwidth, peaks_from = device_peaks(args)
    date = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    stem = os.path.join(args.out, f"train_speed_{device_slug(kind)}_{date}")
    results = {"device": kind, "backend": jax.default_backend(), "date": date,
               "commit": git_commit(args.git_commit), "versions": versions(),
               "peak_flops": peak, "bandwidth": bandwidth, "peaks_from": peaks_from,
               "command": " ".join(["python", "benchmarks/bench_train.py"] + sys.argv[1:]),
               "shapes": []}
    log(f"device {kind}; peaks {peak / 1e12:.2f} TFLOP/s, {bandwidth / 1e9:.1f} GB/s "
        f"({peaks_from})")
    chunks = [int(c) for c in str(args.loss_chunk_rows).split(",") if c != ""]
    finals = [None if f == "joint" else f for f in args.final_logits.split(",") if f]
    for name in names:
        for chunk_rows, final in [(c, f) for c in chunks for f in finals]:
            try:
                entry = measure_shape(args, name, peak, bandwidth, chunk_rows, final)
                print(summary_line(entry), flush=True)
                print("\n".join(prediction_lines(name, entry["predicted"])), flush=True)
            except Exception as e:  # noqa: BLE001  (record it, go on with the next shape)
                log(f"ERROR in {name}: {e!r}\n{traceback.format_exc()}")
                entry = {"shape": name, "loss_chunk_rows": chunk_rows,
                         "final_logits": final or "joint", "error": repr(e)[:500],
                         "traceback": traceback.format_exc()[-4000:]}
            results["shapes"].append(entry)
            write_report(results, stem)
    log(f"wrote {stem}.json / .md")


if __name__ == "__main__":
    main()
