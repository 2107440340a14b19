"""Tests of roformer/train/optimizer.py: the schedule, weight decay and its mask, gradient
clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from roformer.config import OptimConfig
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model
from roformer.train import optimizer


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_warms_up_linearly_then_decays_to_final_fraction(schedule):
  optim = OptimConfig(
    learning_rate=1.0, schedule=schedule, warmup_steps=10, final_learning_rate_fraction=0.1
  )
  lr = optimizer.make_schedule(optim, num_train_steps=110)
  np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 0.5, 1.0], atol=1e-6)
  end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
  np.testing.assert_allclose(lr(110), end, atol=1e-6)
  middle = {"cosine": 0.55, "linear": 0.55, "constant": 1.0}[schedule]
  np.testing.assert_allclose(lr(60), middle, atol=1e-6)


def test_schedule_without_warmup_starts_at_peak():
  lr = optimizer.make_schedule(OptimConfig(learning_rate=2.0, warmup_steps=0), num_train_steps=10)
  np.testing.assert_allclose(lr(0), 2.0)


def _tiny_model():
  cfg = ModelConfig(num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense")
  return make_model(cfg, rngs=nnx.Rngs(0))


def test_weight_decay_shrinks_matrices_but_not_norms_or_biases():
  rng = np.random.default_rng(0)
  params = {
    "embed": {"embedding": rng.normal(size=(11, 4))},
    "attn": {"kernel": rng.normal(size=(4, 2, 2)), "bias": rng.normal(size=(2, 2))},
    "mlp": {"kernel": rng.normal(size=(4, 8)), "bias": rng.normal(size=(8,))},
    "norm": {"scale": rng.normal(size=(4,)), "bias": rng.normal(size=(4,))},
  }
  params = jax.tree.map(jnp.asarray, params)
  optim = OptimConfig(learning_rate=1.0, warmup_steps=0, schedule="constant", weight_decay=0.5)
  tx = optimizer.make_optimizer(optim, 10)

  @jax.jit
  def one_step(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return optax.apply_updates(params, tx.update(zeros, tx.init(params), params)[0])

  after = one_step(params)
  for path, before in jax.tree_util.tree_leaves_with_path(params):
    got = np.asarray(after[path[0].key][path[1].key])
    name = jax.tree_util.keystr(path)
    if name.endswith("['kernel']") or name.endswith("['embedding']"):  # p <- p - lr * wd * p
      np.testing.assert_allclose(got, 0.5 * np.asarray(before), rtol=1e-6, err_msg=name)
    elif name.endswith("['scale']") or np.ndim(before) == 1:
      np.testing.assert_array_equal(got, np.asarray(before), err_msg=name)
  # A 2-D attention bias ([heads, head_dim]) is a bias all the same: never decayed.
  np.testing.assert_array_equal(after["attn"]["bias"], params["attn"]["bias"])


def test_decay_mask_spares_every_one_dimensional_model_parameter_and_every_bias():
  params = nnx.state(nnx.eval_shape(_tiny_model), nnx.Param)
  mask = optimizer.decay_mask(params)
  for (path, keep), (_, value) in zip(
    jax.tree_util.tree_leaves_with_path(mask),
    jax.tree_util.tree_leaves_with_path(params),
    strict=True,
  ):
    name = jax.tree_util.keystr(path)
    assert bool(keep) == (np.ndim(value) >= 2 and "bias" not in name), name
  names = [jax.tree_util.keystr(p) for p, k in jax.tree_util.tree_leaves_with_path(mask) if not k]
  assert any("norm" in n for n in names) and any("bias" in n for n in names)


def test_gradients_are_clipped_to_the_global_norm_before_adam():
  # b1 = b2 = 0 and eps = 1 make Adam's update g / (|g| + 1), which depends on g's scale.
  optim = OptimConfig(
    learning_rate=1.0,
    warmup_steps=0,
    schedule="constant",
    weight_decay=0.0,
    grad_clip_norm=0.5,
    b1=0.0,
    b2=0.0,
    eps=1.0,
  )
  tx = optimizer.make_optimizer(optim, 10)
  params = {"w": jnp.zeros((3, 3))}
  update = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])
  updates = update({"w": jnp.full((3, 3), 10.0)}, params)
  clipped = 0.5 / 3.0  # each of the 9 entries after clipping the norm 30 to 0.5
  np.testing.assert_allclose(updates["w"], -clipped / (clipped + 1.0), rtol=1e-5)
