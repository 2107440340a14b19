"""The registry of positional encodings: `posenc.kind` -> its `PosEnc` class, and its fields.

`POSENCS` is the only switch on the kind. An encoding joins it with `register`, from this
package or from any module of the user's own:

    from roformer import posenc

    @posenc.register("gauss")
    class GaussBias(posenc.PosEnc):
      @dataclasses.dataclass(frozen=True)
      class Fields(posenc.PosEnc.Fields):
        gauss_init_sigma: float = posenc.param(16.0, "initial width of the bias, in positions")
      ...

Its fields (the frozen dataclass `Fields`, each with a default and a one-line doc) join the posenc
config group: `configs/default.py` builds the group from here, `python -m roformer.posenc` lists
it, and the resume rule ignores the fields of encodings a run does not use. A config file that
imports the module can name the kind and its fields; the run's config.json records the module
under "imports", so eval.py and generate.py import it again when they open the workdir.
"""

import importlib
import re
import sys

from roformer.posenc.base import PosEnc
from roformer.posenc.config import declare_fields, encoding_fields, fields_of

__all__ = ["encoding_fields", "fields_of"]  # the posenc group's fields, declared by `register`

POSENCS: dict[str, type] = {}
# The top-level package whose encodings every install has; other modules are recorded.
_BUILTIN_PACKAGE = "roformer."


class UnknownEncodingError(ValueError):
  """A posenc.kind (or a layer_pattern entry) that no imported module registered."""


def register(kind: str, cls: type | None = None):
  """Registers an encoding class under `kind`; usable as a decorator (`@register("gauss")`).

  Raises:
    ValueError: `kind` is not a lowercase identifier, is taken by another class, or the class's
      fields clash with the posenc group's or with another encoding's field of the same name
      and another type or default (a shared name must mean the same field, as max_wavelength).
  """
  if cls is None:
    return lambda c: register(kind, c)
  if not re.fullmatch(r"[a-z][a-z0-9_]*", kind):
    raise ValueError(f"an encoding kind must be a lowercase identifier, got {kind!r}")
  if not (isinstance(cls, type) and issubclass(cls, PosEnc)):
    raise ValueError(f"register({kind!r}, ...) needs a subclass of roformer.posenc.PosEnc")
  previous = POSENCS.get(kind)
  if previous is not None and _qualified(previous) != _qualified(cls):
    raise ValueError(
      f"posenc.kind {kind!r} is registered already, by {_qualified(previous)}; pick another name"
    )
  declare_fields(kind, cls.Fields, _qualified(cls))
  POSENCS[kind] = cls
  return cls


def unregister(kind: str) -> None:
  """Removes `kind` and its fields (a test that registers a throwaway encoding cleans up)."""
  POSENCS.pop(kind, None)
  declare_fields(kind, None, "")


def _qualified(cls: type) -> str:
  return f"{cls.__module__}.{cls.__qualname__}"


def unknown_kind_message(kind: str, field: str = "posenc.kind") -> str:
  return (
    f"{field}={kind!r} is not a registered encoding (registered: {', '.join(POSENCS)}); an "
    f"encoding of your own is a PosEnc subclass decorated with @roformer.posenc.register("
    f"{kind!r}) in a module that the config file imports (docs/extending.md)"
  )


def plugin_modules() -> dict[str, list[str]]:
  """module -> "posenc.kind 'NAME'" of each encoding registered outside roformer (with the
  attention kernels' of `kernels.base.plugin_modules`, what a workdir records so that eval.py and
  generate.py can import them again)."""
  found: dict[str, list[str]] = {}
  for kind, cls in POSENCS.items():
    if not cls.__module__.startswith(_BUILTIN_PACKAGE):
      found.setdefault(cls.__module__, []).append(f"posenc.kind {kind!r}")
  return found


def importable(module: str) -> bool:
  """Whether a later process could import `module` by its name: found on the Python path, not
  only in this process's modules (a config file ml_collections loaded, or `__main__`)."""
  if module == "__main__":
    return False
  top = module.split(".")[0]
  finders = (f for f in sys.meta_path if hasattr(f, "find_spec"))
  return any(finder.find_spec(top, None) is not None for finder in finders)


def check_importable(plugins: dict[str, list[str]]) -> None:
  """Raises ValueError for a module that a later process could not import by its name (what is
  defined in a config file or a script); `plugins`: module -> what it registered."""
  for module, names in plugins.items():
    if not importable(module):
      raise ValueError(
        f"{', '.join(names)} defined in {module!r}, which eval.py and generate.py could not "
        "import again to open the run: define it in a module on the Python path (PYTHONPATH) "
        "and import that module in the config file"
      )


def import_modules(modules) -> None:
  """Imports the modules a workdir recorded (config.json "imports"), registering their
  encodings and attention kernels."""
  for module in modules:
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise ValueError(
        f"this run's encodings or attention kernels come from module {module!r} (config.json "
        f'"imports"), which cannot be imported ({e}): put the directory that holds it on '
        "PYTHONPATH"
      ) from None
