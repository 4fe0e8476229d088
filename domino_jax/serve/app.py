"""The HTTP layer: an OpenAI-compatible FastAPI app around an :class:`~.engine.Engine`.

    app = create_app(engine, tokenizer, "smollm2", Metrics(), default_sampling)
    uvicorn.run(app)            # or python -m domino_jax.serve

Routes: ``POST /v1/chat/completions`` (messages through the tokenizer's chat template),
``POST /v1/completions`` (a text prompt or token ids), both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``; ``GET /v1/models``, ``GET /health`` (200
once the engine has compiled its programs, 503 before, while draining or after a failed
warm-up) and ``GET /metrics`` (:mod:`~.metrics`).

Statuses: 400 for a body that does not validate or that the engine cannot honour (the
OpenAI error body names the field, :mod:`~.protocol`); 404 for another model name; 429 when
``--max-queue`` requests wait already; 503 while compiling or shutting down; 500 when
decoding failed. A client that disconnects (a stream closed early, or a plain request whose
connection drops) cancels its request: its slot is free for the next one at the engine's
next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from domino_jax.decode.sampling import SamplingConfig
from domino_jax.serve.detokenize import TextStream
from domino_jax.serve.engine import (Engine, Finished, QueueFull, Request, Tokens,
                                     Unavailable)
from domino_jax.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from domino_jax.serve.protocol import (APIError, ChatRequest, CompletionRequest, Shape,
                                       check_supported, error_param, sampling_of)
from domino_jax.text import encode_chat

log = logging.getLogger("domino_jax.serve")


class _Job:
    """One request seen from the event loop: the engine's events through an asyncio queue,
    turned into text pieces (:meth:`pieces`)."""

    def __init__(self, engine: Engine, tokenizer, prompt, sampling, max_tokens, stop_ids,
                 stops):
        loop = asyncio.get_running_loop()
        self.engine, self.queue = engine, asyncio.Queue()
        self.request = Request(list(prompt), sampling, max_tokens,
                               lambda event: loop.call_soon_threadsafe(self.queue.put_nowait,
                                                                       event),
                               stop_ids=frozenset(stop_ids))
        self.text = TextStream(tokenizer, stops)
        self.done = False

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.engine.cancel(self.request)

    async def pieces(self):
        """Yields ``(text, token ids, finish reason | None)`` until one has a finish reason
        (``"stop"`` or ``"length"``); raises :class:`APIError` when the engine failed or
        shut down. Leaving early (a disconnect) cancels the request."""
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, Tokens):
                    text, ids = "", []
                    for token in event.ids:
                        ids.append(token)
                        text += self.text.add(token)
                        if self.text.stopped:        # a stop string: the engine stops too
                            self.done = True
                            self.engine.cancel(self.request, "stop", len(self.text.tokens))
                            yield text, ids, "stop"
                            return
                    yield text, ids, None
                    continue
                assert isinstance(event, Finished)
                self.done = True
                if event.reason == "error":
                    raise APIError(500, f"decoding failed: {event.message}", None,
                                   "server_error")
                if event.reason == "cancelled":
                    raise APIError(503, "the server shut down before the request finished",
                                   None, "server_error")
                yield self.text.flush(), [], event.reason
                return
        finally:
            self.cancel()


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def create_app(engine: Engine, tokenizer, model_name: str, metrics: Metrics,
               default_sampling: SamplingConfig = SamplingConfig(),
               shutdown_timeout: float = 30.0) -> FastAPI:
    """The app; its lifespan starts the engine (compiling in the background, ``/health``
    503 until done) and stops it at shutdown."""
    vocab = len(tokenizer)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        # a warm-up compile cannot be interrupted: do not wait for it
        await asyncio.to_thread(engine.stop, shutdown_timeout if engine.ready.is_set()
                                else 1.0)

    app = FastAPI(title="domino_jax", lifespan=lifespan)

    def refuse(status: int, body: dict) -> JSONResponse:
        metrics.on_rejected(status)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return refuse(e.status, e.body())

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0]
        param = error_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('msg')}"
            param = None
        elif first.get("type") == "missing":
            message = f"{param}: required field missing"
        elif first.get("type") == "extra_forbidden":
            message = f"{param}: unknown field"
        else:
            given = repr(first.get("input"))
            given = given if len(given) <= 60 else given[:57] + "..."
            message = f"{param or 'body'}: {first.get('msg')} (got {given})"
        return refuse(400, APIError(400, message, param).body())

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return refuse(e.status_code, APIError(e.status_code, str(e.detail), None, kind).body())

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "message": engine.error}, 503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        if not engine.accepting:
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        metrics.set_load(engine.queue_length, engine.live_slots, engine.slots)
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": started, "owned_by": "domino_jax",
            "max_model_len": engine.max_prompt_tokens + engine.max_new_tokens}]}

    def start(body, prompt: list[int], field: str) -> _Job:
        """Check what pydantic cannot and queue the request (or raise :class:`APIError`)."""
        check_supported(body, vocab)
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model: {body.model!r} is not served here (this server "
                           f"serves {model_name!r})", "model", "not_found_error",
                           "model_not_found")
        if not prompt:
            raise APIError(400, f"{field}: the prompt is empty", field)
        if len(prompt) > engine.max_prompt_tokens:
            raise APIError(400, f"{field}: the prompt is {len(prompt)} tokens, more than the "
                           f"server's limit of {engine.max_prompt_tokens} "
                           "(--max-prompt-tokens)", field)
        limit, limit_field = body.token_limit()
        max_tokens = engine.max_new_tokens if limit is None else limit
        if max_tokens > engine.max_new_tokens:
            raise APIError(400, f"{limit_field}: {max_tokens} is more than this server "
                           f"generates per request ({engine.max_new_tokens}, "
                           "--max-new-tokens)", limit_field)
        job = _Job(engine, tokenizer, prompt, sampling_of(body, default_sampling), max_tokens,
                   body.stop_token_ids or (), body.stops())
        try:
            engine.submit(job.request)
        except QueueFull as e:
            raise APIError(429, f"too many requests waiting: {e}", None, "rate_limit_error",
                           "queue_full") from None
        except Unavailable as e:
            raise APIError(503, str(e), None, "server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), field) from None
        return job

    async def respond(http: HTTPRequest, body, job: _Job, chat: bool, prompt_tokens: int):
        shape = Shape(chat, model_name, body.return_token_ids)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(job, shape, chat, prompt_tokens, usage),
                                     media_type="text/event-stream")
        watch = asyncio.create_task(_watch(http, job))
        try:
            text, ids, finish = "", [], None
            async for piece, piece_ids, finish in job.pieces():
                text += piece
                ids += piece_ids
        finally:
            watch.cancel()
        return shape.response(text, finish, ids, prompt_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in body.messages]
        try:
            prompt = encode_chat(tokenizer, messages)
        except Exception as e:                        # noqa: BLE001  (a template's error)
            raise APIError(400, f"messages: cannot apply the chat template: {e}",
                           "messages") from None
        return await respond(http, body, start(body, prompt, "messages"), True, len(prompt))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt: one prompt per request (got {len(prompt)})",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt = [int(t) for t in tokenizer.encode(prompt)]
        for i, t in enumerate(prompt):
            if not 0 <= t < vocab:
                raise APIError(400, f"prompt[{i}]: {t} is not a token id (vocabulary of "
                               f"{vocab})", f"prompt[{i}]")
        return await respond(http, body, start(body, prompt, "prompt"), False, len(prompt))

    return app


async def _watch(http: HTTPRequest, job: _Job) -> None:
    """Cancel ``job`` as soon as the client of a plain request has gone. Its body is read, so
    the connection's next ASGI message is ``http.disconnect``: the client closed it, or the
    response was sent (then the job is done and ``cancel`` does nothing)."""
    while not job.done:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _stream(job: _Job, shape: Shape, chat: bool, prompt_tokens: int, usage: bool):
    """The server-sent events of a streamed request (a closed connection ends the generator:
    its request is cancelled, :meth:`_Job.pieces`)."""
    ids_total = 0
    try:
        if chat:
            yield _sse(shape.chunk("", role=True))
        async for text, ids, finish in job.pieces():
            ids_total += len(ids)
            if text or ids:
                yield _sse(shape.chunk(text, None, ids))
            if finish is not None:
                yield _sse(shape.chunk(None if chat else "", finish, []))
        if usage:
            yield _sse(shape.usage_chunk(prompt_tokens, ids_total))
    except APIError as e:
        yield _sse(e.body())
    yield _sse("[DONE]")
