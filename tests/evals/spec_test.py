"""Unit tests of the evaluation spec (evals/spec.py: default lengths, output names), the model
config an evaluation runs (runs.eval_model_config) and the per-position bins."""

import numpy as np
import pytest

from configs import default
from roformer import config as config_lib
from roformer import runs
from roformer.evals import ppl_vs_length, spec


def test_eval_model_config_dense_attention_becomes_auto():
  cfg = config_lib.run_config_from_dict(default.get_config()).model
  dense = runs.eval_model_config(
    type(cfg)(**{**cfg.__dict__, "attention_impl": "dense"}), seq_len=512
  )
  assert dense.attention_impl == "auto"


def _name(**options):
  return spec.output_name(spec.spec_from_options(**options), seq_len=256)


def test_default_lengths_and_output_name():
  default = spec.default_lengths(256)
  assert default == [256, 512, 1024, 2048, 4096]
  assert _name() == "ppl_vs_length"
  assert _name(lengths=default[::-1]) == "ppl_vs_length"
  # What changes the result changes the name: lengths, protocol, stride.
  assert (
    _name(lengths=[512, 256], protocol="sliding", stride=64)
    == "ppl_vs_length_len256-512_sliding_stride64"
  )
  assert _name(protocol="nonoverlapping", stride=64) == "ppl_vs_length_nonoverlapping"
  assert _name(protocol="both", stride=32) == "ppl_vs_length_stride32"
  assert _name(rope_scaling="yarn", rope_factor=4.0) == "ppl_vs_length_yarn_4"
  assert _name(out="mine", rope_scaling="yarn", rope_factor=4.0) == "mine"
  assert _name(split="test") == "ppl_vs_length_test"
  # Two evaluations of different sizes never share a name.
  assert _name(max_tokens=8192) == "ppl_vs_length_tok8192"
  assert _name(max_tokens=spec.DEFAULT_MAX_TOKENS) == "ppl_vs_length"
  assert _name(data_files="a/*.txt", split="test") == "ppl_vs_length_files"
  assert _name(split="test", rope_scaling="ntk", rope_factor=2.0) == "ppl_vs_length_test_ntk_2"
  # An imposed window, and BCA with blocks of the training length by default.
  assert _name(attention_window=64) == "ppl_vs_length_window64"
  assert _name(bca=True) == "ppl_vs_length_bca256"
  # Key tokens add fields: a name of their own, with the short window (default L / 4).
  assert _name(key_tokens=True) == "ppl_vs_length_keytok64"
  assert _name(key_tokens=True, key_short_window=32) == "ppl_vs_length_keytok32"


def test_a_yarn_ramp_of_its_own_names_its_result_and_scales_each_length_over_itself():
  authors = dict(rope_scaling="yarn", rope_factor="auto", rope_beta_fast=2, rope_beta_slow=1,
                 rope_ramp="evaluated")  # fmt: skip
  assert _name(**authors) == "ppl_vs_length_yarn_auto_bf2_bs1_ramp_evaluated"
  rope = spec.spec_from_options(**authors).rope
  assert spec.rope_options(rope, 1024, 256) == {
    "rope_scaling": "yarn",
    "rope_factor": 4.0,
    "rope_fields": {"beta_fast": 2.0, "beta_slow": 1.0, "ramp_len": 1024},
  }
  cfg = config_lib.run_config_from_dict(default.get_config()).model
  scaling = runs.eval_model_config(cfg, seq_len=256, **spec.rope_options(rope, 1024, 256))
  scaling = scaling.posenc.scaling
  assert (scaling.factor, scaling.original_max_len, scaling.ramp_len) == (4.0, 256, 1024)
  assert (scaling.beta_fast, scaling.beta_slow) == (2.0, 1.0)
  # Hugging Face's ramp: nothing set, the training length.
  plain = spec.spec_from_options(rope_scaling="yarn", rope_factor="auto").rope
  assert spec.rope_options(plain, 1024, 256)["rope_fields"] == {}
  assert ppl_vs_length.scaling_record(cfg, rope) == {
    "kind": "yarn", "factor": "auto", "beta_fast": 2.0, "beta_slow": 1.0, "ramp": "evaluated"
  }  # fmt: skip
  assert ppl_vs_length.scaling_record(cfg, plain) == {"kind": "yarn", "factor": "auto"}


@pytest.mark.parametrize(
  "options, message",
  [
    (dict(rope_scaling="linear", rope_factor=2, rope_beta_fast=2), "not by --rope_scaling=linear"),
    (dict(rope_ramp="evaluated"), "need --rope_scaling"),
    (dict(rope_scaling="yarn", rope_ramp="extended"), "--rope_ramp must be one of"),
    (dict(rope_scaling="yarn", rope_beta_slow=-1), "--rope_beta_slow must be > 0"),
  ],
)
def test_a_yarn_ramp_is_refused_where_no_scaling_reads_it(options, message):
  with pytest.raises(ValueError, match=message):
    spec.spec_from_options(**options)


def test_bin_positions_averages_weighted_loss_per_bin():
  loss = np.array([1.0, 3.0, 0.0, 0.0, 4.0, 8.0])
  weight = np.array([1.0, 1.0, 0.0, 0.0, 2.0, 2.0])
  assert ppl_vs_length.bin_positions(loss, weight, max_points=3) == [2.0, None, 3.0]
  assert ppl_vs_length.bin_positions(loss[:2], weight[:2]) == [1.0, 3.0]
