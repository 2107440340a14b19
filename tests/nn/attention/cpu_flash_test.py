"""The fused CPU kernel (cpu_flash): equal to the dense kernel in outputs and gradients, picked
by `auto` on a CPU only for calls it fits, refused with the reason otherwise, and a clean
fall-back when it cannot be built."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer import testing
from roformer.nn.attention import kernels
from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kernels import cpu_flash

TOL = 1e-5


def _inputs(B, L, H, G, K, seed=0, V=None):
  r = np.random.default_rng(seed)
  shapes = [(B, L, H, K), (B, L, G, K), (B, L, G, V or K), (B, L, H, V or K)]
  q, k, v, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)
  return q, k, v, w, jnp.broadcast_to(jnp.arange(L), (B, L))


def _value_and_grads(fn, q, k, v, w):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v) * w)

  out = jax.jit(fn)(q, k, v)
  return (out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))


def _max_errors(got, want):
  return [
    float(jnp.abs(a - b).max() / max(1.0, float(jnp.abs(b).max())))
    for a, b in zip(got, want, strict=True)
  ]


@pytest.mark.parametrize(
  "B, L, H, G, K, V",
  [
    (2, 64, 3, 3, 16, 16),  # one block, no padding
    (2, 37, 4, 2, 24, 24),  # GQA; length and head dim padded
    (1, 130, 2, 1, 64, 64),  # MQA over three blocks, the last one short
    (2, 70, 2, 2, 16, 8),  # values narrower than queries and keys (PoPE)
    (1, 1100, 2, 1, 16, 16),  # keys in three chunks of the forward pass's softmax
    (1, 70, 2, 1, 48, 48),  # a head dim of three vectors (the GEMM's narrowest column tile)
  ],
)
def test_cpu_flash_equals_dense_in_outputs_and_gradients(B, L, H, G, K, V):
  q, k, v, w, pos = _inputs(B, L, H, G, K, V=V)
  want = _value_and_grads(
    lambda q, k, v: kernels.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True)),
    q,
    k,
    v,
    w,
  )
  got = _value_and_grads(
    lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, pos, pos, AttentionCall(causal=True)),
    q,
    k,
    v,
    w,
  )
  assert max(_max_errors(got, want)) < TOL
  # Negative control: the same comparison sees a mask shifted by one (each query's own key
  # masked) and bidirectional attention.
  shifted = _value_and_grads(
    lambda q, k, v: kernels.dense_attention(q, k, v, pos, pos + 1, AttentionCall(causal=True)),
    q,
    k,
    v,
    w,
  )
  bidirectional = _value_and_grads(
    lambda q, k, v: kernels.dense_attention(q, k, v, pos, pos, AttentionCall()), q, k, v, w
  )
  for wrong in (shifted, bidirectional):
    assert _max_errors(got[:1], wrong[:1])[0] > 100 * TOL


def test_auto_on_cpu_runs_cpu_flash_for_plain_causal_self_attention_only(monkeypatch):
  calls = []
  real = cpu_flash.attend
  monkeypatch.setattr(cpu_flash, "attend", lambda *a: calls.append(1) or real(*a))
  q, k, v, _, pos = _inputs(2, 40, 4, 2, 16)
  for kwargs, used in [
    (dict(causal=True), True),
    (dict(causal=False), False),
    (dict(causal=True, window=8), False),
    (
      dict(causal=True, qseg_BL=jnp.ones((2, 40), jnp.int32), kseg_BS=jnp.ones((2, 40), jnp.int32)),
      False,
    ),
    (dict(causal=True, bias_fn=lambda a, b: jnp.zeros((2, 4) + a.shape[1:] + b.shape[1:])), False),
    (dict(causal=True, sink_H=jnp.zeros(4)), False),
  ]:
    calls.clear()
    got = kernels.auto_attention(q, k, v, pos, pos, AttentionCall(block=512, **kwargs))
    want = kernels.dense_attention(q, k, v, pos, pos, AttentionCall(**kwargs))
    assert bool(calls) == used, kwargs
    assert float(jnp.abs(got - want).max()) < TOL
  calls.clear()
  kernels.auto_attention(
    *(x.astype(jnp.bfloat16) for x in (q, k, v)), pos, pos, AttentionCall(causal=True)
  )
  assert not calls  # float32 only


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(causal=False), "causal attention only"),
    (dict(causal=True, window=8), "window"),
    (dict(causal=True, sink_H=jnp.zeros(4)), "sinks"),
    (
      dict(causal=True, bias_fn=lambda a, b: jnp.zeros((2, 4) + a.shape[1:] + b.shape[1:])),
      "no logit bias",
    ),
  ],
)
def test_cpu_flash_refuses_what_it_cannot_run_in_one_line(kwargs, message):
  q, k, v, _, pos = _inputs(2, 40, 4, 2, 16)
  with pytest.raises(
    ValueError, match=f"attention_impl='cpu_flash' cannot run this attention: .*{message}"
  ):
    cpu_flash.cpu_flash_attention(q, k, v, pos, pos, AttentionCall(**kwargs))


def test_cpu_flash_refuses_16_bit_inputs_in_one_line():
  q, k, v, _, pos = _inputs(2, 40, 4, 2, 16)
  with pytest.raises(ValueError, match="float32"):
    cpu_flash.cpu_flash_attention(
      *(x.astype(jnp.bfloat16) for x in (q, k, v)), pos, pos, AttentionCall(causal=True)
    )


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
  """No usable C++ compiler and an empty build cache; the real build is back afterwards."""
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
  monkeypatch.setenv("ROFORMER_CACHE", str(tmp_path / "cache"))
  cpu_flash.build.cache_clear()
  cpu_flash.unavailable.cache_clear()
  yield
  cpu_flash.build.cache_clear()
  cpu_flash.unavailable.cache_clear()


def test_without_a_compiler_auto_falls_back_and_cpu_flash_says_why(no_compiler):
  assert "did not build" in cpu_flash.unavailable()
  q, k, v, _, pos = _inputs(2, 40, 4, 2, 16)
  got = kernels.auto_attention(q, k, v, pos, pos, AttentionCall(causal=True))
  assert (
    float(
      jnp.abs(got - kernels.dense_attention(q, k, v, pos, pos, AttentionCall(causal=True))).max()
    )
    < TOL
  )
  with pytest.raises(
    RuntimeError, match="cpu_flash' cannot run: the CPU kernel did not build.*no-such-c"
  ):
    cpu_flash.cpu_flash_attention(q, k, v, pos, pos, AttentionCall(causal=True))


def test_cpu_flash_in_the_model_equals_dense_in_a_training_step():
  """A GQA decoder with QK-norm: the loss and every parameter gradient through cpu_flash equal
  the dense kernel's."""

  testing.assert_training_step_equals_dense("cpu_flash", TOL, num_kv_heads=2, qk_norm="rmsnorm")


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from roformer.config import MeshConfig
from roformer.infra.sharding import make_mesh
from roformer.nn.attention import kernels
from roformer.nn.attention.kernels import cpu_flash
from roformer.nn.attention.call import AttentionCall
CAUSAL = AttentionCall(causal=True)
mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2))
r = np.random.default_rng(0)
q, k, v, w = (jnp.asarray(r.standard_normal(s), jnp.float32)
              for s in [(4, 100, 4, 16), (4, 100, 2, 16), (4, 100, 2, 16), (4, 100, 4, 16)])
pos = jnp.broadcast_to(jnp.arange(100), (4, 100))
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor", None)))
def loss(fn):
  return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, pos, pos, CAUSAL) * w),
                                    argnums=(0, 1, 2)))
with jax.set_mesh(mesh):
  got = loss(cpu_flash.cpu_flash_attention)(put(q), put(k), put(v))
  run = jax.jit(lambda q, k, v: cpu_flash.cpu_flash_attention(q, k, v, pos, pos, CAUSAL))
  text = run.lower(put(q), put(k), put(v)).compile().as_text()
want = loss(kernels.dense_attention)(q, k, v)
pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
print("error", max(float(jnp.abs(a - b).max() / max(1.0, jnp.abs(b).max())) for a, b in pairs))
print("all-gathers", text.count("all-gather"))
"""


@pytest.mark.slow
def test_cpu_flash_splits_over_batch_and_heads_of_a_mesh():
  """Batch over data and heads over tensor by shard_map: the same loss and gradients as one
  device, with no all-gather of q, k or v in the compiled program."""
  out = subprocess.run(
    [sys.executable, "-c", SHARDED], env=testing.subprocess_env(devices=4),
    capture_output=True, text=True, check=True, timeout=600,
  ).stdout  # fmt: skip
  results = dict(line.split() for line in out.strip().splitlines())
  assert float(results["error"]) < TOL
  assert int(results["all-gathers"]) == 0
