"""Tests of the rotary state (`PosEnc.prepare`): one state per pass, shared by any key subset."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import posenc
from roformer.posenc.config import PosEncConfig, RopeScaling

DYNAMIC = dict(scaling=RopeScaling(kind="dynamic", factor=4.0, original_max_len=8))


def make(kind, **fields):
  with nnx.use_eager_sharding(False):
    return posenc.make_posenc(
      PosEncConfig(kind=kind, **fields),
      num_heads=2,
      head_dim=8,
      emb_dim=16,
      causal=True,
      rngs=nnx.Rngs(0),
    )


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


@pytest.mark.parametrize(
  "kind, fields, depends_on_span",
  [("rope", {}, False), ("rope", DYNAMIC, True), ("xpos", {}, True), ("xpos", DYNAMIC, True)],
)
def test_keys_rotated_in_pieces_with_the_pass_state_equal_one_call(kind, fields, depends_on_span):
  pe = make(kind, **fields)
  pos = jnp.arange(40, dtype=jnp.int32)[None] + 3
  q, k = normal(0, (1, 40, 2, 8)), normal(1, (1, 40, 2, 8))
  whole_q, whole_k = pe.rotate(q, k, pos, pos)
  state = pe.prepare(pos)
  # A decode step sees a query and a window of keys; the state of the whole pass keeps both
  # consistent with the single call.
  piece_q, _ = pe.rotate(q[:, -1:], k[:, :5], pos[:, -1:], pos[:, :5], state)
  _, piece_k = pe.rotate(q[:, :1], k[:, :20], pos[:, :1], pos[:, :20], state)
  np.testing.assert_allclose(piece_q, whole_q[:, -1:], atol=1e-6)
  np.testing.assert_allclose(piece_k, whole_k[:, :20], atol=1e-6)
  # Without the pass state, the piece's own positions decide: a different rotation when the
  # state depends on the span of positions.
  alone_k = pe.rotate(q[:, :1], k[:, :20], pos[:, :1], pos[:, :20])[1]
  assert (float(jnp.max(jnp.abs(alone_k - whole_k[:, :20]))) > 1e-3) == depends_on_span


@pytest.mark.parametrize("kind, fields", [("rope", DYNAMIC), ("xpos", {})])
def test_state_of_a_row_depends_only_on_its_first_and_last_position(kind, fields):
  pe = make(kind, **fields)
  pos = jnp.arange(30, dtype=jnp.int32)[None] + 5
  span = jnp.asarray([[5, 34]], jnp.int32)
  for a, b in zip(jax.tree.leaves(pe.prepare(pos)), jax.tree.leaves(pe.prepare(span)), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["nope", "alibi", "t5", "sinusoidal", "learned"])
def test_non_rotary_encodings_have_no_state(kind):
  assert make(kind).prepare(jnp.zeros((1, 4), jnp.int32)) is None
