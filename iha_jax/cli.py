"""Command-line plumbing of train.py and eval.py: one-line errors, `--help` that exits 0.

A person's mistakes (a mistyped `--config.KEY`, a workdir without checkpoints, a dataset
that is not prepared) end the command with one line naming the fix, never a traceback:
every `iha_jax.errors.UserError`, flag errors, and Ctrl-C outside the training loop.
`--debug` or `IHA_DEBUG=1` shows the traceback. Other exceptions are bugs and keep theirs.
"""

from __future__ import annotations

import difflib
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags

from iha_jax.errors import UserError

FLAGS = flags.FLAGS
DEBUG_ENV = "IHA_DEBUG"
HELP_ARGS = ("-h", "-?", "--help", "-help", "--helpshort", "--helpfull")
DEFAULT_CONFIG = "configs/default.py"
CONFIG_PREFIX = "--config."


def define_debug_flag() -> None:
  flags.DEFINE_bool("debug", False, f"Show the traceback of errors (or set {DEBUG_ENV}=1).")


def debug_requested(argv: Sequence[str]) -> bool:
  """`--debug` on the command line (flags may not be parsed yet) or `IHA_DEBUG` set."""
  return any(arg in ("--debug", "--debug=true", "--debug=1") for arg in argv) or (
    os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")
  )


def fail(message: str, *, code: int = 2) -> NoReturn:
  """Prints `PROG: error: MESSAGE` to stderr and exits with `code`."""
  print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
  sys.exit(code)


def _flag_value(argv: Sequence[str], name: str) -> str | None:
  """The value of `--name=V` or `--name V` in `argv` (the last one), or None."""
  value = None
  for index, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and index + 1 < len(argv):
      value = argv[index + 1]
  return value


def load_config_file(spec: str) -> Any:
  """`get_config()` of a config file `path.py[:arg]`, as `--config` loads it."""
  path, _, arg = spec.partition(":")
  module = runpy.run_path(path)
  return module["get_config"](arg) if arg else module["get_config"]()


def config_keys(config: Any, prefix: str = "") -> dict[str, Any]:
  """`{"train.total_steps": 3000, ...}`: every leaf key of a ConfigDict with its value."""
  keys = {}
  for key, value in sorted(config.items()):
    if hasattr(value, "items") and value:  # a section (ConfigDict or dict)
      keys.update(config_keys(value, f"{prefix}{key}."))
    else:
      keys[f"{prefix}{key}"] = value
  return keys


def config_keys_help(argv: Sequence[str]) -> str:
  """The keys of `--config` (default configs/default.py) with their values, for --help."""
  spec = _flag_value(argv, "config")
  if spec is None:  # the repository's default config, from any working directory
    beside_script = os.path.join(os.path.dirname(os.path.abspath(argv[0])), DEFAULT_CONFIG)
    spec = DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else beside_script
  try:
    keys = config_keys(load_config_file(spec))
  except Exception as e:  # pylint: disable=broad-except
    return f"\nconfig keys: cannot load {spec!r} ({type(e).__name__}: {e})\n"
  width = max(map(len, keys))
  lines = [f"  --config.{key:<{width}} = {value!r}" for key, value in keys.items()]
  return (
    f"\nconfig keys of {spec} (override any with --config.KEY=VALUE; "
    f"--config=FILE --help lists another config's):\n" + "\n".join(lines) + "\n"
  )


def _override_error(argv: Sequence[str], error: Exception) -> str:
  """One line for a failed `--config.KEY=VALUE`: the unknown key and the closest known
  one, or the value that does not parse."""
  spec = _flag_value(argv, "config")
  overrides = [
    arg[len(CONFIG_PREFIX) :].split("=", 1) for arg in argv if arg.startswith(CONFIG_PREFIX)
  ]
  try:
    known = config_keys(load_config_file(spec)) if spec else {}
  except Exception:  # pylint: disable=broad-except
    known = {}
  for key, *_ in overrides:
    if known and key not in known and not any(k.startswith(key + ".") for k in known):
      close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
      hint = f"did you mean {close[0]}? " if close else ""
      return (
        f"--config.{key}: no such config key; {hint}"
        f"(`{os.path.basename(sys.argv[0])} --help` lists every key)"
      )
  detail = str(error).strip().replace("\\n", " ").replace("\n", " ")
  return f"a --config override does not apply: {type(error).__name__}: {detail}"


def _missing_config_file(argv: Sequence[str]) -> str | None:
  """The one-line error of a `--config` file that does not exist (ml_collections would
  report it at first use, in a traceback), else None."""
  spec = _flag_value(argv, "config")
  if spec is None:
    return None
  path = spec.partition(":")[0]
  if os.path.isfile(path):
    return None
  return (
    f"--config={spec}: no such file {path!r} (a relative path starts at {os.getcwd()}); "
    f"pass a config file, e.g. --config={DEFAULT_CONFIG}"
  )


def parse_flags(
  argv: list[str], *, help_extra: Callable[[Sequence[str]], str] | None = None
) -> list[str]:
  """absl flag parsing with `--help` that exits 0 (and lists the config keys when
  `help_extra` gives them) and one-line errors."""
  if any(arg in HELP_ARGS for arg in argv[1:]):
    doc = sys.modules["__main__"].__doc__ or ""
    print(
      doc.rstrip()
      + "\n\nflags:\n"
      + FLAGS.main_module_help()
      + "\n"
      + FLAGS.module_help(__name__)
      + (help_extra(argv) if help_extra else "")
    )
    sys.exit(0)
  missing = _missing_config_file(argv)
  if missing and not debug_requested(argv):
    fail(missing)
  try:
    return FLAGS(argv)
  except flags.Error as e:
    if debug_requested(argv):
      raise
    fail(f"{e} (`{os.path.basename(argv[0])} --help` lists the flags)")
  except Exception as e:  # pylint: disable=broad-except
    # ml_collections raises AttributeError/KeyError/ValueError/TypeError for overrides.
    if debug_requested(argv):
      raise
    fail(_override_error(argv, e))


def run(
  main: Callable[[list[str]], Any], *, help_extra: Callable[[Sequence[str]], str] | None = None
) -> None:
  """`absl.app.run(main)` with one-line user errors (see the module docstring)."""

  def guarded(argv: list[str]) -> Any:
    try:
      return main(argv)
    except UserError as e:
      if debug_requested(sys.argv):
        raise
      fail(f"{type(e).__name__}: {e}", code=1)
    except KeyboardInterrupt:
      if debug_requested(sys.argv):
        raise
      fail("interrupted (Ctrl-C)", code=130)

  app.run(guarded, flags_parser=lambda argv: parse_flags(argv, help_extra=help_extra))
