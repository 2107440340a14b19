"""A checkpoint's manifest: the size and SHA-256 digest of each of its files, in
DIR/checkpoints/<step>/manifest.json.

Written when the step is saved, before Orbax commits it, and checked before the step is restored.
TensorStore reads most damage to an array file back without an error (overwritten bytes decode
as other numbers); the manifest turns any change after the save into an unreadable checkpoint.
"""

import concurrent.futures
import hashlib
import json
import os

from etils import epath

MANIFEST_FILE = "manifest.json"
ALGORITHM = "sha256"  # the fastest of hashlib's digests on CPUs with SHA instructions (~1 GB/s)
_CHUNK_BYTES = 16 << 20
# Files of the step's own directory that Orbax writes or rewrites when it commits the step, after
# the manifest: the commit time in its step metadata, and the commit marker.
_WRITTEN_AT_COMMIT = frozenset({"_CHECKPOINT_METADATA", "commit_success.txt"})


class ManifestMismatchError(ValueError):
  """A file of a checkpoint is missing, or differs from what its manifest recorded."""


def _files(step_dir: epath.Path) -> list[str]:
  """The files of `step_dir` the manifest covers, as sorted paths relative to it."""
  names = []
  for folder, _, files in step_dir.walk():
    for file in files:
      name = str((folder / file).relative_to(step_dir))
      if name not in _WRITTEN_AT_COMMIT and name != MANIFEST_FILE:
        names.append(name)
  return sorted(names)


def _digest(path: epath.Path, algorithm: str) -> str:
  digest = hashlib.new(algorithm)
  with path.open("rb") as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _digests(step_dir: epath.Path, names: list[str], algorithm: str = ALGORITHM) -> list[str]:
  # hashlib releases the GIL on large buffers: a checkpoint's files hash on several cores.
  workers = max(1, min(8, os.cpu_count() or 1, len(names)))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda name: _digest(step_dir / name, algorithm), names))


def write(step_dir: epath.Path) -> None:
  """Writes the manifest of every file now in `step_dir`."""
  step_dir = epath.Path(step_dir)
  names = _files(step_dir)
  sizes = [(step_dir / name).stat().length for name in names]
  files = {
    name: {"bytes": size, ALGORITHM: digest}
    for name, size, digest in zip(names, sizes, _digests(step_dir, names), strict=True)
  }
  text = json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1, sort_keys=True)
  (step_dir / MANIFEST_FILE).write_text(text + "\n")


def verify(step_dir: epath.Path) -> bool:
  """Checks every file of `step_dir` against its manifest.

  Returns:
    True when every file matched; False when the step has no manifest (a checkpoint written
    before checkpoints carried one), which is then not checked.

  Raises:
    ManifestMismatchError, one line naming the first file at fault (or the manifest itself).
  """
  step_dir = epath.Path(step_dir)
  path = step_dir / MANIFEST_FILE
  if not path.exists():
    return False
  try:
    recorded = json.loads(path.read_text())
    algorithm, files = recorded["algorithm"], recorded["files"]
    sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
    digests = {name: str(entry[algorithm]) for name, entry in files.items()}
    hashlib.new(algorithm)  # a name hashlib knows
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ManifestMismatchError(f"{MANIFEST_FILE} is damaged ({type(e).__name__})") from None
  # Sizes first: a truncated or lost file is found without reading the others.
  for name, size in sizes.items():
    file = step_dir / name
    if not file.exists():
      raise ManifestMismatchError(f"{name} is missing")
    if file.stat().length != size:
      raise ManifestMismatchError(f"{name} holds {file.stat().length} bytes, {size} when saved")
  names = sorted(digests)
  for name, digest in zip(names, _digests(step_dir, names, algorithm), strict=True):
    if digest != digests[name]:
      raise ManifestMismatchError(f"{name} differs from its {algorithm} digest written when saved")
  return True
