"""generate.py's driver: a run's checkpoint and tokenizer, a prompt in, its continuation out."""

import jax
import numpy as np
from etils import epath

from roformer import config as config_lib
from roformer import generate as gen
from roformer.data.tokenizer import build_tokenizer
from roformer.evals import ppl_vs_length as eval_run


def generate_text(
  workdir,
  prompt: str,
  *,
  max_new_tokens: int = 64,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  rope_scaling: str = "none",
  rope_factor: float = 1.0,
  step: int | None = None,
) -> str:
  """The continuation of `prompt` by the run in `workdir`, decoded by the run's tokenizer.

  Args:
    workdir: a decoder run's workdir (config.json, checkpoints, tokenizer).
    prompt: the text to continue (at least one token).
    max_new_tokens, temperature, top_k, top_p: as `roformer.generate.generate`.
    seed: the sampling seed.
    rope_scaling, rope_factor: a RoPE scaling applied at generation ("none" = as trained).
    step: the checkpoint step; None = the latest.
  """
  workdir = epath.Path(workdir)
  run_config = config_lib.load_run_config(workdir)
  if run_config.model.kind != "decoder":
    raise ValueError(
      f"{workdir} holds a model.kind={run_config.model.kind!r} run; generation needs a causal "
      "decoder (model.kind='decoder')"
    )
  model_cfg = eval_run.eval_model_config(
    run_config.model,
    seq_len=run_config.data.seq_len,
    rope_scaling=rope_scaling,
    rope_factor=rope_factor,
  )
  tokenizer = build_tokenizer(run_config.data, workdir=str(workdir))
  ids = tokenizer.encode(prompt)
  if not ids:
    raise ValueError("--prompt must hold at least one token")
  model, _ = eval_run.restore_for_eval(workdir, run_config, model_cfg, step=step)
  tokens_BT = gen.generate(
    model,
    np.asarray([ids], np.int32),
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    rng=jax.random.PRNGKey(seed),
  )
  return tokenizer.decode(np.asarray(tokens_BT[0, len(ids) :]).tolist())
