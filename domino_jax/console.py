"""What the command-line tools print on stderr: logging set-up and timed progress lines.

    from domino_jax.console import setup_logging, step
    setup_logging(args.verbose)          # before jax initialises a backend / transformers loads
    with step("loading target", path):   # "loading target /x ... 1.2 s"
        ...

Default (``verbosity`` 0): our loggers (``domino_jax.*``, ``converters.*``) print INFO, every
other library prints WARNING and above, and two notices that do not concern the user are
dropped (:data:`DROPPED_NOTICES`): jax's probe of a TPU backend on hosts without one (INFO in
jax 0.11, shown as soon as anything sets the root logger to INFO) and transformers' "PyTorch
was not found" advice (we never use transformers' models, only its tokenizers). Every other
warning still shows. ``-v`` (1) shows every library's INFO and nothing is dropped; ``-vv``
(2) shows DEBUG.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

# logger name -> message prefixes dropped at verbosity 0 (records of that logger only).
DROPPED_NOTICES: dict[str, tuple[str, ...]] = {
    "jax._src.xla_bridge": ("Unable to initialize backend",),
    "transformers": ("PyTorch was not found",),
}
OUR_LOGGERS = ("domino_jax", "converters")


class _DropNotices(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def setup_logging(verbosity: int = 0, fmt: str = "%(message)s") -> None:
    """Configure logging for a CLI (idempotent; see the module docstring for the levels).

    Call it before anything initialises a jax backend or imports transformers (a filter
    installed later still applies, but a message logged earlier is gone). Adds one stderr
    handler to the root logger unless it has one already (then its level is left alone);
    transformers keeps its own handler (its loggers do not propagate), so ``-v`` sets its
    level through its logger.
    """
    verbosity = int(verbosity or 0)
    others = logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else \
        logging.WARNING
    if not logging.root.handlers:        # else an embedding program (pytest) owns the root
        logging.basicConfig(level=others, format=fmt)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    for name, prefixes in DROPPED_NOTICES.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _DropNotices)]:
            logger.removeFilter(f)
        if verbosity == 0:
            logger.addFilter(_DropNotices(prefixes))
    if verbosity:        # transformers reads this when it first configures its logger
        logging.getLogger("transformers").setLevel(others)


@contextlib.contextmanager
def step(what: str, *details, stream=None):
    """Print ``what details ...`` on stderr, run the block, then finish the line with the
    seconds it took (``" 1.2 s"``); on an exception the line ends with ``" failed"``.

    The start is flushed at once, so a pipe or a terminal shows what is running now. Yields
    a ``note(text)`` function that adds ``text`` to the finished line (e.g. a size).
    """
    stream = stream or sys.stderr
    extra: list[str] = []
    stream.write(" ".join([what, *map(str, details)]) + " ... ")
    stream.flush()
    t0 = time.perf_counter()
    try:
        yield extra.append
    except BaseException:
        stream.write("failed\n")
        stream.flush()
        raise
    note = (", " + ", ".join(extra)) if extra else ""
    stream.write(f"{time.perf_counter() - t0:.1f} s{note}\n")
    stream.flush()


def add_verbose_flag(parser) -> None:
    """``-v`` / ``--verbose`` (repeatable) on an argparse parser, as ``args.verbose``."""
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show every library's log messages (-vv: debug too); by "
                             "default ours and other libraries' warnings only, less jax's "
                             "TPU probe and transformers' no-torch notice")


def train_postfix(metrics: dict, heldout_tau: float | None = None) -> dict[str, str]:
    """The training bar's postfix from one logged metrics row (``loop.summarise`` + the
    loop's fields): loss, mean accuracy, the first drafted slot's accuracy, tokens/s, the
    loss schedule's lambda and, when the loop has evaluated one, the last held-out tau."""
    post = dict(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc_mean']:.3f}")
    acc = metrics.get("acc") or []
    if len(acc) > 1 and acc[1] is not None:          # slot 1: the first drafted token
        post["acc1"] = f"{acc[1]:.3f}"
    post["tok_s"] = f"{metrics['tokens_per_second']:.0f}"
    if "lambda" in metrics:
        post["lam"] = f"{metrics['lambda']:.2f}"
    if heldout_tau is not None:
        post["tau"] = f"{heldout_tau:.2f}"
    return post
