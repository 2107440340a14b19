"""Tests of evals.key_tokens (LongPPL's key-token perplexity): the paper's selection rule on hand
numbers, the short pass's windows, both passes against a token-by-token hand computation on a
tiny model, and a model that ignores its context (no key tokens)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from roformer.data import ByteTokenizer, eval_windows
from roformer.evals import key_tokens
from roformer.nn.config import ModelConfig
from roformer.nn.model import make_model

VOCAB = ByteTokenizer.vocab_size
L, K = 24, 8  # window length and short window: chunks of S = 2, candidates from slot 10


def test_selection_is_the_papers_strict_lsd_and_lcl_thresholds():
  # LSD = short - long: 2.5, 2.25, 3, 2 (not > 2), 3, 2 (not > 2);
  # LCL = -long: -0.5, -1.75, -2 (not > -2), -0.5, -3, -1.
  long = [0.5, 1.75, 2.0, 0.5, 3.0, 1.0]
  short = [3.0, 4.0, 5.0, 2.5, 6.0, 3.0]
  assert key_tokens.select_key_tokens(long, short).tolist() == [1, 1, 0, 0, 0, 0]
  got = key_tokens.summarize(long, short)
  assert got == {
    "candidates": 6, "count": 2, "fraction": 2 / 6, "loss": 1.125,
    "ppl": pytest.approx(math.exp(1.125)), "short_loss": 3.5,
  }  # fmt: skip
  # The passes swapped: the long context never helps, nothing is a key token.
  swapped = key_tokens.summarize(short, long)
  assert swapped["count"] == 0 and swapped["loss"] is swapped["ppl"] is None
  assert key_tokens.LSD_THRESHOLD == 2.0 and key_tokens.LCL_THRESHOLD == -2.0


def test_short_windows_give_target_i_of_a_chunk_k_plus_i_inputs():
  # K = 8, S = 2, truncated inputs of K + S - 1 = 9 slots; chunks start at slots 10, 12, 14.
  starts, scored = key_tokens.short_windows(16, 8)
  assert starts.tolist() == [3, 5, 7]
  assert [np.flatnonzero(row).tolist() for row in scored] == [[10, 11], [12, 13], [14, 15]]
  # Slot 14 reads slots 7..14 (8 = K inputs), slot 15 reads 7..15 (K + 1).
  # Length 15: the last input moves back to end at slot 14 (14 - 6 + 1 = 9 = K + S - 1 inputs).
  starts, scored = key_tokens.short_windows(15, 8)
  assert starts.tolist() == [3, 5, 6]
  assert [np.flatnonzero(row).tolist() for row in scored] == [[10, 11], [12, 13], [14]]
  # No slot with more than K + S inputs in the window: no candidates.
  assert len(key_tokens.short_windows(10, 8)[0]) == 0


@functools.cache
def _model():
  cfg = ModelConfig(
    kind="decoder", vocab_size=VOCAB, num_layers=2, emb_dim=32, num_heads=2, mlp_dim=64,
    attention_block=16,
  )  # fmt: skip
  return make_model(cfg, rngs=nnx.Rngs(3))


def _windows():
  tokens = np.random.default_rng(0).integers(32, 127, 200).astype(np.int32)
  return eval_windows(
    tokens, model_kind="decoder", length=L, protocol="nonoverlapping", stride=L, max_tokens=48,
    max_length=L,
  )  # fmt: skip


def _nll(forward, inputs, targets):
  """NLL [T] of every target after a full forward pass over `inputs` [T] (positions 0..T-1)."""
  logits = np.asarray(forward(inputs[None], np.arange(len(inputs), dtype=np.int32)[None]))[0]
  logits = logits.astype(np.float64)
  peak = logits.max(-1, keepdims=True)
  logz = np.log(np.exp(logits - peak).sum(-1)) + peak[:, 0]
  return logz - logits[np.arange(len(targets)), targets]


def _by_hand(model, windows):
  """Each candidate's loss with its whole window, and with the K + i inputs before it (target i
  of its chunk) as a sequence of its own, one forward pass per target: the definition."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda x, p: nnx.merge(graphdef, state)(x, p))
  S = K // 4
  long, short, contexts = [], [], []
  for inputs, targets in zip(windows.inputs, windows.targets, strict=True):
    whole = _nll(forward, inputs, targets)
    for p in range(K + S, L):
      i = (p - K) % S
      start = min(p - (K + i) + 1, L - (K + S - 1))  # the last chunk's input ends at L
      long.append(whole[p])
      short.append(_nll(forward, inputs[start : p + 1], targets[start : p + 1])[-1])
      contexts.append(p + 1 - start)
  return np.asarray(long), np.asarray(short), contexts


def test_both_passes_and_the_key_token_perplexity_match_a_hand_computation():
  model, windows = _model(), _windows()
  long, short, indices = key_tokens.long_and_short_nll(model, windows, short_window=K)
  want_long, want_short, contexts = _by_hand(model, windows)
  assert set(contexts) == {K, K + 1}  # the short pass reads K + i inputs, never the window
  assert len(long) == 2 * (L - K - 2)  # 2 windows, slots 10..23
  np.testing.assert_allclose(long, want_long, atol=2e-5)
  np.testing.assert_allclose(short, want_short, atol=2e-5)
  assert np.all(np.diff(indices) > 0)  # window order, each target once
  # A random model gains little from context: thresholds at the median LSD and the median loss
  # select a part of the candidates; the selection and perplexity follow the hand numbers.
  lsd = want_short - want_long
  for thresholds in (
    dict(lsd_threshold=float(np.median(lsd)), lcl_threshold=-100.0),
    dict(lsd_threshold=-100.0, lcl_threshold=-float(np.median(want_long))),
    dict(),  # the paper's 2 and -2
  ):
    lsd_t = thresholds.get("lsd_threshold", 2.0)
    lcl_t = thresholds.get("lcl_threshold", -2.0)
    key = (lsd > lsd_t) & (-want_long > lcl_t)
    got = key_tokens.key_token_record(model, windows, short_window=K, **thresholds)
    assert (got["candidates"], got["count"]) == (len(lsd), int(key.sum()))
    if key.any():
      assert 0 < key.sum() < len(key)
      assert got["ppl"] == pytest.approx(math.exp(want_long[key].mean()), rel=1e-5)
      assert got["short_loss"] == pytest.approx(want_short[key].mean(), rel=1e-5)
    else:
      assert got["ppl"] is None


class _ContextFree(nnx.Module):
  """hidden = token embeddings, logits = the tied head: each prediction reads its own token
  only, so no context can help it."""

  def __init__(self):
    self.cfg = ModelConfig(attention_block=16)
    self.embed = nnx.Embed(VOCAB, 8, rngs=nnx.Rngs(0))

  def hidden(self, tokens_BL, positions_BL, segment_ids_BL=None, deterministic=True):
    del positions_BL, segment_ids_BL, deterministic
    return self.embed(tokens_BL) * 4.0  # confident predictions: losses far from uniform

  def logits(self, h_BLD):
    return self.embed.attend(h_BLD).astype(jnp.float32)


def test_a_model_that_ignores_its_context_has_no_key_tokens():
  long, short, _ = key_tokens.long_and_short_nll(_ContextFree(), _windows(), short_window=K)
  np.testing.assert_array_equal(long, short)  # LSD is 0 for every candidate
  got = key_tokens.summarize(long, short, lsd_threshold=0.0, lcl_threshold=-np.inf)
  assert got["candidates"] == len(long) > 0 and got["count"] == 0 and got["ppl"] is None


def test_packed_runs_read_the_short_pass_as_documents_of_their_own():
  # With EOS tokens in the window, the truncated input's segments and positions are those of
  # the documents it holds, starting at 0 where it cuts one (document_segments).
  tokens = np.random.default_rng(1).integers(32, 127, 200).astype(np.int32)
  tokens[::13] = ByteTokenizer.eos_id
  windows = eval_windows(
    tokens, model_kind="decoder", length=L, protocol="nonoverlapping", stride=L, max_tokens=48,
    max_length=L, tokenizer=ByteTokenizer(), packed=True,
  )  # fmt: skip
  model = _model()
  long, short, _ = key_tokens.long_and_short_nll(
    model, windows, short_window=K, eos_id=ByteTokenizer.eos_id
  )
  # A target whose document starts inside its short input (an EOS input at slot start - 1 or
  # later starts a document at the next slot) has the same context in both passes.
  same = []
  for inputs in windows.inputs:
    for p in range(K + 2, L):
      start = min(p - (K + (p - K) % 2) + 1, L - (K + 1))
      same.append(bool(np.any(inputs[start - 1 : p] == ByteTokenizer.eos_id)))
  same = np.asarray(same)
  assert 0 < same.sum() < len(same)
  np.testing.assert_allclose(long[same], short[same], atol=2e-5)
  assert np.abs(long[~same] - short[~same]).max() > 1e-3
