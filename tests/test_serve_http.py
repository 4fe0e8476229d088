"""The OpenAI-compatible server (domino_jax/serve): a real ``python -m domino_jax.serve``
process on 127.0.0.1 with the tiny reference pair (tests/serve_helpers.py: Domino with 4
drafts a round, one program to compile; the adaptive engine that the default flags build is
tests/test_serving.py's, in process), queried with the ``openai`` client and raw HTTP.

At T = 0 every response (chat and completion, streamed or not) equals the offline
``generate`` of its prompt with the server's own config token for token; a load of 64
requests from 16 clients (mixed prompt lengths, ``max_tokens``, temperatures, endpoints)
all answered once and completely; bad input gets a 400 naming the field and the server
serves on; a client that disconnects mid-stream frees its slot; a full queue gets 429;
SIGTERM during load finishes the live requests and exits with status 0.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_helpers import EOS, ServerProcess, get, make_pair, post, word  # noqa: E402

SLOTS, MAX_NEW, MAX_PROMPT = 4, 256, 32
LONG = 120                    # tokens of the requests live at SIGTERM
DOMINO = ["--draft-length", "4"]          # the served method's flags beside _server_args'


def _server_args(target, draft, cache, extra=()):
    return ["--target", target, "--draft", draft, "--slots", str(SLOTS),
            "--max-prompt-tokens", str(MAX_PROMPT), "--max-new-tokens", str(MAX_NEW),
            "--rounds-per-call", "2", "--compile-cache", cache] + list(extra)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    target, draft = make_pair(str(folder))
    return target, draft, str(folder / "xla")


@pytest.fixture(scope="module")
def launched(pair, tmp_path_factory):
    """The server under test: Domino, 4 drafts a round, on the pair, started first: it
    compiles while :func:`offline` runs."""
    target, draft, cache = pair
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    proc = ServerProcess(_server_args(target, draft, cache, DOMINO + ["--max-queue", "64"]), log)
    try:
        yield proc.launch()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def offline(pair, launched):
    """``(tokenizer, reference)``: ``reference[tuple(prompt ids)]`` = the tokens of an offline
    ``generate`` at T = 0 (AR: what every lossless method must give) with the server's
    ``max_new_tokens``, stop ids and cache capacity, for every prompt the tests send at
    T = 0 (one batch: one compile)."""
    import dataclasses

    from domino_jax.decode.__main__ import load_decoder
    from domino_jax.decode.speculative import generate
    from domino_jax.serve.__main__ import build_parser
    from domino_jax.serve.engine import Engine

    target, draft, cache = pair
    args = build_parser().parse_args(_server_args(target, draft, "off") + ["--method", "ar"])
    args.draft = None
    d = load_decoder(args)
    config = Engine(d.target, d.target_params, None, None, d.config, slots=SLOTS,
                    max_prompt_tokens=MAX_PROMPT).config
    server_config = launched_config(target, draft)
    assert config.stop_token_ids == server_config.stop_token_ids
    assert config.max_new_tokens == server_config.max_new_tokens == MAX_NEW
    config = dataclasses.replace(config, capacity=server_config.capacity)
    prompts = sorted({tuple(p) for p in _greedy_prompts(d.tokenizer)})
    result = generate(d.target, d.target_params, [list(p) for p in prompts], config)
    return d.tokenizer, dict(zip(prompts, result.tokens))


def launched_config(target, draft):
    """The DecodeConfig the server under test builds from its flags."""
    from domino_jax.decode.__main__ import load_decoder
    from domino_jax.serve.__main__ import build_parser
    from domino_jax.serve.engine import Engine

    d = load_decoder(build_parser().parse_args(_server_args(target, draft, "off", DOMINO)))
    return Engine(d.target, d.target_params, d.drafter, d.draft_params, d.config,
                  slots=SLOTS, max_prompt_tokens=MAX_PROMPT).config


@pytest.fixture(scope="module")
def server(launched, offline):
    return launched.wait()


def _greedy_prompts(tokenizer) -> list:
    """Every prompt (token ids) the tests below send at T = 0."""
    chats, texts = _equality_prompts()
    load = [_ids(tokenizer, s) for s in _load_specs() if s[3] == 0]
    return ([_chat_ids(tokenizer, c) for c in chats] + [tokenizer.encode(t) for t in texts]
            + [tokenizer.encode(_stop_prompt())] + load)


def _equality_prompts():
    rng = np.random.default_rng(0)
    return [_words(rng, n) for n in (3, 11, 24)], [_words(rng, n) for n in (2, 17, 30)]


def _stop_prompt():
    return _words(np.random.default_rng(1), 9)


def _load_specs(count=64):
    """``(endpoint, prompt text, max_tokens, temperature, stream)`` of the load test."""
    rng = np.random.default_rng(2)
    specs = []
    for i in range(count):
        kind = "chat" if i % 2 else "text"
        temperature = 0.0 if i % 3 else 0.8
        specs.append((kind, _words(rng, int(rng.integers(1, 25))), int(rng.choice([4, 8, 16])),
                      temperature, bool(i % 4 == 1)))
    return specs


def _ids(tokenizer, spec):
    return _chat_ids(tokenizer, spec[1]) if spec[0] == "chat" else tokenizer.encode(spec[1])


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _words(rng, n):
    return " ".join(word(int(i)) for i in rng.integers(0, 250, n))


def _chat_ids(tokenizer, content):
    from domino_jax.text import encode_chat
    return encode_chat(tokenizer, [{"role": "user", "content": content}])


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def _metrics(server) -> dict:
    status, text = get(server.url + "/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_default_flags_serve_adaptive_widths(pair):
    """Without ``--draft-length`` the server runs the CLI's default: the adaptive policy."""
    from domino_jax.decode.__main__ import load_decoder
    from domino_jax.serve.__main__ import build_parser

    target, draft, _ = pair
    d = load_decoder(build_parser().parse_args(["--target", target, "--draft", draft]))
    assert d.config.method == "domino" and d.config.adaptive is not None


def test_health_models_and_metrics(server):
    assert json.loads(get(server.url + "/health")[1]) == {"status": "ok"}
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["target"]
    m = _metrics(server)
    assert m["domino_slots"] == SLOTS and m["domino_compile_seconds_total"] > 0
    for name in ("domino_queue_length", "domino_live_slots", "domino_tokens_per_second",
                 "domino_mean_accepted_tokens_per_round", "domino_prefill_seconds_total",
                 "domino_decode_seconds_total", "domino_generation_tokens_total"):
        assert name in m, name


def test_greedy_chat_and_completion_equal_offline_generate(server, offline):
    tokenizer, reference = offline
    chats, texts = _equality_prompts()
    prompts = [_chat_ids(tokenizer, c) for c in chats] + [tokenizer.encode(t) for t in texts]
    expected = [reference[tuple(p)] for p in prompts]
    client = _client(server)
    for i, content in enumerate(chats):
        want = expected[i][:40]
        out = client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": content}], max_tokens=40,
            temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert _extra(choice, "token_ids") == want
        assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert out.usage.prompt_tokens == len(prompts[i])
        assert out.usage.completion_tokens == len(want)
        # streamed: the same tokens and text, chunk by chunk
        chunks = list(client.chat.completions.create(
            model="target", messages=[{"role": "user", "content": content}], max_tokens=40,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True}))
        ids = [t for c in chunks if c.choices for t in (_extra(c.choices[0], "token_ids")
                                                        or [])]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert ids == want and text == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            choice.finish_reason
        assert chunks[-1].usage.completion_tokens == len(want)
    for i, text in enumerate(texts):
        want = expected[3 + i][:24]
        out = client.completions.create(model="target", prompt=text, max_tokens=24,
                                        extra_body={"return_token_ids": True})
        assert _extra(out.choices[0], "token_ids") == want
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        streamed = client.completions.create(model="target", prompt=text, max_tokens=24,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_stop_strings_and_stop_ids(server, offline):
    tokenizer, reference = offline
    prompt = _stop_prompt()
    full = reference[tuple(tokenizer.encode(prompt))][:30]
    cut = next(i for i in range(3, len(full)) if full[i] not in full[:i] and full[i] < 250)
    client = _client(server)
    # a stop string: the text before it, the string itself never sent (also streamed)
    out = client.completions.create(model="target", prompt=prompt, max_tokens=30,
                                    stop=[word(full[cut])],
                                    extra_body={"return_token_ids": True})
    before = tokenizer.decode(full[:cut], skip_special_tokens=True)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.rstrip() == before
    assert _extra(out.choices[0], "token_ids") == full[:cut + 1]
    streamed = client.completions.create(model="target", prompt=prompt, max_tokens=30,
                                         stop=word(full[cut]), stream=True)
    assert "".join(c.choices[0].text for c in streamed).rstrip() == before
    # a stop id: generation ends after it, the token counted
    out = client.completions.create(model="target", prompt=prompt, max_tokens=30,
                                    extra_body={"stop_token_ids": [full[cut]],
                                                "return_token_ids": True})
    assert _extra(out.choices[0], "token_ids") == full[:cut + 1]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == cut + 1


BAD = [  # (endpoint, body or raw bytes, status, param, words in the message)
    ("completions", b'{"prompt": "w001", "max_tokens": ', 400, None, "malformed JSON"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "w001"}]}, 400,
     "messages[0].role", "wizard"),
    ("chat/completions", {}, 400, "messages", "required"),
    ("completions", {"prompt": "w001", "temperature": -1}, 400, "temperature", "greater"),
    ("completions", {"prompt": "w001", "top_p": 0}, 400, "top_p", "greater"),
    ("completions", {"prompt": "w001", "n": 2}, 400, "n", "n = 1"),
    ("completions", {"prompt": "w001", "best": 1}, 400, "best", "unknown field"),
    ("completions", {"prompt": "w001", "max_tokens": 0}, 400, "max_tokens", "greater"),
    ("completions", {"prompt": "w001", "max_tokens": MAX_NEW + 1}, 400, "max_tokens",
     "--max-new-tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "w001"}],
                          "max_completion_tokens": MAX_NEW + 1}, 400,
     "max_completion_tokens", "--max-new-tokens"),
    ("completions", {"prompt": " ".join(["w001"] * (MAX_PROMPT + 1))}, 400, "prompt",
     "--max-prompt-tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": " ".join(
        ["w001"] * MAX_PROMPT)}]}, 400, "messages", "--max-prompt-tokens"),
    ("completions", {"prompt": [1, 999]}, 400, "prompt[1]", "not a token id"),
    ("completions", {"prompt": ["w001", "w002"]}, 400, "prompt", "one prompt"),
    ("completions", {"prompt": "w001", "stop_token_ids": [-3]}, 400, "stop_token_ids[0]",
     "not a token id"),
    ("completions", {"prompt": "w001", "presence_penalty": 0.5}, 400, "presence_penalty",
     "not supported"),
    ("completions", {"prompt": "w001", "model": "gpt-4"}, 404, "model", "not served"),
]


def test_bad_inputs_get_openai_errors_and_the_server_serves_on(server):
    before = _metrics(server)
    for endpoint, body, status, param, words in BAD:
        raw = body if isinstance(body, bytes) else None
        got, answer = post(f"{server.url}/v1/{endpoint}", None if raw else body, raw)
        assert got == status, (body, got, answer)
        error = answer["error"]
        assert error["param"] == param, (body, error)
        assert words in error["message"], (body, error)
        assert error["type"] in ("invalid_request_error", "not_found_error")
    rejected = sum(v for k, v in _metrics(server).items()
                   if k.startswith("domino_requests_rejected_total"))
    assert rejected - sum(v for k, v in before.items()
                          if k.startswith("domino_requests_rejected_total")) == len(BAD)
    # the openai client raises its typed errors on them
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _client(server).completions.create(model="target", prompt="w001", temperature=5)
    out = _client(server).completions.create(model="target", prompt="w001 w002",
                                             max_tokens=3)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason


def _finished(metrics, reason):
    return metrics.get(f'domino_requests_total{{reason="{reason}"}}', 0.0)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = _metrics(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "w003 w004 w005", "max_tokens": MAX_NEW, "stream": True}),
        {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    first = response.read(8)
    assert first.startswith(b"data: {")
    conn.sock.close()                       # the client goes away mid-stream
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(server)
        if _finished(m, "cancelled") > _finished(before, "cancelled") and \
                m["domino_live_slots"] == 0:
            break
        time.sleep(0.2)
    assert _finished(m, "cancelled") == _finished(before, "cancelled") + 1
    assert _finished(m, "length") == _finished(before, "length")    # not run to the end
    assert m["domino_live_slots"] == 0 and m["domino_queue_length"] == 0


def test_plain_requests_whose_clients_disconnect_are_cancelled(server):
    """Requests without streaming whose clients close the connection at once, next to a long
    stream: the server notices (the connection's ``http.disconnect``) and cancels each, queued or
    live."""
    before = _metrics(server)
    client = _client(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_one, client, ("text", "w007 w008", MAX_NEW, 0.0, True))
        for i in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": f"w009 w01{i}", "max_tokens": MAX_NEW}),
                {"Content-Type": "application/json"})
            conn.close()                    # gone before any answer
        tokens, finish, _ = stream.result()
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(server)
        if _finished(m, "cancelled") - _finished(before, "cancelled") >= 5:
            break
        time.sleep(0.2)
    assert _finished(m, "cancelled") == _finished(before, "cancelled") + 5
    assert finish in ("stop", "length")
    finished = sum(_finished(m, r) - _finished(before, r) for r in ("stop", "length"))
    assert finished == 1                     # the stream only


def _one(client, spec):
    """One load request; returns what came back."""
    kind, prompt, max_tokens, temperature, stream = spec
    extra = {"return_token_ids": True}
    if kind == "chat":
        kwargs = dict(model="target", messages=[{"role": "user", "content": prompt}],
                      max_tokens=max_tokens, temperature=temperature, extra_body=extra)
        call = client.chat.completions.create
    else:
        kwargs = dict(model="target", prompt=prompt, max_tokens=max_tokens,
                      temperature=temperature, extra_body=extra)
        call = client.completions.create
    if not stream:
        out = call(**kwargs)
        return _extra(out.choices[0], "token_ids"), out.choices[0].finish_reason, out.id
    ids, finish, rid = [], None, set()
    for chunk in call(stream=True, **kwargs):
        rid.add(chunk.id)
        for c in chunk.choices:
            ids += _extra(c, "token_ids") or []
            finish = c.finish_reason or finish
    assert len(rid) == 1
    return ids, finish, rid.pop()


def test_load_64_requests_from_16_clients(server, offline):
    tokenizer, reference = offline
    specs = _load_specs()
    expected = {i: reference[tuple(_ids(tokenizer, s))] for i, s in enumerate(specs)
                if s[3] == 0}
    before = _metrics(server)
    client = _client(server)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda s: _one(client, s), specs))
    ids = [r[2] for r in results]
    assert len(set(ids)) == len(specs)                           # none duplicated
    for i, (spec, (tokens, finish, _)) in enumerate(zip(specs, results)):
        max_tokens = spec[2]
        assert finish in ("stop", "length"), (spec, finish)
        assert 1 <= len(tokens) <= max_tokens and all(0 <= t < 256 for t in tokens)
        assert (finish == "length") == (len(tokens) == max_tokens and tokens[-1] != EOS)
        if i in expected:
            assert tokens == expected[i][:max_tokens], spec
    after = _metrics(server)
    finished = sum(_finished(after, r) - _finished(before, r) for r in ("stop", "length"))
    assert finished == len(specs)                                 # none lost
    assert after["domino_generation_tokens_total"] - before[
        "domino_generation_tokens_total"] == sum(len(r[0]) for r in results)
    assert after["domino_live_slots"] == 0 and after["domino_queue_length"] == 0
    # the rounds committed every token after each request's first (its prefill's), and
    # blocks may overrun max_tokens; tau = their ratio
    committed = after["domino_committed_tokens_total"] - before["domino_committed_tokens_total"]
    rounds = after["domino_row_rounds_total"] - before["domino_row_rounds_total"]
    assert committed >= sum(len(r[0]) - 1 for r in results) and rounds > 0
    assert after["domino_mean_accepted_tokens_per_round"] == pytest.approx(
        after["domino_committed_tokens_total"] / after["domino_row_rounds_total"])


def _all_arrived(metrics: dict, sent: int) -> bool:
    """Whether a slot is live and each of ``sent`` requests is refused, queued, live or done."""
    refused = metrics.get('domino_requests_rejected_total{status="429"}', 0)
    done = sum(v for k, v in metrics.items() if k.startswith("domino_requests_total"))
    taken = metrics["domino_queue_length"] + metrics["domino_live_slots"] + done
    return metrics["domino_live_slots"] > 0 and refused + taken >= sent


def test_full_queue_gets_429_and_sigterm_during_load_exits_cleanly(pair, tmp_path):
    target, draft, cache = pair
    # the module server's flags but the queue's: its programs, from the shared compile cache
    proc = ServerProcess(_server_args(target, draft, cache, DOMINO + [
        "--max-queue", "2", "--grace-period", "60"]),
        str(tmp_path / "server.log")).start()
    try:
        client = _client(proc)
        specs = [("text", _words(np.random.default_rng(i), 5), LONG, 0.0, True)
                 for i in range(16)]

        def attempt(spec):
            try:
                return _one(client, spec)
            except openai.RateLimitError as e:
                return e
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(attempt, s) for s in specs]
            deadline = time.time() + 60
            # live load at the signal, and every request already answered 429 or taken in
            # (one that reached the server after the signal would rightly get a 503)
            while not _all_arrived(_metrics(proc), len(specs)):
                assert time.time() < deadline, proc.output()
                time.sleep(0.02)
            status = proc.terminate(timeout=120)
            results = [f.result() for f in futures]
        log = proc.output()
        assert status == 0, log
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert refused and served and len(refused) + len(served) == len(specs), results
        assert all("queue" in str(e) for e in refused)
        for tokens, finish, _ in served:                       # finished, not cut off
            assert finish in ("stop", "length") and (finish == "stop" or len(tokens) == LONG)
        assert "Traceback" not in log, log
    finally:
        proc.stop()


def test_health_is_503_while_compiling_and_sigterm_then_exits_at_once(pair, tmp_path):
    target, draft, _ = pair
    proc = ServerProcess(["--target", target, "--draft", draft, "--slots", "2",
                          "--max-new-tokens", "8", "--max-prompt-tokens", "16",
                          "--compile-cache", "off"],
                         str(tmp_path / "server.log")).launch()
    try:
        status, body = proc.wait_listening()
        assert status == 503 and json.loads(body) == {"status": "loading"}, proc.output()
        code, answer = post(proc.url + "/v1/completions", {"prompt": "w001"})
        assert code == 503 and "compiling" in answer["error"]["message"]
        t0 = time.time()
        assert proc.terminate(timeout=60) == 0, proc.output()
        assert time.time() - t0 < 20                  # not after the whole compile
    finally:
        proc.stop()
