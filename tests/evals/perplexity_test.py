"""Tests of evals.perplexity: the same span at every length, protocols, blockwise loss, encoder
scoring."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.data import ByteTokenizer, eval_windows
from roformer.evals import perplexity
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model

VOCAB = ByteTokenizer.vocab_size


@functools.cache
def _model(kind="decoder", block=64):
  """A tiny model; cached so that tests share compiled scoring functions of equal shapes."""
  cfg = ModelConfig(
    kind=kind, vocab_size=VOCAB, num_layers=1, emb_dim=16, num_heads=2, mlp_dim=32,
    attention_block=block,
  )  # fmt: skip
  return make_model(cfg, rngs=nnx.Rngs(0))


def _tokens(n=700, seed=0):
  # Byte-like text with EOS separators, so the encoder's special-token rule is exercised.
  tokens = np.random.default_rng(seed).integers(32, 127, n).astype(np.int32)
  tokens[::50] = ByteTokenizer.eos_id
  return tokens


def _direct_loss(model, windows):
  """Loss and accuracy from the model's full [N, L, V] logits (the reference)."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, x, p: nnx.merge(graphdef, state)(x, p))
  # One window per call: one compile whatever the number of windows.
  logits = np.concatenate(
    [
      forward(state, x[None], p[None])
      for x, p in zip(windows.inputs, windows.positions, strict=True)
    ]
  ).astype(np.float64)
  peak = logits.max(-1, keepdims=True)
  logp = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, windows.targets[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == windows.targets
  w = windows.weights.astype(np.float64)
  return (nll * w).sum() / w.sum(), (correct * w).sum() / w.sum()


def _evaluate(model, tokens, **kwargs):
  args = dict(stride=0, max_tokens=256, max_length=64, batch_size=4)
  args.update(kwargs)
  args["stride"] = args["stride"] or args["length"]
  return perplexity.evaluate_at_length(model, tokens, **args)


def test_evaluate_at_length_same_token_count_at_every_length_and_protocol():
  model, tokens = _model(), _tokens()
  counts = set()
  for length in (16, 32):
    for protocol in ("nonoverlapping", "sliding"):
      stride = length if protocol == "nonoverlapping" else length // 4
      r = _evaluate(model, tokens, length=length, protocol=protocol, stride=stride)
      counts.add((r["tokens"], r["weight_sum"]))
      assert np.isfinite(r["loss"]) and r["ppl"] == pytest.approx(np.exp(r["loss"]))
  assert counts == {(256, 256.0)}


def test_evaluate_at_length_sliding_with_stride_equal_length_equals_nonoverlapping():
  model, tokens = _model(), _tokens()
  a = _evaluate(model, tokens, length=32, protocol="nonoverlapping")
  b = _evaluate(model, tokens, length=32, protocol="sliding", stride=32)
  assert a == b


def test_evaluate_at_length_blockwise_matches_full_logits_loss():
  # Blockwise attention and loss; the block does not divide the length (the last loss block is
  # shifted back) and the last batch is padded with zero-weight rows.
  length, block, batch_size = 40, 16, 3
  model, tokens = _model(block=block), _tokens()
  for protocol, stride in (("nonoverlapping", length), ("sliding", length // 4)):
    windows = eval_windows(
      tokens,
      model_kind="decoder",
      length=length,
      protocol=protocol,
      stride=stride,
      max_tokens=256,
      max_length=64,
    )
    assert len(windows.inputs) % batch_size
    r = _evaluate(
      model, tokens, length=length, protocol=protocol, stride=stride, batch_size=batch_size
    )
    expected, _ = _direct_loss(model, windows)
    assert r["loss"] == pytest.approx(expected, abs=1e-5)
    assert "accuracy" not in r


def test_evaluate_at_length_encoder_reports_masked_loss_and_accuracy():
  model, tokens = _model(kind="encoder"), _tokens()
  kwargs = dict(length=32, protocol="nonoverlapping", stride=32)
  kwargs.update(tokenizer=ByteTokenizer(), mlm_probability=0.15, seed=3)
  r = _evaluate(model, tokens, **kwargs)
  windows = eval_windows(tokens, model_kind="encoder", **kwargs, max_tokens=256, max_length=64)
  loss, accuracy = _direct_loss(model, windows)
  assert r["loss"] == pytest.approx(loss, abs=1e-5)
  assert r["accuracy"] == pytest.approx(accuracy, abs=1e-9)
  assert r["tokens"] == windows.num_tokens == r["weight_sum"]
  # Deterministic: the same seed gives the same result; another seed masks other tokens.
  assert _evaluate(model, tokens, **kwargs) == r
  assert _evaluate(model, tokens, **{**kwargs, "seed": 4})["loss"] != r["loss"]


def test_evaluate_at_length_encoder_without_tokenizer_raises():
  with pytest.raises(ValueError, match="tokenizer"):
    _evaluate(_model(kind="encoder"), _tokens(), length=32, protocol="nonoverlapping")


def test_score_windows_position_sums_add_up_to_the_loss_sum():
  model, tokens = _model(), _tokens()
  windows = eval_windows(
    tokens, model_kind="decoder", length=32, protocol="sliding", stride=8, max_tokens=256,
    max_length=64,
  )  # fmt: skip
  calls = []
  scores = perplexity.score_windows(
    model, windows, batch_size=4, progress=lambda done, total: calls.append((done, total))
  )
  assert scores.position_loss_sum.sum() == pytest.approx(scores.loss_sum, rel=1e-6)
  # Sliding windows score only their last `stride` positions.
  np.testing.assert_array_equal(scores.position_loss_sum[:24], 0.0)
  assert (scores.position_weight_sum[24:] > 0).all()
  assert calls[-1] == (len(windows.inputs), len(windows.inputs))


class _EmbeddingOnly(nnx.Module):
  """hidden = token embeddings, logits = the tied head: a large vocabulary, nothing else."""

  def __init__(self, vocab, dim, block):
    self.cfg = ModelConfig(attention_block=block)
    self.embed = nnx.Embed(vocab, dim, rngs=nnx.Rngs(0))

  def hidden(self, tokens_BL, positions_BL, segment_ids_BL=None, deterministic=True):
    del positions_BL, segment_ids_BL, deterministic
    return self.embed(tokens_BL)

  def logits(self, h_BLD):
    return self.embed.attend(h_BLD).astype(jnp.float32)


def test_score_batch_never_holds_more_than_a_block_of_logits():
  length, vocab, block = 2048, 4096, 128
  model = _EmbeddingOnly(vocab, 8, block)
  graphdef, state = nnx.split(model)
  x = np.zeros((1, length), np.int32)
  w = np.ones((1, length), np.float32)
  compiled = perplexity.score_batch.lower(graphdef, state, x, x, x, w, block=block).compile()
  analysis = compiled.memory_analysis()
  assert analysis is not None, "XLA on CPU reports a memory analysis; the check needs it"
  # Full logits would be 32 MiB; a few [block, V] buffers are 2 MiB each.
  assert analysis.temp_size_in_bytes < length * vocab * 4 / 4


def test_a_randomized_run_is_scored_at_randomized_positions_per_document(monkeypatch):
  # Each window (each packed document) takes a fresh sorted subset of [0, N) of its own length,
  # in every draw; the loss is the mean over the draws, each draw's loss is returned.
  model, tokens = _model(), _tokens()
  windows = eval_windows(
    tokens, model_kind="decoder", length=32, protocol="nonoverlapping", stride=32,
    max_tokens=256, max_length=64, tokenizer=ByteTokenizer(), packed=True,
  )  # fmt: skip
  seen = []
  original = perplexity.score_windows

  def spy(model, drawn, **kwargs):
    seen.append(drawn.positions)
    return original(model, drawn, **kwargs)

  monkeypatch.setattr(perplexity, "score_windows", spy)
  scores, losses = perplexity.score_windows_at_positions(
    model, windows, batch_size=4, randomize_max=1024, seed=0, draws=3
  )
  assert len(seen) == 3 and len(losses) == 3
  assert not np.array_equal(seen[0], seen[1])
  for positions in seen:
    for row, seg in zip(positions, windows.segment_ids, strict=True):
      for doc in np.unique(seg):
        p = row[seg == doc]
        assert np.all(np.diff(p) > 0) and p.max() < 1024
    assert positions.max() > 256  # far past the window: drawn from [0, 1024)
  # Summed over the draws: the mean loss of the draws.
  assert scores.loss_sum / scores.weight_sum == pytest.approx(np.mean(losses), rel=1e-6)
  seen.clear()
  _, none = perplexity.score_windows_at_positions(model, windows, batch_size=4)
  assert none == [] and np.array_equal(seen[0], windows.positions)
