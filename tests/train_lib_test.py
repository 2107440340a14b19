"""Tests of the optimizer, the train step and the training loop (train.py end to end)."""

import functools
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import train_helpers
from flax import nnx

from roformer import config as config_lib
from roformer import runs
from roformer.config import OptimConfig
from roformer.infra import sharding
from roformer.nn.model import ModelConfig, make_model
from roformer.train import init_from, optimizer
from roformer.train import step as step_lib

# ---- Optimizer ----


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


# ---- Train step ----


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


@pytest.mark.slow
def test_init_from_hf_roformer_loads_its_parameters():
  from roformer import hf

  path = train_helpers.REPO / "tests" / "fixtures" / "hf_roformer_tiny"
  loaded = hf.load_hf_roformer(str(path))
  mesh = sharding.make_mesh(config_lib.MeshConfig())
  make = lambda: make_model(loaded.config, rngs=nnx.Rngs(1))  # noqa: E731
  _, abstract = sharding.abstract_state(make, mesh, config_lib.MeshConfig().rules)
  state = init_from.load_init_state(str(path), abstract)
  expected = jax.tree.leaves(nnx.state(loaded.model))
  assert len(expected) == len(jax.tree.leaves(state))
  for a, b in zip(jax.tree.leaves(state), expected, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- The loop, end to end through train.py ----


def _no_traceback(result) -> None:
  assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
  straight = train_helpers.run_train(tmp_path / "straight")
  assert straight.returncode == 0, straight.stderr[-3000:]

  workdir = tmp_path / "killed"
  process = train_helpers.start_train(workdir, log_path=tmp_path / "killed.log")
  deadline = time.time() + 600
  while 20 not in train_helpers.checkpoint_steps(workdir):
    assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
    assert time.time() < deadline, "no step-20 checkpoint"
    time.sleep(0.02)
  # The step-20 evaluation (compiled on first use) keeps the run busy well past this point.
  assert process.poll() is None, "the run finished before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert train_helpers.checkpoint_steps(workdir) == [20]

  resumed = train_helpers.run_train(workdir)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from the checkpoint of step 20" in resumed.stderr
  straight_train, straight_eval = train_helpers.read_metrics(tmp_path / "straight")
  resumed_train, resumed_eval = train_helpers.read_metrics(workdir)
  assert sorted(resumed_train) == list(range(1, 41))
  for step in range(21, 41):
    train_helpers.assert_close(
      resumed_train[step]["train_loss"], straight_train[step]["train_loss"], 1e-6, f"step {step}"
    )
  train_helpers.assert_close(
    resumed_eval[40]["eval_loss"], straight_eval[40]["eval_loss"], 1e-6, "eval"
  )

  # A rerun may not change anything but the step count and frequencies.
  changed = train_helpers.run_train(
    workdir, {"optim.learning_rate": 1e-2, "train.num_train_steps": 50}
  )
  assert changed.returncode != 0
  assert "optim.learning_rate" in changed.stderr and "train.num_train_steps" in changed.stderr
  _no_traceback(changed)
  assert train_helpers.checkpoint_steps(workdir) == [20, 40]


@pytest.mark.slow
def test_mlm_config_logs_masked_loss_and_accuracy(tmp_path):
  overrides = {
    "data.vocab_size": 120,
    "model.embedding_size": 16,
    "train.num_train_steps": 30,
    "train.eval_every_steps": 30,
    "train.log_every_steps": 10,
    "train.checkpoint_every_steps": 0,
    "optim.learning_rate": 3e-3,
  }
  result = train_helpers.run_train(tmp_path, overrides, config="configs/mlm.py")
  assert result.returncode == 0, result.stderr[-3000:]
  config = config_lib.load_run_config(tmp_path)
  assert config.model.kind == "encoder" and config.data.tokenizer == "wordpiece"
  assert (tmp_path / "tokenizer.json").exists()
  train, evals = train_helpers.read_metrics(tmp_path)
  assert sorted(train) == [10, 20, 30]
  for record in train.values():
    assert 0.0 <= record["train_accuracy"] <= 1.0 and np.isfinite(record["train_loss"])
  assert train[30]["train_loss"] < train[10]["train_loss"]
  assert 0.0 <= evals[30]["eval_accuracy"] <= 1.0
  # Masked-token loss: near ln(vocab) at the start, far from the unmasked-token (copy) loss.
  assert evals[30]["eval_loss"] > 1.0
  assert list(Path(tmp_path).glob("events.out.tfevents.*"))


_BAD_INPUTS = [
  ({}, ["--config.model.num_layerz=3"], "model.num_layerz"),
  ({"posenc.kind": "rotary"}, [], "posenc.kind"),
  ({"data.files": "/nonexistent/*.txt"}, [], "data.files"),
  ({"data.files": "EMPTY"}, [], "empty"),
  (
    {
      "data.source": "hub",
      "data.hub_name": "someone/corpus",
      "data.files": "",
      "data.validation_files": "",
    },
    [],
    "data.hub_name",
  ),
  ({"posenc.kind": "learned", "posenc.max_len": 16}, [], "posenc.max_len"),
  ({"model.num_heads": 4, "model.num_kv_heads": 3}, [], "model.num_kv_heads"),
  ({"model.kind": "encoder", "posenc.kind": "xpos"}, [], "xpos"),
  ({"model.emb_dim": 30, "model.num_heads": 2}, [], "head_dim"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, args, expected", _BAD_INPUTS)
def test_bad_input_fails_with_one_clear_message(tmp_path, overrides, args, expected):
  if overrides.get("data.files") == "EMPTY":
    (tmp_path / "empty.txt").write_text("")
    overrides = {**overrides, "data.files": str(tmp_path / "empty.txt")}
  workdir = tmp_path / "run"
  result = train_helpers.run_train(
    workdir, overrides, args=args, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
  )
  assert result.returncode != 0
  _no_traceback(result)
  errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
  assert not (workdir / "checkpoints").exists()
  assert "Compiled the train step" not in result.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_naming_step_and_last_good_checkpoint(tmp_path):
  overrides = {
    "optim.learning_rate": 1e30,
    "optim.warmup_steps": 0,
    "optim.grad_clip_norm": 0.0,
    "train.checkpoint_every_steps": 1,
    "train.num_train_steps": 10,
  }
  result = train_helpers.run_train(tmp_path, overrides)
  assert result.returncode == 1
  _no_traceback(result)
  message = next(line for line in result.stderr.splitlines() if "non-finite loss" in line)
  bad_step = int(message.split("non-finite loss at step ")[1].split()[0])
  good = train_helpers.checkpoint_steps(tmp_path)
  assert good and max(good) == bad_step - 1
  assert f"The last good checkpoint is step {bad_step - 1}" in message
  model, step = runs.restore_model(tmp_path)
  assert step == bad_step - 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])  # a preemption, Ctrl-C
def test_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
  overrides = {
    "train.num_train_steps": 100_000,
    "train.checkpoint_every_steps": 0,
    "train.eval_every_steps": 0,
  }
  log_path = tmp_path / "run.log"
  process = train_helpers.start_train(tmp_path / "run", overrides, log_path=log_path)
  deadline = time.time() + 600
  metrics = tmp_path / "run" / "metrics.jsonl"
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert process.poll() is None, log_path.read_text()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  process.send_signal(signum)
  assert process.wait(timeout=300) == 0, log_path.read_text()[-3000:]
  log = log_path.read_text()
  assert "Traceback" not in log
  assert f"{signum.name} received: saved the checkpoint of step" in log
  steps = train_helpers.checkpoint_steps(tmp_path / "run")
  assert len(steps) == 1 and 3 <= steps[0] < 100_000
  assert f"saved the checkpoint of step {steps[0]}" in log
  train, _ = train_helpers.read_metrics(tmp_path / "run")
  assert max(train) <= steps[0]


@pytest.mark.slow
def test_a_log_window_cut_short_by_a_resume_says_how_many_steps_it_covers(tmp_path):
  common = {"train.log_every_steps": 4, "train.eval_every_steps": 0, "train.eval_max_tokens": 0}
  first = train_helpers.run_train(tmp_path, {**common, "train.num_train_steps": 6})
  assert first.returncode == 0, first.stderr[-3000:]
  resumed = train_helpers.run_train(tmp_path, {**common, "train.num_train_steps": 12})
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  records, _ = train_helpers.read_metrics(tmp_path)
  # Steps 5-6 end the first run, 7-8 begin the resumed one: two-step windows, said so; the
  # full windows (4 and 12) carry no count.
  assert {s: r.get("train_loss_steps") for s, r in records.items()} == {
    4: None,
    6: 2,
    8: 2,
    12: None,
  }
  assert "(train_loss over 2 steps)" in resumed.stderr


def test_a_run_validates_its_model_and_encoding_configs_once(tmp_path, monkeypatch):
  # A ModelConfig checks itself (and its posenc) when built; nothing after the config boundary
  # checks it again: not the setup, not make_model, not make_posenc, not the evaluation.
  from roformer.nn import model as model_lib
  from roformer.train import loop as train_loop

  calls = {"validate_model": 0, "validate_posenc": 0}

  def counted(name):
    real = getattr(model_lib, name)

    def count(*args, **kwargs):
      calls[name] += 1
      return real(*args, **kwargs)

    return count

  for name in calls:
    monkeypatch.setattr(model_lib, name, counted(name))
  overrides = {"train.num_train_steps": 2, "train.eval_every_steps": 2}
  train_loop.train_and_evaluate(train_helpers.tiny_config(overrides), str(tmp_path / "run"))
  assert calls == {"validate_model": 1, "validate_posenc": 1}
