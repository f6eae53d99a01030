"""Every Python block of README.md and of the docs pages is a complete program that runs
outside the repository (docs/your_model.md's run in tests/nn/test_your_model.py).

The blocks run in one interpreter (JAX is imported once) started in a temporary directory
without PYTHONPATH, so `import iha_jax` must find the installed package (`pip install -e .`,
done by the Makefile), and each block gets a fresh namespace, so a block that leans on
another block's imports or inputs fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.fixtures import REPO_ROOT

REPO = str(REPO_ROOT)
RUNNER = """
import json, sys, traceback
import iha_jax
blocks = json.load(open(sys.argv[1]))
print("iha_jax from", iha_jax.__file__)
for index, (line, code) in enumerate(blocks):
  try:
    exec(compile(code, line, "exec"), {"__name__": "__main__"})
  except Exception:
    traceback.print_exc()
    sys.exit(f"python block {index} ({line}) failed")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
  """`(first line number, code)` of every ```python block."""
  return [
    (text[: m.start()].count("\n") + 2, m.group(1))
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
  ]


# The pages whose Python blocks this test runs (docs/your_model.md has its own test).
PAGES = ("README.md", "docs/attention.md", "docs/data.md", "docs/evaluation.md")


def test_every_page_with_python_is_run():
  """A page with a Python block is either listed here or run by its own test."""
  pages = [os.path.relpath(p, REPO) for p in [os.path.join(REPO, "README.md")]]
  docs = os.path.join(REPO, "docs")
  pages += [os.path.join("docs", name) for name in sorted(os.listdir(docs)) if name.endswith(".md")]
  with_python = set()
  for page in pages:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      if python_blocks(f.read()):
        with_python.add(page)
  assert with_python == set(PAGES) | {"docs/your_model.md"}, with_python


def test_readme_python_blocks_run_outside_the_repository(tmp_path):
  blocks = []
  for page in PAGES:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      blocks += [(f"{page}:{line}", code) for line, code in python_blocks(f.read())]
  assert len(blocks) >= 7, blocks
  (tmp_path / "blocks.json").write_text(json.dumps(blocks))
  (tmp_path / "run_blocks.py").write_text(RUNNER)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  proc = subprocess.run(
    [sys.executable, "run_blocks.py", "blocks.json"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert "No module named 'iha_jax'" not in proc.stderr, (
    "iha_jax is not installed in this Python: `make test` installs it (pip install -e .)"
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  installed = proc.stdout.splitlines()[0]
  assert installed.startswith("iha_jax from " + os.path.join(REPO, "iha_jax")), installed
