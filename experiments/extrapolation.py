"""Length extrapolation of every positional encoding: the ALiBi, xPos, NoPE and YaRN comparisons.

Trains one decoder per encoding (sinusoidal, learned, t5, alibi, rope, xpos, nope) with the same
data, budget, seed and token-embedding scale (fairseq's N(0, 1/d) times sqrt(d), the setting of
the ALiBi paper, which ran every one of its baselines in fairseq) at training length L; evaluates
each from L to 16L with both protocols (xPos also with its blockwise causal attention); evaluates
the rope run with PI, NTK, dynamic NTK, YaRN and Llama-3 scaling applied at evaluation (factor =
length / L); fine-tunes the rope run briefly at 2L with PI and with YaRN (the PI paper's recipe,
scaled down); trains every encoding again with a quarter of the budget, evaluated at L; and
repeats the quarter-budget rope, sinusoidal and learned runs with another seed (the seed noise).

The 2024-26 options (docs/frontier.md) are arms of the same budget and seed, evaluated on
non-overlapping windows from L to 16L: iRoPE, RNoPE-SWA, QK-norm, SSMax, PoPE, Resonance RoPE
(also with YaRN at evaluation: Resonance YaRN; with Hugging Face's YaRN and, beside the rope
run, with YaRN as the Resonance authors' from-scratch code runs it), FoX and attention sinks
(configs/arms.py); the rope and nope checkpoints evaluated with a query temperature imposed
(logn, llama4: no training); and DroPE, the rope run continued at L with no positional encoding
for the fine-tunes' budget, beside the same continuation with RoPE. `--only` takes these names
too; a run that starts from another (a fine-tune, an evaluation) brings that one along,
retraining it if its workdir is gone.

  python -m experiments.extrapolation [--scale=tiny|cpu|paper] [--corpus=pystdlib|sotu]
      [--only=rope,alibi] [--out=DIR] [--workroot=DIR]

Writes OUT (default results/extrapolation/<corpus>): <run>.json per run, results.csv, the plots
encodings.png, scalings.png and frontier.png, and table.md. Finished runs are skipped, so a
killed grid resumes.
"""

from __future__ import annotations

import dataclasses

from configs import arms
from experiments import grid, pages, report, seeds

ENCODINGS = ("sinusoidal", "learned", "rope", "alibi", "nope", "t5", "xpos")
SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3")
FINETUNES = ("linear", "yarn")  # PI and YaRN
SEED_REPEATS = ("rope", "sinusoidal", "learned")
# Parameter-free query temperatures imposed at evaluation on a finished run (no training: both
# are 1 within the training length, so a run trained with them is the run trained without).
EVAL_QUERY_SCALES = {"rope": ("logn",), "nope": ("logn", "llama4")}


# The 2024-26 options (docs/frontier.md), each a full-budget run beside rope and nope, as
# configs/arms.py defines them. The grid's models have 3 layers, so the hybrids (iRoPE, RNoPE-SWA)
# keep one NoPE layer in 3 where Llama 4 and the RNoPE-SWA paper keep one in 4; their windows are
# L/4 (Llama 4: chunks of 8K at 256K).
FRONTIER = arms.FRONTIER
NOPE_EVERY = 3


def frontier_arms(L: int) -> dict[str, dict]:
  """name -> config overrides (posenc.kind included) of each 2024-26 option at training length L."""
  return {name: arms.overrides(name, seq_len=L, nope_every=NOPE_EVERY) for name in FRONTIER}


# YaRN and Resonance YaRN as the Resonance RoPE authors' from-scratch code runs them
# (grid.YARN_AUTHORS) on the rope and resonance runs, beside their Hugging Face YaRN evaluations.
YARN_AUTHORS_OF = ("rope", "resonance")

# DroPE (arXiv 2512.12167): the rope run continued with no positional encoding at L, for the
# fine-tunes' budget; "rope_continued" continues it with RoPE, the control for the extra steps.
RECALIBRATIONS = arms.RECALIBRATIONS
ARMS = (*ENCODINGS, *FRONTIER, *RECALIBRATIONS)


@dataclasses.dataclass(frozen=True)
class Scale:
  base: str  # configs/<base>.py ("" = default)
  overrides: dict
  steps: int
  seq_len: int
  eval_tokens: int
  finetune_steps: int
  multiples: tuple = (1, 2, 4, 8, 16)


SCALES = {
  # A smoke test of the whole grid: a few steps per run (CI).
  "tiny": Scale(
    base="",
    overrides={
      "model.num_layers": 1,
      "model.emb_dim": 32,
      "model.num_heads": 2,
      "model.mlp_dim": 64,
      "train.global_batch_size": 4,
      "train.eval_max_tokens": 256,
      "optim.warmup_steps": 2,
      "optim.learning_rate": 3e-3,
      "train.eval_every_steps": 0,
      "train.checkpoint_every_steps": 0,
    },
    steps=8,
    seq_len=16,
    eval_tokens=256,
    finetune_steps=4,
    multiples=(1, 2),
  ),
  # 3 layers x 128 wide on bytes, L = 128: the whole grid in about 2 hours on 2 CPU cores.
  "cpu": Scale(
    base="",
    overrides={
      "model.num_layers": 3,
      "model.emb_dim": 128,
      "model.num_heads": 4,
      "model.mlp_dim": 512,
      "train.global_batch_size": 16,
      "train.eval_max_tokens": 32_768,
      "optim.warmup_steps": 50,
      "optim.learning_rate": 1.5e-3,
    },
    steps=1500,
    seq_len=128,
    eval_tokens=16_384,
    finetune_steps=200,
  ),
  # The ALiBi paper's WikiText-103 model at L = 512 (configs/paper/alibi_wt103.py); not run here.
  "paper": Scale(
    base="paper.alibi_wt103",
    overrides={},
    steps=286_000,
    seq_len=512,
    eval_tokens=245_760,
    finetune_steps=1000,
  ),
}


def grid_runs(scale: Scale, only: set[str]) -> list[grid.Run]:
  L = scale.seq_len
  lengths = [L * m for m in scale.multiples]
  evaluate = dict(lengths=lengths, protocol="both", max_tokens=scale.eval_tokens)
  at_l = dict(lengths=[L], protocol="nonoverlapping", max_tokens=scale.eval_tokens)
  runs = []
  for enc in ENCODINGS:
    if only and enc not in only:
      continue
    evals = [grid.Eval("none", evaluate)]
    if enc == "xpos":
      evals.append(grid.Eval("bca", dict(evaluate, bca=True)))
    if enc == "rope":
      # Scalings are compared on non-overlapping windows (the sliding ones cost 4x per length).
      for kind in SCALINGS:
        evals.append(
          grid.Eval(
            kind,
            dict(evaluate, protocol="nonoverlapping", rope_scaling=kind, rope_factor="auto"),
          )
        )
    overrides = {"posenc.kind": enc, "train.num_train_steps": scale.steps}
    runs.append(grid.Run(enc, enc, overrides, evals))
  for enc in ENCODINGS:
    if only and enc not in only:
      continue
    overrides = {"posenc.kind": enc, "train.num_train_steps": max(1, scale.steps // 4)}
    runs.append(grid.Run(f"{enc}_short", enc, overrides, [grid.Eval("none", at_l)], budget="short"))
  for enc in SEED_REPEATS:  # the short runs again with another seed: the noise of a ratio
    if only and enc not in only:
      continue
    overrides = {
      "posenc.kind": enc,
      "train.num_train_steps": max(1, scale.steps // 4),
      "train.seed": 1,
    }
    runs.append(
      grid.Run(f"{enc}_short_seed1", enc, overrides, [grid.Eval("none", at_l)], budget="seed")
    )
  curve = dict(evaluate, protocol="nonoverlapping")  # the newer arms' curves (as the scalings')
  for enc, kinds in EVAL_QUERY_SCALES.items():
    if only and enc not in only:
      continue
    for kind in kinds:
      evals = [grid.Eval(kind, dict(curve, query_scale=kind))]
      runs.append(grid.Run(f"{enc}_{kind}", enc, {}, evals, eval_of=enc, budget="eval"))
  for name, arm in frontier_arms(L).items():
    if only and name not in only:
      continue
    evals = [grid.Eval("none", curve)]
    if name == "resonance":  # Resonance YaRN: YaRN's frequencies, each wavelength rounded
      evals.append(grid.Eval("yarn", dict(curve, rope_scaling="yarn", rope_factor="auto")))
    enc = arm["posenc.kind"]
    overrides = {"posenc.kind": enc, "train.num_train_steps": scale.steps, **arm}
    runs.append(grid.Run(name, enc, overrides, evals, budget="frontier"))
  for name in YARN_AUTHORS_OF:  # after the runs they evaluate
    if only and name not in only:
      continue
    evals = [grid.Eval("yarn_authors", dict(curve, **grid.YARN_AUTHORS))]
    runs.append(grid.Run(f"{name}_yarn_authors", "rope", {}, evals, eval_of=name, budget="eval"))
  for name in RECALIBRATIONS:
    if only and name not in only:
      continue
    arm = arms.overrides(name, seq_len=L, nope_every=NOPE_EVERY)
    enc = arm["posenc.kind"]
    overrides = {
      **arm,
      "train.num_train_steps": scale.finetune_steps,
      "optim.warmup_steps": max(1, scale.finetune_steps // 10),
    }
    evals = [grid.Eval("none", curve)]
    if enc == "nope":
      evals.append(grid.Eval("logn", dict(curve, query_scale="logn")))
    start = arms.ARMS[name].starts_from
    runs.append(grid.Run(name, enc, overrides, evals, init_from=start, budget="finetune"))
  if not only or "rope" in only:
    for kind in FINETUNES:
      overrides = {
        "posenc.kind": "rope",
        "posenc.scaling.kind": kind,
        "posenc.scaling.factor": 2.0,
        "data.seq_len": 2 * L,
        "train.num_train_steps": scale.finetune_steps,
        "train.global_batch_size": None,  # halved below: the same tokens per step
        "optim.warmup_steps": max(1, scale.finetune_steps // 10),
      }
      runs.append(
        grid.Run(
          f"rope_{kind}_2x",
          "rope",
          overrides,
          [grid.Eval("none", evaluate)],
          init_from="rope",
          budget="finetune",
        )
      )
  if only:  # the runs these start from, first (a finished one is skipped, or retrained if its
    # workdir is gone)
    names = {r.name for r in runs}
    parents = {r.init_from or r.eval_of for r in runs} - names - {""}
    runs = [r for r in grid_runs(scale, set()) if r.name in parents] + runs
  return runs


def common_overrides(scale: Scale, corpus: str) -> dict:
  """The settings every run of the grid shares (experiments/extension.py trains its rope run
  with them too)."""
  return {
    **grid.corpus_overrides(corpus),
    "model.kind": "decoder",
    "model.embed_scale": "sqrt_d",
    "data.tokenizer": "bytes",
    "data.seq_len": scale.seq_len,
    "posenc.max_len": scale.seq_len,
    "train.log_every_steps": max(1, scale.steps // 10),
    "train.eval_every_steps": max(1, scale.steps // 5),
    "train.checkpoint_every_steps": max(1, scale.steps // 5),
    **scale.overrides,
  }


def main():
  args, only, out, workroot = grid.parse_cli(
    __doc__, name="extrapolation", scales=SCALES, encodings=ARMS
  )
  scale = SCALES[args.scale]
  common = common_overrides(scale, args.corpus)
  runs = grid_runs(scale, only)
  batch = grid.make_config(scale.base, common).train.global_batch_size
  for run in runs:  # fine-tunes read twice the length: half the sequences per step
    if run.overrides.get("train.global_batch_size", 0) is None:
      run.overrides["train.global_batch_size"] = max(1, batch // 2)
      run.overrides["posenc.max_len"] = 2 * scale.seq_len
  print(f"extrapolation grid, scale {args.scale}, corpus {args.corpus}: {len(runs)} runs -> {out}")

  every_run = grid_runs(scale, set())

  def write_report(_=None):  # every finished run in OUT, also those of earlier --only runs
    records = grid.finished_records(every_run, out)
    report.write_extrapolation(records, out, seq_len=scale.seq_len, scale=args.scale)
    pages.refresh_page(out)

  grid.run_grid(
    seeds.replicate(runs, args.seeds),
    base=scale.base,
    common=common,
    out=out,
    workroot=workroot,
    report=write_report,
    adopt=args.adopt,
  )
  write_report()
  print(f"wrote {out}/results.csv, table.md, encodings.png, scalings.png, frontier.png")


if __name__ == "__main__":
  main()
