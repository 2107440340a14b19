"""One attention call as every kernel takes it (`AttentionCall`), and what it asks of a kernel
(`Features`): the typed contract between the attention layers and the kernels (kernels/).

A kernel is `kernel(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)`. The call holds the mask
(causal, window and its kind, global tokens, segments), the logit terms (positional bias and its
query-key factors, content bias, key bias, sinks, piecewise positions), attention dropout and the
block size of the blockwise kernels. `Features` is the hashable summary a kernel's `misfit`
reads, built from a call and its arrays when it runs, or from a model config when it is checked.

Dimension legend: B batch, L query length, S key length, H query heads, G key/value heads,
K query/key head dim, V value head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from roformer.nn.attention.primitives import (
  BiasFactorsFn,
  BiasFn,
  ContentBiasFn,
  PiecesFn,
  RotateFn,
)


@dataclasses.dataclass(frozen=True)
class Features:
  """What one attention call asks of a kernel: `Kernel.misfit`'s one argument.

  The mask and the logit terms are known from the call (or the model config); the fields after
  `dropout` describe where and on what it runs, each unknown as "" / 0 / None (a config check
  knows the dtype and the head dim, not the length; `platform` None: the hardware is not
  checked, as for a kernel run off its hardware in an emulation, or at a config check)."""

  causal: bool = False
  window: bool = False
  window_kind: str = "sliding"
  global_tokens: bool = False
  segments: bool = False
  # Logit terms: a positional bias, its query and key factors (`PosEnc.bias_factors`) and their
  # key width, a content-dependent bias (CoPE), a bias per key (FoX), sink logits, piecewise
  # positions (context extensions).
  bias: bool = False
  factored: bool = False
  fold_width: int = 0
  content_bias: bool = False
  key_bias: bool = False
  sinks: bool = False
  pieces: bool = False
  dropout: bool = False
  # Where and on what: the platform the program is for, the dtype of q, k and v, the q/k head
  # dim, the query and key lengths, the batch and query heads, the devices of the mesh.
  platform: str | None = None
  dtype: str = ""
  head_dim: int = 0
  length: int = 0
  key_length: int = 0
  batch: int = 0
  heads: int = 0
  devices: int = 1

  @classmethod
  def from_config(cls, cfg, posenc_cls, *, head_dim: int = 0) -> Features:
    """The features every attention call of a model with config `cfg` (ModelConfig) and
    encoding class `posenc_cls` has at most (a window pattern: a window somewhere; packing and
    the lengths are known only when it runs)."""
    rate = cfg.attention_dropout_rate
    return cls(
      causal=cfg.kind == "decoder",
      window=bool(cfg.attention_window or cfg.attention_window_pattern),
      window_kind=cfg.attention_window_kind,
      global_tokens=cfg.global_tokens > 0,
      bias=posenc_cls.acts_on_logits(),
      factored=posenc_cls.has_bias_factors(causal=cfg.kind == "decoder"),
      content_bias=posenc_cls.content_bias is not None,
      key_bias=cfg.forget_gate,
      sinks=cfg.attention_sinks,
      pieces=cfg.posenc.extension.kind != "none",
      dropout=(cfg.dropout_rate if rate == -1.0 else rate) > 0,
      dtype=cfg.dtype,
      head_dim=head_dim,
    )

  def portable(self) -> Features:
    """These features with the hardware facts unknown: what a kernel run through its emulation
    (interpret mode, XLA's implementation) is asked."""
    return dataclasses.replace(self, platform=None, dtype="", head_dim=0)


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
  """Everything about one attention call besides q, k, v and their positions.

  Attributes:
    causal, window, window_kind, global_tokens: the mask rule (`primitives.attention_mask`).
    qseg_BL, kseg_BS: int segment ids of queries and keys, or None for one segment.
    bias_fn: the positional bias of a block of positions (`posenc.bias`).
    bias_factors_fn: the same bias as query and key factors (`posenc.bias_factors`), which
      kernels that add no bias (splash) fold into q and k; the others add `bias_fn`'s.
    content_bias_fn: a bias from queries, keys and the mask (`posenc.content_bias`, CoPE).
    key_bias_BSH: a bias per key and query head [B, S, H] (FoX's -c_j), or None.
    sink_H: per query head sink logits [H] (`sinks.py`), or None.
    pieces_fn, rotate_fn: piecewise positions (`piecewise.py`): q and k come unrotated and each
      pair's logit is that of the piece covering it under `rotate_fn`. None: q and k come rotated.
    dropout_rate, dropout_key: attention-probability dropout (none when the key is None).
    block: the query and key block of the blockwise kernels (a tiling, not a result).
  """

  causal: bool = False
  window: int = 0
  window_kind: str = "sliding"
  global_tokens: int = 0
  qseg_BL: jax.Array | None = None
  kseg_BS: jax.Array | None = None
  bias_fn: BiasFn | None = None
  bias_factors_fn: BiasFactorsFn | None = None
  content_bias_fn: ContentBiasFn | None = None
  key_bias_BSH: jax.Array | None = None
  sink_H: jax.Array | None = None
  pieces_fn: PiecesFn | None = None
  rotate_fn: RotateFn | None = None
  dropout_rate: float = 0.0
  dropout_key: jax.Array | None = None
  block: int = 512

  def replace(self, **changes) -> AttentionCall:
    return dataclasses.replace(self, **changes)

  @property
  def dropping(self) -> bool:
    """Whether attention dropout acts (a key and a rate)."""
    return self.dropout_key is not None and self.dropout_rate > 0

  def probe_bias(self, qpos_BL, kpos_BS):
    """(the positional bias, its factors) of the first (query, key) pair, each None when the
    encoding has none: whether they exist, without tracing an [L, S] bias."""
    pair = (qpos_BL[:, :1], kpos_BS[:, :1])
    probe = None if self.bias_fn is None else self.bias_fn(*pair)
    factors = None
    if probe is not None and self.bias_factors_fn is not None:
      factors = self.bias_factors_fn(*pair)
    return probe, factors

  def features(self, q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, *, platform: str | None) -> Features:
    """This call's features on these arrays (the bias probed on one pair), for a program on
    `platform` (None: the hardware unchecked). The dtype names those of q, k and v joined by "/"
    when they differ."""
    probe, factors = self.probe_bias(qpos_BL, kpos_BS)
    mesh = jax.sharding.get_abstract_mesh()
    B, L, H, K = q_BLHK.shape
    return Features(
      causal=self.causal,
      window=self.window > 0,
      window_kind=self.window_kind,
      global_tokens=self.global_tokens > 0,
      segments=self.qseg_BL is not None or self.kseg_BS is not None,
      bias=probe is not None,
      factored=factors is not None,
      fold_width=0 if factors is None else factors[1].shape[-1],
      content_bias=self.content_bias_fn is not None,
      key_bias=self.key_bias_BSH is not None,
      sinks=self.sink_H is not None,
      pieces=self.pieces_fn is not None,
      dropout=self.dropping,
      platform=platform,
      dtype="/".join(sorted({jnp.dtype(x.dtype).name for x in (q_BLHK, k_BSGK, v_BSGV)})),
      head_dim=K,
      length=L,
      key_length=k_BSGK.shape[1],
      batch=B,
      heads=H,
      devices=1 if mesh.empty else mesh.size,
    )
