"""Task accuracy against length for runs trained on a synthetic task (`eval.py --task_lengths`).

For each task length n, a fixed set of examples (drawn from the run's seed and n) is scored by
exact match (every answer token right) and per-token accuracy, greedy. Decoding is teacher-forced:
one forward pass over the whole example, answer token i predicted by the argmax after the gold
prefix. For exact match this equals free-running greedy decoding: if every answer token is right,
greedy decoding would have produced exactly the gold prefix at every step, and if one is wrong,
greedy decoding is wrong at the first such token too (everything before it was right). Per-token
accuracy is the teacher-forced one (it does not propagate earlier mistakes). Positions are
consecutive from 0, except for a run trained with randomized positions: each example then takes a
sorted random subset of [0, posenc.randomize_max) of its own length, as in training and as the
paper's evaluation does, and the scores are the mean over `randomized_positions.EVAL_DRAWS` draws
(each draw's scores are recorded too).

Writes DIR/eval/task_vs_length.json and .png, and for passkey DIR/eval/passkey_heatmap.png
(exact match by depth of the key x length).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer import runs
from roformer.data import synthetic
from roformer.data.tokenizer import ByteTokenizer
from roformer.evals import results, task_plots
from roformer.evals.effective_length import EffectiveRule, describe, task_effective_lengths
from roformer.evals.perplexity import AUTO_BATCH_TOKENS
from roformer.evals.ppl_vs_length import label_notes, scaling_record
from roformer.evals.spec import RopeOverride, overrides_suffix, rope_options
from roformer.infra import workdir as workdir_lib
from roformer.posenc import randomized as randomized_positions
from roformer.posenc.config import ContextExtension

DEFAULT_NAME = task_plots.DEFAULT_NAME
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_EVAL_STREAM = 6  # seed-sequence stream of evaluation examples (training uses 2)


def default_task_lengths(min_len: int, max_len: int) -> list[int]:
  """The training range's ends, then 2x, 4x and 8x the longest training length."""
  return sorted({min_len, max_len, 2 * max_len, 4 * max_len, 8 * max_len})


def eval_examples(task: str, n: int, num: int, *, seed: int, lsb_first=False, depth=None):
  """`num` examples of task length n, a pure function of (seed, n, depth)."""
  key = (seed, _EVAL_STREAM, n) if depth is None else (seed, _EVAL_STREAM, n, int(depth * 1000))
  rng = np.random.default_rng(key)
  return [synthetic.generate(task, rng, n, lsb_first=lsb_first, depth=depth) for _ in range(num)]


def make_predict(model) -> Callable:
  """A jitted (inputs [B, T], positions [B, T]) -> greedy next tokens [B, T] for `model`."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def predict(state, inputs_BT, positions_BT):
    logits_BTV = nnx.merge(graphdef, state)(inputs_BT, positions_BT)
    return jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)

  return lambda inputs_BT, positions_BT: predict(state, inputs_BT, positions_BT)


def score_examples(
  predict, examples, *, batch_size: int, randomize_max: int = 0, seed: int = 0,
  draws: int = randomized_positions.EVAL_DRAWS, hide_answers: bool = False,
) -> dict:  # fmt: skip
  """Exact match and per-token accuracy of teacher-forced greedy predictions.

  Args:
    predict: from `make_predict`.
    examples: (tokens, is_answer) pairs, all of one length.
    batch_size: examples per forward pass, at most all of them (the last batch is filled with
      repeats, then dropped).
    randomize_max: the run's posenc.randomize_max; > 0 scores every example at `draws` draws of
      sorted random positions in [0, randomize_max) of its own length (from `seed`).
    seed, draws: the draws' seed and number.
    hide_answers: answer tokens are hidden in the input, as the task trains
      (`synthetic.HIDDEN_ANSWERS`).

  Returns:
    {"exact_match", "token_accuracy", "examples"}, with randomized positions the means over the
    draws and each draw's scores as "exact_match_draws" and "token_accuracy_draws".
  """
  rows = synthetic.pad_examples(
    examples, len(examples[0][0]) - 1, pad_id=ByteTokenizer.pad_id, hide_answers=hide_answers
  )
  if not randomize_max:
    return {**_score_rows(predict, rows, len(examples), batch_size), "examples": len(examples)}
  if draws < 1:
    raise ValueError(f"--position_draws must be >= 1, got {draws}")
  length = rows["inputs"].shape[1]
  per_draw = []
  for draw in range(draws):
    positions = randomized_positions.randomize_positions(
      jnp.asarray(rows["positions"]),
      jnp.asarray(rows["segment_ids"]),
      max_position=randomize_max,
      key=randomized_positions.eval_key(seed, draw, length),
    )
    per_draw.append(
      _score_rows(predict, dict(rows, positions=np.asarray(positions)), len(examples), batch_size)
    )
  result = {"examples": len(examples)}
  for metric in ("exact_match", "token_accuracy"):
    values = [d[metric] for d in per_draw]
    result[metric] = float(np.mean(values))
    result[f"{metric}_draws"] = values
  return result


def _score_rows(predict, rows: dict, count: int, batch_size: int) -> dict:
  """Exact match and per-token accuracy of the first `count` padded rows."""
  exact, correct_tokens, answer_tokens = 0, 0, 0
  batch_size = min(batch_size, count)  # fewer examples than a batch: no rows of repeats
  for start in range(0, count, batch_size):
    idx = np.arange(start, start + batch_size) % count
    pred = np.asarray(predict(rows["inputs"][idx], rows["positions"][idx]))
    keep = start + np.arange(batch_size) < count
    answer = rows["weights"][idx] > 0
    right = (pred == rows["targets"][idx]) | ~answer
    exact += int(np.sum(right.all(axis=1) & keep))
    correct_tokens += int(np.sum((pred == rows["targets"][idx]) & answer & keep[:, None]))
    answer_tokens += int(np.sum(answer & keep[:, None]))
  return {"exact_match": exact / count, "token_accuracy": correct_tokens / max(answer_tokens, 1)}


def unsupported(model_cfg, task: str, n: int) -> str | None:
  """Why examples of task length n cannot be scored (task limit, learned table), or None."""
  try:
    synthetic.check_length(task, n)
  except ValueError as e:
    return str(e)
  return runs.unsupported_length(model_cfg, synthetic.example_length(task, n) - 1)


def evaluate_tasks(
  workdir,
  *,
  lengths: Sequence[int] = (),
  num_examples: int = 128,
  batch_size: int = 0,
  step: int | None = None,
  out: str = "",
  position_draws: int = randomized_positions.EVAL_DRAWS,
  effective: EffectiveRule | None = None,
  rope: RopeOverride | None = None,
  window: int = 0,
  extension: ContextExtension | None = None,
  query_scale: str = "none",
  log: Callable[[str], None] = print,
  out_dir: str = "",
) -> tuple[dict, epath.Path]:
  """Scores a synthetic-task run at several task lengths; writes NAME.json and .png to DIR/eval/,
  or to `out_dir` (checked writable before the model is loaded).

  RoPE scalings, attention windows, context extensions and query temperatures apply as in
  perplexity evaluation (`runs.eval_model_config`); an "auto" factor is an example's length over
  data.seq_len.

  The JSON's "effective_length" holds, for exact match and per-token accuracy, the longest
  length that scores at or above `effective`'s limit, read upward from data.task_max_len
  (effective_length.py).

  Args:
    workdir: a run trained with data.source='synthetic'.
    lengths: task lengths; default the training range's ends and 2x, 4x, 8x its longest.
    num_examples: examples per length (and per depth for passkey's heatmap).
    batch_size: examples per forward pass; 0 = about 16k tokens per pass.
    step: checkpoint step; None = latest.
    out: NAME (default task_vs_length, with `spec.overrides_suffix` for the overrides below).
    position_draws: draws of positions averaged over, for a run trained with randomized ones.
    effective: the limit of the effective length; None = EffectiveRule() (0.9 of the score at
      the training length).
    rope: a RoPE scaling applied at evaluation; None = as trained.
    window: a sliding attention window imposed at evaluation (0 = as trained).
    extension: a training-free context extension applied at evaluation; None = none.
    query_scale: a query temperature applied at evaluation (`spec.EVAL_QUERY_SCALES`), with
      data.seq_len as its training length; "none" = as trained.
    log: where progress lines go.
    out_dir: the directory of the results instead of DIR/eval/ (the JSON then records
      "workdir", the run's).

  Returns:
    (the JSON dict written, its path).
  """
  workdir = epath.Path(workdir_lib.resolve(str(workdir)))
  run_config = config_lib.load_run_config(workdir)
  eval_dir = results.output_dir(workdir, out_dir)
  results.check_writable(eval_dir, out_dir=out_dir)
  data = run_config.data
  if data.source != "synthetic":
    raise ValueError(
      f"--task_lengths scores synthetic tasks, but {workdir} was trained with "
      f"data.source={data.source!r} (use --lengths for perplexity)"
    )
  if num_examples < 1:
    raise ValueError(f"--task_examples must be >= 1, got {num_examples}")
  effective = effective or EffectiveRule()
  effective.check_task_threshold()
  lengths = sorted(set(int(n) for n in lengths)) or default_task_lengths(
    data.task_min_len, data.task_max_len
  )
  if lengths[0] < 1:
    raise ValueError(f"--task_lengths must be positive, got {lengths}")

  def config_at(n: int):
    tokens = synthetic.example_length(data.task, n) - 1
    return runs.eval_model_config(
      run_config.model,
      seq_len=data.seq_len,
      **rope_options(rope, tokens, data.seq_len),
      attention_window=window,
      extension=extension,
      query_scale=query_scale,
    )

  model_cfg = config_at(lengths[0])
  model, step = runs.restore_for_eval(workdir, run_config, model_cfg, step=step)
  predict = make_predict(model)
  notes = label_notes(model_cfg, trained_window=run_config.model.attention_window, protocols=())
  seed = run_config.train.seed
  randomize_max = model_cfg.posenc.randomize_max
  positions = randomized_positions.protocol(randomize_max, position_draws)
  log(
    f"evaluating {workdir} step {step} (posenc {model_cfg.posenc.kind}) on task {data.task!r}: "
    f"lengths {lengths}, {num_examples} examples each"
    + (
      f", positions drawn from [0, {randomize_max}) as in training ({position_draws} draws)"
      if randomize_max
      else ""
    )
    + "".join(f", {note}" for note in notes)
    + (f", RoPE scaling {rope.kind} factor {rope.factor}" if rope else "")
    + (f", query temperature {query_scale}" if query_scale != "none" else "")
  )

  def score(n, depth=None):
    examples = eval_examples(
      data.task, n, num_examples, seed=seed, lsb_first=data.task_lsb_first, depth=depth
    )
    tokens = len(examples[0][0]) - 1
    return score_examples(
      predict,
      examples,
      batch_size=batch_size or max(1, AUTO_BATCH_TOKENS // tokens),
      randomize_max=randomize_max,
      seed=seed,
      draws=position_draws,
      hide_answers=data.task in synthetic.HIDDEN_ANSWERS,
    )

  records, depth_scores = [], {}  # passkey: n -> exact match per depth
  for i, n in enumerate(lengths, start=1):
    prefix = f"length {i}/{len(lengths)} n={n}"
    length_cfg = config_at(n)
    if length_cfg != model_cfg:  # an "auto" factor: same parameters, another scaling
      model, model_cfg = runs.with_config(model, length_cfg), length_cfg
      predict = make_predict(model)
    reason = unsupported(model_cfg, data.task, n)
    if reason:
      records.append({"length": n, "skipped": reason})
      log(f"{prefix}: skipped ({reason})")
      continue
    start = time.perf_counter()
    record = {"length": n, "tokens": synthetic.example_length(data.task, n) - 1, **score(n)}
    records.append(record)
    if data.task == "passkey":  # scored here, by this length's model (its "auto" factor)
      depth_scores[n] = [score(n, depth)["exact_match"] for depth in PASSKEY_DEPTHS]
    log(
      f"{prefix}: exact match {record['exact_match']:.3f}, token accuracy "
      f"{record['token_accuracy']:.3f} ({time.perf_counter() - start:.1f}s)"
    )

  result = {
    "step": int(step),
    "posenc": model_cfg.posenc.kind,
    "randomize_max": randomize_max,
    "positions": positions,
    "task": data.task,
    "train_lengths": [data.task_min_len, data.task_max_len],
    "rope_scaling": scaling_record(model_cfg, rope),
    "attention_window": {"kind": "sliding", "size": window} if window else None,
    "notes": notes,
    "records": records,
  }
  if extension is not None:
    result["context_extension"] = dataclasses.asdict(extension)
  if query_scale != "none":
    result["query_scale"] = query_scale
  if data.task == "passkey":
    scored = [r["length"] for r in records if "skipped" not in r]
    grid = [[depth_scores[n][d] for n in scored] for d in range(len(PASSKEY_DEPTHS))]
    result["passkey_depths"] = {
      "depths": list(PASSKEY_DEPTHS),
      "lengths": scored,
      "exact_match": grid,
    }
    log("passkey exact match by depth (rows) x length (columns): " + str(grid))
  result["effective_length"] = task_effective_lengths(result, effective)
  for metric, label in task_plots.METRIC_LABELS.items():
    log(f"effective length ({label}): {describe(result['effective_length'][metric])}")
  name = out or DEFAULT_NAME + overrides_suffix(
    rope=rope, window=window, extension=extension, query_scale=query_scale
  )
  if out_dir:  # away from its run: name the run it scores
    result["workdir"] = str(workdir)
  json_path = results.write_result(result, eval_dir / f"{name}.json")
  png_path = task_plots.plot_task_runs(
    [(task_plots.run_label(workdir.name, result), result)],
    json_path.with_suffix(".png"),
    title=f"{workdir.name} step {step}: {data.task}",
  )
  log(f"wrote {json_path} and {png_path}")
  if "passkey_depths" in result:
    # One heatmap per result: evaluations with other overrides write beside each other.
    heatmap_name = "passkey_heatmap.png" if name == DEFAULT_NAME else f"{name}_passkey_heatmap.png"
    heatmap = task_plots.plot_passkey_heatmap(result, json_path.parent / heatmap_name)
    log(f"wrote {heatmap}")
  return result, json_path
