"""Context extensions: the effective relative distance of every (query, key) pair against a
hand computation from each paper's formula, and negative controls."""

import jax.numpy as jnp
import numpy as np
import pytest

from roformer.posenc.config import ContextExtension
from roformer.posenc.extension import position_pieces, query_factor

MASKED = -1  # the distance matrix's entry for a pair no piece covers


def effective_distance(ext: ContextExtension, L: int) -> np.ndarray:
  """[L, L] qrot[i] - krot[j] of the piece covering (i, j), MASKED where none does, for causal
  pairs (j <= i) at positions 0..L-1; checks the pieces are disjoint."""
  pos_1L = jnp.arange(L)[None, :]
  dist = np.full((L, L), MASKED)
  taken = np.zeros((L, L), bool)
  for qrot_BL, krot_BS, where_BLS in position_pieces(ext, pos_1L, pos_1L):
    where = np.asarray(where_BLS[0])
    assert not (where & taken).any(), "pieces overlap"
    taken |= where
    d = np.asarray(qrot_BL[0])[:, None] - np.asarray(krot_BS[0])[None, :]
    dist = np.where(where, d, dist)
  causal = np.tril(np.ones((L, L), bool))
  return np.where(causal, dist, MASKED)


def hand_self_extend_floor(L, W, G):
  # LongLM's self_extend_patch/Llama.py, decoding path: the grouped key at
  # i // G - j // G + (W - W // G); neighbours (i - j < W) keep i - j.
  out = np.full((L, L), MASKED)
  for i in range(L):
    for j in range(i + 1):
      out[i, j] = i - j if i - j < W else (i // G + W - W // G) - j // G
  return out


def hand_self_extend(L, W, G):
  # LongLM's self_extend_patch/Llama.py, a prompt: group_query_position = i // G + W - W / G (a
  # float), group_key_position = j // G; neighbours (i - j < W) keep i - j.
  out = np.full((L, L), float(MASKED))
  for i in range(L):
    for j in range(i + 1):
      out[i, j] = i - j if i - j < W else (i // G + W - W / G) - j // G
  return out


def hand_dca(L, s, w):
  # An et al. 2024 / ChunkLlama: keys at j mod s; the query at i mod s (same chunk), at
  # min(i mod s + s, s + w) (previous chunk), at min(2s - 1, s + w) (earlier chunks).
  out = np.full((L, L), MASKED)
  for i in range(L):
    for j in range(i + 1):
      ci, cj = i // s, j // s
      if ci == cj:
        q = i % s
      elif cj == ci - 1:
        q = min(i % s + s, s + w)
      else:
        q = min(2 * s - 1, s + w)
      out[i, j] = q - j % s
  return out


def hand_rerope(L, w):
  out = np.full((L, L), MASKED)
  for i in range(L):
    for j in range(i + 1):
      out[i, j] = min(i - j, w)
  return out


def hand_string(L, S, W):
  # An et al. 2024 (STRING): P[i, j] = i - j - S + W where i - j >= S, else i - j.
  out = np.full((L, L), MASKED)
  for i in range(L):
    for j in range(i + 1):
      out[i, j] = i - j - S + W if i - j >= S else i - j
  return out


def hand_sinks(L, n, w):
  # StreamingLLM: a cache of n sinks + w recent slots; positions are cache slots, so once the
  # cache is full the query sits at slot n + w - 1 and sink j at slot j.
  out = np.full((L, L), MASKED)
  for i in range(L):
    cache = list(range(i + 1)) if i < n + w else list(range(n)) + list(range(i - w + 1, i + 1))
    for slot, j in enumerate(cache):
      out[i, j] = (len(cache) - 1) - slot
  return out


CASES = [
  (
    ContextExtension("self_extend_floor", window=4, group=3),
    lambda L: hand_self_extend_floor(L, 4, 3),
  ),
  (ContextExtension("self_extend", window=6, group=2), lambda L: hand_self_extend_floor(L, 6, 2)),
  (ContextExtension("dca", chunk=5, local=2), lambda L: hand_dca(L, 5, 2)),
  (ContextExtension("dca_paper", chunk=4, local=6), lambda L: hand_dca(L, 4, 6)),
  (ContextExtension("rerope", window=5), lambda L: hand_rerope(L, 5)),
  (ContextExtension("rerope_clamp", window=3), lambda L: hand_rerope(L, 3)),
  (ContextExtension("string", shift=7, local=2), lambda L: hand_string(L, 7, 2)),
  (ContextExtension("sinks", sinks=2, window=5), lambda L: hand_sinks(L, 2, 5)),
  (ContextExtension("sinks", sinks=0, window=3), lambda L: hand_sinks(L, 0, 3)),
]


@pytest.mark.parametrize("ext, hand", CASES, ids=lambda c: getattr(c, "kind", ""))
def test_extension_distances_equal_hand_computation(ext, hand):
  np.testing.assert_array_equal(effective_distance(ext, 23), hand(23))


def test_self_extend_distances_by_hand_small_example():
  # W = 2, G = 2 at L = 6: row 5 sees keys 4, 5 at 1, 0 and keys 0..3 at (5//2 + 2 - 1) - j//2.
  d = effective_distance(ContextExtension("self_extend_floor", window=2, group=2), 6)
  np.testing.assert_array_equal(d[5], [3, 3, 2, 2, 1, 0])
  np.testing.assert_array_equal(d[2], [2, 1, 0, MASKED, MASKED, MASKED])


@pytest.mark.parametrize("W, G", [(32, 22), (20, 9), (32, 6), (7, 3)])
def test_self_extend_takes_the_reference_code_true_division(W, G):
  # The grids' settings (32/22, 20/9, 32/6) and a small one: the grouped distances are
  # W / G - floor(W / G) closer than the floor form's, the neighbour distances unchanged.
  L = 3 * W + 5
  ext = ContextExtension("self_extend", window=W, group=G)
  got = effective_distance(ext, L)
  np.testing.assert_allclose(got, hand_self_extend(L, W, G), rtol=0, atol=1e-5)
  floor = effective_distance(ContextExtension("self_extend_floor", window=W, group=G), L)
  np.testing.assert_array_equal(floor, hand_self_extend_floor(L, W, G))
  grouped = np.tril(np.ones((L, L), bool), -W)
  np.testing.assert_allclose((floor - got)[grouped], W / G - W // G, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(got[~grouped], floor[~grouped])


def test_self_extend_by_hand_at_w32_g22():
  # Query 100, key 0 (grouped): 100 // 22 + 32 - 32 / 22 = 4 + 30.5454... = 34.5454...; the
  # floor form 4 + 32 - 1 = 35.
  d = effective_distance(ContextExtension("self_extend", window=32, group=22), 101)
  np.testing.assert_allclose(d[100, 0], 4 + 32 - 32 / 22, rtol=0, atol=1e-5)
  floor = effective_distance(ContextExtension("self_extend_floor", window=32, group=22), 101)
  assert floor[100, 0] == 35


def test_self_extend_equals_its_floor_form_when_g_divides_w():
  ext = ContextExtension("self_extend", window=8, group=4)
  np.testing.assert_array_equal(effective_distance(ext, 40), hand_self_extend_floor(40, 8, 4))


def test_rerope_query_factor_is_the_released_patch_log_n():
  # rerope_patch.py: queries *= (log(pos + 1) / log(training_length)).clip(1). L = 128: 1 up to
  # position 127, ln 256 / ln 128 = 8/7 at 255 (2L), 11/7 at 2047 (16L).
  pos_1L = jnp.array([[0, 126, 127, 255, 1023, 2047]])
  got = query_factor(ContextExtension("rerope", window=16, train_len=128), pos_1L)
  np.testing.assert_allclose(np.asarray(got[0]), [1, 1, 1, 8 / 7, 10 / 7, 11 / 7], rtol=1e-6)
  # Negative control: the clamp alone multiplies nothing.
  assert query_factor(ContextExtension("rerope_clamp", window=16), pos_1L) is None


def test_dca_query_factor_is_chunkllama_mscale_squared():
  # ChunkLlama's get_mscale(n / L) = 0.05 ln(n / L) + 1 on the cos and sin of queries and keys:
  # logits times its square, one factor per sequence of n tokens. L = 128: n = 128 -> 1;
  # n = 512 -> (1 + 0.05 ln 4)^2 = 1.1434...; n = 2048 -> (1 + 0.05 ln 16)^2 = 1.29648...
  ext = ContextExtension("dca", chunk=80, local=16, train_len=128)
  for n, want in ((100, 1.0), (128, 1.0), (512, (1 + 0.05 * np.log(4)) ** 2), (2048, 1.296477)):
    got = query_factor(ext, jnp.arange(n)[None, :])
    np.testing.assert_allclose(np.asarray(got), np.full((1, n), want), rtol=1e-6)
  # One factor per row, from its own length (a row of 512 next to one of 128 positions).
  rows = jnp.stack([jnp.arange(512), jnp.minimum(jnp.arange(512), 127)])
  got = np.asarray(query_factor(ext, rows))
  np.testing.assert_allclose(got[:, 0], [(1 + 0.05 * np.log(4)) ** 2, 1.0], rtol=1e-6)
  # Negative control: the paper's DCA has no factor.
  assert query_factor(ContextExtension("dca_paper", chunk=80, local=16), rows) is None


def test_query_factor_needs_the_training_length():
  with pytest.raises(ValueError, match="train_len >= 2"):
    query_factor(ContextExtension("rerope", window=4), jnp.arange(8)[None, :])
  with pytest.raises(ValueError, match="must be >= 2"):
    ContextExtension("dca", chunk=4, local=1, train_len=1)


def _ext(kind, **fields):
  return ContextExtension(kind, **fields)


@pytest.mark.parametrize(
  "ext, other",
  [
    (_ext("self_extend", window=4, group=3), _ext("self_extend", window=5, group=3)),
    (_ext("self_extend", window=4, group=3), _ext("self_extend", window=4, group=4)),
    (_ext("self_extend", window=4, group=3), _ext("self_extend_floor", window=4, group=3)),
    (_ext("dca", chunk=5, local=2), _ext("dca", chunk=6, local=2)),
    (_ext("dca", chunk=5, local=2), _ext("dca", chunk=5, local=3)),
    (_ext("rerope", window=5), _ext("rerope", window=6)),
    (_ext("string", shift=7, local=2), _ext("string", shift=8, local=2)),
    (_ext("string", shift=7, local=2), _ext("string", shift=7, local=3)),
    (_ext("sinks", sinks=2, window=5), _ext("sinks", sinks=3, window=5)),
    (_ext("sinks", sinks=2, window=5), _ext("sinks", sinks=2, window=6)),
  ],
)
def test_extension_parameter_off_by_one_changes_distances(ext, other):
  assert (effective_distance(ext, 23) != effective_distance(other, 23)).any()


def test_extension_keeps_every_distance_inside_its_bound():
  # The point of each method: no distance beyond what the model was trained on.
  L = 64
  assert effective_distance(ContextExtension("rerope", window=5), L).max() == 5
  # Self-Extend's largest distance: (L-1)//G + W - W//G.
  assert effective_distance(ContextExtension("self_extend", window=8, group=4), L).max() == (
    63 // 4 + 8 - 2
  )
  assert effective_distance(ContextExtension("dca", chunk=8, local=3), L).max() == 8 + 3
  assert effective_distance(ContextExtension("string", shift=20, local=4), L).max() == 63 - 16
  assert effective_distance(ContextExtension("sinks", sinks=2, window=10), L).max() == 11


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(kind="self_extend", window=4), "extension.group >= 1"),
    (dict(kind="self_extend_floor", group=4), "extension.window >= 1"),
    (dict(kind="rerope_clamp"), "extension.window >= 1"),
    (dict(kind="dca"), "extension.chunk >= 1"),
    (dict(kind="rerope"), "extension.window >= 1"),
    (dict(kind="string", shift=4, local=4), "must be below"),
    (dict(kind="sinks", sinks=4), "extension.window >= 1"),
    (dict(kind="yarn"), "is not one of"),
    (dict(kind="rerope", window=3, local=-1), "must be >= 0"),
  ],
)
def test_extension_config_refuses_missing_or_bad_fields(fields, message):
  with pytest.raises(ValueError, match=message):
    ContextExtension(**fields)
