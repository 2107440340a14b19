"""The optimizer: AdamW with warmup and decay, weight decay masked by parameter kind, clipping."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from roformer.config import OptimConfig


def make_schedule(optim: OptimConfig, num_train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak, then cosine | linear decay (or constant) to the last step."""
  peak = optim.learning_rate
  end = peak * optim.final_learning_rate_fraction
  decay_steps = max(num_train_steps - optim.warmup_steps, 1)
  if optim.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.final_learning_rate_fraction)
  elif optim.schedule == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  else:
    decay = optax.constant_schedule(peak)
  if optim.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak, optim.warmup_steps)
  return optax.join_schedules([warmup, decay], [optim.warmup_steps])


def decay_mask(params: Any, *, decay_posenc: bool = False) -> Any:
  """True for parameters that get weight decay: matrices and tables, not norms or biases (also
  the 2-D [heads, head_dim] attention biases).

  Positional-encoding parameters get it only when `decay_posenc` (the encoding's
  `decays_parameters`): BERT decays its learned position table, while T5 trains its bias table
  without weight decay; decay would pull every relative bias toward 0.
  """

  def decays(path, x):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "posenc" in names and not decay_posenc:
      return False
    # Attention biases are [heads, head_dim]: 2-D, yet biases all the same.
    return jnp.ndim(x) >= 2 and "bias" not in names

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
  optim: OptimConfig, num_train_steps: int, *, decay_posenc: bool = False
) -> optax.GradientTransformation:
  """AdamW with the schedule, weight decay masked off 1-D parameters (and off positional-encoding
  parameters unless `decay_posenc`), global-norm clipping."""
  adamw = optax.adamw(
    make_schedule(optim, num_train_steps),
    b1=optim.b1,
    b2=optim.b2,
    eps=optim.eps,
    weight_decay=optim.weight_decay,
    mask=functools.partial(decay_mask, decay_posenc=decay_posenc),
  )
  if optim.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), adamw)
  return adamw
