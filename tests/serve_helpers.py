"""A tiny served model for the server tests: the ``domino_shift`` reference pair
(``tests/fixtures/reference``: a 4-layer Qwen3 target, vocabulary 256, and its Domino
drafter) with a word-level tokenizer and a chat template written next to the target, and
a server process on 127.0.0.1 around it.

The vocabulary: ``w000`` .. ``w249`` (one word per id, so decoded text maps back to ids),
then the specials ``<|im_start|>`` (250), ``<|im_end|>`` (251, the eos), ``user`` (252),
``assistant`` (253), ``system`` (254), ``<mask>`` (255, the drafter's mask id).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "reference", "domino_shift")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 251
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
                 "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
                 "{% endif %}")


def word(i: int) -> str:
    return f"w{i:03d}"


def make_pair(folder: str) -> tuple[str, str]:
    """``(target_dir, draft_dir)`` under ``folder``: the reference pair, the target with a
    tokenizer (eos 251) and its config's ``eos_token_id``."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, draft = os.path.join(folder, "target"), os.path.join(folder, "draft")
    shutil.copytree(os.path.join(FIX, "target"), target)
    shutil.copytree(os.path.join(FIX, "draft"), draft)
    specials = ["<|im_start|>", "<|im_end|>", "user", "assistant", "system", "<mask>"]
    vocab = {word(i): i for i in range(250)}
    vocab.update({s: 250 + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w000"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   unk_token="w000", chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=["<|im_start|>", "<mask>"])
    fast.save_pretrained(target)
    path = os.path.join(target, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["eos_token_id"] = EOS
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return target, draft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m domino_jax.serve`` on 127.0.0.1 (a free port) with ``args``; started by
    :meth:`start`, which waits until ``/health`` says ok."""

    def __init__(self, args: list[str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log_path = args, log_path
        self.proc = None

    def launch(self) -> "ServerProcess":
        """Start the process (it compiles before it reports healthy: :meth:`wait`)."""
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   JAX_PLATFORMS="cpu")
        flags = dict(zip(self.args, self.args[1:]))
        if flags.get("--compile-cache") == "off":     # no cache at all, the tests' neither
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "domino_jax.serve", "--port", str(self.port)] + self.args,
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        return self.launch().wait(timeout)

    def _poll_health(self, timeout: float, done, interval: float, what: str):
        """``/health``'s ``(status, body)`` once ``done(status)``; ``RuntimeError`` with the
        log if the server exits first or ``timeout`` passes (``what`` names the wait)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n"
                                   + self.output())
            try:
                answer = get(self.url + "/health")
                if done(answer[0]):
                    return answer
            except OSError:
                pass
            time.sleep(interval)
        raise RuntimeError(f"the server did not {what}:\n" + self.output())

    def wait(self, timeout: float = 300.0) -> "ServerProcess":
        """Until ``/health`` says ok (``RuntimeError`` with the log if it exits first)."""
        try:
            self._poll_health(timeout, lambda status: status == 200, 0.5, "become healthy")
        except RuntimeError:
            if self.proc.poll() is None:        # timed out: do not leave it running
                self.stop()
            raise
        return self

    def wait_listening(self, timeout: float = 120.0) -> tuple[int, bytes]:
        """Until ``/health`` answers at all (compiling or not): its answer."""
        return self._poll_health(timeout, lambda status: True, 0.2, "listen")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self.log.close()


def request(method: str, url: str, body=None, raw: bytes | None = None,
            timeout: float = 120.0) -> tuple[int, bytes]:
    """``(status, body bytes)`` of one HTTP request (JSON ``body`` or ``raw`` bytes)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get(url: str) -> tuple[int, bytes]:
    return request("GET", url, timeout=5)


def post(url: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    status, data = request("POST", url, body, raw)
    return status, json.loads(data)
