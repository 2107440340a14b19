"""The --extend flags of eval.py and generate.py (training-free context extension), defined
once. Imports no JAX, so the CLIs can define their flags before JAX starts."""

from absl import flags

# roformer.posenc.config.EXTENSION_KINDS (tests/evals/extend_flags_test.py keeps them equal).
KINDS = (
  "none", "self_extend", "self_extend_floor", "dca", "dca_paper", "rerope", "rerope_clamp",
  "string", "sinks",
)  # fmt: skip

# --extend_<field>: the ContextExtension field each sets, with its meaning per kind.
FIELDS = {
  "window": "self_extend(_floor): neighbour window W; rerope(_clamp): clamp w; sinks: recent keys "
  "(query too).",
  "group": "self_extend(_floor): group size G.",
  "chunk": "dca(_paper): chunk length s.",
  "local": "dca(_paper): local window w; string: local value W.",
  "shift": "string: shifted offset S.",
  "sinks": "sinks: first tokens every query keeps.",
  "train_len": "dca, rerope: training length L of their query factor (0: the run's).",
}
NAMES = ("extend", *(f"extend_{field}" for field in FIELDS))


def define_flags() -> None:
  flags.DEFINE_enum(
    "extend", "none", list(KINDS),
    "Training-free context extension of a rotary decoder (README: Training-free context "
    "extension); its numbers are the --extend_* flags it reads.",
  )  # fmt: skip
  for field, help_text in FIELDS.items():
    flags.DEFINE_integer(f"extend_{field}", 0, help_text)


def values(flag_values) -> tuple[str, dict[str, int]]:
  """(--extend, {field: --extend_<field>}) for `roformer.evals.spec.extension_from_options`."""
  return flag_values.extend, {field: flag_values[f"extend_{field}"].value for field in FIELDS}
