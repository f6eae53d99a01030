"""train.py / eval.py as a person meets them: --help exits 0, mistakes print one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures import REPO_ROOT

REPO = str(REPO_ROOT)


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
  environ = {k: v for k, v in os.environ.items() if k != "IHA_DEBUG"}
  environ.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", **env)
  return subprocess.run(
    [sys.executable, *args],
    cwd=REPO,
    env=environ,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


@pytest.mark.full
def test_train_help_lists_the_config_keys_and_exits_0():
  proc = run("train.py", "--help")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "--config.train.total_steps" in proc.stdout and "= 3000" in proc.stdout
  assert "--config.data.tokenizer" in proc.stdout and "--[no]debug" in proc.stdout


@pytest.mark.full
def test_eval_help_exits_0_and_points_to_the_keys():
  proc = run("eval.py", "--help")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "python train.py --help" in proc.stdout and "--sweep_lengths" in proc.stdout


@pytest.mark.parametrize("debug", [False, True])
def test_mistyped_config_key_names_the_fix_in_one_line(tmp_path, debug):
  proc = run(
    "train.py",
    "--config",
    "configs/tiny.py",
    f"--workdir={tmp_path}",
    "--config.train.totl_steps=5",
    **({"IHA_DEBUG": "1"} if debug else {}),
  )
  assert proc.returncode != 0
  if debug:  # the traceback is there for whoever asks
    assert "Traceback" in proc.stderr
    return
  assert proc.stderr.strip() == (
    "train.py: error: --config.train.totl_steps: no such config key; did you mean "
    "train.total_steps? (`train.py --help` lists every key)"
  )
  assert not os.listdir(tmp_path)


def test_eval_without_checkpoints_is_one_line(tmp_path):
  proc = run("eval.py", f"--workdir={tmp_path}")
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(
    f"eval.py: error: RunNotFoundError: --workdir '{tmp_path}': no checkpoint in"
  ), proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


@pytest.mark.full
def test_missing_config_file_is_one_line(tmp_path):
  proc = run("train.py", "--config=configs/nope.py", f"--workdir={tmp_path}")
  assert proc.returncode == 2
  assert proc.stderr.strip() == (
    f"train.py: error: --config=configs/nope.py: no such file 'configs/nope.py' (a relative "
    f"path starts at {REPO}); pass a config file, e.g. --config=configs/default.py"
  )
