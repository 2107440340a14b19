"""CoPE (Golovneva et al. 2024): contextual positions counted by gates of the queries and keys."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.base import PosEnc
from roformer.posenc.config import PosEncConfig, max_len_field, param
from roformer.posenc.registry import register


def cope_positions(q_BLHK, k_BSGK, mask_BLS):
  """Contextual positions p_ij = sum_{t=j}^{i} sigmoid(q_i . k_t / sqrt(K)), float32 [B, H, L, S].

  The gates read the scaled logits, as the paper's listing and code do
  (facebookresearch/RAM, projects/cope/src/cope/context_position.py: `sigmoid(gate_logits /
  sqrt(head_dim))`), and masked keys (after the query, other documents) get gate 0: the code
  multiplies the gates by the mask. The sum runs over keys from j to the last allowed one, i.e.
  a reversed cumulative sum along the key axis (keys in sequence order).
  """
  B, L, H, K = q_BLHK.shape
  G = k_BSGK.shape[2]
  q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
  logits_BGRLS = jnp.einsum(
    "blgrk,bsgk->bgrls", q_BLGRK, k_BSGK, preferred_element_type=jnp.float32
  ) / math.sqrt(K)
  gates_BHLS = jax.nn.sigmoid(logits_BGRLS).reshape(B, H, L, -1) * mask_BLS[:, None]
  return jnp.flip(jnp.cumsum(jnp.flip(gates_BHLS, -1), axis=-1), -1)


def cope_logits(q_BLHK, pos_BHLS, pos_emb_PK):
  """q_i . e[p_ij] with e[p] linearly interpolated between integer positions, float32 [B, H, L, S].

  Positions are clamped to P - 1 (P = number of embeddings). q . e[k] is computed once per
  integer k and then interpolated: (p - floor p) z[ceil p] + (1 - p + floor p) z[floor p].
  """
  P = pos_emb_PK.shape[0]
  pos_BHLS = jnp.minimum(pos_BHLS, P - 1)
  z_BHLP = jnp.einsum(
    "blhk,pk->bhlp", q_BLHK, pos_emb_PK.astype(q_BLHK.dtype), preferred_element_type=jnp.float32
  )
  floor_BHLS = jnp.floor(pos_BHLS)
  w_BHLS = pos_BHLS - floor_BHLS
  z_floor = jnp.take_along_axis(z_BHLP, floor_BHLS.astype(jnp.int32), axis=-1)
  z_ceil = jnp.take_along_axis(z_BHLP, jnp.ceil(pos_BHLS).astype(jnp.int32), axis=-1)
  return z_ceil * w_BHLS + z_floor * (1.0 - w_BHLS)


@register("cope")
class Cope(PosEnc):
  """CoPE: a_ij = q_i . (k_j + e[p_ij]) / sqrt(K), p_ij = sum_{t=j..i} sigmoid(q_i . k_t / sqrt(K)).

  Positions count the keys whose gate is open between j and the query, so they depend on the
  content; fractional positions interpolate the learned embeddings e[0..P-1] (P =
  posenc.cope_npos_max; 0 there means data.seq_len + 1, the default of the paper's code, block
  size + 1, so no position the training length can reach is clamped). The table is
  zero-initialised as in the paper's code, so training starts position-free like NoPE. It is one
  [P, K] table shared by the heads, as in the code, and one per layer (`per_layer`), as the code
  by default (its `--cope-shared` is off); posenc.cope_shared gives every layer the same table.
  Causal decoders only: the count runs from the key up to the query.

  Why a fourth hook. The three hooks of the contract see positions (embed, bias) or act on q
  and k position by position (rotate); none sees a query and a key together. CoPE's bias at
  (i, j) needs q_i . k_t for every t between j and i, then the mask, then a cumulative sum over
  the keys. So it gets `content_bias(q, k, mask)`, which the dense kernel adds to the scaled
  logits; the default (PosEnc.content_bias = None) adds nothing. The chunked kernel refuses it:
  the cumulative sum over a query's keys crosses key blocks, which its online softmax visits
  one at a time (a two-pass kernel could carry the sums, at the cost of scoring every block
  twice); `auto` therefore picks the dense kernel for CoPE at every length.
  """

  @dataclasses.dataclass(frozen=True)
  class Fields(PosEnc.Fields):
    """posenc.* fields of this encoding."""

    max_len: int = max_len_field()
    cope_npos_max: int = param(
      0,
      "number of learned position embeddings; contextual positions clamp to it - 1. 0 = "
      "data.seq_len + 1, the default of the paper's code (the block size + 1)",
      reshapes=True,
    )
    cope_shared: bool = param(
      False,
      "one position table shared by every layer instead of one per layer (the paper's code: "
      "--cope-shared, off by default)",
      reshapes=True,
    )

  causal_only = True
  causal_reason = "its positions count the keys from j up to the query"
  reads_positions = False  # its positions come from the gates, never from the token positions

  def __init__(self, cfg: PosEncConfig, *, head_dim: int, **kwargs):
    super().__init__(cfg, head_dim=head_dim, **kwargs)
    # 0: a run config sets data.seq_len + 1; a PosEncConfig used directly has only max_len.
    self.npos = cfg.cope_npos_max or cfg.max_len + 1
    init = nnx.with_partitioning(nnx.initializers.zeros, (None, "kv"))
    self.pos_emb = nnx.Param(init(jax.random.key(0), (self.npos, head_dim), self.param_dtype))

  @classmethod
  def resolve_defaults(cls, values: dict, *, train_len: int) -> dict:
    # The pretraining length, so a fine-tune at another length keeps the table's shape.
    if not values.get("cope_npos_max", 0):
      values = {**values, "cope_npos_max": train_len + 1}
    return values

  @classmethod
  def per_layer(cls, cfg: PosEncConfig) -> bool:
    return not cfg.cope_shared

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    super().check_config(cfg, causal=causal, head_dim=head_dim)
    if cfg.cope_npos_max == 1 or cfg.cope_npos_max < 0:
      raise ValueError(
        f"posenc.cope_npos_max={cfg.cope_npos_max} must be >= 2, or 0 (= data.seq_len + 1)"
      )

  def content_bias(self, q_BLHK, k_BSGK, mask_BLS):
    """float32 [B, H, L, S] added to the scaled logits: q_i . e[p_ij] / sqrt(K).

    Args:
      q_BLHK: queries [B, L, H, K] (after `rotate`).
      k_BSGK: keys [B, S, G, K] (after `rotate`).
      mask_BLS: bool, which keys each query may attend to (causal, segments, window).
    """
    pos_BHLS = cope_positions(q_BLHK, k_BSGK, mask_BLS)
    return cope_logits(q_BLHK, pos_BHLS, self.pos_emb[...]) / math.sqrt(q_BLHK.shape[-1])
