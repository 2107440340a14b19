"""eval.py's driver: a run's checkpoint at several lengths, its JSON and plot, and comparisons.

Writes DIR/eval/NAME.json and NAME.png (docs/design.md, "Workdir"); perplexity.py does the scoring.
"""

import dataclasses
import time
from collections.abc import Callable

import numpy as np
from etils import epath

from roformer import config as config_lib
from roformer import data as data_lib
from roformer import runs
from roformer.data.sources.local_files import TEXT_ENCODING_ADVICE
from roformer.errors import DataError
from roformer.evals import key_tokens, perplexity, plots, results
from roformer.evals.effective_length import describe, perplexity_effective_lengths
from roformer.evals.perplexity import AUTO_BATCH_TOKENS
from roformer.evals.spec import EvalSpec, RopeOverride, output_name, rope_options
from roformer.infra import workdir as workdir_lib
from roformer.posenc import POSENCS
from roformer.posenc import randomized as randomized_positions
from roformer.posenc.config import EXTENSION_FIELDS, RopeScaling

# Positions kept in the JSON's per-position curve; longer windows are averaged over equal bins.
MAX_POSITION_POINTS = 256


def label_notes(model_cfg, *, trained_window: int, stride: int = 0, protocols=()) -> list[str]:
  """What a curve's label must say to be read right: the attention window in force, an
  encoding's paper setting left out (xPos without BCA), the sliding stride."""
  notes = []
  paper_window = POSENCS[model_cfg.posenc.kind].paper_eval_window
  if model_cfg.attention_window and model_cfg.attention_window_kind == "blockwise":
    notes.append(f"BCA {model_cfg.attention_window}")
  elif model_cfg.attention_window and model_cfg.attention_window != trained_window:
    notes.append(f"window {model_cfg.attention_window}")
  elif paper_window == "blockwise":
    notes.append("no BCA")
  extension = model_cfg.posenc.extension
  if extension.kind != "none":
    numbers = ", ".join(f"{f} {getattr(extension, f)}" for f in EXTENSION_FIELDS[extension.kind])
    notes.append(f"{extension.kind} ({numbers})")
  if model_cfg.posenc.query_scale != "none":
    notes.append(f"query scale {model_cfg.posenc.query_scale}")
  if "sliding" in protocols:
    notes.append(f"stride {stride}" if stride else "stride L/4")
  return notes


def load_eval_tokens(run_config, workdir, *, split: str = "validation", data_files: str = ""):
  """The token stream evaluated and the run's tokenizer.

  Args:
    run_config: the run's RunConfig (its DataConfig and tokenizer are reused).
    workdir: the run's workdir (holds a trained tokenizer, read, never written); "" for none.
    split: "validation" or "test" of the run's corpus.
    data_files: a glob of other text files, tokenized with the run's tokenizer (replaces `split`).

  Returns:
    (tokens int32 [T], tokenizer).
  """
  data_cfg = run_config.data
  if data_files:
    # Same tokenizer setting and workdir: a trained tokenizer is loaded from DIR/tokenizer.json.
    data_cfg = dataclasses.replace(
      data_cfg, source="files", files=data_files, validation_files=data_files
    )
    split = "validation"
  # Only a trained tokenizer is read from the workdir; given one by path (data.tokenizer=*.json,
  # an imported model's), load_corpus would copy it there, and evaluation writes only results.
  trained = data_cfg.tokenizer in ("bpe", "wordpiece")
  try:
    corpus = data_lib.load_corpus(
      data_cfg, workdir=str(workdir) if trained else "", splits=(split,)
    )
  except DataError as e:
    if not data_files:
      raise
    raise DataError(_as_data_files_flag(str(e), data_files, data_cfg.text_encoding)) from None
  return np.asarray(corpus.tokens(split)), corpus.tokenizer


def _as_data_files_flag(message: str, data_files: str, encoding: str) -> str:
  """A data error about --data_files in eval.py's words: the flag, not the data.files and
  data.validation_files it sets, and no advice to set data.text_encoding, which eval.py keeps as
  the run's."""
  for field in ("data.files", "data.validation_files"):
    message = message.replace(f"{field}={data_files!r}", f"--data_files={data_files}")
  if TEXT_ENCODING_ADVICE in message:
    message = message.replace(TEXT_ENCODING_ADVICE, "")
    message += f" (eval.py reads --data_files as the run's data.text_encoding={encoding!r})"
  return message


def bin_positions(loss_sum_L, weight_sum_L, *, max_points: int = MAX_POSITION_POINTS) -> list:
  """Mean loss by position, averaged over at most `max_points` equal bins (None where unscored)."""
  length = len(loss_sum_L)
  points = min(length, max_points)
  starts = np.linspace(0, length, points + 1).round().astype(np.int64)[:-1]
  loss = np.add.reduceat(np.asarray(loss_sum_L, np.float64), starts)
  weight = np.add.reduceat(np.asarray(weight_sum_L, np.float64), starts)
  return [float(l_ / w) if w > 0 else None for l_, w in zip(loss, weight, strict=True)]


class _Progress:
  """Prints windows done and tokens/s for one length, at most every `every` seconds.

  The rate counts from the first batch's return, so it excludes compilation.
  """

  def __init__(self, log, prefix: str, length: int, every: float = 5.0):
    self.log, self.prefix, self.length, self.every = log, prefix, length, every
    self.first = None  # (time, windows done) when the first batch returned
    self.last = time.perf_counter()

  def __call__(self, done: int, total: int):
    now = time.perf_counter()
    if self.first is None:
      self.first = (now, done)
    if done < total and now - self.last < self.every:
      return
    self.last = now
    start, start_done = self.first
    rate = (
      f", {(done - start_done) * self.length / (now - start):,.0f} tokens/s"
      if done > start_done
      else ""
    )
    self.log(f"{self.prefix}: {done}/{total} windows{rate}")


def evaluate_workdir(
  workdir,
  spec: EvalSpec | None = None,
  *,
  step: int | None = None,
  overwrite: bool = False,
  log: Callable[[str], None] = print,
  hf_model: str = "",
  out_dir: str = "",
) -> tuple[dict, epath.Path]:
  """Evaluates a run's checkpoint as `spec` asks; writes NAME.json and NAME.png to DIR/eval/, or
  to `out_dir`.

  Whether the results can be written is checked before the model is loaded.

  Args:
    workdir: the run's workdir; with `hf_model`, "" or a directory whose eval/ takes the results.
    spec: what to evaluate (lengths, protocols, tokens, overrides); None = EvalSpec().
    step: checkpoint step; None = latest.
    overwrite: replace an existing DIR/eval/NAME.json (else that is an error, before any work).
    log: where progress lines go.
    hf_model: a Hugging Face causal LM directory evaluated instead of a run's checkpoint
      (`runs.open_hf_model`: its tokenizer.json, its max_position_embeddings as the training
      length); its JSON records "step" 0 and "hf_model", the directory.
    out_dir: the directory of NAME.json and NAME.png instead of DIR/eval/ (the JSON then records
      "workdir", the run's); needed with `hf_model` when `workdir` is "".

  Returns:
    (the JSON dict written, the JSON path).
  """
  spec = spec or EvalSpec()
  spec.effective.check_perplexity_threshold()
  if hf_model:
    if step is not None:
      raise ValueError("--step selects a run's checkpoint; --hf_model has one set of weights")
    if not (workdir or out_dir):
      raise ValueError(
        "--hf_model needs --out_dir=DIR for its results (nothing is written into the model's "
        "directory)"
      )
    hf_model = workdir_lib.resolve(hf_model, flag="--hf_model")
  workdir = epath.Path(workdir_lib.resolve(str(workdir))) if workdir or not hf_model else None
  eval_dir = results.output_dir(workdir, out_dir)
  if hf_model:
    results.check_writable(eval_dir, out_dir=out_dir)
    run_config, hf_decoder = runs.open_hf_model(hf_model)
  else:
    run_config = config_lib.load_run_config(workdir)
    results.check_writable(eval_dir, out_dir=out_dir)
  name = workdir.name if workdir else epath.Path(hf_model).name
  seq_len = run_config.data.seq_len
  if spec.bca and run_config.model.kind != "decoder":
    raise ValueError("--bca (blockwise causal attention) applies to decoders only")
  key_window = spec.key_window_for(seq_len)
  if key_window:
    _check_key_tokens(run_config)
  json_path = eval_dir / f"{output_name(spec, seq_len=seq_len)}.json"
  if json_path.exists() and not overwrite:
    raise FileExistsError(
      f"{json_path} exists{results.step_of(json_path)}; pass --overwrite to replace it, or "
      f"--out=NAME to write {eval_dir}/NAME.json"
    )
  lengths, window = spec.lengths_for(seq_len), spec.window_for(seq_len)
  if spec.stride and spec.stride > lengths[0] and "sliding" in spec.protocols:
    raise ValueError(f"--stride={spec.stride} is longer than the shortest length {lengths[0]}")

  def config_at(length: int):
    return runs.eval_model_config(
      run_config.model,
      seq_len=seq_len,
      **rope_options(spec.rope, length, seq_len),
      attention_window=window,
      window_kind=spec.window_kind,
      extension=spec.extension,
      query_scale=spec.query_scale,
    )

  model_cfg = config_at(lengths[0])
  if hf_model:
    model, step = runs.with_config(hf_decoder, model_cfg), 0
  else:
    model, step = runs.restore_for_eval(workdir, run_config, model_cfg, step=step)
  tokens, tokenizer = load_eval_tokens(
    run_config, workdir or "", split=spec.split, data_files=spec.data_files
  )
  _check_vocabulary(tokens, model_cfg.vocab_size, run_config.data.tokenizer)
  log(
    f"evaluating {hf_model or workdir} step {step} ({model_cfg.kind}, posenc "
    f"{model_cfg.posenc.kind}) on "
    f"{len(tokens):,} tokens of {spec.data_files or spec.split}: lengths {lengths}, "
    f"{', '.join(spec.protocols)}"
  )
  max_length = max(lengths)
  scored = max(1, spec.max_tokens // max_length) * max_length
  if scored != spec.max_tokens:
    log(
      f"--max_tokens={spec.max_tokens} is scored as {scored:,} targets: a whole number of "
      f"windows of the longest length {max_length}, so every length scores the same tokens"
    )

  records, position_scores = [], {}
  for i, length in enumerate(lengths, start=1):
    length_cfg = config_at(length)
    if length_cfg != model_cfg:  # "auto" factors: same parameters, another scaling
      model, model_cfg = runs.with_config(model, length_cfg), length_cfg
    reason = runs.unsupported_length(model_cfg, length)
    for proto in spec.protocols:
      prefix = f"length {i}/{len(lengths)} L={length} {proto}"
      if reason:
        records.append({"length": length, "protocol": proto, "skipped": reason})
        log(f"{prefix}: skipped ({reason})")
        continue
      record, scores = _evaluate_length(
        model, tokens, tokenizer, run_config, spec, length, proto, max_length, log, prefix
      )
      if key_window and proto == "nonoverlapping":
        record["key_tokens"] = _key_tokens_at(
          model, tokens, tokenizer, run_config, spec, length, max_length, key_window, log, prefix
        )
      records.append(record)
      position_scores[(length, proto)] = scores

  result = {
    "step": int(step),
    "posenc": model_cfg.posenc.kind,
    "rope_scaling": scaling_record(model_cfg, spec.rope),
    "attention_window": ({"kind": spec.window_kind, "size": window} if window else None),
    "notes": label_notes(
      model_cfg,
      trained_window=run_config.model.attention_window,
      stride=spec.stride,
      protocols=spec.protocols,
    ),
    "split": f"files:{spec.data_files}" if spec.data_files else spec.split,
    "max_tokens": spec.max_tokens,
    "positions": randomized_positions.protocol(
      run_config.model.posenc.randomize_max, spec.position_draws
    ),
    "records": records,
    "per_position": _per_position(position_scores),
    "effective_length": perplexity_effective_lengths(records, spec.effective, train_length=seq_len),
  }
  for proto in spec.protocols:
    log(f"effective length ({proto}): {describe(result['effective_length'][proto])}")
  if hf_model:
    result["hf_model"] = str(hf_model)
  elif out_dir:  # away from its run: --compare reads the training length from the run
    result["workdir"] = str(workdir)
  if spec.extension is not None:
    result["context_extension"] = dataclasses.asdict(spec.extension)
  if spec.query_scale != "none":
    result["query_scale"] = spec.query_scale
  if key_window:
    result["key_tokens"] = key_tokens.settings(key_window)
  json_path = results.write_result(result, json_path)
  png_path = plots.plot_runs(
    [(plots.run_label(name, result), result, seq_len)],
    json_path.with_suffix(".png"),
    title=f"{name} step {step}",
  )
  log(f"wrote {json_path} and {png_path}")
  return result, json_path


def _check_key_tokens(run_config) -> None:
  """Key tokens compare a decoder's next-token losses at consecutive positions."""
  if run_config.model.kind != "decoder":
    raise ValueError("--key_tokens compares next-token losses: it applies to decoders only")
  if run_config.model.posenc.randomize_max:
    raise ValueError(
      "--key_tokens reads both passes at consecutive positions; this run was trained with "
      "randomized positions (posenc.randomize_max)"
    )


def _key_tokens_at(model, tokens, tokenizer, run_config, spec, length, max_length, key_window,
                   log, prefix) -> dict:  # fmt: skip
  """The "key_tokens" entry of the non-overlapping record at `length`."""
  start = time.perf_counter()
  windows = data_lib.eval_windows(
    tokens, model_kind="decoder", length=length, protocol="nonoverlapping", stride=length,
    max_tokens=spec.max_tokens, max_length=max_length, tokenizer=tokenizer,
    packed=run_config.data.pack,
  )  # fmt: skip
  found = key_tokens.key_token_record(
    model,
    windows,
    short_window=key_window,
    eos_id=tokenizer.eos_id if run_config.data.pack else None,
  )
  ppl = "none" if found["ppl"] is None else f"{found['ppl']:.3f}"
  log(
    f"{prefix}: {found['count']:,} key tokens of {found['candidates']:,} candidates (short "
    f"window {key_window}), key-token ppl {ppl} in {time.perf_counter() - start:.1f}s"
  )
  return found


def _check_vocabulary(tokens, vocab_size: int, tokenizer: str) -> None:
  """Refuses token ids the model has no embedding for (an imported model's tokenizer may lack a
  special token the evaluation joins documents with, e.g. its end-of-text under another name)."""
  if len(tokens) and int(tokens.max()) >= vocab_size:
    raise ValueError(
      f"the tokenizer ({tokenizer}) gives id {int(tokens.max())}, beyond the model's vocabulary "
      f"of {vocab_size}: a special token it lacks was added (see the log), or it is another "
      "model's tokenizer"
    )


def _evaluate_length(model, tokens, tokenizer, run_config, spec, length, proto, max_length, log,
                     prefix) -> tuple[dict, perplexity.Scores]:  # fmt: skip
  """The JSON record of one length and protocol, and its scores by position."""
  start = time.perf_counter()
  model_kind = model.cfg.kind
  stride = spec.stride or max(1, length // 4)
  windows, scores, draw_losses = perplexity.score_at_length(
    model,
    tokens,
    length=length,
    protocol=proto,
    stride=stride,
    max_tokens=spec.max_tokens,
    max_length=max_length,
    batch_size=spec.batch_size or max(1, AUTO_BATCH_TOKENS // length),
    tokenizer=tokenizer,
    mlm_probability=run_config.data.mlm_probability,
    seed=run_config.train.seed,  # the training loop's evaluation mask and position draws
    packed=run_config.data.pack,
    randomize_max=model.cfg.posenc.randomize_max,
    draws=spec.position_draws,
    progress=_Progress(log, prefix, length),
  )
  metrics = perplexity.summarize(scores, model_kind=model_kind, num_tokens=windows.num_tokens)
  record = {"length": length, "protocol": proto}
  record.update({k: metrics[k] for k in ("loss", "ppl", "tokens", "accuracy") if k in metrics})
  if draw_losses:
    record["loss_draws"] = draw_losses
  if proto == "sliding":
    record["stride"] = stride
  if spec.rope is not None:
    record["rope_factor"] = model.cfg.posenc.scaling.factor
  log(
    f"{prefix}: loss {metrics['loss']:.4f}, ppl {metrics['ppl']:.3f} over "
    f"{metrics['tokens']:,} tokens in {time.perf_counter() - start:.1f}s"
  )
  return record, scores


def _per_position(position_scores: dict) -> dict | None:
  """The loss by position of the longest evaluated length (non-overlapping windows preferred:
  they show the loss at every position)."""
  if not position_scores:
    return None
  key = max(position_scores, key=lambda k: (k[0], k[1] == "nonoverlapping"))
  scores = position_scores[key]
  return {
    "length": key[0],
    "protocol": key[1],
    "loss": bin_positions(scores.position_loss_sum, scores.position_weight_sum),
  }


def scaling_record(model_cfg, rope: RopeOverride | None) -> dict | None:
  """JSON "rope_scaling": the one applied at evaluation, else the run's own, else None."""
  if rope is not None:
    record = {"kind": rope.kind, "factor": rope.factor}
    if rope.ramped():  # where beta_fast and beta_slow count rotations, and how many
      default = RopeScaling()
      record.update(
        beta_fast=rope.beta_fast or default.beta_fast,
        beta_slow=rope.beta_slow or default.beta_slow,
        ramp=rope.ramp,
      )
    return record
  scaling = model_cfg.posenc.scaling
  if scaling.kind == "none" or not POSENCS[model_cfg.posenc.kind].accepts_rope_scaling:
    return None
  return {"kind": scaling.kind, "factor": scaling.factor}
