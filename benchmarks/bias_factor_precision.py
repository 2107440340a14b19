"""How exactly splash's folded biases (`bias_factors.fold_bias_factors`) match a dense bias.

Splash adds no logit bias; causal ALiBi, Sandwich and FoX reach it as extra query and key
columns whose products are the bias (up to a constant per query, which softmax ignores). ALiBi's
m j and FoX's -c_j grow with the position, so at long range the kernel's float32 sums hold
large numbers. This prints, per encoding, compute dtype and length, the largest error of the
attention output of the last 128 queries (the ones with the most keys and the largest
positions) against float32 dense attention with the bias added as such:

  dense       the dense kernel in the compute dtype (bias in float32), the reference error
  folded      the folded form as splash computes it: products in the compute dtype summed in
              float32 (preferred_element_type), the large key factors in KEY_FACTOR_PIECES
              pieces in a 16-bit dtype
  one piece   16-bit dtypes only: the large key factors as one bfloat16 value (the control)

  python -m benchmarks.bias_factor_precision [--lengths=2048,8192,32768] [--heads=8]

Values are N(0, 1), queries and keys of head dim 64 scaled as the model scales them.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from roformer.nn.attention import bias_factors, kernels
from roformer.nn.attention.call import AttentionCall
from roformer.posenc import make_posenc
from roformer.posenc.config import PosEncConfig

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Sequence lengths (keys).")
flags.DEFINE_integer("heads", 8, "Attention heads (ALiBi's slopes: 2^-1 ... 2^-8 for 8).")
flags.DEFINE_integer("head_dim", 64, "Query and key head dim.")
flags.DEFINE_integer("sandwich_dim", 512, "Sandwich's d' (model.emb_dim in its paper).")
flags.DEFINE_float(
  "forget", 0.05, "FoX: mean -log(forget gate) per token, so |c_j| ~ this x position."
)
QUERIES = 128


def _posenc(kind: str, heads: int, head_dim: int, sandwich_dim: int):
  cfg = PosEncConfig(kind=kind, max_len=1 << 20, sandwich_dim=sandwich_dim)
  return make_posenc(
    cfg, num_heads=heads, head_dim=head_dim, emb_dim=heads * head_dim, causal=True,
    rngs=nnx.Rngs(0),
  )  # fmt: skip


def _folded_attention(q_BLHK, k_BSHK, v_BSHK, qpos_BL, kpos_BS, terms):
  """Splash's arithmetic on the folded q and k: products in their dtype, float32 sums."""
  K = q_BLHK.shape[-1]
  scaled = q_BLHK * (1.0 / math.sqrt(K))
  q, k, v = bias_factors.fold_bias_factors(scaled, k_BSHK, v_BSHK, terms)
  s_BHLS = jnp.einsum("blhk,bshk->bhls", q, k, preferred_element_type=jnp.float32)
  allowed_B1LS = (qpos_BL[:, :, None] >= kpos_BS[:, None, :])[:, None]
  p_BHLS = jax.nn.softmax(jnp.where(allowed_B1LS, s_BHLS, -jnp.inf), axis=-1)
  return jnp.einsum("bhls,bshv->blhv", p_BHLS.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)  # fmt: skip


def errors(kind: str, length: int, dtype) -> dict:
  """Max |output - float32 dense| of the last QUERIES queries, per method."""
  H, K = FLAGS.heads, FLAGS.head_dim
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, length, H, K)), jnp.float32) for _ in range(3))
  kpos = jnp.arange(length)[None]
  qpos, q = kpos[:, -QUERIES:], q[:, -QUERIES:]
  posenc = _posenc("nope" if kind == "fox" else kind, H, K, FLAGS.sandwich_dim)
  options, terms = dict(causal=True), []
  if kind == "fox":
    logit = jnp.asarray(rng.standard_normal((1, length, H)), jnp.float32)
    # -log sigmoid(x) with its mean set by --forget: a gate near 1 forgets slowly.
    shift = float(np.log(np.expm1(FLAGS.forget)))
    c_BLH = -jnp.cumsum(jax.nn.softplus(shift + 0.5 * logit), axis=1)
    options["key_bias_BSH"] = -c_BLH
    terms.append((None, -c_BLH[..., None]))
  else:
    options["bias_fn"] = posenc.bias
    terms.append(posenc.bias_factors(qpos, kpos))
  call = AttentionCall(**options)
  want = kernels.dense_attention(q, k, v, qpos, kpos, call)
  low = [x.astype(dtype) for x in (q, k, v)]
  result = {
    "dense": kernels.dense_attention(*low, qpos, kpos, call),
    "folded": _folded_attention(*low, qpos, kpos, terms),
  }
  if jnp.dtype(dtype).itemsize < 4:
    pieces, bias_factors.KEY_FACTOR_PIECES = bias_factors.KEY_FACTOR_PIECES, 1
    try:
      result["one piece"] = _folded_attention(*low, qpos, kpos, terms)
    finally:
      bias_factors.KEY_FACTOR_PIECES = pieces
  out = {m: float(jnp.abs(o.astype(jnp.float32) - want).max()) for m, o in result.items()}
  # The key factors that grow with the position (Sandwich's are at most 1).
  a, b = terms[0]
  out["largest key factor"] = float(jnp.abs(b).max()) if a is None else None
  return out


def main(argv):
  del argv
  jax.config.update("jax_numpy_rank_promotion", "allow")
  lengths = [int(x) for x in FLAGS.lengths]
  print(f"max |output - float32 dense| of the last {QUERIES} queries; {FLAGS.heads} heads of "
        f"{FLAGS.head_dim}, values N(0, 1)\n")  # fmt: skip
  print("| encoding | dtype | length | largest key factor | dense | folded | one piece |")
  print("|---|---|---|---|---|---|---|")
  for kind in ("alibi", "sandwich", "fox"):
    for dtype in (jnp.float32, jnp.bfloat16):
      for length in lengths:
        e = errors(kind, length, dtype)
        big = "" if e["largest key factor"] is None else f"{e['largest key factor']:.0f}"
        one = f"{e['one piece']:.1e}" if "one piece" in e else ""
        print(f"| {kind} | {jnp.dtype(dtype).name} | {length} | {big} | {e['dense']:.1e} | "
              f"{e['folded']:.1e} | {one} |", flush=True)  # fmt: skip


if __name__ == "__main__":
  app.run(main)
