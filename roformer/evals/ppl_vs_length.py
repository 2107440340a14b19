"""eval.py's driver: a run's checkpoint at several lengths, its JSON and plot, and comparisons.

Writes DIR/eval/NAME.json and NAME.png (docs/design.md, "Workdir"); perplexity.py does the scoring.
"""

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath

from roformer import config as config_lib
from roformer import data as data_lib
from roformer import runs
from roformer.evals import perplexity, plots, results
from roformer.evals.perplexity import AUTO_BATCH_TOKENS, PROTOCOLS
from roformer.evals.plots import DEFAULT_NAME
from roformer.infra import workdir as workdir_lib
from roformer.posenc import POSENCS
from roformer.posenc import randomized as randomized_positions

# Positions kept in the JSON's per-position curve; longer windows are averaged over equal bins.
MAX_POSITION_POINTS = 256
DEFAULT_MAX_TOKENS = 65536  # eval.py --max_tokens


def default_lengths(seq_len: int) -> list[int]:
  """The training length to 16x by powers of two."""
  return [seq_len * 2**i for i in range(5)]


AUTO_FACTOR = "auto"


def output_name(
  out: str = "",
  rope_scaling: str = "none",
  rope_factor: float | str = 1.0,
  *,
  split: str = "validation",
  data_files: str = "",
  attention_window: int = 0,
  window_kind: str = "sliding",
  lengths: Sequence[int] = (),
  default: Sequence[int] = (),
  protocol: str = "both",
  stride: int = 0,
  max_tokens: int = DEFAULT_MAX_TOKENS,
) -> str:
  """NAME of DIR/eval/NAME.json: `out`, else ppl_vs_length with a suffix per non-default choice.

  Evaluating other text (`_files`), the test split (`_test`), other lengths (`_len256-512`), one
  protocol (`_sliding`), a stride (`_stride64`), another number of scored tokens
  (`_tok8192`), a RoPE scaling (`_<scaling>_<factor>`, factor
  "auto" too) or an attention window (`_window<W>`, `_bca<W>`) never overwrites the plain
  validation result. `default` is the default length list (`lengths` equal to it, or empty, add
  nothing).
  """
  if out:
    return out
  name = DEFAULT_NAME
  if data_files:
    name += "_files"
  elif split != "validation":
    name += f"_{split}"
  lengths = sorted(set(int(x) for x in lengths))
  if lengths and lengths != sorted(default):
    name += "_len" + "-".join(str(x) for x in lengths)
  if protocol != "both":
    name += f"_{protocol}"
  if stride and protocol != "nonoverlapping":
    name += f"_stride{stride}"
  if max_tokens != DEFAULT_MAX_TOKENS:
    name += f"_tok{max_tokens}"
  if rope_scaling != "none":
    factor = rope_factor if rope_factor == AUTO_FACTOR else f"{float(rope_factor):g}"
    name += f"_{rope_scaling}_{factor}"
  if attention_window:
    name += f"_{'bca' if window_kind == 'blockwise' else 'window'}{attention_window}"
  return name


def parse_rope_factor(value: str | float) -> float | str:
  """--rope_factor: a number >= 1, or "auto" (target length / training length at each length)."""
  if isinstance(value, str) and value.strip() == AUTO_FACTOR:
    return AUTO_FACTOR
  try:
    factor = float(value)
  except ValueError:
    raise ValueError(f"--rope_factor must be a number or 'auto', got {value!r}") from None
  if not factor > 0:
    raise ValueError(f"--rope_factor must be > 0, got {value!r}")
  return factor


def factor_at(rope_factor: float | str, length: int, seq_len: int) -> float:
  """The scaling factor at `length`: the given one, or for "auto" s = length / training length
  (at least 1), as Position Interpolation and YaRN set s for a target context."""
  if rope_factor == AUTO_FACTOR:
    return max(1.0, length / seq_len)
  return float(rope_factor)


def label_notes(model_cfg, *, trained_window: int, stride: int, protocols) -> list[str]:
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
  if "sliding" in protocols:
    notes.append(f"stride {stride}" if stride else "stride L/4")
  return notes


def load_eval_tokens(run_config, workdir, *, split: str = "validation", data_files: str = ""):
  """The token stream evaluated and the run's tokenizer.

  Args:
    run_config: the run's RunConfig (its DataConfig and tokenizer are reused).
    workdir: the run's workdir (holds the trained tokenizer and the token cache).
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
  corpus = data_lib.load_corpus(data_cfg, workdir=str(workdir), splits=(split,))
  return np.asarray(corpus.tokens(split)), corpus.tokenizer


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
  *,
  lengths: Sequence[int] = (),
  protocol: str = "both",
  stride: int = 0,
  max_tokens: int = DEFAULT_MAX_TOKENS,
  split: str = "validation",
  step: int | None = None,
  batch_size: int = 0,
  rope_scaling: str = "none",
  rope_factor: float | str = 1.0,
  attention_window: int = 0,
  bca: bool = False,
  data_files: str = "",
  out: str = "",
  overwrite: bool = False,
  position_draws: int = randomized_positions.EVAL_DRAWS,
  log: Callable[[str], None] = print,
) -> tuple[dict, epath.Path]:
  """Evaluates a run's checkpoint at several lengths; writes DIR/eval/NAME.json and NAME.png.

  Args:
    workdir: the run's workdir.
    lengths: window lengths; default the training length to 16x by powers of two.
    protocol: "nonoverlapping", "sliding" or "both".
    stride: sliding stride; 0 = length // 4.
    max_tokens: scored tokens per length (rounded to a multiple of the largest length).
    split: "validation" or "test".
    step: checkpoint step; None = latest.
    batch_size: windows per batch; 0 = about 16k tokens per batch.
    rope_scaling, rope_factor: a RoPE scaling applied at evaluation ("none" = as trained); the
      factor "auto" is length / training length at each length.
    attention_window: a sliding attention window imposed at evaluation (0 = as trained).
    bca: blockwise causal attention (xPos) with blocks of `attention_window` or, when that is 0,
      of the training length.
    data_files: a glob of other text, tokenized with the run's tokenizer.
    out: NAME; default `output_name(...)`.
    overwrite: replace an existing DIR/eval/NAME.json (else that is an error, before any work).
    position_draws: a run trained with randomized positions is scored at this many draws of
      them (`perplexity.score_windows_at_positions`); the loss is their mean.
    log: where progress lines go.

  Returns:
    (the JSON dict written, the JSON path).
  """
  protocols = PROTOCOLS if protocol == "both" else (protocol,)
  if any(p not in PROTOCOLS for p in protocols):
    raise ValueError(f"--protocol must be one of {PROTOCOLS + ('both',)}, got {protocol!r}")
  rope_factor = parse_rope_factor(rope_factor)
  workdir = epath.Path(workdir_lib.resolve(str(workdir)))
  run_config = config_lib.load_run_config(workdir)
  seq_len = run_config.data.seq_len
  window_kind = "blockwise" if bca else "sliding"
  if bca and not attention_window:
    attention_window = seq_len
  if bca and run_config.model.kind != "decoder":
    raise ValueError("--bca (blockwise causal attention) applies to decoders only")
  name = output_name(
    out,
    rope_scaling,
    rope_factor,
    split=split,
    data_files=data_files,
    attention_window=attention_window,
    window_kind=window_kind,
    lengths=lengths,
    default=default_lengths(seq_len),
    protocol=protocol,
    stride=stride,
    max_tokens=max_tokens,
  )
  json_path = workdir / "eval" / f"{name}.json"
  if json_path.exists() and not overwrite:
    raise FileExistsError(
      f"{json_path} exists{results.step_of(json_path)}; pass --overwrite to replace it, or "
      "--out=NAME to write DIR/eval/NAME.json"
    )

  def config_at(length: int):
    return runs.eval_model_config(
      run_config.model,
      seq_len=seq_len,
      rope_scaling=rope_scaling,
      rope_factor=factor_at(rope_factor, length, seq_len),
      attention_window=attention_window,
      window_kind=window_kind,
    )

  lengths = sorted(set(int(x) for x in lengths)) or default_lengths(seq_len)
  if lengths[0] < 1:
    raise ValueError(f"--lengths must be positive, got {lengths}")
  if stride and stride > lengths[0] and "sliding" in protocols:
    raise ValueError(f"--stride={stride} is longer than the shortest length {lengths[0]}")
  model_cfg = config_at(lengths[0])
  model, step = runs.restore_for_eval(workdir, run_config, model_cfg, step=step)
  tokens, tokenizer = load_eval_tokens(run_config, workdir, split=split, data_files=data_files)
  model_kind = model_cfg.kind
  max_length = max(lengths)
  log(
    f"evaluating {workdir} step {step} ({model_kind}, posenc {model_cfg.posenc.kind}) on "
    f"{len(tokens):,} tokens of {data_files or split}: lengths {lengths}, {', '.join(protocols)}"
  )
  scored = max(1, max_tokens // max_length) * max_length
  if scored != max_tokens:
    log(
      f"--max_tokens={max_tokens} is scored as {scored:,} targets: a whole number of windows of "
      f"the longest length {max_length}, so every length scores the same tokens"
    )

  records, position_scores = [], {}
  for i, length in enumerate(lengths, start=1):
    length_cfg = config_at(length)
    if length_cfg != model_cfg:  # "auto" factors: same parameters, another scaling
      model, model_cfg = runs.with_config(model, length_cfg), length_cfg
    reason = runs.unsupported_length(model_cfg, length)
    for proto in protocols:
      prefix = f"length {i}/{len(lengths)} L={length} {proto}"
      if reason:
        records.append({"length": length, "protocol": proto, "skipped": reason})
        log(f"{prefix}: skipped ({reason})")
        continue
      start = time.perf_counter()
      proto_stride = stride or max(1, length // 4)
      windows = perplexity.make_windows(
        tokens,
        model_kind=model_kind,
        length=length,
        protocol=proto,
        stride=proto_stride,
        max_tokens=max_tokens,
        max_length=max_length,
        tokenizer=tokenizer,
        mlm_probability=run_config.data.mlm_probability,
        seed=run_config.train.seed,  # the training loop's evaluation mask
        packed=run_config.data.pack,
      )
      scores, draw_losses = perplexity.score_windows_at_positions(
        model,
        windows,
        batch_size=batch_size or max(1, AUTO_BATCH_TOKENS // length),
        randomize_max=model_cfg.posenc.randomize_max,
        seed=run_config.train.seed,
        draws=position_draws,
        progress=_Progress(log, prefix, length),
      )
      metrics = perplexity.summarize(scores, model_kind=model_kind, num_tokens=windows.num_tokens)
      record = {"length": length, "protocol": proto}
      record.update({k: metrics[k] for k in ("loss", "ppl", "tokens", "accuracy") if k in metrics})
      if draw_losses:
        record["loss_draws"] = draw_losses
      if proto == "sliding":
        record["stride"] = proto_stride
      if rope_scaling != "none":
        record["rope_factor"] = model_cfg.posenc.scaling.factor
      records.append(record)
      position_scores[(length, proto)] = scores
      log(
        f"{prefix}: loss {metrics['loss']:.4f}, ppl {metrics['ppl']:.3f} over "
        f"{metrics['tokens']:,} tokens in {time.perf_counter() - start:.1f}s"
      )

  per_position = None
  if position_scores:
    # The longest evaluated length; non-overlapping windows show the loss at every position.
    key = max(position_scores, key=lambda k: (k[0], k[1] == "nonoverlapping"))
    scores = position_scores[key]
    per_position = {
      "length": key[0],
      "protocol": key[1],
      "loss": bin_positions(scores.position_loss_sum, scores.position_weight_sum),
    }
  result = {
    "step": int(step),
    "posenc": model_cfg.posenc.kind,
    "rope_scaling": _scaling_record(model_cfg, rope_scaling, rope_factor),
    "attention_window": (
      {"kind": window_kind, "size": attention_window} if attention_window else None
    ),
    "notes": label_notes(
      model_cfg,
      trained_window=run_config.model.attention_window,
      stride=stride,
      protocols=protocols,
    ),
    "split": f"files:{data_files}" if data_files else split,
    "max_tokens": max_tokens,
    "positions": randomized_positions.protocol(
      run_config.model.posenc.randomize_max, position_draws
    ),
    "records": records,
    "per_position": per_position,
  }
  json_path = results.write_result(result, json_path)
  png_path = plots.plot_runs(
    [(plots.run_label(workdir.name, result), result, seq_len)],
    json_path.with_suffix(".png"),
    title=f"{workdir.name} step {step}",
  )
  log(f"wrote {json_path} and {png_path}")
  return result, json_path


def _scaling_record(model_cfg, rope_scaling: str, rope_factor) -> dict | None:
  """JSON "rope_scaling": the one applied at evaluation, else the run's own, else None."""
  if rope_scaling != "none":
    return {"kind": rope_scaling, "factor": rope_factor}
  scaling = model_cfg.posenc.scaling
  if scaling.kind == "none" or not POSENCS[model_cfg.posenc.kind].accepts_rope_scaling:
    return None
  return {"kind": scaling.kind, "factor": scaling.factor}
