"""The training loop: data -> sharded jitted steps -> orbax checkpoints -> held-out tau -> HF export.

    result = train(TrainConfig(drafter="domino", steps=1000), target_dir, "data.npz", "out/",
                   draft_layers=2, block_size=16, gru_hidden_dim=256, emb_dim=64,
                   eval_config=EvalConfig(prompts="corpus/heldout.jsonl", every=200))

Writes under ``out``: ``checkpoints/`` (orbax, every ``checkpoint_every`` steps and at the
end, the last ``keep_checkpoints`` kept; ``best/`` with ``keep_best``; see
:mod:`~domino_jax.train.checkpoints`), ``metrics.jsonl`` (one JSON object per logged step),
``curve.json`` / ``curve.png`` (held-out tau per method and kind, loss, lr, tokens seen:
:mod:`~domino_jax.train.curve`), ``train_config.json`` and ``draft/`` (the trained drafter in
the HF ``DFlashDraftModel`` format; plus a ``mask_embedding [H]`` tensor, with a warning,
when the drafter learned its own mask token (``TrainConfig.learned_mask``), see
:func:`load_trained_draft`).

Exact resume: the batch of step ``i`` is a pure function of ``(seed, i)``
(:func:`data.batch_for_step`, indexing ``examples[j]`` only, so a streamed data set works)
and the anchor keys are ``fold_in(PRNGKey(seed), step)``; a resumed run (``resume=True`` or
``resume_from=DIR``) restores params, optimizer state and the bookkeeping (tokens seen,
wall time) and continues bitwise as the uninterrupted run would have. Evaluation reads the
params and never touches the training state or its randomness.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from domino_jax.config import DraftConfig
from domino_jax.console import train_postfix
from domino_jax.models.qwen3 import TargetLM
from domino_jax.program_cache import ProgramCache
from domino_jax.train import data as data_lib
from domino_jax.train.checkpoints import (BEST, CHECKPOINTS, RESUMABLE_CHANGES,
                                          TRAIN_CONFIG, RunError, check_resume_settings,
                                          checkpoint_manager, has_checkpoint,
                                          read_jsonl_until, resolve_checkpoint_dir,
                                          restore_checkpoint, save_checkpoint)
from domino_jax.train.config import TrainConfig, make_draft_config, resolve_mask_token_id
from domino_jax.train.curve import plot_run, read_curve, write_curve
from domino_jax.train.distributed import check_process_count, is_primary, step_batch, to_host
from domino_jax.train.evaluate import (EvalConfig, HeldoutEvaluator, best_metric,
                                       default_methods, encode_prompts, read_eval_prompts)
from domino_jax.train.loss import init_draft_params
from domino_jax.train.step import (horizon_array, init_state, learning_rate, make_train_mesh,
                                   make_train_step, model_flops, place, compile_step)

log = logging.getLogger(__name__)
MASK_EMBEDDING = "mask_embedding"


# ----------------------------------------------------------------------------- export

def export_trained_draft(config: DraftConfig, params: dict, path: str) -> None:
    """HF export via ``converters.hf_draft.export_draft`` (bf16), plus our ``mask_embedding``
    tensor (docs/algorithms.md §9.15 extension) appended to ``model.safetensors``."""
    from safetensors.numpy import load_file, save_file

    from converters.hf_draft import export_draft

    os.makedirs(path, exist_ok=True)
    plain = {k: v for k, v in params.items() if k != MASK_EMBEDDING}
    export_draft(config, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), plain), path)
    if MASK_EMBEDDING in params:
        file = os.path.join(path, "model.safetensors")
        log.warning("%s carries a learned %s: the reference DFlash/Domino inference code "
                    "ignores it and drafts from the target's embedding row mask_token_id=%d "
                    "instead, so this drafter drafts differently (worse) there. Only "
                    "domino_jax reads it; train without --learned-mask for interop.",
                    file, MASK_EMBEDDING, config.mask_token_id)
        tensors = load_file(file)
        tensors[MASK_EMBEDDING] = np.asarray(params[MASK_EMBEDDING], np.float32)
        save_file(tensors, file, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw["dflash_config"]["learned_mask_embedding"] = True
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)


def load_trained_draft(path: str, dtype=jnp.bfloat16) -> tuple[DraftConfig, dict]:
    """``converters.hf_draft.load_draft`` (which also reads our ``mask_embedding``)."""
    from converters.hf_draft import load_draft

    return load_draft(path, dtype)


def load_init_draft(path: str, target_config, drafter: str) -> tuple[DraftConfig, dict]:
    """A drafter to fine-tune (``TrainConfig.init_draft``): its config and float32 params
    (``{"backbone", ["head"], ["mask_embedding"]}``), checked against the target and the
    drafter kind being trained; a mismatch names the folder and the field."""
    config, params = load_trained_draft(path, jnp.float32)
    is_domino = config.has_domino_head
    if is_domino != (drafter == "domino"):
        raise ValueError(f"--init-draft {path!r} is a {'Domino' if is_domino else 'DFlash'} "
                         f"drafter but --drafter is {drafter!r}")
    for field, want in (("vocab_size", target_config.vocab_size),
                        ("hidden_size", target_config.hidden_size),
                        ("num_target_layers", target_config.num_layers)):
        if getattr(config, field) != want:
            raise ValueError(f"--init-draft {path!r}: {field} {getattr(config, field)} does "
                             f"not fit the target ({want})")
    if MASK_EMBEDDING in params:
        log.warning("--init-draft %s carries a learned %s: fine-tuning keeps it (the "
                    "reference inference code ignores it; see --learned-mask)", path,
                    MASK_EMBEDDING)
    return config, jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)


# ----------------------------------------------------------------------------- loop

# compiled train steps per run settings (dropped first when the process nears its
# memory-mapping cap: domino_jax/program_cache.py)
_COMPILED = ProgramCache()


@dataclasses.dataclass
class TrainResult:
    draft_config: DraftConfig
    params: Any                      # float32 drafter params (host)
    history: list[dict]              # logged metrics
    export_dir: str | None
    seconds: float
    curve: list[dict] = dataclasses.field(default_factory=list)   # held-out eval points
    state: Any = None                # the final TrainState (host): params + optimizer state


def summarise(metrics: dict) -> dict:
    """Host-side metrics: floats, ``acc`` per block slot (slots with no count are null)."""
    out = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    correct, count = np.asarray(metrics["correct"]), np.asarray(metrics["count"])
    out["acc"] = [round(float(c / n), 4) if n > 0 else None for c, n in zip(correct, count)]
    seen = count.sum()
    out["acc_mean"] = float(correct.sum() / seen) if seen > 0 else 0.0
    return out


def make_evaluator(eval_config: EvalConfig, target: TargetLM, target_params, config: DraftConfig,
                   target_dir: str | None, encode=None) -> HeldoutEvaluator:
    """The held-out evaluator of a run: prompts read and encoded once (``encode(text) ->
    ids``, default: :func:`decode.loading.encode_prompt` with the target folder's tokenizer,
    as the decode CLI and the shards generator encode), stop tokens from the tokenizer."""
    from domino_jax.decode.loading import encode_prompt, load_tokenizer, stop_token_ids

    texts = read_eval_prompts(eval_config.prompts, eval_config.num_prompts)
    tokenizer = None
    if encode is None:
        if target_dir is None:
            raise RunError("held-out evaluation needs a tokenizer: give target_dir or encode")
        tokenizer = load_tokenizer(target_dir)
        encode = lambda text: encode_prompt(tokenizer, text)
    prompts = encode_prompts(texts, encode, eval_config.max_prompt_tokens)
    log.info("eval: %d held-out prompts (%s), methods %s, %d new tokens",
             sum(map(len, prompts.values())), ", ".join(f"{k} {len(v)}" for k, v in
                                                          prompts.items()),
             eval_config.methods or default_methods(config), eval_config.max_new_tokens)
    return HeldoutEvaluator(target, target_params, config, prompts, eval_config.methods,
                            eval_config.max_new_tokens, eval_config.batch_size,
                            stop_token_ids(tokenizer, target.config))


class _Window:
    """Loss / accuracy of the steps since the last curve point. Steps add device arrays (no
    host sync per step); :meth:`sums` folds them into host sums, which a checkpoint's meta
    carries so that a resumed run's next point averages the same steps."""

    def __init__(self, sums: dict | None = None):
        self._sums = dict(sums or {"loss": 0.0, "steps": 0, "correct": 0.0, "count": 0.0})
        self._pending: list = []

    def add(self, metrics: dict) -> None:
        self._pending.append((metrics["loss"], metrics["correct"].sum(), metrics["count"].sum()))

    def sums(self) -> dict:
        for loss, correct, count in jax.device_get(self._pending):
            self._sums["loss"] += float(loss)
            self._sums["steps"] += 1
            self._sums["correct"] += float(correct)
            self._sums["count"] += float(count)
        self._pending = []
        return dict(self._sums)

    def take(self) -> tuple[float | None, float | None]:
        """``(mean loss, accuracy)`` since the last point (``None`` without steps); resets."""
        sums = self.sums()
        self._sums = {"loss": 0.0, "steps": 0, "correct": 0.0, "count": 0.0}
        if not sums["steps"]:
            return None, None
        return sums["loss"] / sums["steps"], sums["correct"] / max(sums["count"], 1.0)


def fitted_horizon(step: int, seconds_left: float, timed_steps: int, timed_seconds: float,
                   steps: int) -> int:
    """The schedules' horizon for a run on a deadline: ``step`` plus the steps that
    ``seconds_left`` allow at the mean step time measured (``timed_seconds`` over
    ``timed_steps``), at most ``steps``; ``steps`` until a step is timed; ``step`` itself
    (the run ends) when not one more step fits (docs/design.md §26)."""
    if timed_steps < 1 or timed_seconds <= 0.0:
        return steps
    more = int(max(seconds_left, 0.0) * timed_steps / timed_seconds)
    return min(steps, step + more)


def train(cfg: TrainConfig, target_dir: str | None, data_path: str | None, out_dir: str,
          draft_layers: int = 2, block_size: int = 16, gru_hidden_dim: int = 256,
          emb_dim: int = 64, mask_token_id: int | None = None, resume: bool = False,
          examples: list[dict] | None = None, target: TargetLM | None = None,
          target_params: Any = None, export: bool = True, progress: bool = True,
          stop_after: int | None = None, eval_config: EvalConfig | None = None,
          encode=None, keep_checkpoints: int = 2, keep_best: bool = False,
          resume_from: str | None = None, max_seconds: float | None = None) -> TrainResult:
    """Train a drafter against a frozen target (loaded from ``target_dir`` unless
    ``target``/``target_params`` are given) on ``data_path`` (or ``examples``).

    ``resume``: continue from the latest checkpoint of ``out_dir/checkpoints`` (a fresh run
    when there is none); ``resume_from``: from the latest checkpoint of that run or
    checkpoint folder (see :func:`checkpoints.resolve_checkpoint_dir`), writing on into
    ``out_dir``. Either way the settings must match the saved ones and the result is
    bitwise the uninterrupted run's. ``eval_config`` (with ``prompts``): held-out tau with
    the real decode loop at step 0, every ``eval_config.every`` steps and at the end, into
    ``out_dir/curve.json`` (+ ``curve.png``); ``encode(text) -> ids`` overrides the target
    folder's chat template. ``keep_checkpoints``: last K kept; ``keep_best``: also
    ``out_dir/best/`` (highest held-out tau) exported as ``draft-best/``.
    ``stop_after``: leave the loop after that global step (as if interrupted; tests).
    ``max_seconds``: a deadline for a lent machine: end the run after the first step that
    finishes that many seconds into the loop (compile and the first evaluation excluded),
    that step treated as the last (evaluated, checkpointed, exported); and fit the schedules
    to it: their horizon (where the learning rate's cosine reaches 0 and the Domino lambda
    its decay) is ``min(cfg.steps, the steps the seconds allow at the step time measured so
    far)``, estimated again after every step, and the run ends there (docs/design.md §26).
    Without it the horizon is ``cfg.steps``."""
    from tqdm.auto import tqdm

    compute = jnp.dtype(cfg.compute_dtype)
    if target is None:
        from converters.hf_target import load_target

        log.info("loading the target %s (%s)", target_dir, compute.name)
        target_config, target_params = load_target(target_dir, compute)
        target = TargetLM(target_config, dtype=compute, param_dtype=compute)
    else:
        target = TargetLM(target.config, dtype=compute, param_dtype=compute)
        target_params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, compute), target_params)
    if mask_token_id is None and cfg.init_draft is None:   # a row of the target's vocabulary
        mask_token_id = resolve_mask_token_id(target.config, target_dir)
    if cfg.init_draft is not None:      # fine-tune: geometry, weights and mask from there
        config, init_params = load_init_draft(cfg.init_draft, target.config, cfg.drafter)
        if (cfg.grow_layers, cfg.grow_gru_hidden_dim, cfg.grow_emb_dim) != (None,) * 3:
            from domino_jax.train.grow import grow_draft

            config, init_params = grow_draft(config, init_params, jax.random.PRNGKey(cfg.seed),
                                             cfg.grow_layers, cfg.grow_gru_hidden_dim,
                                             cfg.grow_emb_dim)
            log.info("grew %s to %d layers, GRU %d, %d correction features (docs/design.md "
                     "§28)", cfg.init_draft, config.num_layers, config.gru_hidden_dim,
                     config.emb_dim)
        block_size = config.block_size
    else:
        config = make_draft_config(target.config, cfg.drafter, draft_layers, block_size,
                                   gru_hidden_dim, emb_dim, mask_token_id)
    if keep_best and not (eval_config and eval_config.prompts):
        raise RunError("keep_best (--keep-best) ranks checkpoints by held-out tau: give "
                       "eval prompts (--eval-prompts FILE)")
    if examples is None:
        examples = data_lib.load_dataset(data_path)
    examples = data_lib.filter_examples(examples, 2 * block_size, cfg.max_length)
    if not examples:
        raise ValueError(f"no example in {data_path!r} has >= {2 * block_size} response "
                         f"tokens within max_length {cfg.max_length}")
    settings = {"train": dataclasses.asdict(cfg), "draft": config.to_hf_dict()}
    source_ckpt, source_run = None, None
    if resume_from is not None:
        source_ckpt, source_run = resolve_checkpoint_dir(resume_from)
    elif resume:
        source_ckpt, source_run = os.path.join(out_dir, CHECKPOINTS), out_dir
    multi = jax.process_count() > 1
    if multi and eval_config is not None and eval_config.prompts:
        raise RunError("held-out evaluation (--eval-prompts, --keep-best) runs on one "
                       f"process; this run has {jax.process_count()}: evaluate draft/ or "
                       "the checkpoints afterwards")
    if source_ckpt is not None and has_checkpoint(source_ckpt):
        check_resume_settings(source_run, settings, len(examples))
        saved_config = os.path.join(source_run or "", TRAIN_CONFIG)
        if source_run is not None and os.path.isfile(saved_config):
            with open(saved_config) as f:
                check_process_count(json.load(f).get("num_processes", 1), saved_config)
    os.makedirs(out_dir, exist_ok=True)

    if cfg.init_draft is not None:
        params = init_params
    else:
        params = init_draft_params(config, jax.random.PRNGKey(cfg.seed), cfg.learned_mask,
                                   target_params, cfg.init_from_target)
    if multi and cfg.mesh_data * cfg.mesh_fsdp * cfg.mesh_tensor != jax.device_count():
        raise RunError(f"--mesh {cfg.mesh_data},{cfg.mesh_fsdp},{cfg.mesh_tensor} must span "
                       f"all {jax.device_count()} devices of the {jax.process_count()} "
                       "processes")
    mesh = make_train_mesh(cfg)
    state, target_params, s_shard, t_shard = place(cfg, mesh, init_state(cfg, params),
                                                   target_params, target.config)
    meta: dict = {}
    if source_ckpt is not None and os.path.isdir(source_ckpt):
        restored = restore_checkpoint(checkpoint_manager(source_ckpt, None), state)
        if restored is not None:
            state, meta = restored
            check_process_count(meta.get("num_processes"), source_ckpt)
            log.info("resumed from %s at step %d", source_ckpt, int(state.step))
    if source_ckpt is not None and not meta and int(state.step) == 0:
        if resume_from is not None:
            raise RunError(f"--resume-from {resume_from!r}: no checkpoint to resume from")
        log.warning("--resume: no checkpoint in %s; starting a fresh run", source_ckpt)
    start = int(state.step)
    if is_primary():
        with open(os.path.join(out_dir, TRAIN_CONFIG), "w") as f:
            json.dump(dict(settings, examples=len(examples),
                           num_processes=jax.process_count()), f, indent=2)
    manager = checkpoint_manager(os.path.join(out_dir, CHECKPOINTS), keep_checkpoints)
    best_manager = checkpoint_manager(os.path.join(out_dir, BEST), 1) if keep_best else None
    continued = start > 0 and source_run is not None     # history up to ``start`` carries on
    metrics_rows = read_jsonl_until(os.path.join(source_run, "metrics.jsonl"), start) \
        if continued else []
    curve = [p for p in read_curve(source_run) if p["step"] <= start] if continued else []
    if continued and is_primary():
        write_curve(out_dir, curve)                         # points after ``start`` are gone
    evaluator = None
    if eval_config is not None and eval_config.prompts:
        evaluator = make_evaluator(eval_config, target, target_params, config, target_dir,
                                   encode)
    best_tau = max((best_metric(p["tau"], config) for p in curve if p.get("tau")),
                   default=float("-inf"))
    seq_len = cfg.max_length
    flops_model = model_flops(cfg, config, target.config, seq_len)
    n_dev = mesh.devices.size
    metrics_file = None                                     # process 0 writes the files
    if is_primary():
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in metrics_rows)
        metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
    history: list[dict] = []
    t_start = time.perf_counter()
    wall_base = float(meta.get("wall_seconds", 0.0))
    tokens_seen = int(meta.get("tokens_seen", 0))
    run_meta = lambda step: {"step": step, "tokens_seen": tokens_seen,
                             "examples_seen": step * cfg.batch_size,
                             "wall_seconds": wall_base + time.perf_counter() - t_start,
                             "num_processes": jax.process_count()}
    first, first_tokens = step_batch(examples, start, cfg, mesh)
    t0 = time.perf_counter()
    # the step does not read the cadence settings: runs differing only there share a program
    # nor the step count: the schedules' horizon is an argument (docs/design.md §26)
    # nor how the drafter was grown: its geometry (config) is in the key
    step_cfg = dataclasses.replace(cfg, steps=TrainConfig.steps, grow_layers=None,
                                   grow_gru_hidden_dim=None, grow_emb_dim=None,
                                   **{k: getattr(TrainConfig, k) for k in RESUMABLE_CHANGES})
    cache_key = (step_cfg, config, target, tuple(d.id for d in mesh.devices.flat),
                 str(jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), target_params)))

    def build():
        log.info("compiling the %s train step (batch %d x %d tokens) ...", cfg.drafter,
                 cfg.batch_size, cfg.max_length)
        step_fn = make_train_step(step_cfg, config, target, mesh, s_shard, t_shard)
        compiled = compile_step(step_fn, state, first, target_params, cfg.steps)
        log.info("compiled the train step in %.1f s", time.perf_counter() - t0)
        return compiled

    if start >= cfg.steps:
        log.info("already at step %d of %d: nothing to train", start, cfg.steps)
        step_fn, flops_xla = None, 0.0
    else:                               # same run settings in one process: compile once
        (step_fn, flops_xla), _ = _COMPILED.get(cache_key, build)
    horizon = cfg.steps        # fitted to max_seconds below: a step argument, no recompile
    compile_seconds = time.perf_counter() - t0
    window = _Window(meta.get("window"))

    ahead: dict = {}        # the step-0 evaluation on a thread (start_in_background)

    def start_eval_ahead() -> None:
        params0 = jax.tree_util.tree_map(jnp.copy, state.params)   # the step donates state
        t_eval = time.perf_counter()

        def run() -> None:
            try:
                ahead["taus"] = evaluator(params0)
            except Exception as e:  # noqa: BLE001  (the run goes on; the next eval compiles)
                ahead["error"] = e
            ahead["seconds"] = time.perf_counter() - t_eval

        ahead.update(thread=threading.Thread(target=run, name="eval-at-start", daemon=True),
                     index=len(curve), lr=float(learning_rate(cfg, 0, horizon)))
        ahead["thread"].start()
        log.info("step 0: evaluating the starting drafter on a thread beside training")

    def finish_eval_ahead() -> None:
        """Wait for the step-0 evaluation and put its point where it belongs in the curve
        (no loss yet; not a best-checkpoint candidate: its params are gone)."""
        nonlocal last_tau
        thread = ahead.pop("thread", None)
        if thread is None:
            return
        thread.join()
        if "error" in ahead:
            log.warning("step 0: the evaluation on a thread failed (%r); training went on",
                        ahead["error"])
            return
        point = dict(run_meta(0), wall_seconds=wall_base, loss=None, acc=None, lr=ahead["lr"],
                     tau=ahead["taus"], eval_seconds=ahead["seconds"])
        curve.insert(ahead["index"], point)
        write_curve(out_dir, curve)
        last_tau = best_metric(ahead["taus"], config) if last_tau is None else last_tau
        log.info("step 0: held-out tau %s (on a thread, %.0f s)",
                 {m: round(t["all"], 3) for m, t in ahead["taus"].items()}, ahead["seconds"])

    def curve_point(step: int) -> dict:
        """Evaluate the current params on the held-out prompts; append, write, plot."""
        nonlocal best_tau, last_tau
        finish_eval_ahead()                 # one evaluation at a time, in step order
        t_eval = time.perf_counter()
        taus = evaluator(state.params)
        loss, acc = window.take()
        point = dict(run_meta(step), loss=loss, acc=acc,
                     lr=float(learning_rate(cfg, step, horizon)),
                     tau=taus, eval_seconds=time.perf_counter() - t_eval)
        curve.append(point)
        write_curve(out_dir, curve)
        plot_run(out_dir)
        score = last_tau = best_metric(taus, config)
        log.info("step %d: held-out tau %s", step, {m: round(t["all"], 3)
                                                   for m, t in taus.items()})
        if best_manager is not None and score > best_tau:
            best_tau = score
            save_checkpoint(best_manager, state, dict(run_meta(step), best_tau=score))
        return point

    # the training bar shows the last held-out tau (the drafter's own method, pooled)
    last_tau = next((best_metric(p["tau"], config) for p in reversed(curve) if p.get("tau")),
                    None)
    if evaluator is not None and eval_config.at_start and start == 0:
        if eval_config.start_in_background:
            start_eval_ahead()
        else:
            curve_point(0)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and is_primary()),
               desc=f"train {cfg.drafter}")
    window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
    t_loop = t_timed = time.perf_counter()
    pending_tokens: list = []           # multi-process: global token counts, device scalars

    def fold_tokens() -> None:
        nonlocal tokens_seen, window_tokens
        for count in jax.device_get(pending_tokens):
            tokens_seen += int(count)
            window_tokens += float(count)
        pending_tokens.clear()

    for i in bar:
        batch, batch_tokens = (first, first_tokens) if i == start else step_batch(
            examples, i, cfg, mesh)
        state, metrics = step_fn(state, batch, target_params, horizon_array(horizon))
        if evaluator is not None:
            window.add(metrics)
        if multi:           # this process saw only its rows: count the global batch's
            pending_tokens.append(metrics["tokens"])
        else:
            tokens_seen += batch_tokens
            window_tokens += batch_tokens
        window_steps += 1
        step = i + 1
        out_of_time = False
        if max_seconds is not None:
            now = time.perf_counter()
            out_of_time = now - t_loop >= max_seconds
            # the first step (synchronised below) is not timed; processes keep one schedule
            if step > start + 1 and not multi:
                horizon = fitted_horizon(step, max_seconds - (now - t_loop), step - start - 1,
                                         now - t_timed, cfg.steps)
                bar.total = horizon
        if out_of_time:
            log.info("step %d: %.0f s of training reached (max_seconds): ending the run here",
                     step, max_seconds)
        if step >= horizon and horizon < cfg.steps and not out_of_time:
            log.info("step %d: the schedule fitted to max_seconds ends here", step)
        last = step >= horizon or out_of_time
        if step % cfg.log_every == 0 or last or step == start + 1 or \
                step % cfg.checkpoint_every == 0:
            fold_tokens()
        if step % cfg.log_every == 0 or last or step == start + 1:
            m = summarise(jax.device_get(metrics))
            elapsed = time.perf_counter() - window_t
            step_time = elapsed / max(window_steps, 1)
            m.update(step=step, step_time=step_time, horizon=horizon,
                     tokens_per_second=window_tokens / max(elapsed, 1e-9),
                     model_flops_per_step=flops_model, xla_flops_per_step=flops_xla,
                     mfu=flops_model / max(step_time, 1e-9) / (cfg.peak_flops * n_dev),
                     compile_seconds=compile_seconds, tokens_seen=tokens_seen)
            history.append(m)
            if metrics_file is not None:
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
            bar.set_postfix(train_postfix(m, last_tau))
            window_t, window_tokens, window_steps = time.perf_counter(), 0.0, 0
            if step == start + 1:
                t_timed = window_t      # step time is measured from here (max_seconds)
        if evaluator is not None and (last or (eval_config.every and
                                               step % eval_config.every == 0)):
            curve_point(step)
            window_t = time.perf_counter()          # eval time is not step time
        if step % cfg.checkpoint_every == 0 or last:
            save_checkpoint(manager, state, dict(run_meta(step), window=window.sums()))
        if (stop_after is not None and step >= stop_after) or last:
            break
    finish_eval_ahead()                     # a run stopped before its last evaluation
    if metrics_file is not None:
        metrics_file.close()
    host_state = to_host(state)
    export_dir = None
    if export and is_primary():
        export_dir = os.path.join(out_dir, "draft")
        export_trained_draft(config, host_state.params, export_dir)
        if best_manager is not None and best_manager.latest_step() is not None:
            best_state, _ = restore_checkpoint(best_manager, state)
            export_trained_draft(config, jax.device_get(best_state.params),
                                 os.path.join(out_dir, "draft-best"))
    return TrainResult(config, host_state.params, history, export_dir,
                       time.perf_counter() - t_start, curve, host_state)
