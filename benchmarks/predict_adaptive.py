"""Predict, before a GPU run, where adaptive speculation should land on the H200 at the
Qwen3-8B shape: a roofline cost model of each arm's round at batch 1..64, anchored to the
batch-1 stage times measured in README.md / benchmarks/NOTES.md (entry 11, commit 8911535),
and the policy's choice (``domino_jax.decode.adaptive``) at a forced acceptance.

Cost of one round at batch ``B`` with ``k`` drafts (ms):

* target forward over ``r = k + 1`` rows per sequence:
  ``o_t + max(bytes / BW, flops / F) + d_row * (r - 1)``: ``bytes`` = the target's
  weights + the KV cache read (``B * ctx * 144 KiB``); ``flops`` = ``2 * P * B * r`` plus
  attention; ``o_t`` (small kernels) and ``BW`` from the measured AR step (4.79 ms, the
  products at ~93% of 4.3 TB/s); ``d_row`` from the measured 17-row verify (5.36 ms): the
  batch-1 cost of each extra query row (attention over the cache), assumed per sequence;
* draft backbone over the 16-slot block (every arm drafts the whole block):
  ``o_b + max(2.10 GB / BW, 2 * P_b * B * 16 / F)``, ``o_b`` from the measured 0.77 ms;
* the LM head on ``B * k`` draft rows: ``max(1.24 GB / BW, 2 * P_h * B * k / F)`` + 0.03;
* the Domino head: ``k - 1`` corrected steps of 0.045 ms (0.67 ms for 15 measured; the
  per-step products stay tiny up to batch 64); DFlash: none;
* commit and policy: 0.16 ms (measured commit).

``F`` (dense bf16 GEMM throughput at these shapes) is the one number not measured here:
650 TFLOP/s (66% of the H200's 989) by default, ``--tflops`` to vary it. The loop runs a
little under the sum of its stages; each method's stage sum is scaled by the batch-1
ratio measured for it (Domino 6.91 / 7.28, DFlash 6.17 / 6.38).

Acceptance: a forced tau at the full width (16 drafts) is turned into a constant
conditional rate ``a`` per draft depth (``(1 - a^17) / (1 - a) = tau``), so ``k`` drafts
commit ``(1 - a^(k+1)) / (1 - a)`` tokens per round on average; the policy picks the arm
maximising tokens per ms.

    python benchmarks/predict_adaptive.py [--tflops 650] [--batches 1,4,16,32,64]
        [--taus 2,4,6,8] [--context 640] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
# Qwen3-8B shape (README / NOTES "the two numbers")
TARGET_BYTES = 15.14 * GB           # weights read per forward (bf16, embedding excluded)
TARGET_PARAMS = 7.57e9              # incl. the LM head (one product per row)
KV_BYTES_PER_TOKEN = 144 * 1024
BACKBONE_BYTES = 2.10 * GB
BACKBONE_PARAMS = 1.05e9
LM_HEAD_BYTES = 1.24 * GB
LM_HEAD_PARAMS = 0.62e9
ATTN_FLOPS_PER_ROW_TOKEN = 4 * 128 * 32 * 36   # QK^T and PV, per query row and cached token
# batch-1 anchors at prompt 512 (README results table, NOTES entry 11)
AR_MS, VERIFY17_MS, BACKBONE_MS, LM_HEAD16_MS, HEAD15_MS, COMMIT_MS = (
    4.79, 5.36, 0.77, 0.32, 0.67, 0.16)
LOOP_OVER_STAGES = {"domino": 6.91 / (5.36 + 0.77 + 0.32 + 0.67 + 0.16),
                    "dflash": 6.17 / (5.36 + 0.77 + 0.32 + 0.02 + 0.16)}
BW = 0.93 * 4.3e12                  # the products' bandwidth (NOTES entries 7, 12)
ARMS = (0, 2, 4, 8, 16)


def target_ms(batch, rows, context, flops_per_s):
    o_t = AR_MS - (TARGET_BYTES + KV_BYTES_PER_TOKEN * context) / BW * 1e3
    d_row = (VERIFY17_MS - AR_MS) / 16
    nbytes = TARGET_BYTES + batch * context * KV_BYTES_PER_TOKEN
    flops = 2 * TARGET_PARAMS * batch * rows + ATTN_FLOPS_PER_ROW_TOKEN * batch * rows * context
    return o_t + max(nbytes / BW, flops / flops_per_s) * 1e3 + d_row * (rows - 1)


def round_ms(method, batch, k, context, flops_per_s):
    """ms per round of ``method`` with ``k`` drafts at ``batch`` (k = 0: an AR step)."""
    verify = target_ms(batch, k + 1, context, flops_per_s)
    if k == 0:
        return verify + COMMIT_MS
    o_b = BACKBONE_MS - BACKBONE_BYTES / BW * 1e3
    backbone = o_b + max(BACKBONE_BYTES / BW, 2 * BACKBONE_PARAMS * batch * 16 / flops_per_s) * 1e3
    lm_head = 0.03 + max(LM_HEAD_BYTES / BW, 2 * LM_HEAD_PARAMS * batch * k / flops_per_s) * 1e3
    head = (HEAD15_MS / 15) * (k - 1) if method == "domino" else 0.02
    return LOOP_OVER_STAGES[method] * (verify + backbone + lm_head + head + COMMIT_MS)


def rate_for_tau(tau, k=16):
    """The constant conditional acceptance rate giving ``tau`` tokens per round at ``k``."""
    lo, hi = 0.0, 0.999999
    for _ in range(100):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return lo


def tokens(rate, k):
    return (1 - rate ** (k + 1)) / (1 - rate)


def predict(batches, taus, context, flops_per_s):
    rows = []
    for batch in batches:
        ar = round_ms("domino", batch, 0, context, flops_per_s)
        for tau in taus:
            rate = rate_for_tau(tau)
            for method in ("domino", "dflash"):
                costs = {k: round_ms(method, batch, k, context, flops_per_s) for k in ARMS}
                value = {k: tokens(rate, k) / costs[k] for k in ARMS}
                best = max(value, key=value.get)
                rows.append({"batch": batch, "tau": tau, "method": method, "rate": rate,
                             "ar_ms": ar, "costs_ms": costs,
                             "fixed16_speedup": value[16] * ar, "auto_width": best,
                             "auto_speedup": value[best] * ar,
                             "auto_tokens_per_round": tokens(rate, best)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tflops", type=float, default=650.0)
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--taus", default="2,4,6,8")
    p.add_argument("--context", type=int, default=640, help="mean cached tokens per row")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    taus = [float(t) for t in args.taus.split(",")]
    rows = predict(batches, taus, args.context, args.tflops * 1e12)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    lines = [f"# Adaptive speculation on the H200, predicted ({stamp}; Qwen3-8B shape, "
             f"context {args.context}, GEMMs at {args.tflops:.0f} TFLOP/s; "
             "benchmarks/predict_adaptive.py)", "",
             "| batch | tau@16 | method | AR ms | ms per round at k = " +
             " / ".join(map(str, ARMS[1:])) + " | fixed 16 | auto k | auto speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        costs = " / ".join(f"{r['costs_ms'][k]:.2f}" for k in ARMS[1:])
        lines.append(f"| {r['batch']} | {r['tau']:g} | {r['method']} | {r['ar_ms']:.2f} | "
                     f"{costs} | {r['fixed16_speedup']:.2f}x | {r['auto_width']} | "
                     f"**{r['auto_speedup']:.2f}x** |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"predict_adaptive_{stamp}.json"), "w") as f:
        json.dump({"date": stamp, "tflops": args.tflops, "context": args.context,
                   "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, f"predict_adaptive_{stamp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
