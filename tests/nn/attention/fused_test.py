"""JAX's fused kernels (kernels/splash.py, flash_bias.py, cudnn.py; Pallas in interpret mode on
this CPU, cuDNN's adapter through XLA's implementation) beyond the conformance test's matrix:
padding to TPU lanes, a negative control of the mask rule, the refusals in one line, `auto`'s
choice per platform, precision of folded biases, the model's training step and a mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import testing
from roformer.nn.attention import bias_factors, kernels
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import KERNELS, base, cudnn, flash_bias, padding, splash
from roformer.posenc import make_posenc
from roformer.posenc.config import PosEncConfig

# L = 100 is padded to 128 (one TPU lane block), so padding is always exercised.
B, L, H, G, K = 2, 100, 4, 2, 8
TOL = 1e-5


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _posenc(kind, causal, num_kv_heads=G, **fields):
  cfg = PosEncConfig(kind=kind, max_len=512, **fields)
  with nnx.use_eager_sharding(False):
    return make_posenc(
      cfg, num_heads=H, head_dim=K, emb_dim=H * K, causal=causal, num_kv_heads=num_kv_heads,
      rngs=nnx.Rngs(3),
    )  # fmt: skip


def _packed(length=L):
  """Two documents per row, split at different places, positions restarting at each (packing)."""
  split = jnp.array([[60], [23]])
  idx = jnp.arange(length)[None, :]
  seg = (idx >= split).astype(jnp.int32)
  return jnp.where(seg == 1, idx - split, idx), seg


def _offset_positions(length=L):
  # Row 1 starts at 100: a mask on distances is the same on indices and on positions.
  return jnp.arange(length)[None, :] + jnp.array([[0], [100]])


def _compare(kernel, kind="rope", *, causal=True, groups=G, positions="offset", packed=False,
             extra_bias=False, sinks=False, forget=False, dtype=jnp.float32,
             **kwargs):  # fmt: skip
  """Max |fused - dense| over the output and the gradients of a random projection of it with
  respect to q, k, v (and the extra bias, sinks, and key bias when used), after the encoding's
  rotation. Returns (max error, max magnitude)."""
  posenc = _posenc(kind, causal, num_kv_heads=groups)
  q, k, v = _normal((B, L, H, K), 0), _normal((B, L, groups, K), 1), _normal((B, L, groups, K), 2)
  seg = None
  if packed:
    pos, seg = _packed()
  elif positions == "offset":
    pos = _offset_positions()
  else:
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
  q, k = posenc.rotate(q, k, pos, pos, posenc.prepare(pos))
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  cotangent = _normal((B, L, H, v.shape[-1]), 3)
  extra = {
    "bias": _normal((1, H, L, L), 4) if extra_bias else None,
    "sink_H": _normal((H,), 5) if sinks else None,
    "key_bias_BSH": -jnp.cumsum(jax.nn.softplus(_normal((B, L, H), 6)), 1) if forget else None,
  }

  def loss(fn, q, k, v, extra):
    def bias_fn(qpos, kpos):
      b = posenc.bias(qpos, kpos)
      if extra["bias"] is None:
        return b
      return extra["bias"] if b is None else b + extra["bias"]

    call = AttentionCall(
      qseg_BL=seg, kseg_BS=seg, causal=causal, bias_fn=bias_fn,
      bias_factors_fn=None if extra["bias"] is not None else posenc.bias_factors,
      content_bias_fn=posenc.content_bias, sink_H=extra["sink_H"],
      key_bias_BSH=extra["key_bias_BSH"], **kwargs,
    )  # fmt: skip
    o = fn(q, k, v, pos, pos, call)
    return (o * cotangent).sum(), o

  grad = jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True)
  got_g, got = grad(kernel, q, k, v, extra)
  want_g, want = grad(kernels.dense_attention, q, k, v, extra)
  pairs = [(got, want)] + list(zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True))
  err = max(float(jnp.abs(a - b).max()) for a, b in pairs)
  scale = max(float(jnp.abs(b).max()) for _, b in pairs)
  return err, scale


@pytest.mark.parametrize("kernel", ["splash", "flash_bias"])
def test_head_dims_padded_to_tpu_lanes_change_nothing(monkeypatch, kernel):
  monkeypatch.setattr(padding, "PAD_HEAD_DIM", True)  # as flash_bias on a TPU above 128: 16 -> 128
  widths = []
  real = padding.head_width

  def recorded(*args, **kwargs):
    widths.append(real(*args, **kwargs))
    return widths[-1]

  monkeypatch.setattr(padding, "head_width", recorded)
  case = dict(sinks=True) if kernel == "splash" else dict(extra_bias=True)
  err, scale = _compare(KERNELS[kernel].call, kind="pope", **case)  # q, k 16 wide, v 8
  assert err <= TOL * max(1.0, scale)
  assert widths and set(widths) == {padding.LANES}


# What the conformance matrix does not hold: a learned bias over the encoding's (DAB).
@pytest.mark.parametrize("kernel", ["flash_bias", "cudnn"])
def test_a_bias_beside_the_encoding_equals_dense(kernel):
  err, scale = _compare(KERNELS[kernel].emulated, kind="rope", extra_bias=True)
  assert err <= TOL * max(1.0, scale), (err, scale)


def test_a_wrong_mask_rule_is_caught(monkeypatch):
  """Negative control: the comparison sees a window one key wider than the dense kernel's."""
  real = splash.index_mask

  def one_wider(P, causal, window, window_kind, global_tokens):
    return real(P, causal, window + 1, window_kind, global_tokens)

  monkeypatch.setattr(splash, "index_mask", one_wider)
  err, scale = _compare(splash.splash_attention, kind="rope", window=16)
  assert err > 1e-3 * scale


def test_a_splash_kernel_made_under_one_jit_serves_the_next():
  """A kernel first made while a jit traces must not carry that trace's values into another (a
  train step, then an eval step of the same shape)."""
  q, k, v = _normal((B, L, H, K), 0), _normal((B, L, G, K), 1), _normal((B, L, G, K), 2)
  pos = jnp.broadcast_to(jnp.arange(L), (B, L))
  attend = lambda q: splash.splash_attention(q, k, v, pos, pos, AttentionCall(causal=True))  # noqa: E731
  first = jax.jit(attend)(q)
  second = jax.jit(lambda q: attend(q) * 2.0)(q)
  np.testing.assert_allclose(second, 2.0 * first, rtol=1e-6)


REFUSALS = [
  (splash.splash_attention, dict(kind="t5"), "splash.*no query-key factors.*flash_bias"),
  (splash.splash_attention, dict(kind="alibi", causal=False), "splash.*no query-key factors"),
  (splash.splash_attention, dict(kind="rope", extra_bias=True), "splash.*no query-key factors"),
  (splash.splash_attention, dict(kind="alibi", sinks=True), "splash.*per-query constant.*sink"),
  (
    splash.splash_attention,
    dict(kind="rope", packed=True, window=32, window_kind="chunked"),
    "splash.*chunked windows count token indices",
  ),
  (flash_bias.flash_bias_attention, dict(kind="t5", sinks=True), "flash_bias.*sink logit.*splash"),
  (cudnn.cudnn_attention, dict(kind="rope"), "cudnn.*cuDNN runs on a GPU, not on cpu"),
  (cudnn.cudnn_attention, dict(kind="rope", sinks=True), "cudnn.*sink logit"),
]


@pytest.mark.parametrize("kernel, case, message", REFUSALS)
def test_calls_a_kernel_cannot_run_are_refused_in_one_line(kernel, case, message):
  with pytest.raises(ValueError, match=message) as info:
    _compare(kernel, **case)
  assert "\n" not in str(info.value)


def test_cudnn_limits_are_refused_in_one_line():
  gpu = dict(platform="gpu")
  assert "not float32" in cudnn.misfit(Features(dtype="float32", **gpu))
  assert "not 192" in cudnn.misfit(Features(dtype="bfloat16", head_dim=192, **gpu))
  assert "even lengths" in cudnn.misfit(Features(bias=True, length=101, **gpu))
  assert cudnn.misfit(Features(dtype="bfloat16", head_dim=64, length=101, **gpu)) is None


def test_cudnn_takes_fox_bias_relative_to_each_row_in_bfloat16():
  """FoX's -c_j reaches hundreds at long range; cast to bfloat16 as cuDNN wants its bias, the
  absolute values lose the differences between nearby keys, c_i - c_j keeps them."""
  length = 512
  q, k, v = (_normal((1, length, 2, 8), s).astype(jnp.bfloat16) for s in (0, 1, 2))
  pos = jnp.arange(length)[None]
  c_BLH = -300.0 - jnp.cumsum(jnp.full((1, length, 2), 0.05), axis=1)
  fox = AttentionCall(causal=True, key_bias_BSH=-c_BLH)
  want = kernels.dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), pos, pos, fox)
  got = cudnn.emulated(q, k, v, pos, pos, fox).astype(jnp.float32)
  absolute = cudnn.emulated(  # control: the same bias as an absolute one, cast as is
    q, k, v, pos, pos,
    AttentionCall(causal=True, bias_fn=lambda qp, kp: jnp.broadcast_to(
      -c_BLH.transpose(0, 2, 1)[:, :, None, :], (1, 2, length, length))),
  ).astype(jnp.float32)  # fmt: skip
  assert float(jnp.abs(got - want).max()) < 0.05
  assert float(jnp.abs(absolute - want).max()) > 0.2


@pytest.mark.parametrize("kind", ["alibi", "fox"])
def test_folded_key_factors_keep_float32_precision_in_bfloat16(monkeypatch, kind):
  """ALiBi's m (j - j0) and FoX's -c_j reach hundreds and thousands; folded into bfloat16 keys as
  one value they keep 8 significant bits (off by whole logits), as three pieces float32's, and
  the kernel's float32 products and sums add them back exactly. Compiled with jit, where a
  rounding through bfloat16 and back could be dropped as excess precision."""
  length, heads, start = 1024, 4, 30_000  # positions from 30000, as in generation
  q, k, v = (_normal((1, length, heads, 16), s) for s in (0, 1, 2))
  pos = start + jnp.arange(length)[None]
  posenc = _posenc("alibi" if kind == "alibi" else "nope", True, num_kv_heads=heads)
  c_BLH = -jnp.cumsum(jax.nn.softplus(_normal((1, start + length, heads), 6) - 3.0), 1)[:, start:]
  options = dict(causal=True, bias_fn=posenc.bias, bias_factors_fn=posenc.bias_factors)
  if kind == "fox":
    options["key_bias_BSH"] = -c_BLH
  largest = float(jnp.abs(c_BLH).max()) if kind == "fox" else 0.25 * (length - 1)
  assert largest > 250  # past the integers bfloat16 holds exactly
  call = AttentionCall(**options)
  want = kernels.dense_attention(q, k, v, pos, pos, call)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]

  def error(fn):
    got = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos, call))(*low)
    return float(jnp.abs(got.astype(jnp.float32) - want).max())

  dense_bf16 = error(kernels.dense_attention)  # bfloat16 inputs, float32 bias: the reference
  folded = error(splash.splash_attention)
  monkeypatch.setattr(bias_factors, "KEY_FACTOR_PIECES", 1)
  one_piece = error(splash.splash_attention)
  assert folded <= 1.5 * dense_bf16, (folded, dense_bf16)
  assert one_piece > 10 * dense_bf16, (one_piece, dense_bf16)  # the control


def test_cope_and_dropout_are_refused_by_every_fused_kernel():
  fused = [kernel for kernel in KERNELS.values() if kernel.platform is not None]
  assert {kernel.name for kernel in fused} >= {"splash", "flash_bias", "cudnn", "cpu_flash"}
  for kernel in fused:
    assert "dense kernel" in kernel.misfit(Features(causal=True, content_bias=True))
    assert "dropout" in kernel.misfit(Features(causal=True, dropout=True))
    assert "per piece" in kernel.misfit(Features(causal=True, pieces=True))


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"attention_impl": "splash", "posenc.kind": "kerple"}, "splash.*kerple.*flash_bias"),
    ({"attention_impl": "splash", "posenc.kind": "fire"}, "splash.*fire.*no query-key factors"),
    ({"attention_impl": "flash_bias", "attention_sinks": True}, "sink logit"),
    ({"attention_impl": "splash", "posenc.kind": "cope"}, "CoPE"),
    ({"attention_impl": "splash", "dropout_rate": 0.1}, "attention dropout"),
    ({"attention_impl": "cudnn"}, "not float32"),
    ({"attention_impl": "splash", "attention": "linear"}, "softmax kernel.*linear"),
    (
      {
        "attention_impl": "splash",
        "attention": "mla",
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "posenc.kind": "t5",
      },
      "splash.*t5.*flash_bias",
    ),
  ],
)
def test_model_configs_a_fused_kernel_cannot_run_are_refused(overrides, message):
  from roformer.nn.config import ModelConfig

  posenc = {k.split(".")[1]: v for k, v in overrides.items() if k.startswith("posenc.")}
  model = {k: v for k, v in overrides.items() if not k.startswith("posenc.")}
  with pytest.raises(ValueError, match=message):
    ModelConfig(kind="decoder", posenc=PosEncConfig(**{"kind": "rope", **posenc}), **model)


@pytest.mark.parametrize(
  "platform, case, picked",
  [
    ("tpu", dict(kind="rope"), "splash"),
    ("tpu", dict(kind="rope", sinks=True), "splash"),
    ("tpu", dict(kind="rope", sinks=True, window=16), None),  # windows: the banded kernel
    # Folded into q and k: as exact as dense in bfloat16, less than flash_bias in float32.
    ("tpu", dict(kind="alibi", dtype=jnp.bfloat16), "splash"),
    # Sandwich's factors are emb_dim = 32 wide here, wider than the heads (8): flash_bias.
    ("tpu", dict(kind="sandwich", causal=False, dtype=jnp.bfloat16), "flash_bias"),
    ("tpu", dict(kind="nope", forget=True, dtype=jnp.bfloat16), "splash"),
    ("tpu", dict(kind="alibi"), "flash_bias"),
    ("tpu", dict(kind="nope", forget=True), "flash_bias"),
    ("tpu", dict(kind="t5", dtype=jnp.bfloat16), "flash_bias"),
    ("tpu", dict(kind="alibi", causal=False, dtype=jnp.bfloat16), "flash_bias"),
    ("tpu", dict(kind="t5", sinks=True), None),
    ("tpu", dict(kind="alibi", sinks=True, dtype=jnp.bfloat16), None),  # no fused kernel
    ("tpu", dict(kind="nope", forget=True, sinks=True, dtype=jnp.bfloat16), "splash"),
    ("tpu", dict(kind="cope"), None),
    ("gpu", dict(kind="t5", causal=False, dtype=jnp.bfloat16), "cudnn"),
    ("gpu", dict(kind="t5", causal=False), None),  # float32: cuDNN refuses it
    ("gpu", dict(kind="rope", sinks=True, dtype=jnp.bfloat16), None),
    ("cpu", dict(kind="rope"), None),
  ],
)
def test_auto_picks_the_fastest_kernel_the_platform_and_encoding_allow(
  monkeypatch, platform, case, picked
):
  calls = []

  def recorder(name):
    def kernel(q, k, v, *args, **kwargs):
      calls.append(name)
      return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)

    return kernel

  for name in ("splash", "flash_bias", "cudnn"):
    monkeypatch.setitem(KERNELS, name, dataclasses.replace(KERNELS[name], call=recorder(name)))
  monkeypatch.setattr(base, "target_platform", lambda: platform)
  _compare(kernels.auto_attention, **case, block=512)
  assert (calls[0] if calls else None) == picked


def test_auto_leaves_a_bias_too_large_for_flash_bias_to_the_xla_kernels(monkeypatch):
  calls = []
  recorder = dataclasses.replace(KERNELS["flash_bias"], call=lambda *a: calls.append(1))
  monkeypatch.setitem(KERNELS, "flash_bias", recorder)
  monkeypatch.setattr(base, "target_platform", lambda: "tpu")
  monkeypatch.setattr(flash_bias, "AUTO_BIAS_BYTES", B * H * 128 * 128 * 4 - 1)  # L = 100 -> 128
  _compare(kernels.auto_attention, kind="alibi", block=512)
  assert not calls


def test_auto_on_cpu_is_unchanged_by_the_fused_kernels(monkeypatch):
  """auto on a CPU never asks the TPU and GPU kernels: training losses cannot change."""

  def refuse_to_be_asked(features):
    pytest.fail("auto consulted a TPU or GPU kernel")

  for name in ("splash", "flash_bias", "cudnn"):
    kernel = dataclasses.replace(KERNELS[name], misfit=refuse_to_be_asked)
    monkeypatch.setitem(KERNELS, name, kernel)
  for case in (dict(kind="rope"), dict(kind="alibi", window=16)):
    err, _ = _compare(kernels.auto_attention, **case, block=8)  # the chunked path at L = 100
    assert err < 1e-5


MODEL_CASES = {
  "softmax, GQA, QK-norm, sinks": dict(num_kv_heads=2, attention_sinks=True, qk_norm="rmsnorm"),
  "mla": dict(attention="mla", kv_lora_rank=16, qk_rope_head_dim=4),
  "alibi folded, GQA": dict(num_kv_heads=2, posenc="alibi"),
  "fox folded (learned forget gate)": dict(forget_gate=True, posenc="nope"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_splash_in_the_model_equals_dense_in_a_training_step(case):
  """A decoder whose attention_impl is splash: the loss and every parameter gradient equal the
  dense kernel's (the attention layers' own paths: projections, QK-norm, sinks, GQA, MLA's
  latent keys, whose queries and keys are wider than its values, and the biases folded into q
  and k, FoX's gate learning through its key factor)."""

  testing.assert_training_step_equals_dense("splash", TOL, **MODEL_CASES[case])


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from roformer.config import MeshConfig
from roformer.infra.sharding import make_mesh
from roformer.nn.attention import bias_factors, kernels
from roformer.nn.attention.call import AttentionCall
from flax import nnx
from roformer.posenc import make_posenc
from roformer.posenc.config import PosEncConfig
mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2))
r = np.random.default_rng(0)
shapes = [(4, 100, 4, 8), (4, 100, 2, 8), (4, 100, 2, 8)]
q, k, v = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)
pos = jnp.broadcast_to(jnp.arange(100), (4, 100))
sink = jnp.asarray(r.standard_normal(4), jnp.float32)
ab = jnp.asarray(r.standard_normal((1, 4, 100, 100)), jnp.float32)
alibi = make_posenc(PosEncConfig(kind="alibi"), num_heads=4, head_dim=8, emb_dim=32, causal=True,
                    num_kv_heads=2, rngs=nnx.Rngs(0))
folded = dict(bias_fn=alibi.bias, bias_factors_fn=alibi.bias_factors)
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
seg = jnp.broadcast_to(jnp.arange(100) // 30, (4, 100))  # 4 documents a row
with jax.set_mesh(mesh):
  for label, kw in (("splash", dict(sink_H=sink)), ("flash_bias", dict(bias_fn=lambda a, b: ab)),
                    ("splash_folded", folded), ("cudnn", dict(bias_fn=lambda a, b: ab)),
                    ("cudnn_packed", dict(qseg_BL=seg, kseg_BS=seg, window=0))):
    call = AttentionCall(**{"causal": True, "window": 16, **kw})
    kernel = kernels.KERNELS[label.removesuffix("_folded").removesuffix("_packed")]
    fn = kernel.emulated if kernel.name == "cudnn" else kernel  # cuDNN's call, run by XLA
    got = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos, call))(put(q), put(k), put(v))
    print(label, float(jnp.abs(got - kernels.dense_attention(q, k, v, pos, pos, call)).max()))
"""


@pytest.mark.slow
def test_fused_kernels_split_over_batch_and_heads_of_a_mesh():
  """Batch over data, heads (their sinks and bias rows) over tensor, by shard_map; ALiBi folded
  into GQA keys repeated per query head; cuDNN's call (through XLA's implementation) with a
  bias of one batch row and with the mask of packed documents."""
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-c", SHARDED], env=testing.subprocess_env(devices=4),
    capture_output=True, text=True, check=True, timeout=600,
  ).stdout  # fmt: skip
  errors = dict(line.split() for line in out.strip().splitlines())
  assert set(errors) == {"splash", "flash_bias", "splash_folded", "cudnn", "cudnn_packed"}
  assert all(float(e) < TOL for e in errors.values()), errors


def test_attention_dropout_rate_separates_the_probabilities_from_the_residual_dropout():
  from roformer.nn import model as model_lib
  from roformer.nn.config import ModelConfig

  def build(**fields):
    cfg = ModelConfig(
      kind="decoder", vocab_size=64, num_layers=1, emb_dim=32, num_heads=4, mlp_dim=64,
      posenc=PosEncConfig(kind="rope"), **fields,
    )  # fmt: skip
    return cfg, model_lib.make_model(cfg, rngs=nnx.Rngs(0))

  # Residual dropout kept, none on the probabilities: splash accepts it.
  cfg, model = build(attention_impl="splash", dropout_rate=0.1, attention_dropout_rate=0.0)
  assert model.layers[0].attn.dropout_rate == 0.0 and model.layers[0].dropout_rate == 0.1
  cfg, model = build(dropout_rate=0.1)  # -1: the probabilities follow model.dropout_rate
  assert model.layers[0].attn.dropout_rate == 0.1
  # Attention dropout alone still draws a dropout key when training.
  cfg, _ = build(attention_dropout_rate=0.2)
  assert model_lib._dropout_key(cfg, False, nnx.Rngs(dropout=1)) is not None
  assert model_lib._dropout_key(build()[0], False, None) is None
