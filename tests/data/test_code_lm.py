"""Language modelling on the Python standard library: the `python_stdlib` builder (splits
by path hash, exclusions, encodings, the metadata that names the data, the missing
directory), bits per byte, the `code_lm` study at `--scale tiny` with a control that must
learn, and `eval.py --complete` on a trained text run."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform

import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import logging as absl_logging

import iha_jax.data as data
from configs import text_global_local, text_iha
from experiments import protocol, report, run
from experiments.studies import STUDIES, code_lm
from iha_jax.data import python_stdlib, registry, text_stats
from iha_jax.train import config as config_lib
from tests.utils import decode_png

tfds.disable_progress_bar()

# A source tree with every case the builder handles: packages, test packages at any
# depth, third-party code, a coding cookie, a file that does not decode, a non-.py file.
TREE = {
  "a.py": "import os\n\n\ndef f(x):\n  return x + 1\n" * 6,
  "pkg/__init__.py": "",
  "pkg/b.py": "class B:\n  '''A class.'''\n\n  value = 3\n" * 8,
  "pkg/c.py": "print('c')\n" * 30,
  "pkg/tests/test_b.py": "assert True\n",
  "test/test_x.py": "assert 1\n",
  "idlelib/idle_test/t.py": "pass\n",
  "site-packages/third.py": "third = 1\n",
  "notes.txt": "not python\n",
}
LATIN = "# -*- coding: latin-1 -*-\nname = 'café'\n"


def _tree(root) -> str:
  for path, text in TREE.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text, encoding="utf-8")
  (root / "latin.py").write_bytes(LATIN.encode("latin-1"))
  (root / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # no cookie, not UTF-8
  return str(root)


def _records(data_dir: str, options: dict) -> dict[str, list[dict[str, str]]]:
  builder = registry.get_builder("python_stdlib/chunks", data_dir, options)
  out = {}
  for split in builder.info.splits:
    source = builder.as_data_source(split=split)
    out[split] = [{k: source[i][k].decode() for k in ("text", "path")} for i in range(len(source))]
  return out


def test_python_stdlib_splits_files_by_path_hash_and_names_its_data(tmp_path):
  root = _tree(tmp_path / "src")
  # With these paths, 30% / 30% held out puts files in every split.
  options = {"root": root, "chunk_bytes": 40, "validation_percent": 30, "test_percent": 30}
  builder = data.prepare("python_stdlib/chunks", str(tmp_path / "d"), options=options)
  records = _records(str(tmp_path / "d"), options)
  kept = {"a.py", "pkg/b.py", "pkg/c.py", "latin.py"}  # __init__.py is empty: no document
  by_file: dict[str, list[str]] = {}
  for split, rows in records.items():
    for row in rows:
      bucket = int(hashlib.sha256(row["path"].encode()).hexdigest()[:8], 16) % 100
      assert split == ("validation" if bucket < 30 else "test" if bucket < 60 else "train")
      assert len(row["text"].encode()) <= 40 or "\n" not in row["text"][:-1]
      by_file.setdefault(row["path"], []).append(row["text"])
  assert set(by_file) == kept
  assert len({s for s, rows in records.items() if rows}) >= 2  # the split is not trivial
  for path, chunks in by_file.items():  # a file's documents are its lines, all of them
    encoding = "latin-1" if path == "latin.py" else "utf-8"
    text = (tmp_path / "src" / path).read_bytes().decode(encoding)
    assert sorted(chunks) == sorted(python_stdlib.chunk_lines(text, 40))
    assert "".join(python_stdlib.chunk_lines(text, 40)) == text
  assert "café" in "".join(by_file["latin.py"])  # decoded by its coding cookie
  meta = builder.info.metadata
  assert meta["python_version"] == platform.python_version()
  assert meta["skipped_files"] == ["bad.py"]
  files = sorted(kept | {"pkg/__init__.py"})
  lines = sorted(
    f"{p}\t{hashlib.sha256((tmp_path / 'src' / p).read_bytes()).hexdigest()}" for p in files
  )
  assert meta["files_digest"] == hashlib.sha256("\n".join(lines).encode()).hexdigest()
  assert sum(meta["num_files"].values()) == len(files)
  # The digest names the data: one changed byte changes it; test packages come back on
  # request, third-party code never.
  (tmp_path / "src" / "a.py").write_text(TREE["a.py"] + "#\n")
  changed = {**options, "include_tests": True}
  again = data.prepare("python_stdlib/chunks", str(tmp_path / "d2"), options=changed)
  assert again.info.metadata["files_digest"] != meta["files_digest"]
  paths = {row["path"] for rows in _records(str(tmp_path / "d2"), changed).values() for row in rows}
  assert paths == kept | {"pkg/tests/test_b.py", "test/test_x.py", "idlelib/idle_test/t.py"}


def test_python_stdlib_missing_directory_is_one_clear_error(tmp_path, capsys):
  from iha_jax.data import build  # pylint: disable=import-outside-toplevel

  missing = str(tmp_path / "nowhere")
  with pytest.raises(SystemExit) as exit_info:
    build.main(["--name=python_stdlib", f"--data_dir={tmp_path}", f"--option=root={missing}"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and missing in err and "--option=root=" in err
  # The build command of the corpus needs no --manual_dir (the local_text one does).
  assert "manual_dir" not in registry.build_command("python_stdlib/chunks", "D")
  assert "manual_dir" in registry.build_command("local_text/lines", "D")


def test_bits_per_byte_counts_the_bytes_of_the_scored_tokens(tmp_path):
  root = _tree(tmp_path / "src")
  options = {"root": root, "chunk_bytes": 0, "validation_percent": 1, "test_percent": 1}
  data_dir = str(tmp_path / "d")
  data.prepare("python_stdlib/chunks", data_dir, options=options)
  texts = [row["text"] for row in _records(data_dir, options)["train"]]
  config = dict(name="python_stdlib/chunks", data_dir=data_dir, options=options, seq_len=4096)
  scored = text_stats.scored_text(config, "train")  # bytes: one token per byte, + EOS
  total = sum(len(t.encode()) + 1 for t in texts)
  assert (scored.documents, scored.tokens, scored.bytes) == (len(texts), total, total)
  assert scored.bits_per_byte(math.log(2)) == 1.0
  # Rows shorter than the documents: the scored tokens are the first seq_len of each.
  short = text_stats.scored_text({**config, "seq_len": 16}, "train")
  assert short.tokens == short.bytes == sum(min(len(t.encode()) + 1, 16) for t in texts)


@pytest.mark.full
def test_code_lm_tiny_learns_beyond_byte_pair_frequencies(tmp_path):
  out, data_dir = str(tmp_path / "out"), str(tmp_path / "data")
  args = ["code_lm", "--scale", "tiny", "--seeds", "2", "--out", out, "--data_dir", data_dir]
  verbosity = absl_logging.get_verbosity()
  try:
    run.main([*args, "--quiet", "--variants", "iha"])
  finally:  # the runner quiets absl for the process; later tests read its warnings
    absl_logging.set_verbosity(verbosity)
  with open(os.path.join(out, "code_lm.json")) as f:
    results = json.load(f)
  study, scale = STUDIES["code_lm"], STUDIES["code_lm"].scales["tiny"]
  described = results["data"]["python_stdlib/chunks"]
  assert described["python_version"] == platform.python_version()
  tokenizer = code_lm.tokenizer_path(
    protocol.variant_config(study, "tiny", study.variants[0], data_dir).data, 320
  )
  with open(tokenizer, "rb") as f:
    assert described["tokenizer_sha256"] == hashlib.sha256(f.read()).hexdigest()
  # The control: a model that learned nothing beyond token frequencies would score the
  # unigram cross-entropy of the test tokens under the train split's frequencies.
  tok = data.load_tokenizer(tokenizer)
  options = dict(scale.config().data.options)

  def tokens(split: str) -> np.ndarray:
    rows = _records(data_dir, options)[split]
    return np.concatenate([[*tok.encode(r["text"]), tok.eos_id] for r in rows]).astype(int)

  counts = np.bincount(tokens("train"), minlength=tok.vocab_size) + 1.0
  unigram = -np.log(counts / counts.sum())[tokens("test")].mean()
  config = dict(name="python_stdlib/chunks", data_dir=data_dir, options=options, seq_len=64)
  unigram_bpb = text_stats.scored_text({**config, "tokenizer": tokenizer}, "test").bits_per_byte(
    unigram
  )
  chosen = results["chosen_learning_rates"]["iha"]
  base = [r for r in results["runs"].values() if r["learning_rate"] == chosen]
  assert sorted(r["seed"] for r in base) == [0, 1]
  assert sorted(r["learning_rate"] for r in results["runs"].values() if r["phase"] == "grid") == (
    sorted(scale.learning_rates)
  )
  for r in base:
    assert r["test"]["bits_per_byte"] < unigram_bpb - 0.2, (r["test"], unigram_bpb)
    assert r["test"]["bits_per_byte"] == pytest.approx(
      r["test"]["loss"] / math.log(2) / described_bytes_per_token(config, tokenizer), rel=1e-9
    )
  # The report: mean ± std of each metric, learning curves against tokens and FLOPs.
  with open(os.path.join(out, "code_lm.md")) as f:
    md = f.read()
  row = next(line for line in md.splitlines() if line.startswith("| IHA P = 2 (LLLLM) |"))
  assert row.count("±") == 3 and "Data `python_stdlib/chunks`" in md
  fig = report.plot(study, results, os.path.join(out, "again.png"))
  decode_png(os.path.join(out, "code_lm.png"), dpi=110, figure=fig)
  tokens_axis, flops_axis = fig.axes[1], fig.axes[2]
  first = base[0]
  steps = np.array([c["step"] for c in first["curve"]])
  lines = [line for line in tokens_axis.get_lines() if len(line.get_xdata()) == len(steps)]
  np.testing.assert_array_equal(lines[0].get_xdata(), steps * first["batch_size"] * 64)
  np.testing.assert_allclose(
    flops_axis.get_lines()[0].get_xdata(), steps * first["train_flops_per_step"]
  )
  np.testing.assert_allclose(
    lines[0].get_ydata(), [c["loss"] for c in first["curve"]]
  )  # validation loss, nats per token


def described_bytes_per_token(config: dict, tokenizer: str) -> float:
  return text_stats.scored_text({**config, "tokenizer": tokenizer}, "test").bytes_per_token


def test_text_demo_configs_are_the_study_model():
  """`make train-text` trains the study's `small` model and data, and its twin differs from
  it only in the attention schedule and windows."""
  study = code_lm._config("small")  # pylint: disable=protected-access
  iha, twin = text_iha.get_config(), text_global_local.get_config()
  for key in ("num_layers", "model_dim", "num_heads", "head_dim", "mlp_dim", "num_pseudo"):
    assert iha.model[key] == study.model[key], key
  assert (iha.data.name, iha.data.seq_len, dict(iha.data.options)) == (
    study.data.name,
    study.data.seq_len,
    dict(study.data.options),
  )
  assert iha.train.batch_size == study.train.batch_size
  study.data.data_dir = os.path.dirname(os.path.dirname(iha.data.tokenizer))
  assert iha.data.tokenizer == code_lm.tokenizer_path(study.data, 2048)
  assert (twin.model.attention_schedule, twin.model.mha_window) == ("SSSSM", 32)
  assert twin.model.model_dim == iha.model.model_dim and twin.data.name == iha.data.name


@pytest.mark.full
def test_eval_complete_reports_bits_per_byte_and_continues_the_prompt(tmp_path):
  from iha_jax.eval import complete  # pylint: disable=import-outside-toplevel
  from iha_jax.train import train  # pylint: disable=import-outside-toplevel

  config = text_iha.get_config()  # the demo's config, shrunk; bytes, no trained tokenizer
  config.model.update(num_layers=2, model_dim=32, head_dim=8, mlp_dim=64, attention_schedule="LM")
  options = {"root": _tree(tmp_path / "src"), "chunk_bytes": 63}
  options.update(validation_percent=30, test_percent=30)
  config.data.update(data_dir=str(tmp_path / "d"), tokenizer="byte", seq_len=64, options=options)
  config.train.update(batch_size=8, total_steps=4, warmup_steps=1)
  config.checkpoint.update({"every": 4, "async": False})
  config.mesh.update(fsdp=1)
  data.prepare(config.data.name, config.data.data_dir, options=options)
  workdir = str(tmp_path / "text_lm")
  train(config, workdir)
  prompt = "def f(x):\n"
  result = complete.complete_run(workdir, prompt, max_new_tokens=8, temperature=1.0, top_k=5)
  assert (result.name, result.step) == ("text_lm", 4)
  # Byte tokens: every scored token is one byte, so bits per byte are bits per token.
  assert result.metrics["bits_per_byte"] == pytest.approx(result.metrics["loss"] / math.log(2))
  assert isinstance(result.greedy, str) and isinstance(result.sampled, str)
  assert len(result.greedy.encode()) <= 8 * 3  # 8 byte tokens (a bad byte decodes to U+FFFD)
  table = complete.side_by_side([result])
  assert "text_lm" in table and f"{result.metrics['bits_per_byte']:.4f}" in table
  assert complete.describe(result, prompt, 1.0, 5).count(prompt) == 2


def test_equal_flops_gives_the_cheaper_variants_more_steps():
  """At `small`'s "equal_flops" point every covered variant trains for the dearest one's
  FLOPs at 800 steps (to half a step), and the dearest keeps its base runs."""
  study = STUDIES["code_lm"]
  sweep = study.scales["small"].sweeps[0]
  covered = [v for v in study.variants if sweep.covers(v.name)]
  assert {v.name for v in covered} == set(code_lm.EQUAL_FLOPS_VARIANTS)
  per_step, steps = {}, {}
  for variant in covered:
    base = protocol.variant_config(study, "small", variant, "")
    point = protocol.variant_config(study, "small", variant, "", (sweep, "equal_flops"))
    per_step[variant.name] = code_lm.train_flops_per_step(base, 2048)
    steps[variant.name] = point.train.total_steps
    assert base.train.total_steps == 800
  dearest = max(per_step, key=per_step.get)
  budget = 800 * per_step[dearest]
  for name, flops in per_step.items():
    assert abs(steps[name] * flops - budget) <= flops / 2, name
    assert steps[name] > 800 or name == dearest
  assert steps[dearest] == 800
  assert protocol.same_config(
    study, "small", covered[[v.name for v in covered].index(dearest)], (sweep, "equal_flops")
  )


def test_p1_control_is_sliding_window_mha_with_iha_p1s_windows():
  """P = 1's control differs from IHA P = 1 only in the attention kind: Global+Local's
  `S` layers see as many tokens as IHA P = 1's `L` layers (one virtual token per token)."""
  study = STUDIES["code_lm"]
  variants = {v.name: v for v in study.variants}
  iha = protocol.variant_config(study, "small", variants["iha_p1"], "")
  control = protocol.variant_config(study, "small", variants["global_local_p1"], "")
  twin = protocol.variant_config(study, "small", variants["global_local"], "")
  assert control.model.attention_schedule == "SSSSM" and control.model.num_pseudo is None
  assert control.model.mha_window == config_lib.resolve_window(iha) == 128
  assert twin.model.mha_window == 32  # the committed Global+Local: IHA P = 2's window
  assert control.model.to_dict() | {"attention_schedule": "LLLLM", "mha_window": None} == (
    iha.model.to_dict() | {"num_pseudo": None, "iha_window": None}
  )
