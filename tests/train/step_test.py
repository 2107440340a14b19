"""Tests of roformer/train/step.py: gradient accumulation, the kerple clamp, randomized
positions, the MLM head at masked positions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.config import OptimConfig
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model
from roformer.train import optimizer
from roformer.train import step as step_lib


def _tiny_model():
  cfg = ModelConfig(num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense")
  return make_model(cfg, rngs=nnx.Rngs(0))


def _batch(rng, batch_size=8, length=16, vocab=259):
  tokens = rng.integers(0, vocab, size=(batch_size, length + 1)).astype(np.int32)
  weights = (rng.random((batch_size, length)) > 0.2).astype(np.float32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "positions": np.tile(np.arange(length, dtype=np.int32), (batch_size, 1)),
    "segment_ids": np.ones((batch_size, length), np.int32),
    "weights": weights,
  }


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
  model = _tiny_model()
  # A large Adam epsilon makes each update proportional to its gradient (g / (|g| + eps)), so the
  # parameters show the gradients' size: with a tiny eps Adam's first step is lr * sign(g), which
  # hides a wrong scale and turns fp32 rounding of near-zero gradients into visible differences.
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=0, eps=1e-3)
  tx = optimizer.make_optimizer(optim, 10)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(nnx.Optimizer(model, tx, wrt=nnx.Param))
  batch = _batch(np.random.default_rng(0))
  outs = []
  for accum in (1, 4):
    step = jax.jit(
      functools.partial(
        step_lib.train_step,
        model_def=model_def,
        opt_def=opt_def,
        schedule=optimizer.make_schedule(optim, 10),
        seed=0,
        grad_accum_steps=accum,
      )
    )
    outs.append(step(model_state, opt_state, batch, jnp.int32(3)))
  (m1, _, metrics1), (m4, _, metrics4) = outs
  for key in ("loss_sum", "weight_sum", "correct_sum", "grad_norm", "params_finite"):
    np.testing.assert_allclose(metrics4[key], metrics1[key], rtol=1e-5, err_msg=key)
  np.testing.assert_allclose(float(metrics1["weight_sum"]), batch["weights"].sum())
  for a, b in zip(jax.tree.leaves(m1), jax.tree.leaves(m4), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _one_step(model, batch, **options):
  optim = OptimConfig(learning_rate=1e-2, warmup_steps=0)
  tx = optimizer.make_optimizer(optim, 10)
  model_def, model_state = nnx.split(model)
  opt_def, opt_state = nnx.split(nnx.Optimizer(model, tx, wrt=nnx.Param))
  step = functools.partial(
    step_lib.train_step,
    model_def=model_def,
    opt_def=opt_def,
    schedule=optimizer.make_schedule(optim, 10),
    seed=0,
    grad_accum_steps=1,
    **options,
  )
  model_state, _, metrics = jax.jit(step)(model_state, opt_state, batch, jnp.int32(0))
  return nnx.merge(model_def, model_state), metrics


def test_kerple_parameters_below_the_clamp_are_clamped_and_keep_training():
  # The paper's code clamps r1, r2 >= 0.01 in place before every forward pass; the train step
  # does so after every update, so a parameter pushed below 0.01 sits at 0.01, still trainable.
  from roformer.posenc.config import PosEncConfig

  cfg = ModelConfig(
    num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense",
    posenc=PosEncConfig(kind="kerple"),
  )  # fmt: skip
  model = make_model(cfg, rngs=nnx.Rngs(0))
  model.posenc.r1[...] = jnp.asarray([-5.0, 1.0])
  stepped, _ = _one_step(model, _batch(np.random.default_rng(0)))
  r1 = np.asarray(stepped.posenc.r1[...])
  assert r1[0] == pytest.approx(0.01) and r1[1] != pytest.approx(1.0)


def test_randomized_training_positions_are_drawn_per_example(monkeypatch):
  # The train step hands the batch's segment ids to the draw, so a short example padded to the
  # row takes a subset of [0, N) of its own length (the padding is a document of its own).
  from roformer.posenc import randomized as rp

  seen = {}

  def spy(positions_BL, segment_ids_BL, **kwargs):
    out = original(positions_BL, segment_ids_BL, **kwargs)
    seen.update(segment_ids=segment_ids_BL, positions=out)
    return out

  original = rp.randomize_positions
  monkeypatch.setattr(rp, "randomize_positions", spy)
  batch = _batch(np.random.default_rng(0))
  batch["segment_ids"][:, 5:] = 0  # 5-token examples, then padding
  _one_step(_tiny_model(), batch, randomize_max=4096)
  assert seen["segment_ids"] is not None
  got = np.asarray(jax.jit(lambda p, s: original(p, s, max_position=4096, key=rp.train_key(0, 0)))(
    batch["positions"], batch["segment_ids"]))  # fmt: skip
  example = got[:, :5]
  assert np.all(np.diff(example, axis=1) > 0)
  # The 5 positions of each example spread over [0, 4096), far past the 16-token row.
  assert example[:, -1].mean() > 2000


@pytest.mark.parametrize("capacity", [6, 3], ids=["gathered", "row_over_capacity"])
def test_mlm_head_at_masked_positions_matches_every_position(capacity):
  cfg = ModelConfig(
    kind="encoder", num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32, attention_impl="dense"
  )
  model = make_model(cfg, rngs=nnx.Rngs(0))
  batch = _batch(np.random.default_rng(1), batch_size=4, length=16)
  # At most 4 masked positions per row (below 6, above 3), weights of 1 and 2.
  weights = np.zeros((4, 16), np.float32)
  for row, cols in enumerate([[1, 5], [0, 7, 9, 15], [], [3, 4, 8]]):
    weights[row, cols] = 1.0 + (np.arange(len(cols)) % 2)
  batch["weights"] = weights

  def loss(model, max_predictions):
    sums = step_lib.loss_sums(
      model, batch, deterministic=True, rngs=None, max_predictions=max_predictions
    )
    return sums["loss_sum"], sums

  grad_fn = jax.jit(nnx.grad(loss, has_aux=True), static_argnums=1)
  grads_all, sums_all = grad_fn(model, 0)
  grads_some, sums_some = grad_fn(model, capacity)
  assert float(sums_all["loss_sum"]) > 0.0
  for key in ("loss_sum", "correct_sum", "weight_sum"):
    np.testing.assert_allclose(sums_some[key], sums_all[key], rtol=1e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(grads_some), jax.tree.leaves(grads_all), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
