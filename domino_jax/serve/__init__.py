"""An OpenAI-compatible HTTP server over the decode loop: ``python -m domino_jax.serve``.

:mod:`~domino_jax.serve.engine` (live continuous batching on the compiled programs of
:mod:`domino_jax.decode`), :mod:`~domino_jax.serve.app` (the FastAPI routes),
:mod:`~domino_jax.serve.protocol` (the OpenAI request and response shapes, errors),
:mod:`~domino_jax.serve.detokenize` (streamed text and stop strings),
:mod:`~domino_jax.serve.metrics` (Prometheus). Needs the ``serve`` extra
(``pip install domino_jax[serve]``); ``docs/serving.md`` shows how to run and query it.
"""
