"""eval.py --query_scale: a parameter-free query temperature imposed on a trained decoder run."""

import dataclasses

import numpy as np
import pytest

from roformer import config as config_lib
from roformer import runs
from roformer.evals import spec
from tests.e2e.eval_cli_test import SEQ_LEN, _evaluate, _make_run


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
  return _make_run(tmp_path_factory.mktemp("qscale"), "rope_run")


def _losses(result) -> dict[int, float]:
  return {r["length"]: r["loss"] for r in result["records"]}


@pytest.mark.parametrize("kind", ["logn", "llama4"])
def test_query_scale_leaves_the_training_length_and_changes_longer_windows(rope_run, kind):
  options = dict(lengths=[SEQ_LEN - 1, 2 * SEQ_LEN], protocol="nonoverlapping", max_tokens=128)
  plain, plain_path = _evaluate(rope_run, overwrite=True, **options)
  scaled, path = _evaluate(rope_run, query_scale=kind, **options)
  # Windows shorter than L: every query sees n < L keys, where both temperatures are 1.
  np.testing.assert_allclose(_losses(scaled)[SEQ_LEN - 1], _losses(plain)[SEQ_LEN - 1], rtol=1e-6)
  # Beyond L the queries are multiplied by more than 1 (the negative control of the line above).
  assert abs(_losses(scaled)[2 * SEQ_LEN] - _losses(plain)[2 * SEQ_LEN]) > 1e-4
  assert path.name == f"{plain_path.stem}_qscale_{kind}.json"
  assert scaled["query_scale"] == kind and "query_scale" not in plain
  assert f"query scale {kind}" in scaled["notes"]


def test_query_scale_is_logn_of_the_training_length(rope_run):
  model_cfg = config_lib.load_run_config(rope_run).model
  cfg = runs.eval_model_config(model_cfg, seq_len=SEQ_LEN, query_scale="logn").posenc
  assert (cfg.query_scale, cfg.query_scale_len, cfg.query_scale_kinds) == ("logn", SEQ_LEN, "")
  cfg = runs.eval_model_config(model_cfg, seq_len=SEQ_LEN, query_scale="llama4").posenc
  assert (cfg.query_scale, cfg.query_scale_floor) == ("llama4", float(SEQ_LEN))


def test_query_scale_refusals(tmp_path, rope_run):
  with pytest.raises(ValueError, match="ssmax learns its scale"):
    spec.spec_from_options(query_scale="ssmax")
  model_cfg = config_lib.load_run_config(rope_run).model
  trained = dataclasses.replace(
    model_cfg,
    posenc=dataclasses.replace(model_cfg.posenc, query_scale="logn", query_scale_len=SEQ_LEN),
  )
  with pytest.raises(ValueError, match="already trained with posenc.query_scale='logn'"):
    runs.eval_model_config(trained, seq_len=SEQ_LEN, query_scale="llama4")
  encoder = _make_run(tmp_path, "encoder_run", model_kind="encoder")
  with pytest.raises(ValueError, match="causal decoder"):
    runs.eval_model_config(
      config_lib.load_run_config(encoder).model, seq_len=SEQ_LEN, query_scale="logn"
    )
