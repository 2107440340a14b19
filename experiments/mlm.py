"""The RoFormer paper's masked-LM comparison (Fig. 3) at small scale, with every encoding.

Trains one encoder per encoding (learned as BERT, rope as RoFormer, sinusoidal, t5, alibi) with
the same data, WordPiece vocabulary, budget, seed and token-embedding scale (N(0, 1/d) times
sqrt(d) for all, so that no encoding's position term is mis-sized against its tokens); draws the
MLM loss curves in one plot; and scores the final masked-token loss and accuracy at L, 2L and 4L
(learned positions: skipped past their table). NoPE is recorded as refused: without a causal mask
an encoder without positions is a bag of words.

  python -m experiments.mlm [--scale=tiny|cpu|paper] [--corpus=pystdlib|sotu] [--only=rope,learned]
      [--out=DIR] [--workroot=DIR]

Writes OUT (default results/mlm/<corpus>): <run>.json per run, results.csv, curves.png and
table.md. Finished runs are skipped, so a killed grid resumes.
"""

from __future__ import annotations

from experiments import grid, pages, report, seeds

ENCODINGS = ("learned", "rope", "sinusoidal", "t5", "alibi", "nope")

SCALES = {
  # A smoke test of the whole grid: a few steps per run (CI).
  "tiny": dict(
    base="mlm",
    seq_len=16,
    eval_tokens=512,
    overrides={
      "model.num_layers": 1,
      "model.emb_dim": 32,
      "model.num_heads": 2,
      "model.mlp_dim": 64,
      "data.vocab_size": 512,
      "data.tokenizer_max_chars": 200_000,
      "train.global_batch_size": 4,
      "train.num_train_steps": 8,
      "train.eval_every_steps": 4,
      "train.eval_max_tokens": 512,
      "train.checkpoint_every_steps": 0,
      "optim.warmup_steps": 2,
      "optim.learning_rate": 1e-3,
    },
  ),
  # 3 layers x 128 wide, WordPiece 8192, L = 128: the whole grid in about an hour on 2 CPU cores.
  "cpu": dict(
    base="mlm",
    seq_len=128,
    eval_tokens=8192,
    overrides={
      "model.num_layers": 3,
      "model.emb_dim": 128,
      "model.num_heads": 4,
      "model.mlp_dim": 512,
      "data.vocab_size": 8192,
      "data.tokenizer_max_chars": 3_000_000,
      "train.global_batch_size": 16,
      "train.num_train_steps": 1000,
      "train.eval_every_steps": 100,
      "train.eval_max_tokens": 16_384,
      "train.checkpoint_every_steps": 250,
      "optim.warmup_steps": 100,
      "optim.learning_rate": 1e-3,
    },
  ),
  # BERT-base at L = 512 (configs/paper/roformer_mlm_base.py); not run here.
  "paper": dict(base="paper.roformer_mlm_base", seq_len=512, eval_tokens=262_144, overrides={}),
}


def grid_runs(scale: dict, only: set[str]) -> list[grid.Run]:
  from roformer.posenc import POSENCS

  L = scale["seq_len"]
  evaluate = dict(lengths=[L, 2 * L, 4 * L], protocol="both", max_tokens=scale["eval_tokens"])
  runs = []
  for enc in ENCODINGS:
    if only and enc not in only:
      continue
    refused = "" if not POSENCS[enc].causal_only else "causal-only encoding (needs a decoder)"
    runs.append(
      grid.Run(enc, enc, {"posenc.kind": enc}, [grid.Eval("none", evaluate)], skip_reason=refused)
    )
  return runs


def main():
  args, only, out, workroot = grid.parse_cli(
    __doc__, name="mlm", scales=SCALES, encodings=ENCODINGS
  )
  scale = SCALES[args.scale]
  common = {
    **grid.corpus_overrides(args.corpus),
    "model.kind": "encoder",
    "model.embed_scale": "sqrt_d",
    "data.tokenizer": "wordpiece",
    "data.seq_len": scale["seq_len"],
    "posenc.max_len": scale["seq_len"],
    "train.log_every_steps": 50,
    **scale["overrides"],
  }
  runs = grid_runs(scale, only)
  print(f"MLM grid, scale {args.scale}, corpus {args.corpus}: {len(runs)} runs -> {out}")

  every_run = grid_runs(scale, set())

  def write_report(_=None):  # every finished run in OUT, also those of earlier --only runs
    records = grid.finished_records(every_run, out)
    report.write_mlm(records, out, seq_len=scale["seq_len"], scale=args.scale)
    pages.refresh_page(out)

  grid.run_grid(
    seeds.replicate(runs, args.seeds),
    base=scale["base"],
    common=common,
    out=out,
    workroot=workroot,
    report=write_report,
    adopt=args.adopt,
  )
  write_report()
  print(f"wrote {out}/results.csv, table.md, curves.png")


if __name__ == "__main__":
  main()
