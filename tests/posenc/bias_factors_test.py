"""PosEnc.bias_factors: a bias as query and key factors, which splash takes folded into q and k.

The product of the factors must equal the bias up to a constant per query (softmax ignores it)
on every pair the attention allows: causal pairs for a decoder, all pairs for an encoder.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer import posenc
from roformer.posenc.config import PosEncConfig

B, L, H = 2, 40, 4


def _encoding(kind, causal, **fields):
  cfg = PosEncConfig(kind=kind, max_len=4096, **fields)
  return posenc.make_posenc(
    cfg, num_heads=H, head_dim=16, emb_dim=64, causal=causal, rngs=nnx.Rngs(0)
  )


def _positions():
  # Row 1 starts at 1000: the factors see absolute positions, the bias only distances.
  return jnp.arange(L)[None, :] + jnp.array([[0], [1000]])


def _product_minus_bias(enc, bias_enc=None):
  """[B, H, L, S] of sum_r a b - bias (of `bias_enc`, default `enc`), a None `a` read as ones."""
  pos = _positions()
  a_BLHR, b_BSXR = enc.bias_factors(pos, pos)
  if a_BLHR is None:
    a_BLHR = jnp.ones((B, L, H, b_BSXR.shape[-1]), jnp.float32)
  b_BSHR = jnp.broadcast_to(b_BSXR, (B, L, H, b_BSXR.shape[-1]))
  product_BHLS = jnp.einsum("blhr,bshr->bhls", a_BLHR, b_BSHR)
  return np.asarray(product_BHLS - (bias_enc or enc).bias(pos, pos), np.float64)


@pytest.mark.parametrize(
  "kind, causal, fields",
  [("alibi", True, {}), ("sandwich", True, {}), ("sandwich", False, {"sandwich_dim": 32})],
)
def test_factors_give_the_bias_up_to_a_constant_per_query(kind, causal, fields):
  enc = _encoding(kind, causal, **fields)
  assert type(enc).has_bias_factors(causal=causal)
  diff = _product_minus_bias(enc)
  allowed = np.tril(np.ones((L, L), bool)) if causal else np.ones((L, L), bool)
  for b in range(B):
    for h in range(H):
      for i in range(L):
        row = diff[b, h, i][allowed[i]]
        # 1e-3 of the largest ALiBi factor here (m j = 0.25 x 1039) is float32's rounding.
        assert np.ptp(row) < 1e-4 * max(1.0, np.abs(row).max()), (kind, b, h, i)


def test_a_bias_the_factors_do_not_give_is_caught():
  """Negative control: the decoder's factors m j against the encoder's bias -m |i - j|, equal on
  the causal pairs, differ by more than a constant once keys after the query count."""
  diff = _product_minus_bias(_encoding("alibi", True), _encoding("alibi", False))
  assert np.ptp(diff[0, 0, 5, :6]) < 1e-5 and np.ptp(diff[0, 0, 5]) > 1.0


def test_alibi_has_factors_only_when_causal():
  cls = posenc.POSENCS["alibi"]
  assert cls.has_bias_factors(causal=True) and not cls.has_bias_factors(causal=False)
  pos = _positions()
  assert _encoding("alibi", False).bias_factors(pos, pos) is None


@pytest.mark.parametrize("kind", ["t5", "kerple", "fire", "rope", "nope"])
def test_other_encodings_have_no_factors(kind):
  assert not posenc.POSENCS[kind].has_bias_factors(causal=True)
