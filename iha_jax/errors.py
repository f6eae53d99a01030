"""Errors a person running a command can fix themselves.

Each message names what is wrong and the fix (the flag, the config key, the command to
run). `train.py` and `eval.py` print a `UserError` as one line without a traceback
(`--debug` or IHA_DEBUG=1 shows it); any other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
  """Base of the project's actionable errors; subclasses also derive from the builtin
  they refine (ValueError, FileNotFoundError, RuntimeError), so callers may catch either."""
