"""The server's pure-Python parts: streamed detokenization with stop strings
(serve/detokenize.py), request validation and error locations (serve/protocol.py), the
prompt buckets of the engine. No model, no server."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from domino_jax.decode.sampling import SamplingConfig  # noqa: E402
from domino_jax.serve.detokenize import TextStream  # noqa: E402
from domino_jax.serve.engine import prompt_widths  # noqa: E402
from domino_jax.serve.protocol import (APIError, ChatRequest, CompletionRequest,  # noqa: E402
                                       check_supported, error_param, sampling_of)


class ByteTokenizer:
    """Token ``i`` is the byte string ``PIECES[i]``; decoding replaces an incomplete UTF-8
    character by U+FFFD, as byte-level BPE tokenizers do. Token 0 is a special token."""

    PIECES = [b"<eos>", b"Hel", b"lo", b" wor", b"ld", b"\xc3", b"\xa9", b"!", b"\n", b"\n\n"]

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


def _run(tokens, stops=()):
    text = TextStream(ByteTokenizer(), stops)
    pieces = []
    for t in tokens:
        pieces.append(text.add(t))
        if text.stopped:
            return pieces, text
    pieces.append(text.flush())
    return pieces, text


def test_stream_equals_the_full_decode_and_waits_for_whole_characters():
    tokens = [1, 2, 3, 4, 5, 6, 7, 0]
    pieces, text = _run(tokens)
    assert "".join(pieces) == ByteTokenizer().decode(tokens) == "Hello world\u00e9!"
    assert pieces[4] == ""                 # the first byte of "é" alone: held back
    assert pieces[5] == "\u00e9" and not text.stopped and text.tokens == tokens


def test_a_stop_string_across_tokens_is_cut_and_never_sent():
    pieces, text = _run([1, 2, 3, 4, 7], stops=["lo wo"])
    assert "".join(pieces) == "Hel" and text.stopped
    assert text.tokens == [1, 2, 3]       # the token that completed the stop string ends it
    assert pieces == ["He", "l", ""]       # "l", then "lo" might have started it


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    text = TextStream(ByteTokenizer(), ["!\n\n"])
    assert text.add(1) + text.add(2) == "Hello"
    assert text.add(7) == ""               # "!" may start the stop string
    assert text.add(8) == ""               # "!\n" too
    assert text.add(1) == "!\nHel"         # "!\nHel" cannot: released
    assert text.flush() == "" and not text.stopped
    text = TextStream(ByteTokenizer(), ["!\n\n"])
    assert text.add(7) == "" and text.add(9) == "" and text.stopped
    with pytest.raises(RuntimeError):
        text.add(1)


def test_held_back_text_is_sent_at_the_end():
    pieces, text = _run([1, 2, 7], stops=["!?"])
    assert pieces[-2] == "" and pieces[-1] == "!" and "".join(pieces) == "Hello!"


def test_error_param_names_the_field():
    assert error_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert error_param(("body", "temperature")) == "temperature"
    assert error_param(("body", "prompt", "list[int]", 3)) == "prompt"
    assert error_param(("body", "messages", 1, "content", "list[TextPart]", 0, "text")) == \
        "messages[1].content"
    assert error_param(("body",)) is None


def test_requests_validate_and_unsupported_values_are_refused():
    ChatRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_k=5)
    with pytest.raises(ValueError, match="extra"):
        CompletionRequest(prompt="x", bogus=1)
    for field, value in (("n", 2), ("presence_penalty", 0.1), ("logprobs", 3),
                         ("stop_token_ids", [300]), ("stop", ["a"] * 5), ("echo", True)):
        body = CompletionRequest(prompt="x", **{field: value})
        with pytest.raises(APIError) as e:
            check_supported(body, vocab_size=256)
        assert e.value.status == 400 and e.value.param.startswith(field)
        assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_sampling_defaults_and_one_greedy_setting():
    default = SamplingConfig(0.7, 40, 0.9)
    assert sampling_of(CompletionRequest(prompt="x"), default) == default
    assert sampling_of(CompletionRequest(prompt="x", temperature=1.0), default) == \
        SamplingConfig(1.0, 40, 0.9)
    greedy = sampling_of(CompletionRequest(prompt="x", temperature=0, top_p=0.5), default)
    assert greedy == SamplingConfig() == sampling_of(
        CompletionRequest(prompt="x", temperature=0.0, top_k=3), default)


def test_prompt_widths_are_the_buckets():
    assert prompt_widths(1) == [16]
    assert prompt_widths(64) == [16, 32, 64]
    assert prompt_widths(65) == [16, 32, 64, 128]
    assert prompt_widths(600) == [16, 32, 64, 128, 256, 512, 768]
