"""JAX's own fused attention kernels behind the kernels' signature (kernels.py).

  splash      TPU: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`):
              block-sparse masks (causal, full, sliding / chunked / blockwise windows, global
              tokens), segment ids for packed documents, GQA and sink logits; no bias input,
              but a bias with query and key factors (causal ALiBi, Sandwich) and FoX's key
              bias go folded into q and k as extra columns (`bias_factors.py`).
  flash_bias  TPU: Pallas flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`),
              which adds a dense bias `ab` [B, H, L, S] to the logits and returns its gradient:
              the relative biases (T5, ALiBi, KERPLE, FIRE, Sandwich) and FoX's forget gate; every
              mask is folded into that bias. No sinks, no GQA of its own (keys and values are
              repeated over each group's query heads; their gradients sum back through the repeat).
  cudnn       GPU: `jax.nn.dot_product_attention(implementation="cudnn")`: bias, causal and
              causal sliding windows natively, any other mask as a boolean mask, GQA natively.

On a machine without the kernel's hardware the Pallas kernels run in interpret mode (slow,
exact) when asked for by name, which is how the tests check them on CPU; `auto` never picks a
fused kernel there. `fused_misfit` says in one line why a call does not fit a kernel, and the
kernel raises it; `auto_attention` uses it to fall back.

The Pallas kernels tile the sequence by TPU lanes (128): sequences are padded to a multiple of
it (padded keys get a segment id no query of the input has). Head dims the flash kernel does not
take (above 128 and not a multiple of it) are padded to one on a TPU (zeros add nothing to q.k
and give zero output columns, which are cut; logged), and values narrower than the queries
(PoPE) to their width. Queries are scaled by 1 / sqrt(K) before
the kernel, as every kernel here scales them.

Splash's masks are functions of the token index within the sequence, not of the positions the
model passes: they equal the position masks when positions count up by one within each segment
(train.py, eval.py and generation's prefill). The masks that depend on where a position falls
from the segment start (chunked, blockwise, global tokens) are refused with packed documents,
whose positions restart mid-sequence.

Dimension legend as kernels.py; P the padded sequence length, W the padded head width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging

from roformer.nn.attention.bias_factors import fold_bias_factors
from roformer.nn.attention.primitives import (
  NEG,
  add_key_bias,
  allowed_pairs,
  attention_mask,
  check_ranks,
)

LANES = 128  # TPU vector lanes: the Pallas TPU kernels' block and head-dim granularity
FUSED_KERNELS = ("splash", "flash_bias", "cudnn")
# The hardware each fused kernel compiles for.
PLATFORM = {"splash": "tpu", "flash_bias": "tpu", "cudnn": "gpu"}
# Pad head dims to a multiple of LANES: None = where a kernel needs it (tests set True to check the
# padding). Compiled for v4 and v5e, splash takes any head dim (16, 64 and 192 tried); the flash
# kernel takes any up to 128 and multiples of 128 above.
PAD_HEAD_DIM: bool | None = None
# Windows whose mask depends on a position's offset within its segment, not on index distances.
_SEGMENT_ALIGNED = ("chunked", "blockwise")


def fused_misfit(
  kernel: str,
  *,
  bias: bool = False,
  factored: bool = False,
  content_bias: bool = False,
  pieces: bool = False,
  dropout: bool = False,
  sinks: bool = False,
  key_bias: bool = False,
  segments: bool = False,
  window: int = 0,
  window_kind: str = "sliding",
  global_tokens: int = 0,
  platform: str | None = None,
  dtype: str = "",
  head_dim: int = 0,
  length: int = 0,
) -> str | None:
  """Why an attention call with these features does not fit `kernel`, or None when it does.

  `factored`: the positional bias has query and key factors (`PosEnc.bias_factors`), which splash
  takes folded into q and k, as it takes FoX's key bias (`bias_factors.py`). `platform` (None:
  any) adds the hardware check: cudnn needs a GPU (the Pallas kernels interpret themselves
  anywhere). `dtype`, `head_dim` (the q/k width) and `length` ("" or 0:
  unknown) add cuDNN's limits."""
  if content_bias:
    return "CoPE's content-dependent bias needs the logits, which only the dense kernel has"
  if pieces:
    return "piecewise positions (posenc.extension) rotate q and k per piece inside the kernel"
  if dropout:
    return "it has no attention dropout (set model.attention_dropout_rate=0, or dense/chunked)"
  if kernel == "splash":
    if bias and not factored:
      return (
        "it adds no logit bias, and this encoding's has no query-key factors to fold into q "
        "and k; use flash_bias"
      )
    if bias and sinks:
      return (
        "folding a bias into q and k drops its per-query constant, which a sink logit is "
        "compared with; use dense or chunked"
      )
    if segments and window and (window_kind in _SEGMENT_ALIGNED or global_tokens):
      form = "global tokens" if global_tokens else f"{window_kind} windows"
      return f"its {form} count token indices, and packed documents restart positions"
  if kernel == "flash_bias" and sinks:
    return "it has no sink logit (model.attention_sinks); use splash"
  if kernel == "cudnn":
    if sinks:
      return "cuDNN's kernel has no sink logit (model.attention_sinks)"
    if platform not in (None, "gpu"):
      return f"cuDNN runs on a GPU, not on {platform}"
    if dtype and dtype not in ("bfloat16", "float16"):
      return f"cuDNN's flash attention takes bfloat16 or float16, not {dtype} (model.dtype)"
    if head_dim and (head_dim % 8 or head_dim > 128):
      return f"cuDNN takes head dims that are multiples of 8 up to 128, not {head_dim}"
    if length % 2 and (bias or key_bias):
      return f"cuDNN adds a bias only at even lengths, not {length}"
  return None


# `auto` leaves a call to the XLA kernels when a [B, H, L, S] float32 bias (flash_bias) would
# take more than this per device; the chunked kernel computes it block by block.
AUTO_BIAS_BYTES = 1 << 30


def auto_misfit(
  kernel: str, features: dict, *, bias_bytes: int, dtype: str, head_dim: int, fold_width: int = 0
) -> str | None:
  """What `auto` adds to `fused_misfit`: no windows (the banded XLA kernel visits only the
  window's key blocks; splash's and cuDNN's windows count token indices, which differ from
  positions under randomized or offset positions), no bias folded into splash's q and k in
  float32 or wider than the heads, and no flash_bias whose dense bias would exceed
  AUTO_BIAS_BYTES per device.

  In a 16-bit dtype a folded ALiBi or FoX bias is as exact as the dense kernel's (three pieces per
  large key factor, float32 sums), Sandwich's within 1.7x (benchmarks/bias_factor_precision.py).
  In float32 the kernel's sums hold ALiBi's m (j - j0) or FoX's -c_j whole, so a logit is off by
  up to 2^-24 of it (2e-4 in the output at 8k tokens, where the dense kernel is exact);
  flash_bias adds the bias as it is. Sandwich's factors are d' wide (model.emb_dim by default):
  folded, they would multiply the q.k work."""
  if features["window"]:
    return "windows go to the banded XLA kernel"
  if kernel == "splash" and (features["factored"] or features["key_bias"]):
    if dtype == "float32":
      return "in float32 a bias folded into q and k is less exact than flash_bias's"
    if fold_width > head_dim:  # the factors' columns, before any splitting into pieces
      return f"folding its bias would widen q and k from {head_dim} to {head_dim + fold_width}"
  if kernel == "flash_bias" and bias_bytes > AUTO_BIAS_BYTES:
    return f"its [B, H, L, S] bias would take {bias_bytes / (1 << 30):.1f} GiB per device"
  return None


def _features(kwargs, bias_BHLS, factors=None) -> dict:
  """`fused_misfit`'s arguments for one kernel call (kernels' keyword arguments)."""
  return dict(
    bias=bias_BHLS is not None,
    factored=factors is not None,
    content_bias=kwargs.get("content_bias_fn") is not None,
    pieces=kwargs.get("pieces_fn") is not None,
    dropout=kwargs.get("dropout_key") is not None and kwargs.get("dropout_rate", 0.0) > 0,
    sinks=kwargs.get("sink_H") is not None,
    key_bias=kwargs.get("key_bias_BSH") is not None,
    segments=kwargs.get("qseg_BL") is not None,
    window=kwargs.get("window", 0),
    window_kind=kwargs.get("window_kind", "sliding"),
    global_tokens=kwargs.get("global_tokens", 0),
  )


def _positional_bias(bias_fn, qpos_BL, kpos_BS):
  return None if bias_fn is None else bias_fn(qpos_BL, kpos_BS)


def probe_bias(kwargs, qpos_BL, kpos_BS):
  """(the positional bias, its factors) of the first (query, key) pair, each None when the
  encoding has none: whether they exist, without tracing an [L, S] bias."""
  pair = (qpos_BL[:, :1], kpos_BS[:, :1])
  probe = _positional_bias(kwargs.get("bias_fn"), *pair)
  factors_fn = kwargs.get("bias_factors_fn")
  factors = None if probe is None or factors_fn is None else factors_fn(*pair)
  return probe, factors


def _refuse(kernel: str, reason: str | None) -> None:
  if reason is not None:
    raise ValueError(f"model.attention_impl={kernel!r} cannot run this attention: {reason}")


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _block(padded: int, block: int) -> int:
  """The largest multiple of LANES that divides `padded` and is at most max(block, LANES)."""
  units = padded // LANES
  best = max(1, min(units, block // LANES))
  while units % best:
    best -= 1
  return best * LANES


def _pad_axis(x, axis: int, size: int, value=0):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _head_width(q_BLHK, v_BSGV, lanes: bool) -> int:
  """W: one width for queries, keys and values (values narrower than PoPE's keys are padded),
  rounded up to a multiple of LANES when `lanes` (or PAD_HEAD_DIM) says so."""
  width = max(q_BLHK.shape[-1], v_BSGV.shape[-1])
  lanes = lanes if PAD_HEAD_DIM is None else PAD_HEAD_DIM
  if lanes and width % LANES:
    log_once(f"attention head dim {width} padded to {_round_up(width, LANES)} (TPU lanes)")
  return _round_up(width, LANES) if lanes else width


def _segments_padded(qseg_BL, kseg_BS, B: int, L: int, S: int, P: int):
  """Segment ids [B, P] of queries and keys, or None when neither padding nor packing needs them.
  Padded keys get -1, which no real query carries (real ids are >= 0), so no real query sees one;
  padded queries see only padded keys (their rows are cut)."""
  if qseg_BL is None and P == L == S:
    return None, None
  qseg_BL = jnp.zeros((B, L), jnp.int32) if qseg_BL is None else qseg_BL.astype(jnp.int32)
  kseg_BS = jnp.zeros((B, S), jnp.int32) if kseg_BS is None else kseg_BS.astype(jnp.int32)
  return _pad_axis(qseg_BL, 1, P, -1), _pad_axis(kseg_BS, 1, P, -1)


def target_platform() -> str:
  """The platform the traced program is for: the devices of the current mesh (a TPU slice's when
  compiling ahead of time on another machine), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def _mesh_specs(B: int, G: int):
  """(batch axes, head axis) of the current mesh the kernel call is split over with shard_map
  (a Pallas call is opaque to XLA's partitioner): the batch over the mesh's data and fsdp axes,
  the heads over its tensor axis when the key/value heads divide evenly. None without a mesh of
  more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  if B % math.prod(sizes[a] for a in batch):
    batch = ()
  heads = "tensor" if sizes.get("tensor", 1) > 1 and G % sizes["tensor"] == 0 else None
  return (batch or None), heads


def _shard(fn, mesh_specs, args_specs):
  """`fn(*args)` split over the current mesh by `args_specs` ((array, logical dims), ...), each
  dim "B" (batch), "H" (heads) or None. The output is [B, L, H, W]."""
  if mesh_specs is None:
    return fn(*(a for a, _ in args_specs))
  batch, heads = mesh_specs
  P = jax.sharding.PartitionSpec
  to_axes = {"B": batch, "H": heads, None: None}
  in_specs = tuple(P(*(to_axes[d] for d in dims)) for _, dims in args_specs)
  out_spec = P(batch, None, heads, None)
  mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_spec, check_vma=False)
  return mapped(*(a for a, _ in args_specs))


# ---------------------------------------------------------------------------------------------
# splash


@functools.cache
def _index_mask(P: int, causal: bool, window: int, window_kind: str, global_tokens: int):
  """Splash's computable mask of `attention_mask`'s rule on token indices [P, P], evaluated
  lazily per block (no [P, P] array is built)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  def rule(q_ids, k_ids):  # numpy index arrays when planning blocks, traced ones in the kernel
    allowed = allowed_pairs(
      q_ids, k_ids, causal=causal, window=window, window_kind=window_kind,
      global_tokens=global_tokens,
    )  # fmt: skip
    return (q_ids >= 0) & (k_ids >= 0) if allowed is None else allowed

  class RuleMask(masks._ComputableMask):  # one class per rule (cached), so equal iff same type
    def __eq__(self, other):
      return type(other) is type(self)

    def __hash__(self):
      return hash((P, causal, window, window_kind, global_tokens))

  return RuleMask(shape=(P, P), mask_function=rule)


def _splash_kernel(H: int, P: int, block: int, rule: tuple, interpret: bool):
  """Splash's kernel for H heads of one mask rule. Made anew in every trace: the kernel holds its
  masks' block tables as arrays, which are the trace's constants (a kernel kept across traces
  would hand one trace's values to the next). The costly part, evaluating the mask block by
  block, is cached by splash itself per mask (`_index_mask` returns the same one)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  mask = masks.MultiHeadMask([_index_mask(P, *rule)] * H)
  blocks = splash.BlockSizes(
    block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
    block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
  )  # fmt: skip
  return splash.make_splash_mha(
    mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
  )


def _checked_pallas_call(kernel: str, q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, kwargs):
  """The positional bias [B, H, L, S] of a flash_bias call, or splash's bias factors (each None
  when there are none), after the kernel's refusals: self-attention only, and what
  `fused_misfit` says. Splash never needs the bias itself: it is probed on one pair."""
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  factors = None
  if kernel == "splash":
    bias_BHLS, factors = probe_bias(kwargs, qpos_BL, kpos_BS)
    if factors is not None:  # the factors of every position, not of the probed pair
      factors = kwargs["bias_factors_fn"](qpos_BL, kpos_BS)
  else:
    bias_BHLS = _positional_bias(kwargs.get("bias_fn"), qpos_BL, kpos_BS)
  _refuse(kernel, fused_misfit(kernel, **_features(kwargs, bias_BHLS, factors)))
  L, S = q_BLHK.shape[1], k_BSGK.shape[1]
  if S != L:
    raise ValueError(f"model.attention_impl={kernel!r} runs self-attention; got L={L}, S={S}")
  return factors if kernel == "splash" else bias_BHLS


def splash_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, **kwargs):
  """Self-attention through Pallas splash attention; args and returns as `dense_attention`.
  A positional bias with query and key factors and FoX's key bias go folded into q and k
  (`bias_factors.py`)."""
  factors = _checked_pallas_call("splash", q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, kwargs)
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  B, L, H, K = q_BLHK.shape
  S, V = k_BSGK.shape[1], v_BSGK.shape[3]
  on = target_platform()
  P, W = _round_up(L, LANES), _head_width(q_BLHK, v_BSGK, lanes=False)
  q, k, v = (_pad_axis(x, 3, W) for x in (q_BLHK * (1.0 / math.sqrt(K)), k_BSGK, v_BSGK))
  terms = [] if factors is None else [factors]
  if (kb_BSH := kwargs.get("key_bias_BSH")) is not None:
    terms.append((None, kb_BSH.astype(jnp.float32)[..., None]))
  if terms:
    q, k, v = fold_bias_factors(q, k, v, terms)
  q, k, v = (_pad_axis(x, 1, P) for x in (q, k, v))
  G = k.shape[2]
  qseg, kseg = _segments_padded(kwargs.get("qseg_BL"), kwargs.get("kseg_BS"), B, L, S, P)
  rule = (
    kwargs.get("causal", False), kwargs.get("window", 0), kwargs.get("window_kind", "sliding"),
    kwargs.get("global_tokens", 0),
  )  # fmt: skip
  block, sink_H = _block(P, kwargs.get("block", 512)), kwargs.get("sink_H")

  def run(q_BPHW, k_BPGW, v_BPGW, qseg_BP, kseg_BP, sink_H):
    # The heads of this device's shard (all of them without a mesh).
    kernel = _splash_kernel(q_BPHW.shape[2], P, block, rule, on != "tpu")

    def one(q_HPW, k_GPW, v_GPW, qseg_P, kseg_P):
      segments = None if qseg_P is None else splash.SegmentIds(q=qseg_P, kv=kseg_P)
      return kernel(q_HPW, k_GPW, v_GPW, segment_ids=segments, sinks=sink_H)

    heads_first = lambda x: None if x is None else x.transpose(0, 2, 1, 3)  # noqa: E731
    o_BHPW = jax.vmap(one)(*map(heads_first, (q_BPHW, k_BPGW, v_BPGW)), qseg_BP, kseg_BP)
    return o_BHPW.transpose(0, 2, 1, 3)

  specs = _mesh_specs(B, G)
  o_BPHW = _shard(
    run, specs,
    ((q, ("B", None, "H", None)), (k, ("B", None, "H", None)), (v, ("B", None, "H", None)),
     (qseg, ("B", None)), (kseg, ("B", None)), (sink_H, ("H",))),
  )  # fmt: skip
  return o_BPHW[:, :L, :, :V].astype(q_BLHK.dtype)


# ---------------------------------------------------------------------------------------------
# flash_bias


def flash_bias_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, **kwargs):
  """Self-attention through the Pallas flash attention with a dense logit bias; args and returns
  as `dense_attention`. The bias is the encoding's, plus FoX's -c_j, plus NEG where the mask
  (causal, windows, global tokens, all on positions) forbids a pair; with no bias and no window
  there is none, and the kernel's causal flag (on indices, as splash's masks) and segment ids
  mask alone."""
  bias_BHLS = _checked_pallas_call("flash_bias", q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, kwargs)
  from jax.experimental.pallas.ops.tpu import flash_attention as flash

  B, L, H, K = q_BLHK.shape
  S, G, V = k_BSGK.shape[1], k_BSGK.shape[2], v_BSGK.shape[3]
  on = target_platform()
  width = max(K, V)
  P, W = _round_up(L, LANES), _head_width(q_BLHK, v_BSGK, lanes=on == "tpu" and width > LANES)
  causal, window = kwargs.get("causal", False), kwargs.get("window", 0)
  ab_BHLS = add_key_bias(bias_BHLS, kwargs.get("key_bias_BSH"), L)
  ab_BHPP = None  # no bias and no window: the kernel's causal flag and segment ids suffice
  if ab_BHLS is not None or window > 0:
    allowed_BLS = attention_mask(
      qpos_BL, kpos_BS, causal=causal, window=window,
      window_kind=kwargs.get("window_kind", "sliding"),
      global_tokens=kwargs.get("global_tokens", 0),
    )  # fmt: skip
    ab_BHLS = jnp.zeros((B, H, L, S), jnp.float32) if ab_BHLS is None else ab_BHLS
    ab_BHLS = jnp.broadcast_to(ab_BHLS.astype(jnp.float32), (B, H, L, S))
    ab_BHLS = jnp.where(allowed_BLS[:, None], ab_BHLS, NEG)
    ab_BHPP = _pad_axis(_pad_axis(ab_BHLS, 2, P), 3, P)
  R = H // G
  q = _pad_axis(_pad_axis(q_BLHK * (1.0 / math.sqrt(K)), 3, W), 1, P)
  # The kernel wants as many key/value heads as query heads: head h = g * R + r reads group g.
  k, v = (jnp.repeat(_pad_axis(_pad_axis(x, 3, W), 1, P), R, axis=2) for x in (k_BSGK, v_BSGK))
  qseg, kseg = _segments_padded(kwargs.get("qseg_BL"), kwargs.get("kseg_BS"), B, L, S, P)
  block = _block(P, kwargs.get("block", 512))
  sizes = flash.BlockSizes(
    block_q=block, block_k_major=block, block_k=block, block_b=1, block_q_major_dkv=block,
    block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
    block_k_dq=block, block_q_dq=block,
  )  # fmt: skip

  def run(q_BPHW, k_BPHW, v_BPHW, ab_BHPP, qseg_BP, kseg_BP):
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    segments = None if qseg_BP is None else flash.SegmentIds(q=qseg_BP, kv=kseg_BP)
    o_BHPW = flash.flash_attention(
      *map(heads_first, (q_BPHW, k_BPHW, v_BPHW)), ab_BHPP, segments, causal=causal,
      sm_scale=1.0, block_sizes=sizes,
    )  # fmt: skip
    return o_BHPW.transpose(0, 2, 1, 3)

  if on != "tpu":  # explicitly asked for off a TPU: Pallas's TPU interpreter
    run = _interpreted(run)
  o_BPHW = _shard(
    run, _mesh_specs(B, H),
    ((q, ("B", None, "H", None)), (k, ("B", None, "H", None)), (v, ("B", None, "H", None)),
     (ab_BHPP, ("B", "H", None, None)), (qseg, ("B", None)), (kseg, ("B", None))),
  )  # fmt: skip
  return o_BPHW[:, :L, :, :V].astype(q_BLHK.dtype)


def _interpreted(fn):
  """`fn` with the Pallas TPU kernels it traces, forward and backward, in interpret mode. The
  flash kernel has no `interpret` argument and its backward pass is traced after the forward
  one, outside any context manager around the call: this VJP re-enters it for both.

  The mode is `True`, Pallas's HLO interpreter (what splash's `interpret=True` selects), not an
  `InterpretParams`, whose TPU simulator (threads standing in for cores and DMAs) stalls in
  some runs on a CPU."""
  import jax.experimental.pallas.tpu as pltpu

  @jax.custom_vjp
  def call(*args):
    with pltpu.force_tpu_interpret_mode(True):
      return fn(*args)

  def call_fwd(*args):
    with pltpu.force_tpu_interpret_mode(True):
      return jax.vjp(fn, *args)

  def call_bwd(vjp_fn, g):
    with pltpu.force_tpu_interpret_mode(True):
      return vjp_fn(g)

  call.defvjp(call_fwd, call_bwd)
  return call


# ---------------------------------------------------------------------------------------------
# cudnn


def cudnn_attention(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS, *, implementation="cudnn", **kwargs):
  """Self-attention through `jax.nn.dot_product_attention`; args and returns as
  `dense_attention`. Causal attention and causal sliding windows go to cuDNN as such (it skips
  the masked blocks); segments and every other window as a boolean mask on positions.

  `implementation="xla"` runs the same call through XLA's implementation, which checks this
  adapter's arguments on any machine (the tests do; cuDNN itself needs a GPU)."""
  check_ranks(q_BLHK, k_BSGK, v_BSGK, qpos_BL, kpos_BS)
  bias_BHLS = _positional_bias(kwargs.get("bias_fn"), qpos_BL, kpos_BS)
  B, L, H, K = q_BLHK.shape
  on, shape = None, {}
  if implementation != "xla":  # XLA's implementation has none of cuDNN's limits
    on, shape = target_platform(), dict(dtype=jnp.dtype(q_BLHK.dtype).name, head_dim=K, length=L)
  _refuse("cudnn", fused_misfit("cudnn", **_features(kwargs, bias_BHLS), platform=on, **shape))
  V = v_BSGK.shape[3]
  causal, window = kwargs.get("causal", False), kwargs.get("window", 0)
  window_kind, global_tokens = kwargs.get("window_kind", "sliding"), kwargs.get("global_tokens", 0)
  qseg_BL, kseg_BS = kwargs.get("qseg_BL"), kwargs.get("kseg_BS")
  native_window = causal and window > 0 and window_kind == "sliding" and not global_tokens
  mask_B1LS = None
  if qseg_BL is not None or (window > 0 and not native_window):
    mask_B1LS = attention_mask(
      qpos_BL, kpos_BS, qseg_BL, kseg_BS, causal=causal, window=window,
      window_kind=window_kind, global_tokens=global_tokens,
    )[:, None]  # fmt: skip
  bias = bias_BHLS
  if (kb_BSH := kwargs.get("key_bias_BSH")) is not None:
    if k_BSGK.shape[1] != L:
      raise ValueError(
        f"model.attention_impl='cudnn' runs self-attention; got L={L}, S={k_BSGK.shape[1]}"
      )
    # FoX's -c_j grows with the position; each row's own -c_i, which the softmax ignores, is
    # taken off first (self-attention: key i is query i), so the bias cast to the compute
    # dtype below holds c_i - c_j, small near the diagonal, not the large absolute -c_j.
    kb_BHS = kb_BSH.astype(jnp.float32).transpose(0, 2, 1)
    rel_BHLS = kb_BHS[:, :, None, :] - kb_BHS[:, :, :, None]
    bias = rel_BHLS if bias is None else bias.astype(jnp.float32) + rel_BHLS
  W = max(K, V)  # values as wide as PoPE's keys
  o_BLHW = jax.nn.dot_product_attention(
    q_BLHK, k_BSGK, _pad_axis(v_BSGK, 3, W),
    bias=None if bias is None else bias.astype(q_BLHK.dtype), mask=mask_B1LS,
    scale=1.0 / math.sqrt(K), is_causal=causal,
    local_window_size=(window - 1, 0) if native_window else None,
    implementation=implementation,
  )  # fmt: skip
  return o_BLHW[..., :V]


FUSED = {"splash": splash_attention, "flash_bias": flash_bias_attention, "cudnn": cudnn_attention}


def pick_fused(q_BLHK, kwargs, bias_BHLS, platform: str, factors=None) -> str | None:
  """The fused kernel `auto` uses on `platform` for this call, or None (the XLA kernels):
  splash, else flash_bias on a TPU; cudnn on a GPU; none on a CPU (`auto_misfit`). `bias_BHLS`
  and `factors` may be those of one (query, key) pair: only whether they exist is read."""
  B, L, H, K = q_BLHK.shape
  features = _features(kwargs, bias_BHLS, factors)
  shape = dict(dtype=jnp.dtype(q_BLHK.dtype).name, head_dim=K, length=L)
  mesh = jax.sharding.get_abstract_mesh()
  bias_bytes = B * H * _round_up(L, LANES) ** 2 * 4 // (1 if mesh.empty else mesh.size)
  for kernel in ("splash", "flash_bias", "cudnn"):
    if PLATFORM[kernel] != platform:
      continue
    reason = fused_misfit(kernel, **features, platform=platform, **shape) or auto_misfit(
      kernel,
      features,
      bias_bytes=bias_bytes,
      dtype=shape["dtype"],
      head_dim=K,
      fold_width=0 if factors is None else factors[1].shape[-1],
    )
    if reason is None:
      log_once(f"attention_impl=auto, q {tuple(q_BLHK.shape)}: {kernel}")
      return kernel
    log_once(f"attention_impl=auto, q {tuple(q_BLHK.shape)}: not {kernel}, {reason}")
  return None


@functools.cache
def log_once(message: str) -> None:
  # Tracing runs once per compile, and each message is logged once per process.
  logging.info(message)
