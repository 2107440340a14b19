"""Lists the registered encodings and every posenc.* field with its default and doc.

    python -m roformer.posenc [--import MODULE ...] [--markdown]

`--import` imports modules first (an encoding of your own registers when its module is imported),
so their kinds and fields are listed too. The listing is read from the encodings' declarations
(`PosEnc.Fields`) and the posenc group (roformer/posenc/config.py): the same source as
configs/default.py's posenc group and the resume rule.
"""

import argparse
import dataclasses
import importlib
import sys

from roformer import posenc
from roformer.posenc.config import ContextExtension, PosEncConfig, RopeScaling, field_doc


def _summary(cls: type) -> str:
  return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def _group_rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
  return [
    (f"{prefix}{f.name}", repr(f.default), "", field_doc(f))
    for f in dataclasses.fields(cls)
    if f.name != "own" and f.metadata
  ]


def rows() -> list[tuple[str, str, str, str]]:
  """(field, default, kinds that declare it, doc) of every posenc.* field."""
  out = _group_rows(PosEncConfig, "posenc.")
  owners: dict[str, list[str]] = {}
  for kind in posenc.POSENCS:
    for name in posenc.fields_of(kind):
      owners.setdefault(name, []).append(kind)
  for name, f in posenc.encoding_fields().items():
    doc = field_doc(f) + (" [changes the parameters' shapes]" if f.metadata["reshapes"] else "")
    out.append((f"posenc.{name}", repr(f.default), ", ".join(owners[name]), doc))
  out += _group_rows(RopeScaling, "posenc.scaling.")
  out += _group_rows(ContextExtension, "posenc.extension.")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m roformer.posenc", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE")
  parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
  args = parser.parse_args(argv)
  for module in args.modules:
    try:
      importlib.import_module(module)
    except ImportError as e:
      parser.error(f"--import={module}: {e} (is its directory on PYTHONPATH?)")
  kinds = [(k, c.__module__, _summary(c)) for k, c in posenc.POSENCS.items()]
  if args.markdown:
    print("| kind | module | what it is |\n|---|---|---|")
    print("\n".join(f"| `{k}` | `{m}` | {s} |" for k, m, s in kinds))
    print("\n| field | default | kinds | doc |\n|---|---|---|---|")
    print("\n".join(f"| `{n}` | `{d}` | {k} | {doc} |" for n, d, k, doc in rows()))
    return 0
  print("encodings (posenc.kind):")
  for kind, module, summary in kinds:
    print(f"  {kind:<12} {summary}  [{module}]")
  print("\nfields:")
  for name, default, owners, doc in rows():
    print(f"  {name} = {default}" + (f"  ({owners})" if owners else ""))
    print(f"      {doc}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
