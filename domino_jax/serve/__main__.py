"""``python -m domino_jax.serve``: the OpenAI-compatible server (see ``docs/serving.md``).

    python -m domino_jax.serve                       # the embedded SmolLM2 pair, port 8000
    python -m domino_jax.serve --target DIR --draft DIR --slots 16 --port 8080

Takes every model and method flag of ``python -m domino_jax.decode`` (the same defaults:
Domino with adaptive widths on the demo pair); ``--temperature``, ``--top-p`` and
``--top-k`` are the defaults of requests that omit them and the setting compiled before the
server reports healthy; ``--max-new-tokens`` is the most a request may generate.
``SIGTERM`` (or Ctrl+C) stops accepting connections, lets live requests finish for up to
``--grace-period`` seconds, cancels the rest and exits with status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from domino_jax.console import setup_logging
from domino_jax.decode.__main__ import _positive, add_decode_arguments, load_decoder

log = logging.getLogger("domino_jax.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m domino_jax.serve",
                                description="An OpenAI-compatible server (chat and text "
                                "completions, streaming, /metrics) over lossless speculative "
                                "decoding with continuous batching.")
    add_decode_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--slots", type=_positive("--slots"), default=8, metavar="N",
                   help="rows decoded together; a finished request's row takes the next "
                        "waiting request (default 8)")
    p.add_argument("--max-queue", type=_positive("--max-queue"), default=256, metavar="N",
                   help="requests that may wait for a slot; more get 429 (default 256)")
    p.add_argument("--max-prompt-tokens", type=_positive("--max-prompt-tokens"), default=512,
                   metavar="N", help="the longest prompt accepted (with --max-new-tokens it "
                   "sizes the KV cache; one prefill program per prompt bucket up to it; "
                   "default 512)")
    p.add_argument("--rounds-per-call", type=_positive("--rounds-per-call"), default=8,
                   metavar="N", help="rounds per call of the decode loop: new requests join "
                   "and streamed tokens leave between calls (default 8)")
    p.add_argument("--warm-temperature", type=float, action="append", default=[],
                   metavar="T", help="also compile this temperature (with --top-p/--top-k) "
                   "before reporting healthy (repeatable); other settings compile on first "
                   "use")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of /v1/models and requests (default: the target "
                        "folder's name)")
    p.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds live requests may take to finish before they "
                        "are cancelled (default 30)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return _serve(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    try:
        import uvicorn

        from domino_jax.serve.app import create_app
    except ImportError as e:
        print(f"error: the server needs the 'serve' extra (pip install "
              f"'domino_jax[serve]'): {e}", file=sys.stderr)
        return 2
    from domino_jax.decode.sampling import SamplingConfig
    from domino_jax.serve.engine import Engine
    from domino_jax.serve.metrics import Metrics

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0, got {args.grace_period}")
    warm = [SamplingConfig(t, args.top_k, args.top_p) for t in args.warm_temperature]
    d = load_decoder(args)
    metrics = Metrics()
    engine = Engine(d.target, d.target_params, d.drafter, d.draft_params, d.config,
                    slots=args.slots, max_queue=args.max_queue,
                    max_prompt_tokens=args.max_prompt_tokens,
                    rounds_per_call=args.rounds_per_call, seed=args.seed,
                    cost_model=d.cost_model, warm=[d.config.sampling] + warm, mesh=d.mesh,
                    metrics=metrics)
    name = args.served_model_name or os.path.basename(os.path.normpath(d.target_dir))
    log.info("[serve] %s (method %s, %d slots) on http://%s:%d; compiling before /health "
             "reports ok", name, d.config.method, args.slots, args.host, args.port)
    app = create_app(engine, d.tokenizer, name, metrics, d.config.sampling,
                     shutdown_timeout=args.grace_period + 10)
    config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="on",
                            timeout_graceful_shutdown=args.grace_period,
                            log_level="debug" if args.verbose >= 2 else "info"
                            if args.verbose else "warning")
    server = _Server(config, engine)
    server.run()
    if engine.error is not None:
        print(f"error: the warm-up failed: {engine.error}", file=sys.stderr)
        return 1
    if engine.running:                  # stopped while compiling: do not wait for XLA
        log.info("[serve] stopped during the warm-up")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that drains the engine on SIGTERM/SIGINT, exits when the
        engine's warm-up failed, and returns normally after a graceful shutdown (uvicorn
        re-raises the signal once it has shut down, which would end the process by the
        signal rather than with status 0)."""

        def __init__(self, config, engine):
            super().__init__(config)
            self.engine = engine

        def handle_exit(self, sig, frame) -> None:
            self.engine.drain()
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

        async def on_tick(self, counter: int) -> bool:
            if self.engine.error is not None:
                return True
            return await super().on_tick(counter)

    return Server


def _Server(config, engine):
    return _server_class()(config, engine)


if __name__ == "__main__":
    sys.exit(main())
