"""Tests of training batches (order, resumption, sharding, packing) and MLM masking."""

import dataclasses

import numpy as np
import pytest

from roformer import data, testing

FIXTURES = testing.FIXTURES / "data"


class _ArrayCorpus:
  """A corpus whose training split is a given token array."""

  def __init__(self, tokens, tokenizer=None):
    self._tokens = np.asarray(tokens, dtype=np.int32)
    self.tokenizer = tokenizer or data.ByteTokenizer()
    self.source = self

  def tokens(self, split):
    del split
    return self._tokens

  def describe(self):
    return "test array"


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
  cfg = data.DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))
  return data.load_corpus(cfg, workdir="", splits=("train",))


@pytest.fixture(scope="module")
def files_corpus(tmp_path_factory):
  files = f"{FIXTURES / 'docs' / '*.txt'},{FIXTURES / 'records.jsonl'}"
  cfg = data.DataConfig(
    source="files", files=files, cache_dir=str(tmp_path_factory.mktemp("cache"))
  )
  return data.load_corpus(cfg, workdir="", splits=("train",))


def _batches(corpus, *, seq_len=64, pack=False, kind="decoder", batch=8, seed=0, pi=0, pc=1):
  cfg = data.DataConfig(seq_len=seq_len, pack=pack)
  return data.TrainBatches(
    corpus,
    cfg,
    model_kind=kind,
    global_batch_size=batch,
    seed=seed,
    process_index=pi,
    process_count=pc,
  )


def _assert_batches_equal(a, b):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---- decoder windows ----


def test_decoder_batch_targets_are_next_tokens_of_contiguous_windows():
  seq_len, n = 16, 16 * 40 + 1
  batches = _batches(_ArrayCorpus(np.arange(n)), seq_len=seq_len)
  b = batches.batch(0)
  assert b["inputs"].dtype == np.int32 and b["weights"].dtype == np.float32
  starts = b["inputs"][:, 0]
  assert np.all(starts % seq_len == 0)
  np.testing.assert_array_equal(b["inputs"], starts[:, None] + np.arange(seq_len))
  np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
  np.testing.assert_array_equal(b["positions"], np.broadcast_to(np.arange(seq_len), (8, seq_len)))
  # One sequence per row: no segment ids (attention runs unmasked; only packed rows carry them).
  assert "segment_ids" not in b and np.all(b["weights"] == 1)


def test_decoder_epoch_visits_every_window_once_in_a_seed_dependent_order():
  seq_len, num_windows = 8, 24
  corpus = _ArrayCorpus(np.arange(seq_len * num_windows + 1))
  order = {}
  for seed in (0, 1):
    batches = _batches(corpus, seq_len=seq_len, batch=4, seed=seed)
    assert batches.num_windows == num_windows
    starts = np.concatenate([batches.batch(s)["inputs"][:, 0] for s in range(6)])
    np.testing.assert_array_equal(np.sort(starts) // seq_len, np.arange(num_windows))
    order[seed] = starts
  assert not np.array_equal(order[0], order[1])


@pytest.mark.parametrize(
  ("kind", "pack"), [("decoder", False), ("decoder", True), ("encoder", False)]
)
def test_batch_at_step_is_identical_when_resumed_at_that_step(files_corpus, kind, pack):
  # 40 steps of 8 rows cross epochs of this small corpus.
  running = _batches(files_corpus, kind=kind, pack=pack, seq_len=32).iterate(0)
  stream = [next(running) for _ in range(40)]
  assert _batches(files_corpus, kind=kind, pack=pack, seq_len=32).num_windows < 8 * 20
  for step in (0, 17, 39):
    resumed = _batches(files_corpus, kind=kind, pack=pack, seq_len=32)
    _assert_batches_equal(resumed.batch(step), stream[step])
    _assert_batches_equal(next(resumed.iterate(step)), stream[step])


@pytest.mark.parametrize(
  ("kind", "pack"), [("decoder", False), ("decoder", True), ("encoder", False)]
)
def test_processes_together_produce_the_global_batch(stdlib_corpus, kind, pack):
  single = _batches(stdlib_corpus, kind=kind, pack=pack, batch=8, seq_len=128)
  shards = [
    _batches(stdlib_corpus, kind=kind, pack=pack, batch=8, seq_len=128, pi=i, pc=2)
    for i in range(2)
  ]
  for step in (0, 5):
    parts = [s.batch(step) for s in shards]
    assert parts[0]["inputs"].shape == (4, 128)
    whole = single.batch(step)
    _assert_batches_equal({k: np.concatenate([p[k] for p in parts]) for k in whole}, whole)


# ---- packing ----


def test_packed_epoch_trains_every_in_document_target_exactly_once(files_corpus):
  tokens = np.asarray(files_corpus.tokens("train"))
  eos = files_corpus.tokenizer.eos_id
  num_rows = _batches(files_corpus, pack=True, seq_len=32).num_windows
  b = _batches(files_corpus, pack=True, seq_len=32, batch=num_rows).batch(0)
  w = b["weights"] == 1
  # The (input, target) pairs trained in one epoch are exactly the pairs inside documents.
  trained = np.sort(b["inputs"][w].astype(np.int64) << 20 | b["targets"][w])
  inside = tokens[:-1] != eos
  expected = np.sort(tokens[:-1][inside].astype(np.int64) << 20 | tokens[1:][inside])
  np.testing.assert_array_equal(trained, expected)


def test_packed_rows_have_restarting_positions_and_no_cross_document_targets(files_corpus):
  b = _batches(files_corpus, pack=True, seq_len=48, batch=16).batch(1)
  seg, pos, w = b["segment_ids"], b["positions"], b["weights"]
  pad = files_corpus.tokenizer.pad_id
  assert (seg > 0).sum(axis=1).min() > 0
  for row in range(seg.shape[0]):
    s = seg[row]
    live = s > 0
    assert np.all(np.diff(s[live]) >= 0) and s[live][0] == 1  # segments 1, 2, ... in order
    assert np.all(b["inputs"][row][~live] == pad) and np.all(w[row][~live] == 0)
    starts = np.flatnonzero(live & np.concatenate([[True], s[1:] != s[:-1]]))
    assert np.all(pos[row][starts] == 0)
    same = live[1:] & (s[1:] == s[:-1])
    np.testing.assert_array_equal(pos[row][1:][same], pos[row][:-1][same] + 1)
    # A target counts only when it continues the input's document.
    np.testing.assert_array_equal(w[row][:-1], (s[1:] == s[:-1]) & live[:-1])
  assert (w == 0).any() and (w == 1).any()


# ---- encoder and masking ----


def test_encoder_masking_rates_over_many_batches(stdlib_corpus):
  batches = _batches(stdlib_corpus, kind="encoder", seq_len=512, batch=16, seed=3)
  mask_id = stdlib_corpus.tokenizer.mask_id
  counts = dict(selected=0, eligible=0, mask=0, random=0, kept=0)
  for step in range(40):
    b = batches.batch(step)
    sel = b["weights"] == 1
    np.testing.assert_array_equal(b["inputs"][~sel], b["targets"][~sel])
    counts["selected"] += sel.sum()
    counts["eligible"] += (~np.isin(b["targets"], stdlib_corpus.tokenizer.special_ids)).sum()
    counts["mask"] += (b["inputs"][sel] == mask_id).sum()
    counts["kept"] += (b["inputs"][sel] == b["targets"][sel]).sum()
    counts["random"] += (
      (b["inputs"][sel] != mask_id) & (b["inputs"][sel] != b["targets"][sel])
    ).sum()
  assert abs(counts["selected"] / counts["eligible"] - 0.15) < 0.005
  assert abs(counts["mask"] / counts["selected"] - 0.8) < 0.01
  assert abs(counts["random"] / counts["selected"] - 0.1) < 0.01
  assert abs(counts["kept"] / counts["selected"] - 0.1) < 0.01


def test_mlm_mask_never_selects_pad_or_specials_and_is_deterministic():
  tok = data.ByteTokenizer()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(64, 128))
  tokens[:, 100:] = tok.pad_id
  tokens[:, 0] = tok.cls_id
  tokens[:, 50] = tok.eos_id
  inputs, weights = data.mlm_mask(
    tokens, rng=np.random.default_rng(7), tokenizer=tok, mlm_probability=0.5
  )
  assert weights.dtype == np.float32 and inputs.dtype == np.int32
  assert np.all(weights[:, 100:] == 0) and np.all(weights[:, [0, 50]] == 0)
  np.testing.assert_array_equal(inputs[:, 100:], tok.pad_id)
  changed = inputs != tokens
  assert np.all(weights[changed] == 1)
  replaced = changed & (inputs != tok.mask_id)
  assert replaced.any() and np.all(inputs[replaced] < 256)  # random tokens are regular
  again = data.mlm_mask(tokens, rng=np.random.default_rng(7), tokenizer=tok, mlm_probability=0.5)
  np.testing.assert_array_equal(again[0], inputs)
  np.testing.assert_array_equal(again[1], weights)


# ---- errors ----


def test_corpus_shorter_than_one_window_raises_naming_seq_len(files_corpus):
  n = len(files_corpus.tokens("train"))
  with pytest.raises(data.DataError, match=f"data.seq_len=4096.*only {n} tokens"):
    _batches(files_corpus, seq_len=4096)


@pytest.mark.parametrize(
  ("kwargs", "pattern"),
  [
    (dict(kind="mlm"), "model.kind='mlm'"),
    (dict(batch=7, pc=2), "train.global_batch_size=7"),
  ],
)
def test_train_batches_bad_arguments_raise_data_error(files_corpus, kwargs, pattern):
  with pytest.raises(data.DataError, match=pattern):
    _batches(files_corpus, **kwargs)


def test_encoder_bad_mlm_probability_raises_naming_field(files_corpus):
  cfg = dataclasses.replace(data.DataConfig(seq_len=16), mlm_probability=1.5)
  with pytest.raises(data.DataError, match="data.mlm_probability=1.5"):
    data.TrainBatches(files_corpus, cfg, model_kind="encoder", global_batch_size=2, seed=0)
