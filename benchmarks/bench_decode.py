"""Decode benchmark: our jitted AR / DFlash / Domino loops vs Hugging Face generate.

One invocation measures, for each prompt length (batch 1, random bf16 weights made on the
device, Qwen3-8B target and drafter shapes):

* AR: ``generate(method="ar")`` end to end, and the round loop alone (decode time / rounds);
* DFlash and Domino: the whole round inside the ``lax.while_loop`` (decode time / rounds),
  and each stage as its own jitted function on realistic inputs (median of ~20 runs):
  draft backbone, LM head on the draft rows, head (Domino rollout, or argmax for DFlash),
  verify (target forward over K+1 tokens with the KV cache), commit;
* the round cost ``c = round_ms / ar_step_ms`` and projected speedups ``tau / c``; with
  ``--forced-taus`` also the loop with a forced acceptance length (random weights accept
  nothing, so the config's verification rule is one that accepts ``tau - 1`` drafts per
  round, :class:`ForcedMatch`);
* every time beside its memory-bandwidth floor (bytes counted from the parameter shapes);
* Hugging Face ``Qwen3ForCausalLM.generate`` (bf16, sdpa, dynamic and static cache) on the
  same shape, in a child process with a hard timeout (``hf_generate_worker.py``: a slow
  ``torch.compile`` cannot eat the whole budget, and its GPU memory is returned when it
  exits).

Helpers (floors, random weights, timing) live in ``bench_util.py``, the Markdown report and
the plot in ``decode_report.py``.

Results (JSON, Markdown, PNG) are rewritten after every finished task, so a run stopped by
``--time-budget-s`` or killed from outside still leaves partial results.

    python benchmarks/bench_decode.py                       # H200, ~6-7 minutes
    python benchmarks/bench_decode.py --tiny --skip-hf      # CPU smoke test, < 1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import re
import signal
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child_process import run_streaming  # noqa: E402
from domino_jax.pallas import (ATTENTION_IMPLEMENTATIONS,  # noqa: E402 (imports no jax)
                               HEAD_IMPLEMENTATIONS)

T_START = time.perf_counter()
TAUS = (4, 6, 8)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- arguments

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    p.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--skip-stages", action="store_true",
                   help="time the whole loops only (no per-stage jits): quick A/B runs")
    p.add_argument("--prompt-lens", default=None, help="comma list (default 512,2048; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 12)")
    p.add_argument("--hf-prompt-len", type=int, default=None,
                   help="prompt length of the HF baseline (default: the first prompt length)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new tasks past this (default 420; tiny 150)")
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS, e.g. "
                   "'--xla_gpu_enable_latency_hiding_scheduler=true'")
    p.add_argument("--mem-fraction", default="0.5", help="XLA_PYTHON_CLIENT_MEM_FRACTION")
    p.add_argument("--stage-reps", type=int, default=None,
                   help="timed runs per stage function (default 20; tiny 5)")
    p.add_argument("--loop-reps", type=int, default=None,
                   help="timed generate calls per method (default 3; tiny 1)")
    p.add_argument("--forced-taus", default=None, help="comma list of forced acceptance "
                   "lengths for the loop at the first prompt length (default 6; tiny 3; '' = none)")
    p.add_argument("--hf-timeout-s", type=float, default=240.0,
                   help="hard limit for the HF child process")
    p.add_argument("--methods", default="ar,domino,domino_pool64,dflash",
                   help="ar, dflash, domino (full-vocab head, the reference), domino_poolM "
                        "(head with a top-M candidate pool, --head-topm M); a Domino method "
                        "with '@IMPL' runs the head's steps through --head-kernels IMPL "
                        "(pallas.head_kernels: pallas, reference, pallas_interpret, xla), "
                        "e.g. 'ar,domino,domino@pallas' A/Bs the fused kernels against XLA in "
                        "one process")
    p.add_argument("--layout", choices=("fused", "unfused"), default="fused",
                   help="parameter layout of target and drafter: fused q/k/v and gate/up (the "
                        "decode default, models/fused_layout.py) or the checkpoint's")
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLEMENTATIONS,
                   help="attention over the KV caches (models.layers.attend): 'xla' (the "
                        "default of load_pair and the decode CLI), 'pallas' / 'auto' (the "
                        "split-K Pallas kernel on a GPU)")
    p.add_argument("--git-commit", default=None, help="recorded when .git is absent")
    args = p.parse_args(argv)
    if args.prompt_lens is None:
        args.prompt_lens = "16" if args.tiny else "512,2048"
    args.prompt_lens = [int(x) for x in str(args.prompt_lens).split(",") if x.strip()]
    if args.new_tokens is None:
        args.new_tokens = 12 if args.tiny else 256
    if args.time_budget_s is None:
        args.time_budget_s = 150.0 if args.tiny else 420.0
    if args.hf_prompt_len is None:
        args.hf_prompt_len = args.prompt_lens[0]
    if args.stage_reps is None:
        args.stage_reps = 5 if args.tiny else 20
    if args.loop_reps is None:
        args.loop_reps = 1 if args.tiny else 3
    if args.forced_taus is None:
        args.forced_taus = "3" if args.tiny else "6"
    args.forced_taus = [int(x) for x in str(args.forced_taus).split(",") if x.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in ("ar", "dflash") and not re.fullmatch(
                r"domino(_pool[1-9]\d*)?(@(" + "|".join(HEAD_IMPLEMENTATIONS) + "))?", m):
            p.error(f"unknown method {m!r} in --methods (ar, dflash, domino, domino_poolM, "
                    f"either Domino one with @IMPL, IMPL in {HEAD_IMPLEMENTATIONS})")
    return args


def setup_env(args) -> None:
    """Environment for XLA; must run before jax is imported."""
    if args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    setup_env(ARGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from domino_jax.config import (QWEN3_8B, QWEN3_8B_DOMINO_DRAFT, DraftConfig,  # noqa: E402
                               TargetConfig)
from domino_jax.decode import round as round_lib  # noqa: E402
from domino_jax.decode import speculative  # noqa: E402
from domino_jax.decode.drafters import DominoOptions  # noqa: E402
from domino_jax.decode.methods import make_drafter  # noqa: E402
from domino_jax.decode.speculative import DecodeConfig, generate  # noqa: E402
from domino_jax.decode.contract import Proposal  # noqa: E402
from domino_jax.decode.verify import Match, Verdict  # noqa: E402
from domino_jax.kv_cache import KVCache, align_slots  # noqa: E402
from domino_jax.models import dflash, domino_head, qwen3  # noqa: E402
from domino_jax.models.qwen3 import TargetLM  # noqa: E402

# --------------------------------------------------------------------------- shapes

TINY_TARGET = TargetConfig("qwen3", 512, 64, 4, 4, 2, 16, 128, 1e-6, 1e6,
                           tie_word_embeddings=False, eos_token_ids=(), bos_token_id=None)
TINY_DOMINO = DraftConfig(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, block_size=4, num_target_layers=4, mask_token_id=511,
    target_layer_ids=(0, 2), projector_type="domino", pure_draft_prefix_len=1,
    shift_label=True, emb_dim=16, gru_hidden_dim=32)


@dataclasses.dataclass(frozen=True)
class ForcedMatch(Match):
    """A verification rule for timing only: every round accepts ``accepted`` drafts (and the
    target's argmax after them as the bonus), whatever the drafts are."""

    accepted: int = 0

    def accept(self, key, proposal, target_log_probs, max_commit):
        argmax = jnp.argmax(target_log_probs, axis=-1).astype(jnp.int32)
        return self.accept_greedy(key, proposal, argmax, max_commit)

    def accept_greedy(self, key, proposal, targets, max_commit):
        """The loop's T = 0 path (the target's argmax tokens ``targets [B, N + 1]``)."""
        batch = proposal.tokens.shape[0]
        accepted = jnp.full((batch,), self.accepted, jnp.int32)
        return Verdict(accepted, targets[:, self.accepted], None)


def dflash_config_of(domino: DraftConfig) -> DraftConfig:
    """The plain DFlash drafter with the same backbone (K = block_size - 1)."""
    return dataclasses.replace(domino, projector_type=None, shift_label=False, emb_dim=0,
                               gru_hidden_dim=0)


# --------------------------------------------------------------------------- helpers

from bench_util import (compile_timed, device_peak_bytes, floor_ms,  # noqa: E402,F401
                        git_commit, hbm_bytes_per_s, head_rollout_bytes, random_params,
                        random_prompt, time_calls, tree_bytes, versions, with_floor)
import bench_util  # noqa: E402
import decode_report  # noqa: E402


# --------------------------------------------------------------------------- the benchmark

class Bench:
    def __init__(self, args):
        self.args = args
        self.stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
        self.task_seconds: dict[str, float] = {}
        dev = jax.devices()[0]
        self.results = {
            "schema": "bench_decode/1",
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "git_commit": git_commit(args.git_commit),
            "device": {"platform": dev.platform, "kind": dev.device_kind,
                       "count": jax.device_count()},
            "versions": versions(),
            "argv": sys.argv[1:],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "hbm_bytes_per_s": hbm_bytes_per_s(),      # the floors' (bench_util)
            "shape": "tiny" if args.tiny else "qwen3-8b",
            "batch": 1,
            "new_tokens": args.new_tokens,
            "prompt_lens": args.prompt_lens,
            "bytes": {},
            "prompts": {},
            "hf": {},
            "skipped": [],
            "errors": [],
            "complete": False,
        }

    # ---- budget and bookkeeping

    def elapsed(self) -> float:
        return time.perf_counter() - T_START

    def left(self) -> float:
        return self.args.time_budget_s - self.elapsed()

    def run_task(self, name: str, kind: str, fn, default_estimate: float) -> bool:
        """Run ``fn`` unless the budget cannot hold it (estimate: the last task of the same
        kind, else ``default_estimate``); record errors and keep going; save after."""
        estimate = self.task_seconds.get(kind, default_estimate)
        if self.left() < estimate:
            log(f"SKIP {name}: {self.left():.0f}s left, task needs ~{estimate:.0f}s")
            self.results["skipped"].append({"task": name, "left_s": self.left(),
                                            "estimate_s": estimate})
            return False
        log(f"START {name} (~{estimate:.0f}s estimated, {self.left():.0f}s left)")
        t0 = time.perf_counter()
        ok = True
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            ok = False
            tb = traceback.format_exc()
            log(f"ERROR in {name}: {e!r}\n{tb}")
            self.results["errors"].append({"task": name, "error": repr(e), "traceback": tb[-4000:]})
        took = time.perf_counter() - t0
        self.task_seconds[kind] = took
        log(f"DONE {name} in {took:.1f}s")
        self.save()
        return ok

    # ---- models

    def build_models(self):
        a = self.args
        self.tcfg = TINY_TARGET if a.tiny else QWEN3_8B
        self.domino_cfg = TINY_DOMINO if a.tiny else QWEN3_8B_DOMINO_DRAFT
        if a.layout == "fused":                    # what load_pair gives the decode CLI
            self.tcfg = dataclasses.replace(self.tcfg, fused_projections=True)
            self.domino_cfg = dataclasses.replace(self.domino_cfg, fused_projections=True)
        self.results["layout"] = a.layout
        self.dflash_cfg = dflash_config_of(self.domino_cfg)
        self.target = TargetLM(self.tcfg, attention_impl=a.attention)
        self.results["attention"] = a.attention
        t0 = time.perf_counter()
        init: dict = {}
        self.tp = random_params(qwen3.param_shapes(self.tcfg), 0)
        jax.block_until_ready(self.tp)
        init["target_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        backbone = random_params(dflash.param_shapes(self.domino_cfg), 1)
        head = random_params(domino_head.head_param_shapes(self.domino_cfg), 2)
        jax.block_until_ready((backbone, head))
        init["drafter_s"] = time.perf_counter() - t1
        self.results["init_seconds"] = time.perf_counter() - t0
        try:
            init["compiled_leaf_programs"] = int(bench_util._random_leaf._cache_size())
        except Exception:  # noqa: BLE001
            pass
        init["device_peak_bytes"] = device_peak_bytes()
        self.results["init"] = init
        log(f"random init: target {init['target_s']:.1f}s, drafter {init['drafter_s']:.1f}s, "
            f"{init.get('compiled_leaf_programs', '?')} leaf programs, device peak "
            + (f"{init['device_peak_bytes'] / 1e9:.2f} GB" if init["device_peak_bytes"]
               else "n/a"))
        self.plain_head = head
        if a.layout == "fused":      # the head's decode layout too, as load_pair gives it
            head = domino_head.decode_head(head, self.tp["embed_tokens"]["embedding"])
            jax.block_until_ready(head)
        self.dp = {"domino": {"backbone": backbone, "head": head},
                   "dflash": {"backbone": backbone}}
        self.drafters = {"domino": make_drafter(self.domino_cfg, self.target, "domino"),
                         "dflash": make_drafter(self.dflash_cfg, self.target, "dflash")}
        for m in self.args.methods:    # domino_poolM: a top-M pool; @IMPL: --head-kernels IMPL
            if m.startswith("domino") and m != "domino":
                name, _, impl = m.partition("@")
                topm = int(name[len("domino_pool"):]) if name != "domino" else 0
                self.dp[m] = self.dp["domino"]
                self.drafters[m] = make_drafter(self.domino_cfg, self.target, "domino",
                                                DominoOptions(head_topm=topm,
                                                              head_kernels=impl or "auto"))
        t = self.tcfg
        embed = tree_bytes(self.tp["embed_tokens"])
        target_total = tree_bytes(self.tp)
        lm_head = t.hidden_size * t.vocab_size * 2
        head_w2 = tree_bytes(domino_head.plain_params(head)["embed_proj_2"])
        n_corr = self.domino_cfg.k_draft - self.domino_cfg.pure_draft_prefix_len
        self.bytes = {
            "target_params_total": target_total,
            "target_embedding": embed,
            "target_streamed": target_total - embed,          # 15.14 GB for Qwen3-8B
            "target_kv_per_token": 2 * t.num_layers * t.num_kv_heads * t.head_dim * 2,
            "lm_head": lm_head,
            "draft_backbone": tree_bytes(backbone),
            "draft_kv_per_token": (2 * self.domino_cfg.num_layers * self.domino_cfg.num_kv_heads
                                   * self.domino_cfg.head_dim * 2),
            "head_total": tree_bytes(head),
            "head_w2": head_w2,
            "head_corrected_steps": n_corr,
            # each corrected step re-reads W2 (78 MB > L2), each advance the state's weights
            # (bench_util.head_rollout_bytes: the input table is gathered, never read whole)
            "head_floor": head_rollout_bytes(head, self.domino_cfg.k_draft,
                                             self.domino_cfg.pure_draft_prefix_len, 1,
                                             t.vocab_size),
        }
        self.results["bytes"] = self.bytes
        self.results["params"] = {"target": target_total // 2, "draft_backbone":
                                  self.bytes["draft_backbone"] // 2,
                                  "head": self.bytes["head_total"] // 2}
        log(f"params on device: target {target_total / 1e9:.2f} GB (streamed "
            f"{self.bytes['target_streamed'] / 1e9:.2f} GB), backbone "
            f"{self.bytes['draft_backbone'] / 1e9:.3f} GB, head {self.bytes['head_total'] / 1e6:.1f}"
            f" MB; init {self.results['init_seconds']:.1f}s")

    def ar_floor_bytes(self, context: int) -> int:
        return self.bytes["target_streamed"] + context * self.bytes["target_kv_per_token"]

    def stage_floor_bytes(self, method: str, context: int) -> dict:
        b = self.bytes
        k = self.drafters[method].num_drafts
        vocab = self.tcfg.vocab_size
        topm = getattr(self.drafters[method].options, "head_topm", 0)
        if method == "dflash":
            head = k * vocab * 4                               # argmax over the base logits
        elif topm:
            head = head_rollout_bytes(self.dp[method]["head"], k,
                                      self.domino_cfg.pure_draft_prefix_len, 1, vocab, topm=topm)
        else:
            head = b["head_floor"]
        return {"backbone": b["draft_backbone"] + context * b["draft_kv_per_token"],
                "lm_head": b["lm_head"],
                "head": head,
                "verify": self.ar_floor_bytes(context),
                "commit": (k + 1) * vocab * 4}

    # ---- loops

    def decode_config(self, method: str, capacity: int | None = None,
                      verify=Match()) -> DecodeConfig:
        base_method = "domino" if method.startswith("domino") else method
        return DecodeConfig(method=base_method, max_new_tokens=self.args.new_tokens,
                            capacity=capacity, verify=verify)

    def gen(self, method: str, prompt: list[int], config: DecodeConfig, seed: int):
        drafter = self.drafters.get(method) if method != "ar" else None
        dp = self.dp.get(method) if method != "ar" else None
        t0 = time.perf_counter()
        res = generate(self.target, self.tp, [prompt], config, drafter=drafter,
                       draft_params=dp, seed=seed)
        return res, time.perf_counter() - t0

    def measure_loop(self, method: str, plen: int, config: DecodeConfig | None = None,
                     label: str | None = None) -> dict:
        a = self.args
        config = config or self.decode_config(method)
        vocab = self.tcfg.vocab_size
        res, wall = self.gen(method, random_prompt(plen, vocab, 100), config, seed=0)
        compile_s = res.compile_seconds
        runs = []
        for r in range(a.loop_reps):                       # rotate prompts
            res, wall = self.gen(method, random_prompt(plen, vocab, 200 + r), config, seed=r)
            rounds = int(res.rounds[0])
            runs.append({"wall_s": wall, "prefill_s": res.prefill_seconds,
                         "decode_s": res.decode_seconds, "rounds": rounds,
                         "new_tokens": res.new_tokens, "tau": res.tau})
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        rounds = statistics.median(r["rounds"] for r in runs)
        new_tokens = statistics.median(r["new_tokens"] for r in runs)
        entry = {
            "method": method, "prompt_len": plen, "compile_s": compile_s,
            "verify_width": res.verify_width, "runs": runs,
            "round_ms": 1e3 * med("decode_s") / max(rounds, 1),
            "rounds": rounds, "tau_observed": statistics.median(r["tau"] for r in runs),
            "prefill_ms": 1e3 * med("prefill_s"),
            "generate_ms_per_token": 1e3 * med("wall_s") / max(new_tokens, 1),
            # tokens after the first one come from the loop
            "decode_ms_per_token": 1e3 * med("decode_s") / max(new_tokens - 1, 1),
        }
        entry["ms"] = entry["round_ms"]
        log(f"  {label or method} L={plen}: round {entry['round_ms']:.3f} ms x {rounds:.0f} "
            f"rounds, decode {entry['decode_ms_per_token']:.3f} ms/token, generate "
            f"{entry['generate_ms_per_token']:.3f} ms/token (incl. prefill "
            f"{entry['prefill_ms']:.1f} ms), tau {entry['tau_observed']:.2f}, compile "
            f"{compile_s:.1f}s")
        return entry

    # ---- stage functions

    def stage_inputs(self, method: str, plen: int):
        """A post-prefill DecodeState (real caches) for ``method`` at prompt length ``plen``."""
        drafter = self.drafters.get(method) if method != "ar" else None
        dp = self.dp.get(method) if method != "ar" else None
        config = self.decode_config(method)
        prompt, prompt_len = speculative.pad_prompts([random_prompt(plen, self.tcfg.vocab_size, 7)])
        k = drafter.num_drafts if drafter is not None else 0
        capacity = align_slots(speculative.required_capacity(plen, config, k))
        key = jax.random.PRNGKey(0)
        prefill_fn = jax.jit(round_lib.prefill, static_argnums=(0, 1, 2, 8))
        return prefill_fn(self.target, drafter, config, self.tp, dp, prompt, prompt_len, key,
                          capacity), config

    def measure_stages(self, method: str, plen: int) -> dict:
        reps = self.args.stage_reps
        target, tp = self.target, self.tp
        state, config = self.stage_inputs(method, plen)
        batch = 1
        key = jax.random.PRNGKey(3)
        out: dict = {}
        floors = self.stage_floor_bytes(method, plen) if method != "ar" else {}

        if method == "ar":
            verify_fn = jax.jit(lambda p, t, pos, c: target.apply(
                {"params": p}, t, pos, cache=c), donate_argnums=(3,))
            cache = {"c": state.target_cache}
            tokens = state.root[:, None]
            pos = state.target_cache.lengths[:, None]
            compiled, cs = compile_timed(verify_fn, tp, tokens, pos, cache["c"])

            def step():
                o = compiled(tp, tokens, pos, cache["c"])
                cache["c"] = o.cache
                return o.logits
            out["ar_step"] = with_floor(dict(time_calls(step, reps), compile_s=cs),
                                        self.ar_floor_bytes(plen))
            log(f"  ar_step (standalone jit) L={plen}: {out['ar_step']['ms']:.3f} ms, floor "
                f"{out['ar_step']['floor_ms']:.3f} ms ({out['ar_step']['pct_of_floor']:.0f}%)")
            return out

        drafter = self.drafters[method]
        dp = self.dp[method]
        k = drafter.num_drafts
        width = state.context.shape[1]
        ctx_len = jnp.full((batch,), min(max(self.args.forced_taus or [6]), width), jnp.int32)
        context = (0.5 * jax.random.normal(key, state.context.shape, jnp.float32)
                   ).astype(state.context.dtype)
        # copies: the caches (lengths included) are donated below
        root, start = jnp.array(state.root), jnp.array(state.target_cache.lengths)
        dcache = {"c": state.draft_cache}
        tcache = {"c": state.target_cache}
        # the state the stage functions read, without the big caches (passed on their own)
        lengths_only = KVCache(jnp.zeros((1, 1, 1, 1, 1), state.target_cache.keys.dtype),
                               jnp.zeros((1, 1, 1, 1, 1), state.target_cache.values.dtype),
                               start)
        small = state.replace(target_cache=lengths_only, draft_cache=None, context=context,
                              context_len=ctx_len)

        # 1. draft backbone (embed the block, fc + layers; cache committed then rolled back)
        def backbone(dparams, tparams, root, start, context, context_len, draft_cache):
            hidden, draft_cache = drafter.block_hidden(tparams, dparams, root, start, context,
                                                       context_len, draft_cache)
            # keep the committed length fixed across repeated calls
            return hidden, draft_cache.replace(lengths=draft_cache.lengths - context_len)

        bb, cs = compile_timed(jax.jit(backbone, donate_argnums=(6,)), dp, tp, root, start,
                               context, ctx_len, dcache["c"])

        def run_bb():
            h, dcache["c"] = bb(dp, tp, root, start, context, ctx_len, dcache["c"])
            return h
        out["backbone"] = dict(time_calls(run_bb, reps), compile_s=cs)
        hidden = run_bb()

        # 2. LM head on the K draft rows
        lm = jax.jit(lambda p, h: drafter.lm_head(p, h))
        lm_c, cs = compile_timed(lm, tp, hidden)
        out["lm_head"] = dict(time_calls(lambda: lm_c(tp, hidden), reps), compile_s=cs)
        base = lm_c(tp, hidden)

        # 3. head: Domino rollout, or DFlash argmax
        if method.startswith("domino"):
            def head_fn(dparams, tparams, hidden, base, root, key):
                return drafter.rollout(tparams, dparams, hidden, base, root, key, config)[0]
            hd, cs = compile_timed(jax.jit(head_fn), dp, tp, hidden, base, root, key)
            out["head"] = dict(time_calls(lambda: hd(dp, tp, hidden, base, root, key), reps),
                               compile_s=cs)
            drafts = hd(dp, tp, hidden, base, root, key)
            if drafter.options.head_kernels not in ("auto", "xla"):   # kernels: vs XLA's drafts
                xla = self.drafters["domino"] if not drafter.options.head_topm else \
                    make_drafter(self.domino_cfg, self.target, "domino",
                                 DominoOptions(head_topm=drafter.options.head_topm))
                xla_drafts = jax.jit(lambda *a: xla.rollout(*a, config)[0])(
                    tp, dp, hidden, base, root, key)
                out["head"]["same_drafts_as_xla"] = float(jnp.mean(xla_drafts == drafts))
            elif dp["head"] is not self.plain_head:    # A/B: the head in its checkpoint layout
                plain = dict(dp, head=self.plain_head)
                hp, cs = compile_timed(jax.jit(head_fn), plain, tp, hidden, base, root, key)
                out["head_plain_layout"] = dict(
                    time_calls(lambda: hp(plain, tp, hidden, base, root, key), reps),
                    compile_s=cs)
                same = bool(jnp.all(hp(plain, tp, hidden, base, root, key) == drafts))
                out["head_plain_layout"]["same_drafts"] = same
        else:
            am = jax.jit(lambda b: jnp.argmax(b, axis=-1).astype(jnp.int32))
            hd, cs = compile_timed(am, base)
            out["head"] = dict(time_calls(lambda: hd(base), reps), compile_s=cs)
            drafts = hd(base)

        # 1+2+3 together: the round's draft stage exactly as the loop runs it
        def draft(tparams, dparams, st, draft_cache, key):
            proposal = round_lib.draft(drafter, config, tparams, dparams,
                                       st.replace(draft_cache=draft_cache), key)
            c = proposal.draft_cache
            return proposal.tokens, c.replace(lengths=c.lengths - st.context_len)
        pr, cs = compile_timed(jax.jit(draft, donate_argnums=(3,)), tp, dp, small, dcache["c"],
                               key)

        def run_pr():
            d, dcache["c"] = pr(tp, dp, small, dcache["c"], key)
            return d
        out["draft_total"] = dict(time_calls(run_pr, reps), compile_s=cs)

        # 4. verify: target forward over [root, drafts] with the KV cache (donated, in place)
        def verify(tparams, st, cache, drafts):
            return round_lib.verify_forward(target, drafter, tparams,
                                            st.replace(target_cache=cache), Proposal(drafts))
        vf_c, cs = compile_timed(jax.jit(verify, donate_argnums=(2,)), tp, small, tcache["c"],
                                 drafts)
        holder = {}

        def run_verify():
            o = vf_c(tp, small, tcache["c"], drafts)
            tcache["c"] = o.cache
            holder["out"] = o
            return o.logits
        out["verify"] = dict(time_calls(run_verify, reps), compile_s=cs)
        vout = holder["out"]._replace(cache=lengths_only)

        # 5. accept + commit: acceptance, output writes, cache advance, next draft context
        def commit(st, drafts, vout, key):
            proposal = Proposal(drafts)
            verdict = round_lib.accept(drafter, config, proposal, vout, key)
            return round_lib.commit(drafter, config, st,
                                    round_lib.Verified(verdict, proposal, vout), key)

        cm, cs = compile_timed(jax.jit(commit), small, drafts, vout, key)
        out["commit"] = dict(time_calls(lambda: cm(small, drafts, vout, key), reps),
                             compile_s=cs)

        for name, nbytes in floors.items():
            with_floor(out[name], nbytes)
        if "head_plain_layout" in out:
            with_floor(out["head_plain_layout"], floors["head"])
        with_floor(out["draft_total"], floors["backbone"] + floors["lm_head"] + floors["head"])
        out["sum_of_stages_ms"] = sum(out[s]["ms"] for s in
                                      ("draft_total", "verify", "commit"))
        out["round_floor_ms"] = floor_ms(sum(floors.values()))
        parts = ", ".join(f"{s} {out[s]['ms']:.3f}" for s in
                          ("backbone", "lm_head", "head", "draft_total", "verify", "commit"))
        log(f"  {method} stages L={plen} (ms): {parts}; sum {out['sum_of_stages_ms']:.3f}, "
            f"round floor {out['round_floor_ms']:.3f}")
        return out

    # ---- forced acceptance

    def measure_forced(self, method: str, plen: int, tau: int) -> dict:
        """The real loop with ``accepted = tau - 1`` every round (:class:`ForcedMatch`)."""
        drafter = self.drafters[method]
        k = drafter.num_drafts
        needed = speculative.required_capacity(plen, self.decode_config(method), k)
        config = self.decode_config(method, capacity=align_slots(needed + tau),
                                    verify=ForcedMatch(min(tau - 1, k)))
        entry = self.measure_loop(method, plen, config, label=f"{method} forced tau={tau}")
        entry["forced_tau"] = tau
        return entry

    # ---- Hugging Face

    def run_hf(self, plen: int):
        """HF generate in a child process (own session, killed as a group on timeout); its
        output is streamed with a prefix and the tail kept for the error record."""
        timeout = max(30.0, min(self.args.hf_timeout_s, self.left() - 15.0))
        payload = json.dumps({"tiny": self.args.tiny, "prompt_len": plen,
                              "new_tokens": self.args.new_tokens,
                              "config": self.tcfg.to_hf_dict()})
        out_file = os.path.join(self.args.out, f".hf_{self.stamp}.json")
        if os.path.exists(out_file):
            os.remove(out_file)
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "hf_generate_worker.py"), out_file]
        env = dict(os.environ, BENCH_HF_PAYLOAD=payload, PYTHONUNBUFFERED="1")
        log(f"  HF worker (timeout {timeout:.0f}s): {os.path.basename(cmd[1])} ...")
        error = None
        rc, tail, wall = run_streaming(cmd, timeout, env=env, tail_lines=40)
        if rc == "timeout":
            error = (f"HF worker still running after its {timeout:.0f}s timeout; killed "
                     "(raise --hf-timeout-s / --time-budget-s)")
        result = {}
        if os.path.exists(out_file):          # the worker saves after every mode
            try:
                with open(out_file) as f:
                    result = json.load(f)
            except Exception as e:  # noqa: BLE001
                result = {"error": f"unreadable worker result: {e!r}"}
            os.remove(out_file)
        if os.path.exists(out_file + ".tmp"):   # a worker killed while saving
            os.remove(out_file + ".tmp")
        if error is None and rc != 0:
            error = f"HF worker exited with code {rc}"
        if error:
            result["error"] = (result["error"] + "; " + error) if result.get("error") else error
        if result.get("error"):
            result["output_tail"] = "\n".join(tail)[-4000:]
            log(f"  HF worker failed: {result['error']}")
        result["returncode"] = rc
        result["wall_s"] = wall
        self.results["hf"][str(plen)] = result

    # ---- summary

    def summarise(self):
        """c, projected speedups and ratios from whatever has been measured."""
        for plen_s, pr in self.results["prompts"].items():
            plen = int(plen_s)
            loops = pr.get("loops", {})
            ar = loops.get("ar")
            if not ar:
                continue
            mid = plen + self.args.new_tokens // 2
            with_floor(ar, self.ar_floor_bytes(mid))
            ar_ms = ar["round_ms"]
            pr["ar_step_ms"] = ar_ms
            for method in [m for m in loops if m != "ar"]:
                loop = loops.get(method)
                if not loop:
                    continue
                floors = self.stage_floor_bytes(method, mid)
                with_floor(loop, sum(floors.values()))
                c = loop["round_ms"] / ar_ms
                c_floor = loop["floor_ms"] / ar["floor_ms"]
                loop["c"] = c
                loop["c_floor"] = c_floor
                loop["projected_speedup"] = {str(t): t / c for t in TAUS}
                loop["projected_ms_per_token"] = {str(t): loop["round_ms"] / t for t in TAUS}
            for key, forced in pr.get("forced", {}).items():
                forced["speedup_vs_ar"] = ar["decode_ms_per_token"] / forced["decode_ms_per_token"]
                forced["c"] = forced["round_ms"] / ar_ms
            hf = self.results["hf"].get(plen_s, {})
            for mode in ("static", "static_eager", "dynamic"):
                m = hf.get(mode) or {}
                if m.get("ms_per_token"):
                    m["ours_generate_over_hf"] = ar["generate_ms_per_token"] / m["ms_per_token"]
                    m["hf_over_ours_generate"] = m["ms_per_token"] / ar["generate_ms_per_token"]

    def markdown(self) -> str:
        return decode_report.markdown(self.results)

    def plot(self, path: str) -> bool:
        return decode_report.plot(self.results, path)

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        self.results["elapsed_s"] = self.elapsed()
        try:
            self.summarise()
        except Exception as e:  # noqa: BLE001
            self.results.setdefault("summary_error", repr(e))
        base = os.path.join(self.args.out, f"decode_{self.stamp}")
        tmp = base + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=float)
        os.replace(tmp, base + ".json")
        with open(base + ".md", "w") as f:
            f.write(self.markdown())
        try:
            self.results["plot"] = base + ".png" if self.plot(base + ".png") else None
        except Exception as e:  # noqa: BLE001
            self.results["plot"] = f"failed: {e!r}"
        self.paths = (base + ".json", base + ".md")

    # ---- driver

    def run(self):
        a = self.args
        log(f"device {self.results['device']}; versions {self.results['versions']}; "
            f"XLA_FLAGS={self.results['xla_flags']!r}; budget {a.time_budget_s:.0f}s")
        self.build_models()
        self.save()
        spec_methods = [m for m in a.methods if m != "ar"]
        loop_methods = (["ar"] if "ar" in a.methods else []) + spec_methods
        # priority order: everything at the first prompt length, HF, the loops at the
        # other lengths, the forced-acceptance loops, then the stages at the other lengths
        for plen in a.prompt_lens:
            self.results["prompts"].setdefault(str(plen), {"loops": {}, "stages": {},
                                                           "forced": {}})

        def per_method(kind, plen, measure, estimate):
            """``measure(method, plen)`` for every loop method into results[...][kind]."""
            section = self.results["prompts"][str(plen)][kind]
            for m in loop_methods:
                self.run_task(f"{kind} {m} L={plen}", f"{kind}_{m}",
                              lambda m=m: section.__setitem__(m, measure(m, plen)), estimate)

        loops = lambda plen: per_method("loops", plen, self.measure_loop, 40)  # noqa: E731
        stages = lambda plen: None if a.skip_stages else per_method(  # noqa: E731
            "stages", plen, self.measure_stages, 30)

        first = a.prompt_lens[0]
        loops(first)
        stages(first)
        if not a.skip_hf:
            self.run_task(f"hf L={a.hf_prompt_len}", "hf", lambda: self.run_hf(a.hf_prompt_len),
                          40 if a.tiny else 150)
        for plen in a.prompt_lens[1:]:
            loops(plen)
        pr = self.results["prompts"][str(first)]
        for tau in a.forced_taus:
            for m in spec_methods:
                self.run_task(f"forced {m} tau={tau} L={first}", f"forced_{m}",
                              lambda m=m, tau=tau: pr["forced"].__setitem__(
                                  f"{m}_tau{tau}", self.measure_forced(m, first, tau)), 40)
        for plen in a.prompt_lens[1:]:
            stages(plen)
        self.results["complete"] = True
        self.save()
        print(self.markdown(), flush=True)
        log(f"wrote {self.paths[0]} and {self.paths[1]}")


def main():
    args = ARGS if ARGS is not None else parse_args()
    bench = Bench(args)

    def on_term(signum, _frame):          # `timeout` sends SIGTERM: keep what we have
        raise SystemExit(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        bench.run()
    except BaseException as e:  # noqa: BLE001
        log(f"stopped early: {e!r}")
        bench.results["errors"].append({"task": "run", "error": repr(e),
                                        "traceback": traceback.format_exc()[-4000:]})
        bench.save()
        print(bench.markdown(), flush=True)
        raise


if __name__ == "__main__":
    main()
