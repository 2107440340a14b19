"""roformer/evals/extend_flags.py: the CLIs' --extend flags name every extension kind and field."""

import dataclasses

from roformer.evals import extend_flags
from roformer.posenc.config import EXTENSION_KINDS, ContextExtension


def test_extend_flags_cover_every_kind_and_field_of_context_extension():
  assert extend_flags.KINDS == EXTENSION_KINDS
  fields = [f.name for f in dataclasses.fields(ContextExtension) if f.name != "kind"]
  assert list(extend_flags.FIELDS) == fields
