"""Relative position biases added to the attention logits: ALiBi and T5's bucketed bias.

Both are computed from the positions of any block of queries and keys, so a blockwise kernel
never materialises an L x S bias. Biases are float32 [B, H, L, S].
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.posenc.base import PosEnc, check_positions
from roformer.posenc.config import PosEncConfig, param
from roformer.posenc.registry import register


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi head slopes (Press et al. 2022; fairseq `get_slopes`).

  For n a power of two the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8).
  Otherwise, with p the largest power of two below n, they are the p slopes of p heads followed
  by every other slope of 2p heads, the first n - p of them.

  Returns:
    float32 [num_heads].
  """
  return jnp.asarray(_alibi_slopes_np(num_heads))


def _alibi_slopes_np(num_heads: int) -> np.ndarray:
  # numpy, not jnp: under jit or nnx.eval_shape (sharded init, restore) a jnp array would be a
  # tracer, and the module needs the slopes as concrete constants.
  if num_heads < 1:
    raise ValueError(f"alibi_slopes needs num_heads >= 1, got {num_heads}")

  def power_of_two_slopes(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))  # = 2^(-8/n), written as in the paper's code
    return [start ** (k + 1) for k in range(n)]

  p = 2 ** math.floor(math.log2(num_heads))
  slopes = power_of_two_slopes(p)
  if p != num_heads:
    slopes += power_of_two_slopes(2 * p)[0::2][: num_heads - p]
  return np.asarray(slopes, np.float32)


@register("alibi")
class Alibi(PosEnc):
  """ALiBi: a per-head linear penalty on query-key distance.

  Decoder: -m (qpos - kpos), the paper's bias (keys after the query are masked by attention,
  so their positive values never count; softmax makes it equal to fairseq's m * kpos form).
  Encoder: -m |qpos - kpos|. The paper defines no bidirectional form; this is the symmetric
  one of x-transformers and gpt-neox, which penalises distance equally in both directions.

  The paper's models are fairseq's, whose token embeddings are N(0, 1/d) times sqrt(d).
  """

  paper_embed_scale = "sqrt_d"

  def __init__(self, cfg: PosEncConfig, *, num_heads: int, **kwargs):
    super().__init__(cfg, num_heads=num_heads, **kwargs)
    # Python floats, so the module holds no array state (slopes are constants, not parameters).
    self.slopes = tuple(float(m) for m in _alibi_slopes_np(num_heads))

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    distance_BLS = (qpos_BL[:, :, None] - kpos_BS[:, None, :]).astype(jnp.float32)
    if not self.causal:
      distance_BLS = jnp.abs(distance_BLS)
    slopes_1H11 = jnp.asarray(self.slopes, jnp.float32)[None, :, None, None]
    return -slopes_1H11 * distance_BLS[:, None, :, :]

  @classmethod
  def has_bias_factors(cls, *, causal: bool) -> bool:
    return causal  # |i - j| is no product of a query and a key term

  def bias_factors(self, qpos_BL, kpos_BS):
    """Decoder: -m (i - j) = m (j - j0) - m (i - j0), of which -m (i - j0) is the same for all
    of query i's keys: the key factor m (j - j0) per head (float32 [B, S, H, 1]), j0 each row's
    first key position (positions far from 0 keep the factor small). None for an encoder."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    if not self.causal:
      return None
    slopes_11H1 = jnp.asarray(self.slopes, jnp.float32)[None, None, :, None]
    offset_BS = (kpos_BS - kpos_BS[:, :1]).astype(jnp.float32)
    return None, offset_BS[:, :, None, None] * slopes_11H1


def t5_relative_bucket(
  relative_position: jax.Array,
  *,
  bidirectional: bool,
  num_buckets: int = 32,
  max_distance: int = 128,
) -> jax.Array:
  """T5's bucket of a relative position key_pos - query_pos (flaxformer's formula).

  Bidirectional: half the buckets for keys after the query, half for the rest. In each half,
  the first half of the buckets are exact distances and the rest are logarithmically spaced up
  to max_distance; every distance beyond shares the last bucket. Causal: all buckets describe
  keys at or before the query; keys after it fall in bucket 0.

  Args:
    relative_position: integer array, key position - query position.
    bidirectional: encoder (True) or causal decoder (False) bucketing.
    num_buckets, max_distance: as T5 (defaults 32 and 128).

  Returns:
    int32 buckets in [0, num_buckets), the shape of relative_position.
  """
  n = -jnp.asarray(relative_position).astype(jnp.int32)
  ret = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  # float32 with eps inside the log as flaxformer, so exact powers land in the upper bucket.
  log_ratio = jnp.log(n.astype(jnp.float32) / max_exact + jnp.finfo(jnp.float32).eps)
  large = max_exact + (
    log_ratio / jnp.log(jnp.float32(max_distance / max_exact)) * (num_buckets - max_exact)
  ).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return ret + jnp.where(n < max_exact, n, large)


@register("t5")
class T5Bias(PosEnc):
  """T5's learned relative bias: one scalar per (head, bucket) of key_pos - query_pos.

  One instance (one table) serves every layer, as in T5. Buckets are bidirectional for an
  encoder and causal for a decoder. T5's token embeddings are N(0, 1) and unscaled, and its tied
  output layer first multiplies by d^-0.5: the forward pass of "sqrt_d" (N(0, 1/d) times sqrt(d)).
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    t5_num_buckets: int = param(32, "number of relative-position buckets", reshapes=True)
    t5_max_distance: int = param(128, "distance beyond which all positions share the last bucket")

  paper_embed_scale = "sqrt_d"

  def __init__(self, cfg: PosEncConfig, *, num_heads: int, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, num_heads=num_heads, rngs=rngs, **kwargs)
    # t5x's initialiser for the relative-attention table.
    init = nnx.with_partitioning(
      nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform"), ("heads", None)
    )
    self.table = nnx.Param(init(rngs.params(), (num_heads, cfg.t5_num_buckets), self.param_dtype))

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.t5_num_buckets < 4:
      raise ValueError(f"posenc.t5_num_buckets={cfg.t5_num_buckets} must be >= 4")
    if cfg.t5_max_distance <= cfg.t5_num_buckets // 2:
      raise ValueError(
        f"posenc.t5_max_distance={cfg.t5_max_distance} must be > posenc.t5_num_buckets // 2 "
        f"= {cfg.t5_num_buckets // 2} (the exact buckets end there)"
      )

  def bias(self, qpos_BL, kpos_BS):
    """float32 [B, H, L, S] for integer positions qpos [B, L] and kpos [B, S]."""
    check_positions(qpos_BL, "qpos_BL")
    check_positions(kpos_BS, "kpos_BS")
    bucket_BLS = t5_relative_bucket(
      kpos_BS[:, None, :] - qpos_BL[:, :, None],
      bidirectional=not self.causal,
      num_buckets=self.cfg.t5_num_buckets,
      max_distance=self.cfg.t5_max_distance,
    )
    table_HN = self.table[...].astype(jnp.float32)
    return jnp.moveaxis(jnp.take(table_HN, bucket_BLS, axis=1), 0, 1)
