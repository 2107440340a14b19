"""Small models with random values in every parameter, for the attention-variant tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from roformer.nn.model import ModelConfig, make_model
from roformer.posenc.config import PosEncConfig

V = 32
TINY = ModelConfig(
  kind="decoder", vocab_size=V, num_layers=2, emb_dim=16, num_heads=4, num_kv_heads=2, mlp_dim=32
)


def config(posenc="rope", posenc_fields=None, **fields):
  """TINY with the encoding `posenc` (its fields as a dict) and model fields overridden."""
  pe = PosEncConfig(kind=posenc, max_len=64, **(posenc_fields or {}))
  return dataclasses.replace(TINY, posenc=pe, **fields)


def random_model(cfg, seed=0):
  """make_model's structure with random values in every parameter (norms and biases included)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    name = path[-2].key
    noise = rng.standard_normal(x.shape).astype(np.float32)
    if name == "scale":
      value = 1.0 + 0.1 * noise
    elif name in ("bias", "head_bias"):
      value = 0.1 * noise
    elif name == "kernel":  # fan-in scaling, roughly
      value = noise / np.sqrt(np.prod(x.shape) / x.shape[-1] if x.ndim > 1 else 1.0)
    else:
      value = 0.5 * noise
    return jnp.asarray(value, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))


def tokens(batch, length, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, V, (batch, length)), jnp.int32)


def arange(batch, length, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


@jax.jit
def forward(model, tokens_BL, positions_BL):
  return model(tokens_BL, positions_BL)


# Prompt and new tokens of `check_cached_generation`: the sequence (9) passes the original
# length (4) of the scalings the tests use.
P, N = 3, 6


def greedy_by_full_forward(model, prompt_BP, n):
  """Greedy tokens and next-token logits from one full forward pass per step.

  Each pass sees the sequence so far padded to its final length P + n: a causal model's logits
  at t - 1 do not depend on the padding, and dynamic NTK runs at the generation's length, as
  `generate` does (see its module doc).
  """
  B, P = prompt_BP.shape
  seq_BT = jnp.concatenate([prompt_BP, jnp.zeros((B, n), jnp.int32)], 1)
  logits = []
  for t in range(P, P + n):
    last_BV = forward(model, seq_BT, arange(B, P + n))[:, t - 1]
    logits.append(last_BV)
    seq_BT = seq_BT.at[:, t].set(jnp.argmax(last_BV, -1).astype(jnp.int32))
  return seq_BT, jnp.stack(logits, 1)


def check_cached_generation(cfg):
  """Greedy `generate` and cached logits of a random `cfg` model equal full forward passes."""
  from roformer import generate as gen

  model = random_model(cfg)
  prompt_BP = tokens(2, P)
  want_BT, want_logits = greedy_by_full_forward(model, prompt_BP, N)
  got_BT = gen.generate(model, prompt_BP, max_new_tokens=N)
  np.testing.assert_array_equal(got_BT, want_BT)
  got_logits = gen.cached_logits(model, want_BT, P)[:, :-1]
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
