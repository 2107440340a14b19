"""The cuDNN adapter (roformer/nn/attention/kernels/cudnn.py) without and with segment ids: run
through the same jax.nn.dot_product_attention call with implementation="xla", it equals the
oracle; and without segments the call carries no mask at all (cuDNN's causal kernel, its own
sliding window), which is what every unpacked batch gives it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from roformer.nn.attention.call import AttentionCall
from roformer.nn.attention.kernels import cudnn
from roformer.nn.attention.oracle import reference_attention

B, L, H, G, K = 2, 16, 4, 2, 16
MASKS = {
  "causal": dict(causal=True),
  "causal_window": dict(causal=True, window=5),
  "bidirectional": dict(causal=False),
}


def _inputs(offset=0):
  q_BLHK, k_BLGK, v_BLGK = (
    jax.random.normal(jax.random.key(i), (B, L, n, K), jnp.float32) for i, n in enumerate((H, G, G))
  )
  pos_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32) + offset, (B, L))
  return q_BLHK, k_BLGK, v_BLGK, pos_BL


def _segments():
  return jnp.asarray(np.repeat([[1] * 7 + [2] * 9], B, axis=0), jnp.int32)


def _loss_and_grads(kernel, call, q_BLHK, k_BLGK, v_BLGK, pos_BL):
  w_BLHK = jax.random.normal(jax.random.key(9), (B, L, H, K), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(kernel(q, k, v, pos_BL, pos_BL, call).astype(jnp.float32) * w_BLHK)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q_BLHK, k_BLGK, v_BLGK)


@pytest.mark.parametrize("segments", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("mask", MASKS)
def test_cudnn_adapter_equals_the_oracle(mask, segments):
  # Positions offset as an evaluation window's: cuDNN's causal rule and window count token
  # indices, which agree with positions that count up by one along the row.
  q_BLHK, k_BLGK, v_BLGK, pos_BL = _inputs(offset=100)
  seg_BL = _segments() if segments else None
  call = AttentionCall(**MASKS[mask], qseg_BL=seg_BL, kseg_BS=seg_BL)
  got = _loss_and_grads(cudnn.emulated, call, q_BLHK, k_BLGK, v_BLGK, pos_BL)
  want = _loss_and_grads(reference_attention, call, q_BLHK, k_BLGK, v_BLGK, pos_BL)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", MASKS)
def test_cudnn_adapter_sends_no_mask_without_segments(mask, monkeypatch):
  seen = []
  original = jax.nn.dot_product_attention

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return original(*args, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  q_BLHK, k_BLGK, v_BLGK, pos_BL = _inputs()
  for seg_BL in (None, _segments()):
    call = AttentionCall(**MASKS[mask], qseg_BL=seg_BL, kseg_BS=seg_BL)
    cudnn.emulated(q_BLHK, k_BLGK, v_BLGK, pos_BL, pos_BL, call)
  unpacked, packed = seen
  causal = MASKS[mask]["causal"]
  window = MASKS[mask].get("window", 0)
  assert unpacked["mask"] is None  # cuDNN's unmasked kernel: causal or full
  assert unpacked["is_causal"] == causal
  assert unpacked["local_window_size"] == ((window - 1, 0) if window else None)
  assert packed["mask"].shape == (B, 1, L, L)  # documents need the [B, 1, L, S] mask
