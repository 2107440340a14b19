"""Config fields that carry their default and their doc in one place.

Every frozen config dataclass (ModelConfig, DataConfig, OptimConfig, TrainConfig, MeshConfig,
PosEncConfig and the encodings' `Fields`) declares each field with `param(default, doc)`: the
config groups of configs/default.py, docs/reference/config.md and `python -m roformer.posenc` are
all read from these declarations.
"""

import dataclasses
from typing import Any


def param(default: Any, doc: str, **metadata: Any) -> Any:
  """A dataclass field with its default and its doc (`metadata["doc"]`), plus any other metadata
  (the encodings' `reshapes`)."""
  return dataclasses.field(default=default, metadata={"doc": doc, **metadata})


def field_doc(f: dataclasses.Field) -> str:
  """The doc a field was declared with ("" for a field declared without `param`)."""
  return f.metadata.get("doc", "")
