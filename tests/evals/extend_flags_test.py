"""roformer/evals/extend_flags.py: the CLIs' --extend flags name every extension kind and field."""

import dataclasses

import pytest

from roformer.evals import extend_flags, spec
from roformer.posenc.config import EXTENSION_KINDS, ContextExtension


def test_extend_flags_cover_every_kind_and_field_of_context_extension():
  assert extend_flags.KINDS == EXTENSION_KINDS
  fields = [f.name for f in dataclasses.fields(ContextExtension) if f.name != "kind"]
  assert list(extend_flags.FIELDS) == fields


def test_self_extend_true_division_switch_is_named_in_the_suffix_and_refused_elsewhere():
  ext = spec.extension_from_options("self_extend", window=4, group=3, true_division=True)
  assert ext == ContextExtension("self_extend", window=4, group=3, true_division=True)
  assert spec.extension_suffix(ext) == "_self_extend_window4_group3_true_division"
  # Off, the suffix (and so the result file's name) is what it was before the switch existed.
  plain = spec.extension_from_options("self_extend", window=4, group=3, true_division=False)
  assert spec.extension_suffix(plain) == "_self_extend_window4_group3"
  with pytest.raises(ValueError, match="--extend_true_division is not read by --extend=rerope"):
    spec.extension_from_options("rerope", window=4, true_division=True)
