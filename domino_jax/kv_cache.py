"""Fixed-capacity KV cache: a pytree of ``[layers, batch, capacity, kv_heads, head_dim]`` buffers.

Contract
--------
* ``lengths [batch]`` (int32) is the number of *committed* slots per row; slots ``>= length``
  hold stale data that no query can see and that later writes overwrite (no copies).
* A forward over ``T`` new tokens writes their K/V at slots ``length .. length + T - 1`` of
  each row (:meth:`KVCache.write_layer`), without moving ``lengths``. The caller commits
  with :meth:`KVCache.advance` (accepted tokens) or leaves ``lengths`` alone (discard).
* :meth:`KVCache.rollback` moves lengths back; :meth:`KVCache.gather_path` compacts the
  accepted path of a tree verify into place.
* Keys are stored after RoPE (and after the q/k norm), exactly what attention reads.
Donate the cache to jitted steps so XLA updates the buffers in place.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


# The attention score of a key a query may not see: finite, so a row that sees no key at
# all gets a uniform average instead of NaN (the value jax.nn.dot_product_attention uses).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

SLOT_ALIGN = 64   # default capacities are multiples of this (the attention kernel's key chunk)


def align_slots(slots: int, multiple: int = SLOT_ALIGN) -> int:
    """``slots`` rounded up to a multiple of ``multiple``: cache capacities chosen by the
    library (not by the user) are aligned so the Pallas attention kernel
    (:mod:`domino_jax.pallas.cache_attention`) reads whole 64-slot chunks."""
    return -(-int(slots) // multiple) * multiple


@flax.struct.dataclass
class KVCache:
    keys: jax.Array      # [L, B, C, nKV, D]
    values: jax.Array    # [L, B, C, nKV, D]
    lengths: jax.Array   # [B] int32, committed slots per row

    @classmethod
    def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    def write_layer(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> "KVCache":
        """Write ``k_new, v_new [B, T, nKV, D]`` at slots ``lengths[b] + t`` of ``layer``.

        Writes past the capacity are dropped (callers check capacity before any compute).
        """
        batch, new_len = k_new.shape[:2]
        rows = jnp.arange(batch)[:, None]
        slots = self.lengths[:, None] + jnp.arange(new_len)[None, :]
        keys = self.keys.at[layer, rows, slots].set(k_new.astype(self.keys.dtype), mode="drop")
        values = self.values.at[layer, rows, slots].set(v_new.astype(self.values.dtype), mode="drop")
        return self.replace(keys=keys, values=values)

    def gather_layer(self, layer: int, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, L, nKV, D]`` of ``layer`` at ``slots [B, L]`` (clipped to
        the capacity: callers mask slots ``>= capacity``), e.g. a sliding window."""
        rows = jnp.arange(self.batch)[:, None]
        slots = jnp.minimum(slots, self.capacity - 1)
        return self.keys[layer, rows, slots], self.values[layer, rows, slots]

    def advance(self, n: jax.Array) -> "KVCache":
        """Commit ``n [B]`` (or a scalar) more slots per row."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def rollback(self, lengths: jax.Array) -> "KVCache":
        """Set the committed lengths to ``lengths [B]`` (must not exceed the current ones)."""
        return self.replace(lengths=jnp.minimum(self.lengths, jnp.asarray(lengths, jnp.int32)))

    def gather_path(self, path: jax.Array, path_len: jax.Array) -> "KVCache":
        """Compact a tree's accepted path into place and commit it.

        Args:
          path: ``[B, P]`` int32 offsets (relative to ``lengths``) of the slots to keep, in
            path order (e.g. ``[0, 3, 7, ...]``: root, then accepted nodes); entries past
            ``path_len`` are ignored.
          path_len: ``[B]`` number of valid entries.
        Slot ``lengths + i`` receives slot ``lengths + path[i]``; then ``lengths += path_len``.
        """
        batch, plen = path.shape
        rows = jnp.arange(batch)[:, None]
        src = self.lengths[:, None] + path
        dst = self.lengths[:, None] + jnp.arange(plen)[None, :]
        valid = jnp.arange(plen)[None, :] < path_len[:, None]
        dst = jnp.where(valid, dst, self.capacity)  # out of range -> dropped
        src = jnp.minimum(src, self.capacity - 1)
        gathered_k = self.keys[:, rows, src]         # [L, B, P, nKV, D]
        gathered_v = self.values[:, rows, src]
        keys = self.keys.at[:, rows, dst].set(gathered_k, mode="drop")
        values = self.values.at[:, rows, dst].set(gathered_v, mode="drop")
        return KVCache(keys, values, self.lengths + path_len.astype(jnp.int32))


def key_visibility(lengths: jax.Array, new_len: int, num_keys: int,
                   block_mask: jax.Array | None = None) -> jax.Array:
    """Which key slots each new query may read: bool ``[B, new_len, num_keys]``.

    Query ``t`` of row ``b`` sits at slot ``lengths[b] + t``. It sees every committed slot
    (``< lengths[b]``) and, among the new slots, those allowed by ``block_mask [B, T, T]``
    (``block_mask[b, t, u]``: query t reads new key u). ``None`` means causal.
    """
    key_slot = jnp.arange(num_keys)[None, None, :]
    rel = key_slot - lengths[:, None, None]                        # offset inside the new block
    query = jnp.arange(new_len)[None, :, None]
    committed = rel < 0
    if block_mask is None:
        in_block = (rel >= 0) & (rel <= query)
    else:
        in_range = (rel >= 0) & (rel < new_len)
        rel_c = jnp.clip(rel, 0, new_len - 1)
        rel_c = jnp.broadcast_to(rel_c, (block_mask.shape[0], new_len, num_keys))
        in_block = in_range & jnp.take_along_axis(block_mask, rel_c, axis=2)
    return committed | in_block
