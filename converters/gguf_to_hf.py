"""Llama-architecture GGUF -> HF ``LlamaForCausalLM`` folder (float32), numpy only (no torch).

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out_dir")

writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, HF names and
torch ``[out, in]`` layout, as in :data:`converters.hf_target.TARGET_RULES`), and
``tokenizer.json`` / ``tokenizer_config.json`` (incl. the GGUF's ``tokenizer.chat_template``)
+ special tokens, so ``AutoTokenizer.from_pretrained(out_dir)`` and
``converters.hf_target.load_target(out_dir)`` both work.

Tensors are dequantized with ``gguf.quants.dequantize``. llama.cpp's converter permutes the
rows of ``q_proj``/``k_proj`` (``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``: HF's
rotate-half RoPE layout -> GGML's interleaved pairs); :func:`unpermute_qk` inverts it exactly,
as transformers' own GGUF loader does.

The tokenizer is built by transformers' GGUF tokenizer converter
(``transformers.integrations.gguf.gguf_tokenizer_mapping``), fed from ``gguf.GGUFReader``:
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` itself needs torch in transformers 5.x
(its GGUF reader module imports torch), and the demo setup must not.
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")

# Bump when the output of convert_gguf changes, so cached demo folders get rebuilt.
CONVERTER_VERSION = 1


class GGUFConversionError(ValueError):
    """A GGUF we cannot convert; the message names the file and the field/tensor."""


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF -> GGUF) on the rows of a ``[out, in]`` weight.
    ``n_head`` is the head count of that projection (kv heads for k_proj)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of :func:`permute_qk` (GGUF -> HF)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_hf_name(name: str) -> str | None:
    """HF tensor name of a llama GGUF tensor name (``None``: not a model weight)."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = _BLK.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_metadata(reader, where: str) -> dict:
    """The scalar/string metadata (arrays of tokens etc. are left out)."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key in ("tokenizer.ggml.tokens",
                                                         "tokenizer.ggml.merges",
                                                         "tokenizer.ggml.token_type",
                                                         "tokenizer.ggml.scores"):
            continue
        try:
            out[key] = f.contents()
        except Exception:  # an exotic field type we do not need
            pass
    return out


def hf_config_from_gguf(reader, where: str) -> dict:
    """``config.json`` for ``LlamaForCausalLM`` from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"{where}: general.architecture={arch!r}; only 'llama' GGUFs "
                                  "are supported")

    def req(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise GGUFConversionError(f"{where}: missing metadata llama.{key}")
        return v

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFConversionError(f"{where}: llama.rope.dimension_count={rope_dim} != head_dim "
                                  f"{head_dim} (partial RoPE is not supported)")
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise GGUFConversionError(f"{where}: llama.rope.scaling.type="
                                  f"{_field(reader, 'llama.rope.scaling.type')!r} is not supported")
    if _field(reader, "llama.expert_count"):
        raise GGUFConversionError(f"{where}: mixture-of-experts GGUFs are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        if tokens is None:
            raise GGUFConversionError(f"{where}: neither llama.vocab_size nor tokenizer tokens")
        vocab = len(tokens.data)
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(req("feed_forward_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        v = _field(reader, gguf_key)
        if v is not None:
            config[hf_key] = int(v)
    # float32 metadata (e.g. eps 1e-5 stored as 9.99999974e-06): round to the float32 value's
    # shortest repr so the config reads like the original HF one.
    config["rms_norm_eps"] = float(np.format_float_positional(np.float32(config["rms_norm_eps"]),
                                                              unique=True))
    return config


def dequantized_tensors(reader, config: dict, where: str) -> dict[str, np.ndarray]:
    """HF-named float32 tensors in torch ``[out, in]`` layout, Q/K rows un-permuted."""
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    unknown = []
    for t in reader.tensors:
        hf = gguf_hf_name(t.name)
        if hf is None:
            unknown.append(t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGML ne order -> numpy row-major
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if hf.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, kv_heads)
        out[hf] = np.ascontiguousarray(w)
    # rope_freqs etc. would change the math; anything unknown is an error, not silently dropped
    if unknown:
        raise GGUFConversionError(f"{where}: unknown tensors {sorted(unknown)[:8]}")
    return out


def _tokenizer_dict(reader) -> tuple[dict, dict]:
    """(tokenizer_dict, tokenizer_config) as transformers' ``get_gguf_tokenizer`` makes them,
    read with ``gguf.GGUFReader`` instead of transformers' torch-importing reader."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                       _SPECIAL_TOKENS)

    meta = {}
    for key in reader.fields:
        if key.startswith("tokenizer."):
            try:
                meta[key] = reader.fields[key].contents()
            except Exception:
                pass
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, tokenizer_config


def build_tokenizer(reader, where: str):
    """A ``PreTrainedTokenizerFast`` built from the GGUF's tokenizer metadata, no torch."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as e:
        # Older transformers (e.g. 5.17) lack this converter: accept a tokenizer folder
        # converted elsewhere from the same GGUF (tokenizer.json + tokenizer_config.json).
        prebuilt = os.environ.get("DOMINO_JAX_TOKENIZER_DIR")
        if prebuilt:
            return AutoTokenizer.from_pretrained(prebuilt)
        raise GGUFConversionError(
            f"{where}: this transformers has no GGUF tokenizer converter ({e}); upgrade "
            "transformers, or set DOMINO_JAX_TOKENIZER_DIR to a tokenizer folder converted "
            "from the same GGUF") from e

    arch = _field(reader, "general.architecture")
    tokenizer_dict, tokenizer_config = _tokenizer_dict(reader)
    if "tokens" not in tokenizer_dict:
        raise GGUFConversionError(f"{where}: no tokenizer.ggml.tokens")
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    kwargs = {k: v for k, v in {**tokenizer_config, **extra}.items() if v is not None}
    if "chat_template" not in kwargs:
        raise GGUFConversionError(f"{where}: no tokenizer.chat_template")
    kwargs.setdefault("model_max_length", int(_field(reader, f"{arch}.context_length", 2048)))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def convert_gguf(gguf_path: str, out_dir: str, verbose: bool = False) -> dict:
    """Convert; returns the config dict written to ``out_dir/config.json``."""
    import gguf

    from converters.table import write_tensors

    t0 = time.perf_counter()
    where = str(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    config = hf_config_from_gguf(reader, where)
    tensors = dequantized_tensors(reader, config, where)
    expected = 2 + 9 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    if len(tensors) != expected:
        raise GGUFConversionError(f"{where}: {len(tensors)} model tensors, expected {expected}")
    emb = tensors["model.embed_tokens.weight"]
    if emb.shape != (config["vocab_size"], config["hidden_size"]):
        raise GGUFConversionError(f"{where}: token_embd is {emb.shape}, config says "
                                  f"({config['vocab_size']}, {config['hidden_size']})")
    os.makedirs(out_dir, exist_ok=True)
    write_tensors(tensors, out_dir)
    del tensors
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    tok = build_tokenizer(reader, where)
    tok.save_pretrained(out_dir)
    # transformers 5 writes the template to chat_template.jinja; keep a copy inline in
    # tokenizer_config.json too (older readers and humans look there).
    cfg_file = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_file) as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = tok.chat_template
    tok_cfg.setdefault("add_bos_token", bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))
    with open(cfg_file, "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
    if verbose:
        print(f"converted {where} -> {out_dir} in {time.perf_counter() - t0:.1f}s")
    return config


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m converters.gguf_to_hf FILE.gguf OUT_DIR")
    convert_gguf(sys.argv[1], sys.argv[2], verbose=True)
