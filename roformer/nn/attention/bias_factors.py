"""A logit bias folded into queries and keys, for kernels that add no bias (Pallas splash).

A bias that is a sum of products of a query term and a key term, up to a constant per query
(which softmax ignores), needs no bias input: appended to q and k as extra columns, q.k adds it.
Causal ALiBi (m (j - j0)), Sandwich (sinusoids on both sides, `PosEnc.bias_factors`) and FoX's
key bias (-c_j) have such forms; docs/attention_variants.md measures their precision.

Dimension legend as call.py; R factor columns, E extra columns of q and k.
"""

import jax
import jax.numpy as jnp

# Pieces of a key factor that grows with the position (ALiBi's m (j - j0), FoX's -c_j) in a 16-bit
# compute dtype: three bfloat16 pieces hold 24 significant bits, float32's, and the kernel's
# products and sums run in float32 (splash: preferred_element_type=float32), so the folded bias
# is float32's. One piece would keep 8 bits: a factor x off by up to |x| / 512.
KEY_FACTOR_PIECES = 3


def _split(x, dtype, pieces: int):
  """x (float32) as `pieces` values of `dtype` whose float32 sum is x to float32 precision: each
  what the ones before it left, cut to dtype's significand.

  The cut masks float32's low significand bits, so each piece is exactly a `dtype` value. A
  rounding through `dtype` and back (x - float32(dtype(x))) would be the same numbers, but
  compilers may drop such a round trip as excess precision (XLA's SimplifyFPConversions), which
  would leave one piece. The gradient reaches x through the first piece (the rest are x minus
  their predecessors, whose derivative in x is 0)."""
  drop = 23 - jnp.finfo(dtype).nmant  # float32's significand bits the dtype has not
  keep = jnp.uint32((0xFFFFFFFF >> drop) << drop)
  parts, rest = [], x
  for _ in range(pieces):
    cut = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(rest, jnp.uint32) & keep, jnp.float32
    )
    piece = rest - jax.lax.stop_gradient(rest - cut)  # = cut, with rest's gradient
    parts.append(piece.astype(dtype))
    rest = rest - piece
  return parts


def fold_bias_factors(q_BLHK, k_BSGK, v_BSGK, terms):
  """Queries and keys whose products add the bias of `terms` to q.k: splash's logit bias.

  Args:
    q_BLHK, k_BSGK, v_BSGK: queries (already scaled), keys and values.
    terms: (a [B, L, H, R] or None, b [B, S, H or 1, R]) pairs, float32: bias_ij = sum of a_i . b_j
      (`PosEnc.bias_factors`; FoX's key bias as (None, -c)). A None `a` is ones; its `b` grows with
      the position and in a 16-bit dtype goes in KEY_FACTOR_PIECES pieces, each with a column of
      ones in the queries.

  Returns:
    (q [B, L, H, K + E], k [B, S, G', K + E], v [B, S, G', V]) with E the extra columns; G' = H
    (keys and values repeated over each group's query heads) when a key factor differs per
    query head and G < H, else G.
  """
  B, L, H, _ = q_BLHK.shape
  G = k_BSGK.shape[2]
  dtype = q_BLHK.dtype
  pieces = 1 if jnp.dtype(dtype).itemsize >= 4 else KEY_FACTOR_PIECES
  per_head = any(b.shape[2] != 1 for _, b in terms)
  if per_head and G != H:  # head h = g * R + r reads group g, as the grouped kernels do
    k_BSGK, v_BSGK = (jnp.repeat(x, H // G, axis=2) for x in (k_BSGK, v_BSGK))
    G = H
  q_cols, k_cols = [q_BLHK], [k_BSGK]
  for a_BLHR, b_BSXR in terms:
    b_BSGR = jnp.broadcast_to(b_BSXR, (B, b_BSXR.shape[1], G, b_BSXR.shape[3]))
    if a_BLHR is None:
      parts = _split(b_BSGR, dtype, pieces)
      k_cols += parts
      q_cols += [jnp.ones((B, L, H, b_BSGR.shape[3]), dtype)] * len(parts)
    else:
      q_cols.append(a_BLHR.astype(dtype))
      k_cols.append(b_BSGR.astype(dtype))
  return jnp.concatenate(q_cols, axis=-1), jnp.concatenate(k_cols, axis=-1), v_BSGK
