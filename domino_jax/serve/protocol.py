"""The OpenAI request and response shapes the server speaks (pydantic models), and its errors.

Requests are validated by pydantic (types, ranges, unknown fields: ``extra="forbid"``) and
then by :func:`sampling_of` / :func:`check_supported` (what the engine cannot do). Every
refusal is an :class:`APIError`, sent as OpenAI's error body::

    {"error": {"message": "temperature: Input should be less than or equal to 2",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

Extensions beyond OpenAI's fields (vLLM spells them the same): ``top_k`` (0 = off),
``stop_token_ids`` (generation ends after any of them, the token counted),
``return_token_ids`` (each choice, and each streamed chunk's choice, carries the generated
``token_ids``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from domino_jax.decode.sampling import SamplingConfig


class APIError(Exception):
    """A refusal: HTTP ``status``, OpenAI error ``type`` and the ``param`` it names."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_param(loc: tuple) -> str | None:
    """A pydantic error location as a field path (``("body", "messages", 0, "role")`` ->
    ``"messages[0].role"``); ``None`` for the body as a whole. A union's member tags in the
    location (``str``, ``list[int]``, ``TextPart``) end the path."""
    out = ""
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and p.islower() and p not in _TYPE_TAGS:
            out += ("." if out else "") + p
        else:
            break
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    # accepted at their neutral values only (check_supported)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None

    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Sampled):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def token_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"


def check_supported(body: _Sampled, vocab_size: int) -> None:
    """:class:`APIError` (400) naming the first field the engine cannot honour."""
    if body.n != 1:
        raise APIError(400, f"n: only n = 1 is supported, got {body.n}", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name}: not supported (give 0)", name)
    if body.logit_bias:
        raise APIError(400, "logit_bias: not supported", "logit_bias")
    if body.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs: not supported", "logprobs")
    if getattr(body, "top_logprobs", None):
        raise APIError(400, "top_logprobs: not supported", "top_logprobs")
    if getattr(body, "echo", False):
        raise APIError(400, "echo: not supported", "echo")
    if getattr(body, "suffix", None):
        raise APIError(400, "suffix: not supported", "suffix")
    if getattr(body, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of: only 1 is supported", "best_of")
    for i, t in enumerate(body.stop_token_ids or []):
        if not 0 <= t < vocab_size:
            raise APIError(400, f"stop_token_ids[{i}]: {t} is not a token id (vocabulary "
                           f"of {vocab_size})", f"stop_token_ids[{i}]")
    if len(body.stops()) > 4:
        raise APIError(400, f"stop: at most 4 stop strings, got {len(body.stops())}", "stop")


def sampling_of(body: _Sampled, default: SamplingConfig) -> SamplingConfig:
    """The request's sampling setting; omitted fields take the server's ``default``. Greedy
    settings are one setting whatever their top-k / top-p (they choose the argmax)."""
    sampling = SamplingConfig(
        default.temperature if body.temperature is None else body.temperature,
        default.top_k if body.top_k is None else body.top_k,
        default.top_p if body.top_p is None else body.top_p)
    return SamplingConfig() if sampling.greedy else sampling


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shape:
    """Response and chunk bodies of one endpoint (``chat``: chat completions, else text
    completions) for one request."""

    def __init__(self, chat: bool, model: str, token_ids: bool):
        self.chat, self.model, self.token_ids = chat, model, token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, ids: list[int] | None,
                delta: bool) -> dict:
        if self.chat:
            content = {} if text is None else {"content": text}
            choice = ({"index": 0, "delta": content} if delta else
                      {"index": 0, "message": {"role": "assistant", "content": text}})
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        choice["finish_reason"] = finish
        if self.token_ids and ids is not None:
            choice["token_ids"] = ids
        return choice

    def response(self, text: str, finish: str, ids: list[int], prompt_tokens: int) -> dict:
        return dict(self._head(self.object), choices=[self._choice(text, finish, ids, False)],
                    usage=usage(prompt_tokens, len(ids)))

    def chunk(self, text: str | None, finish: str | None = None,
              ids: list[int] | None = None, role: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choice = self._choice(text, finish, ids, True)
        if role and self.chat:
            choice["delta"]["role"] = "assistant"
        return dict(self._head(obj), choices=[choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return dict(self._head(obj), choices=[], usage=usage(prompt_tokens, completion_tokens))
