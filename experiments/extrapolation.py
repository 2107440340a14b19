"""Length extrapolation of every positional encoding: the ALiBi, xPos, NoPE and YaRN comparisons.

Trains one decoder per encoding (sinusoidal, learned, t5, alibi, rope, xpos, nope) with the same
data, budget, seed and token-embedding scale (fairseq's N(0, 1/d) times sqrt(d), the setting of
the ALiBi paper, which ran every one of its baselines in fairseq) at training length L; evaluates
each from L to 16L with both protocols (xPos also with its blockwise causal attention); evaluates
the rope run with PI, NTK, dynamic NTK, YaRN and Llama-3 scaling applied at evaluation (factor =
length / L); fine-tunes the rope run briefly at 2L with PI and with YaRN (the PI paper's recipe,
scaled down); trains every encoding again with a quarter of the budget, evaluated at L; and
repeats the quarter-budget rope, sinusoidal and learned runs with another seed (the seed noise).

  python experiments/extrapolation.py [--scale=tiny|cpu|paper] [--corpus=pystdlib|sotu]
      [--only=rope,alibi] [--out=DIR] [--workroot=DIR]

Writes OUT (default results/extrapolation/<corpus>): <run>.json per run, results.csv, the plots
encodings.png and scalings.png, and table.md. Finished runs are skipped, so a killed grid resumes.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import grid  # noqa: E402
import report  # noqa: E402

ENCODINGS = ("sinusoidal", "learned", "rope", "alibi", "nope", "t5", "xpos")
SCALINGS = ("linear", "ntk", "dynamic", "yarn", "llama3")
FINETUNES = ("linear", "yarn")  # PI and YaRN
SEED_REPEATS = ("rope", "sinusoidal", "learned")


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
  return runs


def main():
  args, only, out, workroot = grid.parse_cli(
    __doc__, name="extrapolation", scales=SCALES, encodings=ENCODINGS
  )
  scale = SCALES[args.scale]
  common = {
    **grid.corpus_overrides(args.corpus),
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

  grid.run_grid(
    runs,
    base=scale.base,
    common=common,
    out=out,
    workroot=workroot,
    report=write_report,
    adopt=args.adopt,
  )
  write_report()
  print(f"wrote {out}/results.csv, table.md, encodings.png, scalings.png")


if __name__ == "__main__":
  main()
