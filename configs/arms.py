"""The experiment arms: every named variant of a model that the grids compare, defined once.

An arm is a name, a one-line description and the config overrides it makes: dotted field names
(`posenc.kind`, `model.qk_norm`, ...) to values, applied on whatever config a run starts from.
The presets that train.py runs (configs/irope.py, rnope_swa.py, fox.py), the grids
(experiments/extrapolation.py, experiments/synthetic.py) and the benchmark of their cost
(benchmarks/frontier.py) all read them from here, so an arm is the same model everywhere.

It lives in configs/ because the preset config files import it, and train.py loads those from the
repository root, where `configs` is a package (as `from configs import default` is); the grids and
benchmarks run with `python -m` from the same root and import it the same way. Like the other
files here it imports nothing of roformer/: overrides are plain data, checked by the config
boundary (roformer/config.py) when a run is built.

Two things an arm cannot fix by itself, so `overrides` takes them:
- `seq_len`: the hybrids' RoPE layers attend within a window of data.seq_len / 4 (Llama 4: chunks
  of 8192 at 256K), and iRoPE's query temperature floor is that window;
- `nope_every`: the hybrids keep one NoPE layer (full attention) in every `nope_every` layers,
  the others RoPE. Llama 4 and the RNoPE-SWA paper keep one in 4 (the presets); a grid whose model
  has fewer layers keeps one in its depth (3 in the extrapolation grid, 2 in the synthetic one).

Recalibrations (DroPE and its control) continue a finished run of another arm (`starts_from`)
for a fraction of its budget; each grid sets that budget, the arm only the fields that change.
Plain encodings are not listed: a grid's "alibi" run is {"posenc.kind": "alibi"}.

  from configs import arms
  arms.overrides("irope", seq_len=128, nope_every=3)   # {"posenc.kind": "rope", ...}
  arms.apply(config, "fox")                            # in place, at config.data.seq_len
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

Overrides = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Arm:
  """One experiment arm.

  Attributes:
    description: one line: what it is and where it comes from.
    fields: its config overrides (dotted names), or for an arm whose fields depend on the run's
      length and depth a function (seq_len, nope_every) -> overrides.
    starts_from: the arm whose finished run this one continues ("" = trained from scratch).
  """

  description: str
  fields: Overrides | Callable[[int, int], Overrides]
  starts_from: str = ""


def _window(seq_len: int) -> int:
  """The hybrids' local window: a quarter of the training length (at least one token)."""
  return max(1, seq_len // 4)


def _hybrid(seq_len: int, nope_every: int, window_kind: str) -> Overrides:
  """`nope_every - 1` RoPE layers attending within the window (chunks or a sliding window), then
  one NoPE layer attending to every earlier token, repeated over the depth."""
  local = _window(seq_len)
  return {
    "posenc.kind": "rope",
    "posenc.layer_pattern": ",".join(["rope"] * (nope_every - 1) + ["nope"]),
    "model.attention_window_pattern": ",".join([str(local)] * (nope_every - 1) + ["0"]),
    "model.attention_window_kind": window_kind,
  }


def _irope(seq_len: int, nope_every: int) -> Overrides:
  # Llama 4 (Hugging Face transformers `Llama4TextConfig`, `Llama4TextAttention`):
  # `no_rope_layers` (one NoPE layer in 4), chunked attention on the RoPE layers
  # (`attention_chunk_size`), `rope_theta` 500,000 with interleaved pairs (its complex
  # `freqs_cis`), L2 QK-norm after RoPE on the RoPE layers only (`use_qk_norm`,
  # `Llama4TextL2Norm`), and the query temperature 1 + 0.1 ln(floor((pos + 1) / floor_scale) + 1)
  # on the NoPE layers only (`attn_temperature_tuning`), floor_scale = the chunk.
  return {
    **_hybrid(seq_len, nope_every, "chunked"),
    "posenc.max_wavelength": 500_000.0,
    "model.qk_norm": "l2",
    "model.qk_norm_kinds": "rope",
    "posenc.query_scale": "llama4",
    "posenc.query_scale_kinds": "nope",
    "posenc.query_scale_floor": float(_window(seq_len)),
  }


def _rnope_swa(seq_len: int, nope_every: int) -> Overrides:
  return _hybrid(seq_len, nope_every, "sliding")


ARMS: dict[str, Arm] = {
  # The 2024-26 options (docs/frontier.md), each as its paper or model runs it.
  "irope": Arm(
    "Llama 4's iRoPE: chunked RoPE layers (base 500K, L2 QK-norm) and a NoPE layer with a query "
    "temperature",
    _irope,
  ),
  "rnope_swa": Arm(
    "RNoPE-SWA (arXiv 2501.18795, as in Command A): sliding-window RoPE layers and a full NoPE "
    "layer",
    _rnope_swa,
  ),
  "qk_norm": Arm(
    "QK-norm: RMSNorm per head on queries and keys, before RoPE (Qwen3, Gemma 3)",
    {"posenc.kind": "rope", "model.qk_norm": "rmsnorm"},
  ),
  "qk_norm_whole": Arm(
    "QK-norm over the whole projection: RMSNorm over all heads' queries and all keys, before "
    "the heads are split and before RoPE (OLMo 2)",
    {"posenc.kind": "rope", "model.qk_norm": "rmsnorm_whole"},
  ),
  "ssmax": Arm(
    "Scalable-Softmax (arXiv 2501.19399): queries scaled by s ln n, s learned per head",
    {"posenc.kind": "rope", "posenc.query_scale": "ssmax"},
  ),
  "pope": Arm(
    "PoPE, polar coordinate position embeddings (arXiv 2509.10534)", {"posenc.kind": "pope"}
  ),
  "resonance": Arm(
    "Resonance RoPE (arXiv 2403.00071): every RoPE wavelength rounded to a whole number",
    {"posenc.kind": "rope", "posenc.rope_resonance": True},
  ),
  "fox": Arm(
    "FoX, the Forgetting Transformer (arXiv 2503.02130): a per-head forget gate, no positional "
    "encoding (the paper's base FoX)",
    {"posenc.kind": "nope", "model.forget_gate": True},
  ),
  "sinks": Arm(
    "attention sinks: a learned sink logit per head (gpt-oss)",
    {"posenc.kind": "rope", "model.attention_sinks": True},
  ),
  # Variants of a classic encoding.
  "prope": Arm(
    "p-RoPE: RoPE with its lowest quarter of frequencies off",
    {"posenc.kind": "rope", "posenc.rope_truncate": 0.25},
  ),
  # Recalibrations: a finished RoPE run continued.
  "drope": Arm(
    "DroPE (arXiv 2512.12167): the RoPE run continued with no positional encoding",
    {"posenc.kind": "nope"},
    starts_from="rope",
  ),
  "rope_continued": Arm(
    "the RoPE run continued with RoPE for as many steps (DroPE's control: the extra steps alone)",
    {"posenc.kind": "rope"},
    starts_from="rope",
  ),
}

# The 2024-26 options, in the order the grids and reports list them.
FRONTIER = (
  "irope", "rnope_swa", "qk_norm", "qk_norm_whole", "ssmax", "pope", "resonance", "fox", "sinks"
)  # fmt: skip
RECALIBRATIONS = tuple(name for name, arm in ARMS.items() if arm.starts_from)


def overrides(name: str, *, seq_len: int, nope_every: int = 4) -> Overrides:
  """The config overrides of arm `name` for a run of training length `seq_len` whose hybrids keep
  one NoPE layer in `nope_every` (a new dict: callers may add to it)."""
  if name not in ARMS:
    raise KeyError(f"unknown arm {name!r}; the arms are {tuple(ARMS)}")
  if nope_every < 2:
    raise ValueError(f"nope_every={nope_every}: a hybrid needs a RoPE and a NoPE layer")
  fields = ARMS[name].fields
  return dict(fields(seq_len, nope_every) if callable(fields) else fields)


def kind(name: str) -> str:
  """The arm's posenc.kind (at every length and depth)."""
  return overrides(name, seq_len=4)["posenc.kind"]


def apply(config, name: str, *, nope_every: int = 4):
  """Sets arm `name`'s fields on `config` (a ConfigDict) at its data.seq_len; returns it."""
  for field, value in overrides(name, seq_len=config.data.seq_len, nope_every=nope_every).items():
    *groups, key = field.split(".")
    node = config
    for group in groups:
      node = node[group]
    node[key] = value
  return config
