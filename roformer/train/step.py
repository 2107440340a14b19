"""The jitted train step: loss sums of a batch, gradients, the optimizer update, the metrics.

Pure functions of (model state, optimizer state, batch, step); roformer/train/loop.py jits them with
the state's shardings.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from roformer import data as data_lib
from roformer.config import RunConfig
from roformer.posenc import PosEnc
from roformer.posenc import randomized as randomized_positions
from roformer.train.optimizer import make_schedule


def loss_sums(
  model,
  batch: dict,
  *,
  deterministic: bool,
  rngs: nnx.Rngs | None,
  max_predictions: int = 0,
) -> dict:
  """Weighted sums of the cross-entropy and of correct predictions over one batch.

  With `max_predictions` (encoders), the output layer runs only at the first `max_predictions`
  positions of nonzero weight in each row, gathered as BERT's pre-training does: the masked
  positions, about 15% of the [B, L, V] matmul. A batch with a row of more weighted positions
  takes the all-positions path instead (lax.cond), so the sums never depend on the capacity.
  A prediction counts as correct when the target's logit is the row maximum.

  Args:
    model: Encoder or Decoder.
    batch: "inputs", "targets", "positions" int32 [B, L], optionally "segment_ids" int32 [B, L]
      (absent = one document per row); "weights" float32 [B, L] (decoder: 1 on real next-token
      targets; encoder: 1 on masked positions).
    max_predictions: per-row capacity of scored positions; 0 = score every position.

  Returns:
    {"loss_sum", "correct_sum", "weight_sum"} float32 scalars (divided once, on host).
  """
  h_BLD = model.hidden(
    batch["inputs"],
    batch["positions"],
    segment_ids_BL=batch.get("segment_ids"),
    deterministic=deterministic,
    rngs=rngs,
  )
  targets_BL = batch["targets"]
  weights_BL = batch["weights"].astype(jnp.float32)
  L = targets_BL.shape[1]

  def head_sums(h_BCD, targets_BC, weights_BC):
    logits_BCV = model.logits(h_BCD).astype(jnp.float32)
    target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    nll_BC = jax.nn.logsumexp(logits_BCV, axis=-1) - target_logit_BC
    # A max reduction instead of an argmax, which XLA:CPU runs on one thread.
    correct_BC = (target_logit_BC >= logits_BCV.max(axis=-1)).astype(jnp.float32)
    return jnp.sum(nll_BC * weights_BC), jnp.sum(correct_BC * weights_BC)

  if 0 < max_predictions < L:
    count_B = jnp.sum(weights_BL != 0, axis=1)

    def gathered(h_BLD, targets_BL, weights_BL):
      C = max_predictions
      index_BC = jax.vmap(lambda w_L: jnp.nonzero(w_L != 0, size=C, fill_value=0)[0])(weights_BL)
      h_BCD = jnp.take_along_axis(h_BLD, index_BC[..., None], axis=1)
      t_BC, w_BC = (jnp.take_along_axis(x, index_BC, axis=1) for x in (targets_BL, weights_BL))
      # Slots past a row's count repeat position 0: weight 0.
      return head_sums(h_BCD, t_BC, jnp.where(jnp.arange(C)[None, :] < count_B[:, None], w_BC, 0.0))

    loss_sum, correct_sum = jax.lax.cond(
      jnp.all(count_B <= max_predictions), gathered, head_sums, h_BLD, targets_BL, weights_BL
    )
  else:
    loss_sum, correct_sum = head_sums(h_BLD, targets_BL, weights_BL)
  return {"loss_sum": loss_sum, "correct_sum": correct_sum, "weight_sum": jnp.sum(weights_BL)}


def train_step_options(run_config: RunConfig) -> dict:
  """The static keyword arguments of `train_step` for a run (train.py and benchmarks share them)."""
  optim, train, data = run_config.optim, run_config.train, run_config.data
  encoder = run_config.model.kind == "encoder"
  return dict(
    schedule=make_schedule(optim, train.num_train_steps),
    seed=train.seed,
    grad_accum_steps=optim.grad_accum_steps,
    randomize_max=run_config.model.posenc.randomize_max,
    packed=data.pack,
    max_predictions=data_lib.max_predictions(data.seq_len, data.mlm_probability) if encoder else 0,
  )


def train_step(
  model_state,
  opt_state,
  batch: dict,
  step,
  *,
  model_def,
  opt_def,
  schedule: optax.Schedule,
  seed: int,
  grad_accum_steps: int,
  randomize_max: int = 0,
  packed: bool = True,
  max_predictions: int = 0,
):
  """One optimizer step on a global batch; returns (model_state, opt_state, metrics).

  Without `packed`, every row is one document and the segment ids are dropped (no segment mask
  in attention); `max_predictions` is `loss_sums`'.

  The loss is the sum of weighted token losses divided by the batch's total weight, so gradient
  accumulation over microbatches gives the same update as one big batch. Dropout keys are
  fold_in(key(seed), step) (then the microbatch index): a resumed run draws the same masks.
  With `randomize_max` (posenc.randomize_max), each document's positions are replaced by a sorted
  random subset of [0, randomize_max) of its own length, drawn from (seed, step)
  (`randomized_positions`).
  """
  if randomize_max:
    positions_BL = randomized_positions.randomize_positions(
      batch["positions"],
      batch.get("segment_ids"),
      max_position=randomize_max,
      key=randomized_positions.train_key(seed, step),
    )
    batch = dict(batch, positions=positions_BL)
  model = nnx.merge(model_def, model_state)
  optimizer = nnx.merge(opt_def, opt_state)
  step_key = jax.random.fold_in(jax.random.key(seed), step)
  total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)

  def loss_fn(model, micro, key):
    if not packed:
      micro = {k: v for k, v in micro.items() if k != "segment_ids"}
    sums = loss_sums(
      model,
      micro,
      deterministic=False,
      rngs=nnx.Rngs(dropout=key),
      max_predictions=max_predictions,
    )
    return sums["loss_sum"] / total_weight, sums

  grad_fn = nnx.grad(loss_fn, has_aux=True)
  if grad_accum_steps == 1:
    grads, sums = grad_fn(model, batch, step_key)
  else:
    # Microbatch m takes rows m, m + A, m + 2A, ...: every device keeps its own rows of each.
    def split(x):
      x = x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:])
      return jnp.moveaxis(x, 1, 0)

    micro_batches = {k: split(v) for k, v in batch.items()}
    params = nnx.state(model, nnx.Param)
    zeros = (
      jax.tree.map(jnp.zeros_like, params),
      {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "correct_sum", "weight_sum")},
    )

    graphdef, state = nnx.split(model)

    def body(carry, xs):
      index, micro = xs
      # Fresh Variables inside the scan's trace (nnx refuses ones from the outer trace).
      inner = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
      grads, sums = grad_fn(inner, micro, jax.random.fold_in(step_key, index))
      return jax.tree.map(jnp.add, carry, (grads, sums)), None

    (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum_steps), micro_batches))
  grad_norm = optax.tree.norm(grads)
  optimizer.update(model, grads)
  # Encodings whose parameters live in a constrained set (KERPLE's r >= 0.01) project them back.
  for _, module in nnx.iter_modules(model):
    if isinstance(module, PosEnc):
      module.constrain()
  # A finite loss and gradient can still overflow the update into inf parameters.
  params_finite = jnp.all(
    jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))])
  )
  metrics = dict(
    sums, grad_norm=grad_norm, params_finite=params_finite, learning_rate=schedule(step)
  )
  return nnx.state(model), nnx.state(optimizer), metrics
