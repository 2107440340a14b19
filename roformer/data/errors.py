"""The one exception type of the input pipeline."""


class DataError(ValueError):
  """Bad data configuration or input; the message names the config field or path at fault."""
