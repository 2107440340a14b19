"""The positional-encoding interface: identity hooks (embed, prepare + rotate, bias).

Legend: B batch, L query length, S key length, H query heads, G key/value heads, K head dim,
D model dim.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.posenc.config import PosEncConfig


class PosEnc(nnx.Module):
  """Base class: every hook is the identity, so a subclass overrides only the sites it acts at.

  The model creates one instance, calls `embed` once on the token embeddings, calls `prepare`
  once per forward pass (or decode step) on all key positions, and hands the instance and the
  prepared state to every attention layer, which calls `rotate` and `bias` unconditionally. An
  encoding with parameters in every layer (`per_layer`: CoPE, FIRE) has an instance per layer,
  which that layer uses instead; the model's own is then parameter-free.

  Class attributes answer what other code asks of an encoding (never `kind == ...` elsewhere):
    paper_embed_scale: the token-embedding scale its paper trained with, `model.embed_scale="auto"`
      ("none": BERT's N(0, 0.02^2) table; "sqrt_d": N(0, 1/d) times sqrt(d), Vaswani / fairseq).
    accepts_rope_scaling: whether a RoPE context-extension scaling applies to it.
    causal_only: whether it needs a causal decoder (`check_config` refuses an encoder, giving
      `causal_reason`).
    decays_parameters: whether its parameters get weight decay as its paper trained them.
    paper_eval_window: the attention its paper evaluated long inputs with: "none" (full causal
      attention) or "blockwise" (xPos's blockwise causal attention at the training length);
      evaluation labels a curve run without it.
    reads_positions: whether its output depends on the token positions at all (NoPE's and CoPE's
      do not, so `posenc.randomize_max` would change nothing and is refused).
  """

  @dataclasses.dataclass(frozen=True)
  class Fields:
    """The encoding's own posenc.* fields, each declared with `param(default, doc)`; a subclass
    extends its parent's (`class Fields(Rope.Fields)`). The registry adds them to the posenc
    config group and reads them as `cfg.<name>` (`PosEncConfig`)."""

  paper_embed_scale = "none"
  accepts_rope_scaling = False
  causal_only = False
  causal_reason = ""
  decays_parameters = False
  paper_eval_window = "none"
  reads_positions = True

  def __init__(
    self,
    cfg: PosEncConfig,
    *,
    num_heads: int,
    head_dim: int,
    emb_dim: int,
    causal: bool,
    num_kv_heads: int = 0,
    param_dtype=jnp.float32,
    embed_init_std: float = 0.02,
    rngs: nnx.Rngs,
  ):
    del rngs  # only encodings with parameters draw from it
    self.embed_init_std = embed_init_std  # std of tables added to the token embeddings
    self.cfg = cfg
    self.num_heads = num_heads
    # Key/value heads G (0 = num_heads): the heads of the keys `rotate` receives.
    self.num_kv_heads = num_kv_heads or num_heads
    self.head_dim = head_dim
    self.emb_dim = emb_dim
    self.causal = causal
    self.param_dtype = jnp.dtype(param_dtype)

  @classmethod
  def resolve_defaults(cls, values: dict, *, train_len: int) -> dict:
    """The posenc.* values of a run with this encoding's run-dependent defaults filled in.

    Called at the config boundary on the plain values (before they are checked), for every
    encoding a layer of the run uses. `train_len` is the pretraining length: the data.seq_len
    of the train.init_from run (or the Hugging Face decoder's max_position_embeddings) when
    there is one, else this run's data.seq_len. Returns `values` (here unchanged).
    """
    del train_len
    return values

  @classmethod
  def check_config(cls, cfg: PosEncConfig, *, causal: bool, head_dim: int) -> None:
    """Raises ValueError for settings this encoding cannot honour (see `validate_posenc`)."""
    del cfg, causal, head_dim

  @classmethod
  def unsupported_length(cls, cfg: PosEncConfig, length: int) -> str | None:
    """Why this encoding cannot run sequences of `length` positions (e.g. a learned table too
    short), or None. Randomized training positions reach posenc.randomize_max - 1, so a run
    config asks about max(data.seq_len, posenc.randomize_max)."""
    del cfg, length
    return None

  @classmethod
  def per_layer(cls, cfg: PosEncConfig) -> bool:
    """Whether every attention layer gets an instance of its own (its own parameters) instead of
    the model's one. Only encodings that act through `bias` or `content_bias` alone can be per
    layer: the model still calls `embed` and `prepare` once, on a parameter-free instance."""
    del cfg
    return False

  @classmethod
  def rotated_dim(cls, cfg: PosEncConfig, head_dim: int) -> int:
    """The width of each query and key head after `rotate`: the key width of the attention
    kernels and of the decoding cache. head_dim (values keep it) for every encoding but those
    that map a head to more dims (PoPE: 2 * head_dim)."""
    del cfg
    return head_dim

  @classmethod
  def acts_on_logits(cls) -> bool:
    """Whether the encoding adds a bias to attention logits (attention kinds without logits,
    such as linear attention, cannot honour it)."""
    return cls.bias is not PosEnc.bias

  @classmethod
  def has_bias_factors(cls, *, causal: bool) -> bool:
    """Whether `bias_factors` gives this encoding's bias as a low-rank product (kernels that add
    no bias, such as splash, then fold it into the queries and keys)."""
    del causal
    return False

  def layer(self, i: int) -> "PosEnc":
    """The encoding layer i uses: this one, unless a per-layer pattern (`posenc.layers`) says
    otherwise."""
    del i
    return self

  def layer_state(self, state: Any, i: int) -> Any:
    """Layer i's part of `prepare`'s state: all of it, unless a per-layer pattern splits it."""
    del i
    return state

  def embed(self, x_BLD: jax.Array, pos_BL: jax.Array) -> jax.Array:
    """Adds absolute position information to token embeddings [B, L, D] (identity here)."""
    del pos_BL
    return x_BLD

  def prepare(self, kpos_BS: jax.Array) -> Any:
    """The rotary state (e.g. frequencies and scales) of one forward pass or decode step.

    `rotate` needs state that depends on all the keys that meet in one attention (dynamic NTK
    reads the current length, xPos a centre). The model computes it here once, from every key
    position of the pass, and hands it to every layer; a layer may then rotate any subset of
    keys (a block, a cache, a window) consistently. The state may depend on the positions only
    through each row's minimum and maximum, so a decode step describes the whole sequence so
    far by a [B, 2] array (first position, current position).

    Args:
      kpos_BS: int key positions [B, S] of the whole pass.

    Returns:
      A pytree, or None for encodings that do not rotate (here).
    """
    del kpos_BS
    return None

  def rotate(
    self,
    q_BLHK: jax.Array,
    k_BSGK: jax.Array,
    qpos_BL: jax.Array,
    kpos_BS: jax.Array,
    state: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Transforms queries [B, L, H, K] and keys [B, S, G, K] by position (identity here).

    `state` is `prepare`'s result; None means `prepare(kpos_BS)` (the keys given are all keys).
    Both come back `rotated_dim` wide (K here).
    """
    del qpos_BL, kpos_BS, state
    return q_BLHK, k_BSGK

  def position_pieces(self, qpos_BL: jax.Array, kpos_BS: jax.Array) -> tuple | None:
    """Piecewise positions of a block of (query, key) pairs, or None (here: `rotate`'s own).

    A training-free context extension (`roformer.posenc.extension`) remaps the relative
    position of each pair, which no rotation by absolute positions can express: the kernel then
    gets unrotated queries and keys and scores each piece (query rotation positions, key
    rotation positions, where) with `rotate` at those positions.
    """
    del qpos_BL, kpos_BS
    return None

  def extends_positions(self) -> bool:
    """Whether `position_pieces` replaces the plain rotation (queries and keys then reach the
    kernel unrotated)."""
    return False

  def bias(self, qpos_BL: jax.Array, kpos_BS: jax.Array) -> jax.Array | None:
    """Float32 attention-logit bias [B, H, L, S] for any block of positions, or None."""
    del qpos_BL, kpos_BS
    return None

  def bias_factors(self, qpos_BL: jax.Array, kpos_BS: jax.Array):
    """`bias` as a product of query and key factors, for kernels that add no bias, or None.

    Returns (a [B, L, H, R] or None, b [B, S, H or 1, R]), float32, with
    bias[b, h, i, j] = sum_r a[b, i, h, r] b[b, j, h, r] + c[b, h, i] on every pair the attention
    allows, for some c constant over each query's keys (softmax ignores it). A None `a` stands for
    ones: a bias of the key alone (plus c), which may grow with the position (ALiBi's m (j - j0)).
    """
    del qpos_BL, kpos_BS
    return None

  def constrain(self) -> None:
    """Projects the parameters back onto their allowed set; the train step calls it on every
    encoding module after each optimizer update (identity here; KERPLE clamps its own)."""

  # Fourth hook, for content-dependent encodings (CoPE): a method
  # `content_bias(q_BLHK, k_BSGK, mask_BLS) -> float32 [B, H, L, S]` added to the scaled logits.
  # None (the default) means the encoding has none; only the dense kernel can call it.
  content_bias = None


def check_positions(
  pos: jax.Array, name: str, leading: tuple[int, ...] | None = None, *, fractional: bool = False
) -> None:
  """Raises ValueError unless `pos` is an integer [B, L] array (equal to `leading` when given);
  with `fractional`, float positions pass too."""
  if pos.ndim != 2 or (leading is not None and tuple(pos.shape) != tuple(leading)):
    want = "[B, L]" if leading is None else f"[B, L] = {tuple(leading)}"
    raise ValueError(f"{name} must have shape {want}, got {tuple(pos.shape)}")
  if fractional and jnp.issubdtype(pos.dtype, jnp.floating):
    return
  if not jnp.issubdtype(pos.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integer positions, got dtype {pos.dtype}")
