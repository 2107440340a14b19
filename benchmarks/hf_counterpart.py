"""The Hugging Face model a user would otherwise train, of the same shape as a run config, and a
torch AdamW train step for it (throughput.py --compare_hf, profile_step.py --torch).

- encoder (MLM): RoFormerForMaskedLM;
- Llama-style decoder (model.activation=swiglu, model.norm=rmsnorm): LlamaForCausalLM (SDPA
  attention, rope_theta = posenc.max_wavelength);
- the default decoder block (gelu, layernorm, biases): GPTNeoXForCausalLM (use_parallel_residual
  = model.parallel_residual, exact GELU, SDPA, rotary_pct = posenc.rope_fraction).

torch and transformers are optional: nothing here imports them before it is called.

`--hf_device` (throughput.py, eval_speed.py) puts the PyTorch side on the accelerator JAX runs
on: on a GPU, torch on cuda with bf16 autocast (for a bfloat16 config) and fused AdamW, as a
PyTorch user chasing speed runs it.
"""

import contextlib
import dataclasses
import os
import sys
import time

from benchmarks import bench_step


class NoCounterpartError(ValueError):
  """No Hugging Face model computes what the config's model does (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Counterpart:
  """The Hugging Face model a user would otherwise train for this config."""

  name: str  # the transformers class, e.g. "LlamaForCausalLM"
  config: object  # its transformers config, of the same shape
  note: str = ""  # what the two do not share ("" = the same computation)


def _needs(m, **fields) -> list[str]:
  """`model.FIELD=wanted (got value)` for every field of `m` that differs from `fields`."""
  return [
    f"model.{name}={wanted!r} (got {getattr(m, name)!r})"
    for name, wanted in fields.items()
    if getattr(m, name) != wanted
  ]


def _llama_mismatches(m) -> list[str]:
  # Llama biases all of q/k/v/o or none, and runs attention and MLP one after the other.
  needs = _needs(m, activation="swiglu", norm="rmsnorm", qkv_bias=False, parallel_residual=False)
  if m.dropout_rate:  # Llama drops attention probabilities only, not the residual branches
    needs += _needs(m, dropout_rate=0.0)
  return needs


def _neox_mismatches(m) -> list[str]:
  from roformer.nn import config as nn_config

  needs = _needs(m, activation="gelu", norm="layernorm", use_bias=True)  # its MLP always has biases
  if nn_config.resolve_num_kv_heads(m) != m.num_heads:  # no grouped-query attention
    needs += _needs(m, num_kv_heads=0)
  if nn_config.resolve_head_dim(m) * m.num_heads != m.emb_dim:  # head_dim is hidden / heads
    needs += _needs(m, head_dim=0)
  return needs


def _rope(run_config, *, partial: bool) -> tuple[float, float, str]:
  """(base, rotated fraction, note) of the HF model's RoPE, which is plain and in half layout.

  A non-rotary encoding cannot be left out of Llama or GPT-NeoX (rotary_pct=0 is not allowed), so
  the HF side then runs full RoPE and the note says so.
  """
  p = run_config.model.posenc
  if p.kind != "rope":
    return p.max_wavelength, 1.0, f"HF runs RoPE, ours posenc.kind={p.kind!r}"
  fraction = p.rope_fraction if partial else 1.0
  notes = []
  if p.rope_layout != "half":
    notes.append(f"ours posenc.rope_layout={p.rope_layout!r}, HF 'half' (same cost)")
  if fraction != p.rope_fraction:
    notes.append(f"HF rotates every dimension, ours posenc.rope_fraction={p.rope_fraction}")
  if p.rope_truncate:
    notes.append(f"HF plain RoPE, ours posenc.rope_truncate={p.rope_truncate}")
  if p.scaling.kind != "none":
    notes.append(f"HF unscaled RoPE, ours posenc.scaling.kind={p.scaling.kind!r}")
  return p.max_wavelength, fraction, "; ".join(notes)


def _roformer_config(run_config):
  import transformers

  m = run_config.model
  return transformers.RoFormerConfig(
    vocab_size=m.vocab_size,
    embedding_size=m.embedding_size or m.emb_dim,
    hidden_size=m.emb_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    intermediate_size=m.mlp_dim,
    hidden_act="gelu",
    hidden_dropout_prob=m.dropout_rate,
    attention_probs_dropout_prob=m.dropout_rate,
    max_position_embeddings=run_config.data.seq_len,
    type_vocab_size=max(m.type_vocab_size, 1),
    layer_norm_eps=m.norm_eps,
    tie_word_embeddings=m.tie_embeddings,
  )


def _llama_config(run_config):
  import transformers

  from roformer.nn import config as nn_config

  m = run_config.model
  base, _, note = _rope(run_config, partial=False)
  config = transformers.LlamaConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.emb_dim,
    intermediate_size=m.mlp_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=nn_config.resolve_num_kv_heads(m),
    head_dim=nn_config.resolve_head_dim(m),
    hidden_act="silu",
    max_position_embeddings=run_config.data.seq_len,
    rms_norm_eps=m.norm_eps,
    rope_theta=base,
    attention_bias=m.use_bias,
    mlp_bias=m.use_bias,
    attention_dropout=0.0,
    tie_word_embeddings=m.tie_embeddings,
    attn_implementation="sdpa",
  )
  return config, note


def _neox_config(run_config):
  import transformers

  m = run_config.model
  base, fraction, note = _rope(run_config, partial=True)
  config = transformers.GPTNeoXConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.emb_dim,
    intermediate_size=m.mlp_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    hidden_act="gelu",  # exact (erf), as ours
    rotary_pct=fraction,
    rotary_emb_base=base,
    max_position_embeddings=run_config.data.seq_len,
    layer_norm_eps=m.norm_eps,
    use_parallel_residual=m.parallel_residual,
    attention_dropout=m.dropout_rate,
    hidden_dropout=m.dropout_rate,
    tie_word_embeddings=m.tie_embeddings,
    attn_implementation="sdpa",
  )
  return config, note


# Decoder families: (class, the config fields it needs, its transformers config).
DECODERS = (
  ("LlamaForCausalLM", _llama_mismatches, _llama_config),
  ("GPTNeoXForCausalLM", _neox_mismatches, _neox_config),
)


def hf_counterpart(run_config) -> Counterpart:
  """The Hugging Face model of the same shape: RoFormerForMaskedLM for encoders; for decoders
  LlamaForCausalLM (SwiGLU, RMSNorm) or GPTNeoXForCausalLM (GELU, LayerNorm, biases).

  Raises:
    NoCounterpartError: a decoder that neither family reproduces, naming the fields.
  """
  m = run_config.model
  if m.kind == "encoder":
    return Counterpart("RoFormerForMaskedLM", _roformer_config(run_config))
  common = _needs(m, attention="softmax", attention_window=0, attention_window_pattern="")
  if common:
    raise NoCounterpartError(f"no Hugging Face decoder of this shape: it needs {common[0]}")
  needs = {}
  for name, mismatches, make_config in DECODERS:
    needs[name] = mismatches(m)
    if not needs[name]:
      return Counterpart(name, *make_config(run_config))
  raise NoCounterpartError(
    "no Hugging Face decoder of this shape: "
    + "; ".join(f"{name} needs {', '.join(fields)}" for name, fields in needs.items())
  )


def define_device_flag() -> None:
  """--hf_device, for a script that runs the Hugging Face side."""
  from absl import flags

  flags.DEFINE_enum(
    "hf_device",
    "auto",
    ["auto", "cpu", "cuda"],
    "Where the Hugging Face model runs: auto = cuda when JAX may run on a GPU (JAX_PLATFORMS "
    "unset or naming cuda/gpu) and torch sees one, else cpu.",
  )


def resolve_device(requested: str, *, cuda_available: bool, jax_platforms: str) -> str:
  """The device, "cpu" or "cuda", of --hf_device=`requested`; `jax_platforms` is $JAX_PLATFORMS.
  Decided without starting JAX, whose GPU client would take most of the GPU's memory in this
  process. Raises ValueError for cuda that torch cannot see."""
  if requested == "cuda" and not cuda_available:
    raise ValueError("--hf_device=cuda: torch sees no CUDA device (torch.cuda.is_available())")
  if requested != "auto":
    return requested
  platforms = {p.strip() for p in jax_platforms.split(",") if p.strip()}
  jax_on_gpu = not platforms or bool(platforms & {"cuda", "gpu", "rocm"})
  return "cuda" if cuda_available and jax_on_gpu else "cpu"


def torch_device(requested: str) -> str:
  """`resolve_device` for this machine (imports torch)."""
  import torch

  available = torch.cuda.is_available()
  return resolve_device(
    requested, cuda_available=available, jax_platforms=os.environ.get("JAX_PLATFORMS", "")
  )


def device_or_exit(script: str, compare_hf: bool, requested: str) -> str:
  """The torch device of a script's Hugging Face side ("cpu" without --compare_hf); exits with
  one line on stderr when torch or transformers is missing or the device cannot be had. Call it
  before JAX starts: a GPU shared with torch is set up here (`share_gpu_with_torch`)."""
  if not compare_hf:
    return "cpu"
  try:
    if why := missing():
      raise ValueError(why)
    device = torch_device(requested)
  except ValueError as e:
    print(f"{script}: error: {e}", file=sys.stderr)
    sys.exit(1)
  share_gpu_with_torch(device)
  return device


def share_gpu_with_torch(device: str) -> None:
  """With the PyTorch side on the GPU, JAX allocates device memory as it needs it instead of
  taking 75% of it up front (set before JAX starts; children inherit it)."""
  if device != "cpu":
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


class TorchTrainer:
  """A Hugging Face model trained with torch AdamW (the optim group's settings) on our batch,
  on `device` ("cpu" or "cuda"), eager or through `torch.compile` (`compile=True`)."""

  def __init__(self, run_config, counterpart: Counterpart, *, device="cpu", compile=False):
    import numpy as np
    import torch
    import transformers

    m, o = run_config.model, run_config.optim
    torch.manual_seed(run_config.train.seed)
    self.name, self.note = counterpart.name, counterpart.note
    model_cls = getattr(transformers, counterpart.name)
    self.model = model_cls(counterpart.config).to(torch.float32).to(device).train()
    self.opt = torch.optim.AdamW(
      self.model.parameters(),
      lr=o.learning_rate,
      betas=(o.b1, o.b2),
      eps=o.eps,
      weight_decay=o.weight_decay,
      fused=device != "cpu",  # one kernel per step on a GPU, as its users run it there
    )
    batch = bench_step.synthetic_batch(run_config, np.random.default_rng(0))
    self.inputs = torch.from_numpy(batch["inputs"]).long().to(device)
    labels = batch["inputs"].astype(np.int64)
    if m.kind == "encoder":  # HF ignores label -100: loss on masked positions only
      labels = np.where(batch["weights"] > 0, batch["targets"], -100).astype(np.int64)
    self.labels = torch.from_numpy(labels).to(device)  # CausalLM shifts the labels itself
    self.clip = o.grad_clip_norm
    self.torch = torch
    self.device = device
    # The optimizer holds the parameters themselves: compiling the forward leaves it unchanged.
    self.forward = torch.compile(self.model) if compile else self.model
    # Our bfloat16 path (float32 master weights, bfloat16 matmuls) against PyTorch's counterpart:
    # the forward and loss under autocast, the backward and AdamW outside it.
    self.autocast = m.dtype == "bfloat16"

  def run(self, steps: int) -> float:
    """Runs `steps` train steps; returns the seconds they took."""
    start = time.perf_counter()
    for _ in range(steps):
      self.step()
    if self.device != "cpu":
      self.torch.cuda.synchronize()  # the steps were queued, not run
    return time.perf_counter() - start

  def step(self, phase=contextlib.nullcontext) -> None:
    """One train step; `phase(name)` wraps its forward, backward and update (profiler labels)."""
    with phase("forward"):
      with self.torch.autocast(self.device, dtype=self.torch.bfloat16, enabled=self.autocast):
        loss = self.forward(input_ids=self.inputs, labels=self.labels).loss
    with phase("backward"):
      loss.backward()
    with phase("update"):
      if self.clip > 0:
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
      self.opt.step()
      self.opt.zero_grad(set_to_none=True)


def missing() -> str:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError as e:
    return (
      f"--compare_hf needs torch and transformers ({e}); install them with "
      "`pip install -c requirements.txt torch transformers`"
    )
  return ""
