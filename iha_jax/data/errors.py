"""The data package's actionable error."""

from iha_jax.errors import UserError


class DataError(UserError, ValueError):
  """A dataset, split, data config field or tokenizer problem; the message names the fix
  (often the `python -m iha_jax.data.build ...` command that prepares the data)."""
