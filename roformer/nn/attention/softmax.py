"""The softmax attention layer: q/k/v/out projections (MHA/GQA/MQA) over explicit positions,
with a KV cache for generation.

The cache holds `num_kv_heads` heads (GQA/MQA caches are H/G times smaller) and, for a sliding
window w shorter than the generated length, w slots used as a ring buffer (kv_cache.py); under
StreamingLLM's attention sinks (posenc.extension kind "sinks"), the n sink slots and a ring of
the recent window.

Dimension legend as call.py; C cache slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from roformer.nn.attention import forget_gate, kv_cache
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import KERNELS, dense_attention
from roformer.nn.attention.qk_norm import l2_norm, qk_norm_layers
from roformer.nn.attention.sinks import sink_param
from roformer.nn.layers import DTYPES, shared_input_dense, tokens
from roformer.posenc import POSENCS, QueryScale
from roformer.posenc.extension import query_factor as extension_query_factor

if TYPE_CHECKING:
  from roformer.nn.layer_spec import LayerSpec
  from roformer.posenc import PosEnc


def kernel_init(in_axis, out_axis, names):
  # fan-in scaling over the contracted axes (the default would take the wrong fan for 3-D kernels).
  init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )
  return nnx.with_partitioning(init, names)


def attention_dropout(cfg) -> float:
  """The dropout rate of attention probabilities: model.attention_dropout_rate, or
  model.dropout_rate when it is -1."""
  rate = cfg.attention_dropout_rate
  return cfg.dropout_rate if rate == -1.0 else rate


def check_kernel_config(cfg, posenc_cls, *, head_dim: int = 0) -> None:
  """Raises ValueError, in one line, when the kernel `model.attention_impl` names cannot run this
  model's attention (its `misfit` on `Features.from_config`; packing and exact lengths are
  checked when it runs)."""
  if posenc_cls is None:
    return
  features = Features.from_config(cfg, posenc_cls, head_dim=head_dim)
  if reason := KERNELS[cfg.attention_impl].misfit(features):
    raise ValueError(
      f"model.attention_impl={cfg.attention_impl!r} cannot run posenc.kind="
      f"{cfg.posenc.kind!r} here: {reason}"
    )


def _checked_bias(posenc, num_heads: int):
  """`posenc.bias`, its shape checked when traced: an encoding's bias of the wrong shape is one
  line naming the encoding, not a broadcasting error deep in a kernel."""

  def bias(qpos_BL, kpos_BS):
    bias_BHLS = posenc.bias(qpos_BL, kpos_BS)
    if bias_BHLS is None:
      return None
    B, L, S = qpos_BL.shape[0], qpos_BL.shape[1], kpos_BS.shape[1]
    shape = getattr(bias_BHLS, "shape", ())
    # Every kernel splits the bias by head (over GQA groups, over the mesh): a row per head, while
    # a batch of one broadcasts over the batch.
    if len(shape) != 4 or shape[0] not in (1, B) or tuple(shape[1:]) != (num_heads, L, S):
      raise ValueError(
        f"posenc.kind {posenc.cfg.kind!r}: bias returned shape {tuple(shape)}, not [B, H, L, S] "
        f"= ({B}, {num_heads}, {L}, {S}) (B may be 1)"
      )
    return bias_BHLS

  return bias


def _cache_sinks(extension) -> tuple[int, int]:
  """(sinks, recent window) a decoding cache keeps under StreamingLLM's extension: the keys no
  later query sees are evicted, so the cache is bounded. (0, 0) for every other setting."""
  if extension.kind != "sinks":
    return (0, 0)
  return (extension.sinks, extension.window)


class Attention(nnx.Module):
  """Self-attention with q/k/v/out projections; positions enter only through `posenc`.

  Parameters (logical axes): query.kernel [D, H, K] ('embed', 'heads', 'kv'), key.kernel and
  value.kernel [D, G, K], out.kernel [H, K, D] ('heads', 'kv', 'embed'); with model.use_bias,
  query.bias [H, K] and key/value.bias [G, K] ('heads', 'kv') and out.bias [D] ('embed',);
  model.qkv_bias sets the query/key/value biases alone, as Qwen2 has them without an output
  bias. With model.attention_sinks, sinks [H] ('heads',): one learned sink logit per query head
  (sinks.py). With model.forget_gate, forget_gate.proj.kernel [D, H] ('embed', 'heads') and
  .bias [H] ('heads',): FoX's forget gate (forget_gate.py).
  """

  def __init__(self, cfg, spec: LayerSpec, *, rngs: nnx.Rngs):
    """Layer `spec.index` of the model `cfg` (a ModelConfig): every setting comes from the
    config, the per-layer ones (encoding, window, QK-norm, query temperature) from `spec`, so
    a new attention feature is a config field, not a new argument."""
    # model.head_dim and model.num_kv_heads with their 0 defaults resolved (nn/config.py).
    D, H, K = cfg.emb_dim, cfg.num_heads, cfg.head_dim or cfg.emb_dim // cfg.num_heads
    G = cfg.num_kv_heads or cfg.num_heads
    dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    self.dtype = jnp.dtype(dtype)  # of the decoding cache
    # Width of the keys the encoding's `rotate` returns, which the cache holds (PoPE: 2K).
    self.rotated_dim = POSENCS[spec.posenc.kind].rotated_dim(spec.posenc, K)
    self.causal = spec.causal
    self.dropout_rate = attention_dropout(cfg)
    self.impl = cfg.attention_impl
    self.block = cfg.attention_block
    self.window = spec.window
    self.window_kind = spec.window_kind
    self.global_tokens = cfg.global_tokens
    # StreamingLLM's cache policy: (sinks, recent window) slots; (0, 0) = by `window` alone.
    self.cache_sinks, self.cache_window = _cache_sinks(cfg.posenc.extension)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    hk_bias = nnx.with_partitioning(nnx.initializers.zeros, ("heads", "kv"))
    qkv_init = kernel_init(0, (1, 2), ("embed", "heads", "kv"))
    qkv_bias = cfg.use_bias or cfg.qkv_bias
    self.query = nnx.Einsum(
      "...D,DHK->...HK", (D, H, K), (H, K) if qkv_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.key = nnx.Einsum(
      "...D,DGK->...GK", (D, G, K), (G, K) if qkv_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.value = nnx.Einsum(
      "...D,DGK->...GK", (D, G, K), (G, K) if qkv_bias else None,
      kernel_init=qkv_init, bias_init=hk_bias, **common,
    )  # fmt: skip
    self.out = nnx.Einsum(
      "...HK,HKD->...D", (H, K, D), (D,) if cfg.use_bias else None,
      kernel_init=kernel_init((0, 1), 2, ("heads", "kv", "embed")),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **common,
    )  # fmt: skip
    # Query and key transforms (qk_norm.py, query_scale.py): QK-norm, "rmsnorm" per head with a
    # learned scale [K] for queries and one for keys, "rmsnorm_whole" over each whole projection
    # with scales [H, K] and [G, K]; the layer's query temperature.
    self.qk_norm = spec.qk_norm
    self.norm_eps = cfg.norm_eps
    self.query_norm, self.key_norm = qk_norm_layers(
      spec.qk_norm, (H, G), K, cfg.norm_eps, dtype, param_dtype, rngs
    )
    self.query_scale = (
      None
      if spec.posenc.query_scale == "none"
      else QueryScale(spec.posenc, num_heads=H, param_dtype=param_dtype, rngs=rngs)
    )
    # A context extension's own query factor (ReRoPE's log-n, DCA's cos/sin factor squared).
    self.extension = spec.posenc.extension
    # Logit terms of the call (sinks.py, forget_gate.py): a sink logit per head; FoX's gate.
    self.sinks = sink_param(H, param_dtype, rngs) if cfg.attention_sinks else None
    self.forget_gate = (
      forget_gate.ForgetGate(D, H, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      if cfg.forget_gate
      else None
    )

  @classmethod
  def from_config(cls, cfg, spec: LayerSpec, *, rngs: nnx.Rngs):
    """The attention kinds' common builder (kinds.py)."""
    return cls(cfg, spec, rngs=rngs)

  @classmethod
  def check_config(cls, cfg, posenc_cls) -> None:
    """Softmax attention honours every encoding and window; a kernel named by
    `model.attention_impl` refuses what it cannot run (`check_kernel_config`)."""
    check_kernel_config(cfg, posenc_cls, head_dim=cfg.head_dim or cfg.emb_dim // cfg.num_heads)

  @classmethod
  def rotary_head_dim(cls, cfg, head_dim: int) -> int:
    del cfg
    return head_dim

  def qkv(self, x_BLD):
    """Projections (position-wise): x [B, L, D] -> q [B, L, H, K], k and v [B, L, G, K]."""
    B, L, D = x_BLD.shape
    # Over the tokens as one axis, so the weight gradients contract one axis (see `tokens`), and
    # as one `shared_input_dense`: x^T written once for the three weight gradients. The dtypes
    # are nnx.Einsum's (its `promote_dtype`).
    x_ND, projections = tokens(x_BLD), (self.query, self.key, self.value)
    promoted = [
      p.promote_dtype((x_ND, p.kernel[...], None if p.bias is None else p.bias[...]), dtype=p.dtype)
      for p in projections
    ]
    kernels = tuple(kernel.reshape(D, -1) for _, kernel, _ in promoted)
    outputs = []
    for y_NF, (_, kernel, bias) in zip(
      shared_input_dense(promoted[0][0], kernels), promoted, strict=True
    ):
      y_BLHK = y_NF.reshape(B, L, *kernel.shape[1:])
      outputs.append(y_BLHK if bias is None else y_BLHK + bias[None, None])
    return tuple(outputs)

  def init_cache(self, batch: int, max_len: int) -> kv_cache.KVCache:
    """An empty cache for generating up to `max_len` tokens (window slots when shorter; the
    attention sinks and their recent window under StreamingLLM's extension)."""
    _, G, K = self.key.kernel.shape
    window = self.cache_window or self.window
    C = kv_cache.capacity(window, max_len, self.cache_sinks)
    c_BCH = None
    if self.forget_gate is not None:  # c of each key; an empty slot holds c = 0
      c_BCH = jnp.zeros((batch, C, self.query.kernel.shape[1]), jnp.float32)
    # Keys are cached as `rotate` returns them (PoPE's are twice as wide as the values).
    return kv_cache.KVCache(
      jnp.zeros((batch, C, G, self.rotated_dim), self.dtype),
      jnp.zeros((batch, C, G, K), self.dtype),
      c_BCH,
    )

  def __call__(
    self,
    x_BLD,
    pos_BL,
    posenc: PosEnc,
    *,
    cache: kv_cache.KVCache | None = None,
    segment_ids_BL=None,
    dropout_key: jax.Array | None = None,
    rotary_state=None,
  ):
    """Self-attention of x [B, L, D] at positions [B, L]: (heads [B, L, H, K], cache).

    The heads are returned before the output projection `out`, which the block runs over
    sequence blocks together with the MLP. q and k are rotated by `posenc`, whose `bias` and
    `content_bias` the kernel adds to the logits.

    Without a cache this is the full forward pass (training, evaluation). With one it is a
    generation step (`roformer.generate`): the new keys and values are written to it (keys
    rotated, with the generation's fixed `rotary_state`, so keys written at different steps stay
    consistent). L > 1 is the prefill of an empty cache, which is the full forward pass over the
    prompt; L = 1 is a decode step, whose query attends to every filled slot.

    Args:
      x_BLD: the block's (normed) input.
      pos_BL: int positions.
      posenc: the model's positional encoding (its `rotate` and bias hooks are used).
      cache: this layer's `init_cache`, or None for a full forward pass.
      segment_ids_BL: int segment ids; None means one segment.
      dropout_key: key for attention-probability dropout; None disables it.
      rotary_state: `posenc.prepare` of the forward pass; None prepares it from `pos_BL`.

    Returns:
      ([B, L, H, K] in the compute dtype, the updated cache or None).
    """
    q_BLHK, k_BLGK, v_BLGK = self.qkv(x_BLD)
    piecewise = {}
    if posenc.extends_positions():
      # A context extension remaps each (query, key) pair's distance: the kernel rotates q and
      # k per piece, always with the pass's (or the generation's) rotary state, and the cache
      # holds unrotated keys.
      state = posenc.prepare(pos_BL) if rotary_state is None else rotary_state
      piecewise = dict(
        pieces_fn=posenc.position_pieces,
        rotate_fn=lambda q, k, qpos, kpos: posenc.rotate(q, k, qpos, kpos, state),
      )
    q_BLHK, k_BLGK = self._encode(
      q_BLHK, k_BLGK, pos_BL, posenc, rotary_state, rotate=not piecewise
    )
    sink_H = None if self.sinks is None else self.sinks[...]
    c_BLH = None
    if self.forget_gate is not None:
      c_prev_BH = None
      if cache is not None:  # the cached c of the position before (0 from an empty slot)
        c_prev_BH = cache.c_BCH[:, (pos_BL[0, 0] - 1) % cache.c_BCH.shape[1]]
      c_BLH = forget_gate.cumulative(self.forget_gate(x_BLD), c_prev_BH)
    call = AttentionCall(
      causal=self.causal, window=self.window, window_kind=self.window_kind,
      global_tokens=self.global_tokens, bias_fn=_checked_bias(posenc, q_BLHK.shape[2]),
      sink_H=sink_H, **piecewise,
    )  # fmt: skip
    if cache is not None:
      C = cache.k_BCGK.shape[1]
      # A cache shorter than sinks + window holds the whole generation: plain slots.
      sinks = self.cache_sinks if C == self.cache_sinks + self.cache_window else 0
      cache = kv_cache.KVCache(
        kv_cache.write(cache.k_BCGK, k_BLGK, pos_BL, sinks),
        kv_cache.write(cache.v_BCGK, v_BLGK, pos_BL, sinks),
        None if c_BLH is None else kv_cache.write(cache.c_BCH, c_BLH, pos_BL, sinks),
      )
      if q_BLHK.shape[1] == 1:
        kpos_BC, kseg_BC = kv_cache.cache_keys(C, pos_BL, sinks)
        step = call.replace(
          causal=True, global_tokens=0, qseg_BL=jnp.zeros_like(pos_BL), kseg_BS=kseg_BC,
          key_bias_BSH=None if c_BLH is None else -cache.c_BCH,
        )  # fmt: skip
        o_BLHK = dense_attention(q_BLHK, cache.k_BCGK, cache.v_BCGK, pos_BL, kpos_BC, step)
        return o_BLHK, cache
    call = call.replace(
      qseg_BL=segment_ids_BL, kseg_BS=segment_ids_BL, bias_factors_fn=posenc.bias_factors,
      content_bias_fn=posenc.content_bias, dropout_rate=self.dropout_rate,
      dropout_key=dropout_key, block=self.block, key_bias_BSH=None if c_BLH is None else -c_BLH,
    )  # fmt: skip
    o_BLHK = KERNELS[self.impl](q_BLHK, k_BLGK, v_BLGK, pos_BL, pos_BL, call)
    return o_BLHK, cache

  def _encode(self, q_BLHK, k_BLGK, pos_BL, posenc, rotary_state, *, rotate=True):
    """Queries and keys as the kernels see them: QK-norm "rmsnorm" (per head, as Qwen3 and
    Gemma 3) or "rmsnorm_whole" (over the whole projection, as OLMo 2), both before rotation, the
    encoding's rotation, QK-norm "l2" (after it, as Llama 4), then the query temperature (after
    both, as Llama 4), then a context extension's query factor. Keys leave here as the cache
    stores them.

    With `rotate=False` (piecewise positions, whose kernels rotate per piece) the rest still
    applies unchanged: the l2 norm and the temperature commute with a rotation."""
    if self.query_norm is not None:
      q_BLHK, k_BLGK = self.query_norm(q_BLHK), self.key_norm(k_BLGK)
    if rotate:
      q_BLHK, k_BLGK = posenc.rotate(q_BLHK, k_BLGK, pos_BL, pos_BL, rotary_state)
    if self.qk_norm == "l2":
      q_BLHK, k_BLGK = l2_norm(q_BLHK, self.norm_eps), l2_norm(k_BLGK, self.norm_eps)
    if self.query_scale is not None:
      q_BLHK = self.query_scale(q_BLHK, pos_BL)
    t_BL = extension_query_factor(self.extension, pos_BL)
    if t_BL is not None:
      q_BLHK = (q_BLHK.astype(jnp.float32) * t_BL[:, :, None, None]).astype(q_BLHK.dtype)
    return q_BLHK, k_BLGK
