"""The exception types a user sees: each says which input, file or setting is at fault.

The CLIs turn these into one line and a non-zero exit; anything else is a bug and keeps its
traceback."""


class ConfigError(ValueError):
  """A configuration value is missing, misspelt, of the wrong type or out of range."""


class DataError(ValueError):
  """Bad data configuration or input; the message names the config field or path at fault."""


class WorkdirError(ValueError):
  """The workdir is empty, cannot be created or written, or another run holds it."""


class CheckpointNotFoundError(FileNotFoundError):
  """The workdir has no (finished) checkpoint."""


class NonFiniteLossError(RuntimeError):
  """Training produced a NaN or infinite loss or gradient."""
