"""Tests of the positional-encoding registry and of validate_posenc's errors."""

import dataclasses
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from roformer import posenc
from roformer.posenc import POSENCS
from roformer.posenc.config import PosEncConfig, RopeScaling
from roformer.posenc.rope import xpos_max_span
from roformer.testing import build_posenc as make


@pytest.mark.parametrize(
  "kind, causal",
  [(k, c) for k in tuple(POSENCS) for c in (True, False) if c or not posenc.POSENCS[k].causal_only],
)
def test_validate_posenc_accepts_good_configs(kind, causal):
  posenc.validate_posenc(PosEncConfig(kind=kind), causal=causal, head_dim=64)
  assert posenc.POSENCS[kind].unsupported_length(PosEncConfig(kind=kind), 512) is None


_BAD = [
  (dict(kind="bogus"), {}, "posenc.kind='bogus' is not a registered encoding .*rope"),
  (dict(rope_layout="zigzag"), {}, "posenc.rope_layout='zigzag' is not one of .*'half'"),
  (dict(scaling=RopeScaling(kind="foo")), {}, "posenc.scaling.kind='foo' is not one of .*'yarn'"),
  (dict(kind="rope"), dict(head_dim=63), r"model.head_dim=63 must be even for posenc.kind='rope'"),
  (dict(kind="xpos"), dict(head_dim=63), r"model.head_dim=63 must be even for posenc.kind='xpos'"),
  (dict(kind="xpos"), dict(causal=False), "posenc.kind='xpos' needs a causal decoder"),
  (
    dict(kind="nope"),
    dict(causal=False),
    "posenc.kind='nope' needs a causal decoder.*bag of words",
  ),
  (dict(scaling=RopeScaling(kind="linear", factor=0.5)), {}, "posenc.scaling.factor=0.5"),
  (dict(scaling=RopeScaling(kind="yarn", factor=0.9)), {}, "posenc.scaling.factor=0.9"),
  (dict(rope_fraction=0.0), {}, r"posenc.rope_fraction=0.0 must be in \(0, 1\]"),
  (dict(rope_fraction=1.5), {}, r"posenc.rope_fraction=1.5 must be in \(0, 1\]"),
  (dict(rope_fraction=0.01), {}, "posenc.rope_fraction=0.01 .* leaves no pair"),
  (dict(kind="alibi", scaling=RopeScaling(kind="linear", factor=2.0)), {}, "posenc.scaling.kind"),
  (dict(kind="t5", t5_num_buckets=2), {}, "posenc.t5_num_buckets=2"),
  (dict(kind="t5", t5_max_distance=8), {}, "posenc.t5_max_distance=8"),
  (dict(kind="xpos", xpos_gamma=0.0), {}, "posenc.xpos_gamma"),
  (dict(kind="xpos", xpos_scale_base=0.0), {}, "posenc.xpos_scale_base"),
  (dict(max_wavelength=1.0), {}, "posenc.max_wavelength"),
  (
    dict(scaling=RopeScaling(kind="yarn", factor=4.0, beta_fast=0.0)),
    {},
    "posenc.scaling.beta_fast",
  ),
  (
    dict(scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0)),
    {},
    "posenc.scaling.low_freq_factor",
  ),
  (dict(scaling=RopeScaling(kind="ntk", factor=2.0)), dict(head_dim=2), "needs at least 4 rotary"),
]


@pytest.mark.parametrize("fields,kwargs,message", _BAD, ids=lambda v: str(v)[:40])
def test_validate_posenc_rejects_bad_config_naming_the_field(fields, kwargs, message):
  args = {"causal": True, "head_dim": 64, **kwargs}
  with pytest.raises(ValueError, match=message):
    posenc.validate_posenc(PosEncConfig(**fields), **args)


def test_an_encoding_says_which_lengths_it_cannot_run():
  learned = PosEncConfig(kind="learned", max_len=128)
  assert posenc.POSENCS["learned"].unsupported_length(learned, 128) is None
  assert re.search(
    "posenc.max_len=128.*'rope', 'alibi'",
    posenc.POSENCS["learned"].unsupported_length(learned, 256),
  )
  # A learned table must also cover every randomized training position.
  with pytest.raises(ValueError, match="posenc.max_len=128"):
    posenc.validate_posenc(
      dataclasses.replace(learned, randomize_max=256), causal=True, head_dim=64
    )
  xpos = PosEncConfig(kind="xpos")
  span = xpos_max_span(xpos)
  assert posenc.POSENCS["xpos"].unsupported_length(xpos, span) is None
  assert "overflow" in posenc.POSENCS["xpos"].unsupported_length(xpos, span + 1)
  for kind in ("rope", "alibi", "nope"):
    assert posenc.POSENCS[kind].unsupported_length(PosEncConfig(kind=kind), 1 << 20) is None


def test_validate_posenc_leaves_original_len_to_the_config_loader():
  scaling = RopeScaling(kind="yarn", factor=4.0)
  posenc.validate_posenc(PosEncConfig(scaling=scaling), causal=True, head_dim=64)
  filled = dataclasses.replace(scaling, original_max_len=512)
  assert make("rope", scaling=filled, head_dim=64).rotary_dims == 64


def test_messages_that_list_encodings_list_every_one_that_qualifies():
  # Derived from the registry: a kind added later appears without editing the message.
  from roformer import posenc
  from roformer.posenc.config import PosEncConfig

  with pytest.raises(ValueError) as refused:
    posenc.validate_posenc(PosEncConfig(kind="cope"), causal=False, head_dim=4)
  for kind, cls in posenc.POSENCS.items():
    assert (repr(kind) in str(refused.value).split("for an encoder")[1]) == (not cls.causal_only)
  assert "'kerple'" in str(refused.value) and "'sandwich'" in str(refused.value)


def test_every_scaling_is_a_registry_entry_that_says_whether_it_needs_the_pretraining_length():
  from roformer.posenc import rope_scaling

  assert rope_scaling.SCALING_KINDS == ("none", *rope_scaling.SCALINGS)
  needs = {k for k, fn in rope_scaling.SCALINGS.items() if fn.needs_original_len}
  assert needs == {"dynamic", "ntk_by_parts", "yarn", "llama3", "longrope"}
  for kind in rope_scaling.SCALINGS:
    scaling = RopeScaling(kind=kind, factor=2.0)  # original_max_len 0: "not filled in yet"
    if kind in needs:
      with pytest.raises(ValueError, match="original_max_len must be > 0"):
        rope_scaling.check_scaling(scaling)
    else:
      rope_scaling.check_scaling(scaling)


def _encoding(**fields):
  """A PosEnc subclass whose Fields declare `fields` (name -> (type, default, doc))."""
  annotations = {name: typ for name, (typ, _, _) in fields.items()}
  namespace = {n: posenc.param(d, doc) for n, (_, d, doc) in fields.items()}
  fields_cls = dataclasses.dataclass(frozen=True)(
    type("Fields", (posenc.PosEnc.Fields,), {"__annotations__": annotations, **namespace})
  )
  return type("Toy", (posenc.PosEnc,), {"Fields": fields_cls})


@pytest.mark.parametrize(
  "kind, cls, message",
  [
    ("Toy", _encoding(), "lowercase identifier"),
    ("rope", _encoding(), "registered already"),
    ("toy", object, "subclass of roformer.posenc.PosEnc"),
    ("toy", _encoding(randomize_max=(int, 0, "doc")), "field of the posenc group itself"),
    ("toy", _encoding(toy_width=(int, 3, "")), "has no doc"),
    ("toy", _encoding(max_len=(int, 7, "doc")), "clashes with the field"),
  ],
)
def test_register_refuses_what_would_make_the_posenc_group_ambiguous(kind, cls, message):
  with pytest.raises(ValueError, match=message):
    posenc.register(kind, cls)
  assert "toy" not in posenc.POSENCS and "toy_width" not in posenc.encoding_fields()


def test_a_registered_encoding_brings_its_fields_into_the_posenc_group():
  toy = _encoding(toy_width=(int, 3, "width"), max_len=(int, 512, "shared with learned"))
  posenc.register("toy", toy)
  try:
    cfg = PosEncConfig(kind="toy", toy_width=5)
    assert (cfg.toy_width, cfg.max_len) == (5, 512)
    assert PosEncConfig(kind="toy") == PosEncConfig(kind="toy", toy_width=3)  # defaults not stored
    assert set(posenc.fields_of("toy")) == {"toy_width", "max_len"}
    posenc.validate_posenc(cfg, causal=True, head_dim=8)
  finally:
    posenc.unregister("toy")
  with pytest.raises(TypeError, match="no field 'toy_width'"):
    PosEncConfig(kind="toy", toy_width=5)


def test_the_listing_shows_every_kind_and_field_and_imports_a_users_module(capsys, monkeypatch):
  from roformer.posenc import __main__ as listing

  assert listing.main([]) == 0
  out = capsys.readouterr().out
  for kind in POSENCS:
    assert f"\n  {kind} " in out
  for name in posenc.encoding_fields():
    assert f"posenc.{name} = " in out
  assert "gauss" not in out
  examples = str(Path(__file__).resolve().parents[2] / "docs" / "examples")
  monkeypatch.syspath_prepend(examples)
  try:
    assert listing.main(["--import", "gauss_bias", "--markdown"]) == 0
    assert "| `posenc.gauss_init_sigma` | `16.0` | gauss |" in capsys.readouterr().out
  finally:
    posenc.unregister("gauss")
    sys.modules.pop("gauss_bias", None)  # a later import registers it again
  with pytest.raises(SystemExit):
    listing.main(["--import", "no_such_module"])
  assert "--import=no_such_module" in capsys.readouterr().err


@pytest.mark.parametrize(
  "heads, probed",
  [
    (None, "(1, 1, 1)"),  # [B, L, S]: the head axis forgotten
    (1, "(1, 1, 1, 1)"),  # [B, 1, L, S]: one row for every head, which no kernel splits by head
  ],
)
def test_a_bias_of_the_wrong_shape_is_one_line_naming_the_encoding(heads, probed):
  from flax import nnx

  from roformer.nn import model as model_lib
  from roformer.nn.config import ModelConfig

  class Flat(posenc.PosEnc):
    def bias(self, qpos_BL, kpos_BS):
      B, L, S = qpos_BL.shape[0], qpos_BL.shape[1], kpos_BS.shape[1]
      return jnp.zeros((B, L, S) if heads is None else (B, heads, L, S), jnp.float32)

  posenc.register("flat", Flat)
  try:
    cfg = ModelConfig(kind="decoder", vocab_size=16, num_layers=1, emb_dim=16, num_heads=2,
                      mlp_dim=32, posenc=PosEncConfig(kind="flat"))  # fmt: skip
    model = model_lib.make_model(cfg, rngs=nnx.Rngs(0))
    message = rf"posenc.kind 'flat': bias returned shape {re.escape(probed)}, not \[B, H, L, S\]"
    with pytest.raises(ValueError, match=message):
      model(jnp.zeros((1, 8), jnp.int32), jnp.arange(8)[None])
  finally:
    posenc.unregister("flat")
