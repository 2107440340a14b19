"""Every registered kernel against the naive oracle (`oracle.reference_attention`), forward and
gradients, over one matrix built from the registries: every encoding of `POSENCS` under the causal
call, and one encoding of each hook family (`FAMILIES`) under every variant of the call (causal,
bidirectional, packing, windows of each kind, global tokens, GQA and MQA, sinks, FoX's key bias,
bfloat16), each case kept for the kernels whose `misfit` admits it. A kernel runs natively where
its platform is this one (cpu_flash where it builds), else through its emulation (splash and
flash_bias in interpret mode, cudnn through XLA's implementation). A kernel added with
`register_kernel` gets these cases without a line here."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.nn.attention import kernels
from roformer.nn.attention.call import AttentionCall, Features
from roformer.nn.attention.kernels import KERNELS, Kernel, base, refuse, register_kernel
from roformer.nn.attention.oracle import reference_attention
from roformer.posenc import POSENCS, make_posenc
from roformer.posenc.config import PosEncConfig

# L = 100 is padded to 128 by the Pallas kernels and to 112 by cpu_flash; BLOCK = 16 makes the
# chunked kernel run 7 key blocks (and its banded path under windows) and `auto` leave dense.
B, L, H, K = 2, 100, 4, 8
BLOCK = 16
TOL = {"float32": 1e-5, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Variant:
  """One form of call: a mask, the heads, the extra logit terms and the dtype."""

  causal: bool = True
  packed: bool = False
  window: int = 0
  window_kind: str = "sliding"
  global_tokens: int = 0
  groups: int = 2
  sinks: bool = False
  key_bias: bool = False
  dtype: str = "float32"


VARIANTS = {
  "causal": Variant(),
  "bidirectional": Variant(causal=False),
  "causal packed": Variant(packed=True),
  "bidirectional packed": Variant(causal=False, packed=True),
  "causal sliding window": Variant(window=16),
  "bidirectional sliding window": Variant(causal=False, window=9),
  "causal chunked window": Variant(window=32, window_kind="chunked"),
  "causal blockwise window": Variant(window=32, window_kind="blockwise"),
  "bidirectional window + global tokens": Variant(causal=False, window=9, global_tokens=3),
  "causal MQA": Variant(groups=1),
  "causal sinks": Variant(sinks=True),
  "causal sinks sliding window": Variant(sinks=True, window=16),
  "causal key bias (FoX)": Variant(key_bias=True),
  "causal packed key bias, MQA": Variant(key_bias=True, packed=True, groups=1),
  "causal sinks + key bias, MQA": Variant(sinks=True, key_bias=True, groups=1),
  "causal bfloat16": Variant(dtype="bfloat16"),
}
# Every variant runs for one encoding of each way an encoding reaches the logits, so each kernel
# path an encoding selects meets every mask and extra term: rotated q and k (RoPE), a bias with
# no factors (T5: flash_bias's dense bias, the bias blocks of dense and chunked), a bias of the
# key alone, growing with the position (causal ALiBi: folded per head into keys repeated over
# GQA groups, in three pieces in bfloat16), a bias of query and key factors in both directions
# (Sandwich), a content bias (CoPE: dense only). Every encoding runs under `ALL_ENCODINGS_VARIANT`.
FAMILIES = ("rope", "t5", "alibi", "sandwich", "cope")
ALL_ENCODINGS_VARIANT = "causal"
# The fast suite: every encoding under the causal variant, and every variant under RoPE; the slow
# suite adds the other families' variants.
FAST_ENCODINGS = ("rope",)
# Kernels that run another registered kernel (`auto` runs the one it picks, whose own cases check
# it over the whole matrix) take the fast suite's cases: their choice across encodings and variants.
DISPATCHERS = ("auto",)


def _runner(kernel: Kernel, platform: str):
  """(the function that runs `kernel` here, the platform its features are for) or None: the
  kernel itself on its platform, else its emulation with the hardware unchecked."""
  if kernel.platform in (None, platform):
    return kernel.call, platform
  if kernel.emulated is not None:
    return kernel.emulated, None
  return None


def _features(kind: str, variant: Variant, platform: str | None) -> Features:
  """The case's features from the encoding's class (the kernel probes the real ones)."""
  cls = POSENCS[kind]
  return Features(
    causal=variant.causal,
    window=variant.window > 0,
    window_kind=variant.window_kind,
    global_tokens=variant.global_tokens > 0,
    segments=variant.packed,
    bias=cls.acts_on_logits(),
    factored=cls.has_bias_factors(causal=variant.causal),
    content_bias=cls.content_bias is not None,
    key_bias=variant.key_bias,
    sinks=variant.sinks,
    platform=platform,
    dtype=variant.dtype,
    head_dim=cls.rotated_dim(PosEncConfig(kind=kind), K),
    length=L,
    key_length=L,
    batch=B,
    heads=H,
  )


def in_matrix(kind: str, label: str) -> bool:
  """Whether the matrix holds this encoding under this variant (before each kernel's misfit)."""
  return label == ALL_ENCODINGS_VARIANT or kind in FAMILIES


def conformance_cases(platform: str | None = None):
  """(kernel name, encoding, variant name, slow) for every registered kernel and every case of
  the matrix (`in_matrix`) the kernel's `misfit` admits (bidirectional ones only for encodings
  that allow them; only the fast suite's for `DISPATCHERS`); `slow` outside the fast suite."""
  platform = platform or jax.default_backend()
  cases = []
  for name, kernel in KERNELS.items():
    run = _runner(kernel, platform)
    if run is None:
      continue
    for kind, cls in POSENCS.items():
      for label, variant in VARIANTS.items():
        if not in_matrix(kind, label) or (cls.causal_only and not variant.causal):
          continue
        features = _features(kind, variant, run[1])
        if kernel.misfit(features if run[1] else features.portable()) is not None:
          continue
        slow = label != ALL_ENCODINGS_VARIANT and kind not in FAST_ENCODINGS
        if not (slow and name in DISPATCHERS):
          cases.append((name, kind, label, slow))
  return cases


def _params(cases):
  return [
    pytest.param(*case[:3], id="-".join(case[:3]), marks=[pytest.mark.slow] if case[3] else [])
    for case in cases
  ]


@functools.cache
def _posenc(kind: str, causal: bool, groups: int):
  with nnx.use_eager_sharding(False):
    return make_posenc(
      PosEncConfig(kind=kind, max_len=512), num_heads=H, head_dim=K, emb_dim=H * K, causal=causal,
      num_kv_heads=groups, rngs=nnx.Rngs(3),
    )  # fmt: skip


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _inputs(kind: str, variant: Variant):
  """(q, k, v rotated and cast, positions, the call) of a case, and the output's cotangent."""
  posenc = _posenc(kind, variant.causal, variant.groups)
  G = variant.groups
  q, k, v = _normal((B, L, H, K), 0), _normal((B, L, G, K), 1), _normal((B, L, G, K), 2)
  idx = jnp.arange(L)[None, :]
  seg = None
  if variant.packed:  # two documents per row, positions restarting at each
    split = jnp.array([[60], [23]])
    seg = (idx >= split).astype(jnp.int32)
    pos = jnp.where(seg == 1, idx - split, idx)
  elif variant.global_tokens:  # global tokens are the first positions of each row
    pos = jnp.broadcast_to(idx, (B, L))
  else:  # row 1 from 128: kernels read positions, and index-counted masks still align
    pos = idx + jnp.array([[0], [128]])
  q, k = posenc.rotate(q, k, pos, pos, posenc.prepare(pos))
  q, k, v = (x.astype(variant.dtype) for x in (q, k, v))
  call = AttentionCall(
    causal=variant.causal, window=variant.window, window_kind=variant.window_kind,
    global_tokens=variant.global_tokens, qseg_BL=seg, kseg_BS=seg, bias_fn=posenc.bias,
    bias_factors_fn=posenc.bias_factors, content_bias_fn=posenc.content_bias,
    sink_H=_normal((H,), 5) if variant.sinks else None,
    key_bias_BSH=-jnp.cumsum(jax.nn.softplus(_normal((B, L, H), 6)), 1)
    if variant.key_bias else None,
    block=BLOCK,
  )  # fmt: skip
  return (q, k, v, pos, call), _normal((B, L, H, v.shape[-1]), 3)


def _outputs_and_grads(fn, q, k, v, pos, call, cotangent):
  """The output and the gradients of <output, cotangent> with respect to q, k, v and the sink
  and key-bias arrays of the call."""

  def loss(q, k, v, sink, key_bias):
    o = fn(q, k, v, pos, pos, call.replace(sink_H=sink, key_bias_BSH=key_bias))
    return (o.astype(jnp.float32) * cotangent).sum(), o

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
  grads, out = grad(q, k, v, call.sink_H, call.key_bias_BSH)
  return [out, *jax.tree.leaves(grads)]


def check_case(name: str, kind: str, label: str, *, kernel: Kernel | None = None):
  """Max |kernel - oracle| over the output and the gradients of a case, within its dtype's
  tolerance of the largest magnitude; returns (error, scale)."""
  kernel = kernel or KERNELS[name]
  run = _runner(kernel, jax.default_backend())
  if kernel.platform == jax.default_backend() and (reason := kernel.unavailable()) is not None:
    pytest.skip(reason)
  args, cotangent = _inputs(kind, VARIANTS[label])
  got = [x.astype(jnp.float32) for x in _outputs_and_grads(run[0], *args, cotangent)]
  want = _oracle(kind, label)
  err = max(float(jnp.abs(a - b).max()) for a, b in zip(got, want, strict=True))
  scale = max(float(jnp.abs(b).max()) for b in want)
  return err, scale, TOL[VARIANTS[label].dtype]


@functools.cache
def _oracle(kind: str, label: str):
  """The oracle's output and gradients of a case in float32, computed once for every kernel."""
  args, cotangent = _inputs(kind, VARIANTS[label])
  return [x.astype(jnp.float32) for x in _outputs_and_grads(reference_attention, *args, cotangent)]


@pytest.mark.parametrize(("name", "kind", "label"), _params(conformance_cases()))
def test_kernel_equals_the_oracle_forward_and_gradients(name, kind, label):
  err, scale, tol = check_case(name, kind, label)
  assert err <= tol * max(1.0, scale), (err, scale)


def test_every_registered_kernel_and_encoding_has_cases():
  cases = conformance_cases()
  assert {name for name, *_ in cases} == set(KERNELS)
  assert {kind for _, kind, *_ in cases} == set(POSENCS)
  for name in KERNELS:  # every kernel runs the plainest case of an encoding it admits
    assert any(c[0] == name and c[2] == "causal" for c in cases), name


def _logit_terms(cls) -> tuple:
  """How an encoding reaches the logits: a bias, its factors (causal, bidirectional), a content
  bias."""
  factored = tuple(cls.has_bias_factors(causal=causal) for causal in (True, False))
  return (cls.acts_on_logits(), *factored, cls.content_bias is not None)


def test_every_way_an_encoding_reaches_the_logits_runs_every_variant():
  """FAMILIES holds an encoding of each kind of logit term some registered encoding has."""
  assert {_logit_terms(POSENCS[kind]) for kind in FAMILIES} == {
    _logit_terms(cls) for cls in POSENCS.values()
  }
  cases = {c[1:3] for c in conformance_cases() if c[0] == "dense"}
  for kind in FAMILIES:
    labels = [label for label, v in VARIANTS.items() if v.causal or not POSENCS[kind].causal_only]
    assert all((kind, label) in cases for label in labels), kind


def test_the_oracle_catches_a_wrong_kernel():
  """Negative control: the dense kernel with the mask's window one key wider fails the check."""

  def wider(q, k, v, qpos, kpos, call):
    return kernels.dense_attention(q, k, v, qpos, kpos, call.replace(window=call.window + 1))

  err, scale, tol = check_case("", "rope", "causal sliding window", kernel=_toy("wider", wider))
  assert err > 100 * tol * max(1.0, scale)


def _toy(name, call):
  """A kernel that runs anywhere and takes every call, as a test would register one."""
  return Kernel(name, None, lambda features: None, call)


@pytest.fixture
def toy_kernel():
  """A kernel registered as a test file or a user's module would register one (docs/extending.md,
  "An attention kernel"): the oracle under another name, refusing sinks when a config is checked
  and when it is called; taken out of the registry afterwards."""

  def misfit(features: Features) -> str | None:
    return "it has no sink logits" if features.sinks else None

  def toy_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call: AttentionCall):
    refuse("toy", misfit(base.features(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)))
    return reference_attention(q_BLHK, k_BSGK, v_BSGV, qpos_BL, kpos_BS, call)

  toy = register_kernel(Kernel("toy", None, misfit, toy_attention))
  yield toy
  del KERNELS[toy.name]


def test_a_kernel_registered_in_a_test_gets_every_case_of_the_matrix(toy_kernel):
  cases = [c for c in conformance_cases() if c[0] == toy_kernel.name]
  dense = [c for c in conformance_cases() if c[0] == "dense" and not VARIANTS[c[2]].sinks]
  assert sorted(c[1:] for c in cases) == sorted(c[1:] for c in dense)
  assert len(cases) > len(POSENCS) * 5
  for kind in ("rope", "alibi", "t5"):  # and runs them (the oracle against itself: exact)
    err, _, _ = check_case(toy_kernel.name, kind, "causal packed")
    assert err == 0.0, kind
  (q, k, v, pos, call), _ = _inputs("rope", VARIANTS["causal sinks"])
  with pytest.raises(ValueError, match="attention_impl='toy' cannot run .*no sink logits"):
    toy_kernel(q, k, v, pos, pos, call)
