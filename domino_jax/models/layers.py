"""Building blocks shared by the target and the DFlash drafter: RMSNorm, RoPE, attention, MLP.

Conventions (docs/algorithms.md §1.3):
* RMSNorm computes in float32 and casts back to the input dtype *before* the weight multiply.
* RoPE is half-split ("rotate_half"), tables computed in float32 and cast to the activation dtype.
* Attention: grouped-query (query head ``j`` reads kv head ``j // (nH / nKV)``), scores and
  softmax in float32, probabilities cast back to the value dtype.
* Parameter names mirror Hugging Face (``q_proj/kernel``, ``input_layernorm/weight``) so the
  converters are short tables. Dense kernels are ``[in, out]`` (HF stores ``[out, in]``).
"""

from __future__ import annotations

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from domino_jax.kv_cache import MASK_VALUE  # noqa: F401 (the masked score, used below)
from domino_jax.models.blockwise_attention import attend_blockwise
from domino_jax.pallas import cache_attention as kernel
from domino_jax.pallas.cache_attention_tpu import cache_attention_tpu, tpu_supported
from domino_jax.pallas import check_attention_implementation

Dtype = Any


class RMSNorm(nn.Module):
    """``w * cast(x / rms(x))`` over the last axis; statistics in float32."""

    eps: float = 1e-6
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight.astype(self.dtype) * normed.astype(self.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype: Dtype):
    """cos/sin tables ``[..., head_dim]`` for integer ``positions [...]`` (half-split layout)."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq           # [..., D/2]
    emb = jnp.concatenate([angles, angles], axis=-1)                       # [..., D]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` with tables ``[B, T, D]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
           implementation: str = "xla") -> jax.Array:
    """Grouped-query attention; ``implementation`` picks the code (same maths for all):

    * ``"xla"`` (default): ``jax.nn.dot_product_attention(implementation="xla")``, below;
    * ``"reference"``: :func:`attend_reference`, the einsum;
    * ``"pallas"``: the split-K kernel :func:`domino_jax.pallas.cache_attention.cache_attention`
      (GPU; few query rows over a cache), on a TPU its Mosaic variant
      :func:`~domino_jax.pallas.cache_attention_tpu.cache_attention_tpu`. Fails fast
      (``ValueError`` naming the reason) on another backend or for shapes it does not take;
    * ``"pallas_interpret"``: the same kernel in the Pallas interpreter (CPU tests);
    * ``"auto"``: the kernel on a GPU when it takes the shapes and dtypes, else ``"xla"``
      (with a warning when a GPU falls back; XLA on a TPU, where the kernel is not measured);
    * ``"blockwise"``: flash-style attention in XLA ops
      (:func:`domino_jax.models.blockwise_attention.attend_blockwise`): never materialises
      more than one key block of scores (what long prefill chunks use);
    * ``"cudnn"``: cuDNN flash attention (``jax.nn.dot_product_attention(implementation=
      "cudnn")``, the mask as a bias); GPU, bfloat16/float16 only, fails fast elsewhere.

    The kernel choices (``"pallas"``, ``"pallas_interpret"``, ``"auto"``) take the
    ``"xla"`` path for more than ``MAX_ROWS = 256`` query rows per KV head (``T * nH /
    nKV``: a prefill, not the kernel's job). :func:`resolve_attention` makes the choice.

    Args:
      q: ``[B, T, nH, D]`` queries (already rotated).
      k, v: ``[B, S, nKV, D]`` keys (rotated) and values; ``nH`` a multiple of ``nKV``, query
        head ``j`` reads kv head ``j // (nH / nKV)``.
      visible: bool ``[B, T, S]``; ``True`` where query t may read key s.
    Returns:
      ``[B, T, nH, D]`` in ``v.dtype``. A row with no visible key gets the uniform average of
      all ``S`` values (every score is the same finite :data:`MASK_VALUE`): finite, no NaN.

    Same maths as :func:`attend_reference` (checked in ``tests/test_attention.py``): jax 0.11.2's
    ``_dot_product_attention_xla`` / ``_dot_product_attention_core`` (``jax/_src/nn/
    functions.py``) also splits the query heads into ``[nKV, nH / nKV]`` groups, computes the
    scores with ``preferred_element_type=float32`` (bf16 inputs: ``BF16_BF16_F32`` dot
    algorithm), multiplies by ``float32(1 / sqrt(D))`` (equal to ``float32(D ** -0.5)`` for
    every ``D <= 2048``), masks with ``where(mask, scores, -0.7 * finfo(float32).max)`` (=
    :data:`MASK_VALUE`), takes the softmax in float32, casts the probabilities to the key/value
    dtype and multiplies by ``v`` without a preferred type.

    Why the library call: on GPUs it measured faster than the einsum formulation, most of
    all for multi-query verify, and cuDNN's was slower at 17 queries and not bitwise equal
    (``docs/design.md`` §3). On the CPU the
    bf16 outputs of the test shapes are bitwise equal to the einsum's.

    The library requires ``q``, ``k`` and ``v`` to share one dtype; mixed dtypes (e.g. float32
    queries over a bf16 cache) go to :func:`attend_reference`, which promotes as before.
    """
    path = resolve_attention(implementation, q, k, v)
    if path == "reference":
        return attend_reference(q, k, v, visible)
    if path == "blockwise":
        return attend_blockwise(q, k, v, visible, MASK_VALUE)
    if path == "cudnn":
        out = jax.nn.dot_product_attention(q, k, v, mask=visible.astype(bool)[:, None],
                                           implementation="cudnn")
        return out.astype(v.dtype)
    if path == "pallas_tpu":
        return cache_attention_tpu(q, k, v, visible)
    if path.startswith("pallas"):
        return kernel.cache_attention(q, k, v, visible, interpret=path == "pallas_interpret")
    if not (q.dtype == k.dtype == v.dtype):
        return attend_reference(q, k, v, visible)
    out = jax.nn.dot_product_attention(q, k, v, mask=visible.astype(bool)[:, None],
                                       implementation="xla")
    return out.astype(v.dtype)


def resolve_attention(implementation: str, q: jax.Array, k: jax.Array, v: jax.Array) -> str:
    """The code :func:`attend` runs for ``implementation`` on these inputs: ``"xla"``,
    ``"reference"``, ``"pallas"``, ``"pallas_tpu"`` or ``"pallas_interpret"`` (``k`` one
    layer ``[B, S, nKV, D]``). Raises ``ValueError`` for an unknown name or an explicit kernel request it cannot
    serve; ``"auto"`` falls back to ``"xla"`` (warning on a GPU)."""
    check_attention_implementation(implementation)
    if implementation in ("xla", "reference"):
        return implementation
    if implementation == "blockwise":
        return "blockwise"             # any dtypes (products promote, as the reference)
    if implementation == "cudnn":
        if jax.default_backend() != "gpu":
            raise ValueError(f"attention implementation 'cudnn' needs a GPU (backend: "
                             f"{jax.default_backend()}); use 'blockwise' or 'xla'")
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"attention implementation 'cudnn' takes bfloat16/float16 "
                             f"inputs of one dtype (q {q.dtype}, k {k.dtype}, v {v.dtype}); "
                             "use 'blockwise' or 'xla'")
        return "cudnn"
    if kernel.too_many_rows(q.shape, k.shape):
        return "xla"                    # a prefill: the XLA path by design, for every choice
    reason = kernel.supported(q.shape, k.shape)
    if not (q.dtype == k.dtype == v.dtype):
        reason = f"mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "pallas" and jax.default_backend() == "tpu":
        reason = reason or tpu_supported(q.shape, k.shape)
        if reason is None:
            return "pallas_tpu"
        raise ValueError(f"attention implementation 'pallas' (TPU): {reason}")
    if implementation == "pallas" and not on_gpu:
        reason = f"the Pallas Triton kernel needs a GPU (backend: {jax.default_backend()})"
    if reason is None and implementation == "pallas_interpret":
        return "pallas_interpret"
    if reason is None and on_gpu:
        return "pallas"
    if implementation != "auto":
        raise ValueError(f"attention implementation {implementation!r}: {reason}")
    if on_gpu:
        warnings.warn(f"attention: the Pallas kernel does not take q {q.shape} over k "
                      f"{k.shape} ({reason}); using the XLA path", stacklevel=3)
    return "xla"


def attend_cache_layer(q: jax.Array, keys: jax.Array, values: jax.Array, layer: int,
                       visible: jax.Array, implementation: str = "xla") -> jax.Array:
    """:func:`attend` over layer ``layer`` of a stacked cache ``keys, values [L, B, S, nKV,
    D]`` (``KVCache.keys`` / ``.values``). The Pallas kernel reads the layer in place; the
    XLA and reference paths take the slice ``keys[layer]`` as before."""
    k, v = keys[layer], values[layer]
    path = resolve_attention(implementation, q, k, v)
    if path == "blockwise":            # reads the layer block by block, in place
        return attend_blockwise(q, keys, values, visible, MASK_VALUE, layer=layer)
    if path == "pallas_tpu":
        return cache_attention_tpu(q, keys, values, visible, layer=layer)
    if path.startswith("pallas"):
        return kernel.cache_attention(q, keys, values, visible, layer=layer,
                                      interpret=path == "pallas_interpret")
    return attend(q, k, v, visible, path)


def attend_reference(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Grouped-query attention, plain JAX: the reference :func:`attend` is checked against.

    Same contract as :func:`attend` (``q [B, T, nH, D]``, ``k, v [B, S, nKV, D]``, bool
    ``visible [B, T, S]`` -> ``[B, T, nH, D]`` in ``v.dtype``; a row with no visible key gets
    the uniform average of all values, no NaN). Scores and softmax in float32 (``where`` with
    the finite :data:`MASK_VALUE`), probabilities cast to ``v.dtype``. Also the fallback for
    mixed input dtypes.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv = k.shape[2]
    group = num_heads // num_kv
    q = q.reshape(batch, q_len, num_kv, group, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, q_len, num_heads, head_dim)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``.

    ``fused``: gate and up live in one ``gate_up_proj`` kernel ``[H, 2 I]`` (``[gate | up]``,
    see :mod:`domino_jax.models.fused_layout`): one one-row product instead of two at decode.
    """

    intermediate_size: int
    fused: bool = False
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype,
                                         param_dtype=self.param_dtype, name=name)
        if self.fused:
            gate, up = jnp.split(dense(2 * self.intermediate_size, "gate_up_proj")(x), 2, -1)
        else:
            gate = dense(self.intermediate_size, "gate_proj")(x)
            up = dense(self.intermediate_size, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(nn.silu(gate) * up)


class Attention(nn.Module):
    """Self-attention with optional per-head q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2).

    The module only projects (:meth:`qkv`, :meth:`output`); where keys and values come from
    (a KV cache, the drafter's extra context) is the caller's business.

    ``fused``: q, k and v live in one ``qkv_proj`` kernel ``[H, (nH + 2 nKV) D]`` (``[q | k |
    v]``, see :mod:`domino_jax.models.fused_layout`): one one-row product instead of three.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    qk_norm: bool
    qkv_bias: bool
    eps: float = 1e-6
    fused: bool = False
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16

    def setup(self):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused:
            self.qkv_proj = nn.Dense(q_width + 2 * kv_width, use_bias=self.qkv_bias, **kw)
        else:
            self.q_proj = nn.Dense(q_width, use_bias=self.qkv_bias, **kw)
            self.k_proj = nn.Dense(kv_width, use_bias=self.qkv_bias, **kw)
            self.v_proj = nn.Dense(kv_width, use_bias=self.qkv_bias, **kw)
        self.o_proj = nn.Dense(self.hidden_size, use_bias=False, **kw)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.eps, **kw)
            self.k_norm = RMSNorm(self.eps, **kw)

    def qkv(self, h: jax.Array, positions: jax.Array, q_from: int = 0):
        """Queries, keys (normed, rotated) and values for inputs ``h [B, T, H]``.

        Returns ``q [B, T - q_from, nH, D]`` (queries of rows ``q_from..``: the drafter needs
        keys for its context rows but queries only for its block), ``k, v [B, T, nKV, D]``.
        """
        batch, length, _ = h.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused:
            q, k, v = jnp.split(self.qkv_proj(h), [q_width, q_width + kv_width], axis=-1)
            q = q[:, q_from:]
        else:
            q, k, v = self.q_proj(h[:, q_from:]), self.k_proj(h), self.v_proj(h)
        q = q.reshape(batch, length - q_from, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, k.dtype)
        return apply_rope(q, cos[:, q_from:], sin[:, q_from:]), apply_rope(k, cos, sin), v

    def output(self, attn: jax.Array) -> jax.Array:
        """``o_proj`` of ``attn [B, T, nH, D]`` -> ``[B, T, hidden_size]``."""
        batch, length = attn.shape[:2]
        return self.o_proj(attn.reshape(batch, length, -1))


class DecoderLayerBase(nn.Module):
    """The parts every Qwen3-style decoder layer shares (target and DFlash drafter).

    Subclasses compute ``q`` (and ``k``/``v`` from whatever inputs they attend over) with
    ``self.input_layernorm`` + ``self.self_attn.qkv`` and finish with :meth:`finish`.
    ``config`` needs the geometry fields; ``qk_norm``/``qkv_bias`` default to Qwen3's and
    ``fused_projections`` (the parameter layout) to ``False``.
    """

    config: Any
    dtype: Dtype = jnp.bfloat16
    param_dtype: Dtype = jnp.bfloat16
    attention_impl: str = "xla"     # for attention over a KV cache, see :func:`attend`

    def setup(self):
        c = self.config
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        fused = getattr(c, "fused_projections", False)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, **kw)
        self.self_attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                   c.rope_theta, getattr(c, "qk_norm", True),
                                   getattr(c, "qkv_bias", False), c.rms_norm_eps, fused, **kw)
        self.mlp = MLP(c.intermediate_size, fused, **kw)

    def finish(self, x, q, k, v, visible, cache, layer_index: int,
               key_slots: jax.Array | None = None):
        """Write the new ``k, v`` into ``cache`` (if any, reading back the whole layer, or
        only the slots ``key_slots [B, L]`` when given: a sliding window, ``visible`` then
        ``[B, T, L]`` over those slots), attend, add the residual and the MLP:
        ``-> (x', cache')``.

        Attention over a cache uses ``attention_impl``; without a cache (training, cacheless
        forwards) it is always the XLA path."""
        if cache is not None and key_slots is not None:
            cache = cache.write_layer(layer_index, k, v)
            window_k, window_v = cache.gather_layer(layer_index, key_slots)
            attn = attend(q, window_k, window_v, visible, self.attention_impl)
        elif cache is not None:
            cache = cache.write_layer(layer_index, k, v)
            attn = attend_cache_layer(q, cache.keys, cache.values, layer_index, visible,
                                      self.attention_impl)
        else:
            attn = attend(q, k, v, visible)
        x = x + self.self_attn.output(attn)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache
