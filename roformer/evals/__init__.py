"""Evaluation of finished runs: perplexity scoring (also used during training), the perplexity
against length and task accuracy against length drivers of eval.py, and their plots."""
