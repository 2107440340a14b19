"""Generation under a context extension: cached decoding (unrotated keys, pieces per step)
equals repeated full forward passes with the extension, and StreamingLLM's attention sinks keep a
bounded cache of the sinks and a ring of recent keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer import testing
from roformer.nn.attention import kv_cache
from roformer.posenc.config import ContextExtension

# Small enough that every kind remaps distances within the 3 + 6 generated positions.
EXTENSIONS = [
  ContextExtension("self_extend_floor", window=2, group=2),
  ContextExtension("self_extend", window=3, group=2),  # fractional query positions
  ContextExtension("dca_paper", chunk=3, local=1),
  # dca's factor stays 1 up to train_len: one factor per sequence length, which a cached step
  # cannot give the positions before it (roformer.posenc.extension.query_factor).
  ContextExtension("dca", chunk=3, local=1, train_len=16),
  ContextExtension("rerope_clamp", window=2),
  ContextExtension("rerope", window=2, train_len=4),  # log-n from position 4 on
  ContextExtension("string", shift=3, local=1),
  ContextExtension("sinks", sinks=1, window=3),  # 4 slots for 9 positions: keys are evicted
  ContextExtension("sinks", sinks=2, window=2),
]


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: f"{e.kind}")
def test_cached_generation_with_extension_equals_full_forward(ext):
  testing.check_cached_generation(testing.tiny_model_config("rope", {"extension": ext}))


def test_sinks_cache_holds_the_sinks_and_the_recent_window_only():
  cfg = testing.tiny_model_config(
    "rope", {"extension": ContextExtension("sinks", sinks=2, window=3)}
  )
  caches = testing.random_model(cfg).init_caches(2, 100)
  assert all(c.k_BCGK.shape[1] == 5 for c in caches)
  # A generation shorter than sinks + window keeps every position in its own slot.
  assert all(c.k_BCGK.shape[1] == 4 for c in testing.random_model(cfg).init_caches(2, 4))


def test_slot_positions_with_sinks():
  # 2 sinks and a ring of 3 after 9 positions (0..8): sinks 0, 1; ring slots hold 8, 6, 7.
  pos, valid = kv_cache.slot_positions(jnp.int32(9), 5, sinks=2)
  np.testing.assert_array_equal(pos, [0, 1, 8, 6, 7])
  assert valid.all()
  pos, valid = kv_cache.slot_positions(jnp.int32(3), 5, sinks=2)
  np.testing.assert_array_equal(valid, [True, True, True, False, False])
  assert pos[2] == 2
  # The prefill writes the sinks and the last ring's worth of a long prompt.
  buf = kv_cache.write(jnp.zeros((1, 5)), jnp.arange(1, 10)[None].astype(jnp.float32),
                       jnp.arange(9)[None], sinks=2)  # fmt: skip
  np.testing.assert_array_equal(buf[0], [1, 2, 9, 7, 8])  # entry p + 1 at position p
