"""Hugging Face ``generate`` on a random-weight Qwen3 model: the baseline of ``bench_decode.py``.

Run by ``bench_decode.py`` as a child process with a hard timeout (a slow ``torch.compile``
cannot eat the parent's budget, and the GPU memory is returned when it exits)::

    BENCH_HF_PAYLOAD='{"tiny": false, "prompt_len": 512, "new_tokens": 256, "config": {...}}' \
        python benchmarks/hf_generate_worker.py OUT.json

``config`` is a Hugging Face ``Qwen3Config`` dict (``TargetConfig.to_hf_dict()``). The result
file is rewritten after every phase, so a killed worker still leaves what it measured.
This module imports torch and transformers only, never jax.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

T_START = time.perf_counter()


def hf_worker(out_path: str) -> None:
    """HF generate (dynamic, then static cache); results to ``out_path`` (JSON).

    Random bf16 weights without any CPU-side init: the model is built on the meta device,
    materialised uninitialised on the target device (``to_empty``), and each parameter is
    filled in place (norm weights 1, everything else N(0, 0.02)); the RoPE module, whose
    non-persistent buffers ``to_empty`` leaves as garbage, is rebuilt. Every failure is
    written to the result file as ``error`` (with the phase and traceback) and the process
    exits non-zero; the parent enforces the wall-clock limit."""
    payload = json.loads(os.environ["BENCH_HF_PAYLOAD"])
    result: dict = {"prompt_len": payload["prompt_len"], "new_tokens": payload["new_tokens"]}
    phase = "start"

    def save():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, out_path)

    def say(msg):
        print(f"[hf {time.perf_counter() - T_START:6.1f}s] {msg}", flush=True)

    try:
        phase = "import torch/transformers"
        t0 = time.perf_counter()
        import torch
        import transformers
        result["import_s"] = time.perf_counter() - t0
        phase = "device check"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu" and not payload["tiny"]:
            raise RuntimeError("torch sees no CUDA device (torch.cuda.is_available() is False; "
                               f"torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        phase = "config"
        raw = dict(payload["config"])
        raw.pop("architectures", None)
        raw.pop("model_type", None)
        config = transformers.Qwen3Config(**raw)
        config._attn_implementation = "sdpa"

        phase = "build model (meta)"
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = transformers.Qwen3ForCausalLM(config)
        model = model.to(torch.bfloat16)
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        result["param_bytes"] = int(n_bytes)
        if device == "cuda":
            free, total = torch.cuda.mem_get_info()
            result["cuda_free_bytes"] = int(free)
            if free < 1.15 * n_bytes:
                raise RuntimeError(
                    f"not enough free GPU memory for the HF model: {free / 1e9:.1f} GB free of "
                    f"{total / 1e9:.1f} GB, weights need {n_bytes / 1e9:.1f} GB (the parent JAX "
                    f"process holds XLA_PYTHON_CLIENT_MEM_FRACTION="
                    f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')})")

        phase = "materialise + random fill"
        model = model.to_empty(device=device)
        with torch.no_grad():
            for _name, param in model.named_parameters():
                if param.dim() == 1:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
            # to_empty left RoPE's non-persistent buffers (inv_freq) uninitialised: rebuild
            rebuilt = []
            for mod_name, mod in list(model.named_modules()):
                if not type(mod).__name__.endswith("RotaryEmbedding"):
                    continue
                # built on the CPU, then moved (the `device` argument is deprecated in
                # transformers 5.17 and gone in later versions)
                fresh = type(mod)(config=config).to(device)
                parent_name, _, attr = mod_name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
                rebuilt.append(mod_name)
            if not rebuilt:
                raise RuntimeError("found no *RotaryEmbedding module to rebuild after to_empty")
            result["rebuilt_modules"] = rebuilt
        model.eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        sync()
        result["init_s"] = time.perf_counter() - t0
        plen, new = payload["prompt_len"], payload["new_tokens"]
        vocab = config.vocab_size

        phase = "sanity forward"
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, min(vocab, 150000), (1, plen), generator=gen).to(device)
                   for _ in range(4)]
        with torch.no_grad():
            logits = model(prompts[0][:, :8]).logits
        sync()
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("non-finite logits from the randomly initialised HF model")
        result["sanity_logits_std"] = float(logits.float().std())
        say(f"model ready on {device} in {result['init_s']:.1f}s "
            f"({n_bytes / 1e9:.2f} GB bf16; import {result['import_s']:.1f}s)")
        save()
    except BaseException as e:  # noqa: BLE001
        result["error"] = f"{phase}: {e!r}"
        result["traceback"] = traceback.format_exc()[-3000:]
        say(f"FAILED in {phase}: {e!r}")
        traceback.print_exc()
        save()
        sys.exit(1)

    def one(ids, cache_impl, max_new, disable_compile=False):
        kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                      attention_mask=torch.ones_like(ids), pad_token_id=0)
        if cache_impl:
            kwargs["cache_implementation"] = cache_impl
        if disable_compile:
            kwargs["disable_compile"] = True
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kwargs)
        sync()
        return time.perf_counter() - t, out.shape[1] - ids.shape[1]

    def measure(mode, cache_impl, warm_new, reps, disable_compile=False):
        entry: dict = {"cache": cache_impl or "dynamic", "disable_compile": disable_compile}
        try:
            t_warm, _ = one(prompts[0], cache_impl, warm_new, disable_compile)
            entry["warmup_s"] = t_warm
            entry["compiled"] = getattr(model, "_compiled_call", None) is not None
            say(f"{mode}: warm-up {t_warm:.1f}s (compiled forward: {entry['compiled']})")
            runs = []
            for r in range(reps):
                dt, n = one(prompts[1 + r % 3], cache_impl, new, disable_compile)
                runs.append({"s": dt, "new_tokens": int(n)})
                say(f"{mode}: {1e3 * dt / max(n, 1):.2f} ms/token ({n} tokens)")
            entry["runs"] = runs
            entry["ms_per_token"] = statistics.median(1e3 * x["s"] / max(x["new_tokens"], 1)
                                                      for x in runs)
        except Exception as e:  # noqa: BLE001
            entry["error"] = repr(e)
            entry["traceback"] = traceback.format_exc()[-3000:]
            say(f"{mode} failed: {e!r}")
        result[mode] = entry
        save()
        return entry

    # dynamic first, then static (on CUDA its first call torch.compiles the forward:
    # 'reduce-overhead', CUDA graphs); if that fails, static without compile. The dynamic
    # warm-up runs the full length: on the H200 a 16-token warm-up left the first full run
    # at 62 ms/token against 29 for the second (the caching allocator growing with the cache)
    measure("dynamic", None, new, 3)
    static = measure("static", "static", new, 3)
    if static.get("error") and device == "cuda":
        measure("static_eager", "static", new, 2, disable_compile=True)
    result["done"] = True
    save()                        # the process exits next, returning its GPU memory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: BENCH_HF_PAYLOAD=... python hf_generate_worker.py OUT.json")
    hf_worker(sys.argv[1])
