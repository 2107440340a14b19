"""Text generation from a decoder with per-layer decoding caches.

The prompt is prefilled in one call (one forward pass that also fills the caches), then each new
token costs one decode step over the caches; `generate` compiles the prefill and a scan of
decode steps into one program. Every attention kind brings its own cache
(`roformer.nn.attention.kinds`): softmax layers cache `num_kv_heads` unrotated keys and values (a
ring buffer of w slots under a sliding window w), multi-head latent attention its latent and
rotary key, causal linear attention its recurrent state. Positions are 0 .. P + N - 1 in every
row.

The rotary state (`PosEnc.prepare`) is prepared once per generation, from the span of all its
positions 0 .. P + N - 1, and every step rotates with it. For most encodings the state does not
depend on the span (xPos's centre cancels in every score). For dynamic NTK this is a choice:
the generation runs at the frequencies of its final length P + N. A dynamic-NTK model is not
prefix-consistent: when the length grows past the original one, the frequencies change, and so
do the hidden states of every earlier token in every layer, so no cache (of rotated keys, the
known inconsistency of transformers #25104, or of unrotated keys re-rotated per step) can equal
a forward pass over the prefix once a model has two layers. With one state for the generation,
each step's logits equal those of a full forward pass over the whole generated sequence (at any
step, with any tokens after it), keys cached at different steps are consistent, and the
frequencies used never depend on when a token was produced. Up to the original length, dynamic
NTK is plain RoPE and the choice changes nothing.

Legend: B batch, P prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from roformer import config as config_lib
from roformer import runs
from roformer.data.tokenizer import build_tokenizer
from roformer.nn import config as nn_config
from roformer.nn import model as model_lib
from roformer.posenc import POSENCS
from roformer.posenc.config import ContextExtension


def sample_next(
  logits_BV: jax.Array,
  key: jax.Array | None,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """The next token of each row: argmax at temperature 0, else a draw from the filtered softmax.

  top_k > 0 keeps the k most likely tokens; top_p < 1 keeps the smallest set of most likely
  tokens whose probability reaches top_p (nucleus sampling); both may be combined.

  Returns:
    int32 [B].
  """
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, min(top_k, logits_BV.shape[-1]))[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A token stays if the tokens more likely than it have not reached top_p yet.
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = before_BV < top_p
    threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def _check(model, prompt_BP, max_new_tokens, temperature, top_k, top_p):
  if not isinstance(model, model_lib.Decoder):
    raise ValueError(
      "generate needs a causal decoder (model.kind='decoder'); an encoder (masked LM) predicts "
      "masked tokens from both sides and has no next-token distribution to sample"
    )
  kinds = dict.fromkeys(spec.posenc.kind for spec in model.cfg.layers)
  content = [k for k in kinds if POSENCS[k].content_bias is not None]
  if content:
    raise ValueError(
      f"posenc.kind={content[0]!r} biases attention by queries and keys together "
      "(a content-dependent position), which the decoding cache does not compute; it is "
      "evaluated with full forward passes (eval.py)"
    )
  if model.cfg.scan_layers:
    raise ValueError(
      "generate decodes layer by layer from per-layer caches; model.scan_layers=True stacks the "
      "layers: evaluate or fine-tune with model.scan_layers=False to generate"
    )
  if model.cfg.attention_window and model.cfg.attention_window_kind == "blockwise":
    raise ValueError(
      "generate keeps a sliding-window ring buffer; model.attention_window_kind='blockwise' "
      "(xPos's BCA) is an evaluation setting it does not decode"
    )
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"prompt must be int tokens [B, P] with P >= 1, got {prompt_BP.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
  if top_k < 0:
    raise ValueError(f"top_k={top_k} must be >= 0 (0 = no top-k filter)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = no nucleus filter)")
  # E.g. a learned position table must cover every generated position.
  too_long = nn_config.unsupported_length(model.cfg, prompt_BP.shape[1] + max_new_tokens)
  if too_long:
    raise ValueError(too_long)
  _check_cache_memory(model, prompt_BP.shape[0], prompt_BP.shape[1] + max_new_tokens)


def _check_cache_memory(model, batch: int, length: int) -> None:
  """Refuses, before anything is compiled, a generation whose decoding caches alone would take
  more than half of the device's memory (the parameters and activations need the rest)."""
  caches = jax.eval_shape(lambda: model.init_caches(batch, length))
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches))
  have = _device_memory_bytes()
  if have and need > have // 2:
    raise ValueError(
      f"generating {length:,} positions needs {need / 2**30:,.1f} GiB of decoding cache, more "
      f"than half of this device's {have / 2**30:,.1f} GiB; ask for fewer --max_new_tokens"
    )


def _device_memory_bytes() -> int:
  """The memory of the first device (an accelerator's limit, the host's RAM on CPU), or 0."""
  device = jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return 0


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, tokens_BL, positions_BL, caches, rotary_state):
  model = nnx.merge(graphdef, state)
  logits_BLV, caches = model.decode(tokens_BL, positions_BL, caches, rotary_state)
  return logits_BLV[:, -1], caches


def _prepare(posenc, batch, length):
  span_B2 = jnp.broadcast_to(jnp.asarray([0, length - 1], jnp.int32), (batch, 2))
  return posenc.prepare(span_B2)


def _positions(start, length, batch):
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


def cached_logits(model, tokens_BT: jax.Array, prompt_len: int) -> jax.Array:
  """Next-token logits at positions prompt_len - 1 .. T - 1, computed with the caches.

  The prompt tokens[:, :prompt_len] are prefilled in one call and the rest are fed one decode
  step at a time (teacher forcing). Row t equals the last-position logits of a full forward pass
  over tokens[:, :prompt_len + t] (for dynamic NTK: over all of tokens, see the module's doc).

  Returns:
    float32 [B, T - prompt_len + 1, V].
  """
  B, T = tokens_BT.shape
  graphdef, state = nnx.split(model)
  caches = model.init_caches(B, T)
  rotary = _prepare(model.posenc, B, T)
  prompt_BP = tokens_BT[:, :prompt_len]
  logits_BV, caches = _decode(
    graphdef, state, prompt_BP, _positions(0, prompt_len, B), caches, rotary
  )
  out = [logits_BV]
  for t in range(prompt_len, T):
    tokens_B1 = tokens_BT[:, t : t + 1]
    logits_BV, caches = _decode(graphdef, state, tokens_B1, _positions(t, 1, B), caches, rotary)
    out.append(logits_BV)
  return jnp.stack(out, axis=1)


def generate(
  model,
  prompt_BP: jax.Array,
  *,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: jax.Array | None = None,
) -> jax.Array:
  """Continues each prompt row by `max_new_tokens` tokens.

  Args:
    model: a `roformer.nn.Decoder` (an encoder is refused).
    prompt_BP: int tokens [B, P], all rows of length P, at positions 0 .. P - 1.
    max_new_tokens: N >= 1.
    temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k, top_p: filters of the sampled distribution (see `sample_next`).
    rng: a PRNG key for sampling (default PRNGKey(0)); unused when greedy.

  Returns:
    int32 tokens [B, P + N]: the prompt followed by the continuation.
  """
  prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
  _check(model, prompt_BP, max_new_tokens, temperature, top_k, top_p)
  B, P = prompt_BP.shape
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  caches = model.init_caches(B, P + max_new_tokens)
  rotary = _prepare(model.posenc, B, P + max_new_tokens)
  return _generate(
    graphdef, state, prompt_BP, caches, rotary, rng, max_new_tokens=int(max_new_tokens),
    temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
  )  # fmt: skip


@functools.partial(
  jax.jit, static_argnums=0, static_argnames=("max_new_tokens", "temperature", "top_k", "top_p")
)
def _generate(graphdef, state, prompt_BP, caches, rotary, rng, *, max_new_tokens, **filters):
  """Prefill, then a scan of decode steps, all in one program (no per-token dispatch)."""
  model = nnx.merge(graphdef, state)
  B, P = prompt_BP.shape
  logits_BLV, caches = model.decode(prompt_BP, _positions(0, P, B), caches, rotary)
  first_B = sample_next(logits_BLV[:, -1], jax.random.fold_in(rng, 0), **filters)

  def step(carry, i):
    # Feeds new token i - 1 (at position P + i - 1) and samples new token i.
    token_B, caches = carry
    positions_B1 = jnp.broadcast_to(P + i - 1, (B, 1)).astype(jnp.int32)
    logits_B1V, caches = model.decode(token_B[:, None], positions_B1, caches, rotary)
    next_B = sample_next(logits_B1V[:, -1], jax.random.fold_in(rng, i), **filters)
    return (next_B, caches), next_B

  _, rest_NB = jax.lax.scan(step, (first_B, caches), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([prompt_BP, first_B[:, None], rest_NB.T], axis=1)


# ---- generate.py's driver: a run's checkpoint (or an imported decoder) and tokenizer, a prompt
# in, its continuation out ----


def generate_text(
  workdir,
  prompt: str,
  *,
  max_new_tokens: int = 64,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  rope_scaling: str = "none",
  rope_factor: float = 1.0,
  extension: ContextExtension | None = None,
  step: int | None = None,
  hf_model: str = "",
) -> str:
  """The continuation of `prompt` by the run in `workdir` (or by the Hugging Face decoder
  `hf_model`), decoded by its tokenizer.

  Args:
    workdir: a decoder run's workdir (config.json, checkpoints, tokenizer); None with `hf_model`.
    prompt: the text to continue (at least one token).
    max_new_tokens, temperature, top_k, top_p: as `roformer.generate.generate`.
    seed: the sampling seed.
    rope_scaling, rope_factor: a RoPE scaling applied at generation ("none" = as trained); it
      replaces an imported model's own, with its max_position_embeddings as the original length.
    extension: a training-free context extension (`roformer.posenc.extension`), e.g.
      StreamingLLM's attention sinks, whose cache keeps the sinks and the recent window only.
    step: the checkpoint step; None = the latest (a run only).
    hf_model: a Hugging Face Llama/Mistral/Qwen2/GPT-NeoX directory (config.json, safetensors,
      tokenizer.json; `runs.open_hf_model`) that generates instead of a run.
  """
  if bool(workdir) == bool(hf_model):
    raise ValueError("give a run's --workdir=DIR or a Hugging Face --hf_model=HF_DIR (one of them)")
  if hf_model:
    if step is not None:
      raise ValueError("--step selects a run's checkpoint; --hf_model has one set of weights")
    run_config, decoder = runs.open_hf_model(hf_model)
  else:
    workdir = epath.Path(workdir)
    run_config = config_lib.load_run_config(workdir)
    if run_config.model.kind != "decoder":
      raise ValueError(
        f"{workdir} holds a model.kind={run_config.model.kind!r} run; generation needs a causal "
        "decoder (model.kind='decoder')"
      )
  model_cfg = runs.eval_model_config(
    run_config.model,
    seq_len=run_config.data.seq_len,
    rope_scaling=rope_scaling,
    rope_factor=rope_factor,
    extension=extension,
  )
  # An imported model's tokenizer is read where it is; nothing is written beside it.
  tokenizer = build_tokenizer(run_config.data, workdir="" if hf_model else str(workdir))
  ids = tokenizer.encode(prompt)
  if not ids:
    raise ValueError("--prompt must hold at least one token")
  if max(ids) >= model_cfg.vocab_size:
    # The embedding lookup would not fail, it would read another row: refuse instead.
    raise ValueError(
      f"the tokenizer ({run_config.data.tokenizer}) gives the prompt id {max(ids)}, beyond the "
      f"model's vocabulary of {model_cfg.vocab_size}: is it another model's tokenizer?"
    )
  if hf_model:
    model = runs.with_config(decoder, model_cfg)
  else:
    model, _ = runs.restore_for_eval(workdir, run_config, model_cfg, step=step)
  tokens_BT = generate(
    model,
    np.asarray([ids], np.int32),
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    rng=jax.random.PRNGKey(seed),
  )
  return tokenizer.decode(np.asarray(tokens_BT[0, len(ids) :]).tolist())
