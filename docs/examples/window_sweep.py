"""How much context does a run use? Perplexity at its training length under a sliding attention
window of each size, imposed at evaluation, written to DIR/eval/window_sweep.json.

An evaluation of your own over the library (docs/extending.md, "An evaluation"):

  python docs/examples/window_sweep.py --workdir=DIR --windows=8,32,64
"""

import argparse

from etils import epath

from roformer import config as config_lib
from roformer import runs
from roformer.evals import perplexity, results
from roformer.evals.ppl_vs_length import load_eval_tokens


def window_sweep(workdir, windows, *, max_tokens: int = 16384, batch_size: int = 8) -> dict:
  """{"step", "length", "records": [{"window", "loss", "ppl", "tokens"}]}; window 0 = as trained."""
  workdir = epath.Path(workdir)
  run_config = config_lib.load_run_config(workdir)  # config.json, validated as at training
  seq_len = run_config.data.seq_len
  trained_cfg = runs.eval_model_config(run_config.model, seq_len=seq_len)
  model, step = runs.restore_for_eval(workdir, run_config, trained_cfg)  # latest checkpoint
  tokens, tokenizer = load_eval_tokens(run_config, workdir, split="validation")
  records = []
  for window in (0, *windows):
    # Same parameters, another static setting: the window changes the mask, not the weights.
    cfg = runs.eval_model_config(run_config.model, seq_len=seq_len, attention_window=window)
    scores = perplexity.evaluate_at_length(
      runs.with_config(model, cfg),
      tokens,
      length=seq_len,
      protocol="nonoverlapping",
      stride=seq_len,
      max_tokens=max_tokens,
      max_length=seq_len,
      batch_size=batch_size,
      tokenizer=tokenizer,
      mlm_probability=run_config.data.mlm_probability,
      seed=run_config.train.seed,  # an encoder's masking, as the training loop's evaluation
      packed=run_config.data.pack,
      randomize_max=run_config.model.posenc.randomize_max,
    )
    records.append({"window": window, **{k: scores[k] for k in ("loss", "ppl", "tokens")}})
    print(f"window {window or 'as trained'}: loss {scores['loss']:.4f}, ppl {scores['ppl']:.3f}")
  result = {"step": int(step), "length": seq_len, "records": records}
  print("wrote", results.write_result(result, workdir / "eval" / "window_sweep.json"))
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--windows", default="8,32,64", help="comma-separated window sizes")
  parser.add_argument("--max_tokens", type=int, default=16384)
  args = parser.parse_args()
  window_sweep(args.workdir, [int(w) for w in args.windows.split(",")], max_tokens=args.max_tokens)


if __name__ == "__main__":
  main()
