"""Text corpora: local-file builder, tokenizers, packing and truncation."""

import base64
import json
import logging
import pickle

import numpy as np
import pytest
import tensorflow_datasets as tfds

import iha_jax.data as data
from iha_jax.data import tokenizers, train_tokenizer

tfds.disable_progress_bar()

WORDS = "alpha beta gamma delta épsilon zeta eta théta iota kappa lambda mu".split()


class IhaTestCorpus(tfds.core.GeneratorBasedBuilder):
  """A TFDS text dataset outside the project, read as `tfds:iha_test_corpus`."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self, features=tfds.features.FeaturesDict({"sentence": tfds.features.Text()})
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i in range(10):
      yield i, {"sentence": f"sentence number {i}"}


def _corpus(rng, count):
  return [" ".join(rng.choice(WORDS, rng.integers(1, 12)).tolist()) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A prepared `local_text/lines` dataset and the documents it holds."""
  rng = np.random.default_rng(0)
  manual_dir = tmp_path_factory.mktemp("manual")
  train_txt, train_jsonl = _corpus(rng, 40), _corpus(rng, 20)
  validation = _corpus(rng, 8)
  (manual_dir / "train.txt").write_text("\n\n".join(train_txt) + "\n")
  (manual_dir / "train_more.jsonl").write_text(
    "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(train_jsonl))
  )
  (manual_dir / "validation.txt").write_text("\n".join(validation))
  (manual_dir / "notes.md").write_text("ignored")
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  data.prepare("local_text/lines", data_dir, manual_dir=manual_dir)
  return {"data_dir": data_dir, "train": train_txt + train_jsonl, "validation": validation}


def _text_config(corpus, **kwargs):
  return dict(name="local_text/lines", data_dir=corpus["data_dir"], **kwargs)


def _batches(iterator, count):
  batches = [next(iterator) for _ in range(count)]
  iterator.close()
  return batches


def test_local_text_holds_every_document_of_each_split(corpus):
  for split in ("train", "validation"):
    source = tfds.data_source("local_text/lines", split=split, data_dir=corpus["data_dir"])
    texts = sorted(source[i]["text"].decode() for i in range(len(source)))
    assert texts == sorted(corpus[split])


def test_local_text_files_config_keeps_whole_files(tmp_path):
  (tmp_path / "manual").mkdir()
  (tmp_path / "manual" / "train_a.txt").write_text("one\ntwo\n")
  (tmp_path / "manual" / "train_b.txt").write_text("three")
  data.prepare("local_text/files", str(tmp_path / "d"), manual_dir=tmp_path / "manual")
  source = tfds.data_source("local_text/files", split="train", data_dir=str(tmp_path / "d"))
  texts = sorted(source[i]["text"].decode() for i in range(len(source)))
  assert texts == ["one\ntwo\n", "three"]


def test_byte_tokenizer_id_layout_and_round_trip():
  tok = tokenizers.ByteTokenizer()
  ids = tok.encode("aé")
  np.testing.assert_array_equal(ids, [ord("a") + 3, 0xC3 + 3, 0xA9 + 3])
  assert ids.dtype == np.int32 and tok.vocab_size == 259
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  assert tok.decode(np.concatenate([[1], ids, [2, 0]])) == "aé"
  assert data.vocab_size({"name": "tfds:lm1b", "seq_len": 8}) == 259


def test_sentencepiece_trained_by_the_cli_round_trips(corpus, tmp_path):
  prefix = tmp_path / "sp"
  train_tokenizer.main(
    [
      "--name=local_text/lines",
      f"--data_dir={corpus['data_dir']}",
      f"--output={prefix}",
      "--vocab_size=300",
    ]
  )
  model = f"{prefix}.model"
  tok = pickle.loads(pickle.dumps(data.load_tokenizer(model)))
  config = _text_config(corpus, seq_len=32, tokenizer=model)
  assert tok.vocab_size == 300 == data.vocab_size(config)
  assert (tok.bos_id, tok.eos_id) == (tokenizers.BOS_ID, tokenizers.EOS_ID)
  for text in corpus["validation"]:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() > tokenizers.EOS_ID
    assert tok.decode(ids) == text
  it = data.make_dataset(config, "train", global_batch_size=2, shard_count=1, shard_index=0)
  batch = _batches(it, 1)[0]
  assert batch["inputs"].max() < tok.vocab_size


def test_unknown_tokenizer_says_how_to_train_one():
  with pytest.raises(ValueError, match="iha_jax.data.train_tokenizer"):
    data.load_tokenizer("/no/such/file.model")


def test_packed_rows_hold_whole_documents_with_restarting_positions(corpus):
  seq_len = 128
  it = data.make_dataset(
    _text_config(corpus, seq_len=seq_len),
    "train",
    global_batch_size=4,
    shard_index=0,
    shard_count=1,
    num_epochs=1,
  )
  documents = {
    (b"\x01" + t.encode()): t
    for t in corpus["train"]  # BOS + bytes
  }
  seen, num_rows = [], 0
  for batch in it:
    assert set(batch) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    for key, value in batch.items():
      assert value.shape == (4, seq_len)
      assert value.dtype == (np.float32 if key == "weights" else np.int32)
    for row in range(4):
      num_rows += 1
      seg, pos = batch["segment_ids"][row], batch["positions"][row]
      np.testing.assert_array_equal(batch["weights"][row], seg > 0)
      real = seg[seg > 0]
      # Segments are 1..k in order, contiguous, padding only at the end.
      assert np.all(np.diff(seg[: len(real)]) >= 0) and not np.any(seg[len(real) :])
      ids = np.unique(real)
      np.testing.assert_array_equal(ids, np.arange(1, len(ids) + 1))
      for s in ids:
        span = np.flatnonzero(seg == s)
        np.testing.assert_array_equal(pos[span], np.arange(len(span)))
        inputs = batch["inputs"][row, span]
        targets = batch["targets"][row, span]
        np.testing.assert_array_equal(inputs[1:], targets[:-1])
        assert targets[-1] == tokenizers.EOS_ID
        text = bytes([1]) + bytes((inputs[1:] - 3).astype(np.uint8).tolist())
        seen.append(documents[text])
  it.close()
  assert sorted(seen) == sorted(corpus["train"])
  assert num_rows < len(seen) // 2  # Rows hold several documents.
  assert it.num_truncated == 0


def test_long_documents_are_truncated_counted_and_logged(corpus, caplog):
  seq_len = 24
  expected = sum(len(t.encode()) + 1 > seq_len for t in corpus["train"])
  assert 0 < expected < len(corpus["train"])
  it = data.make_dataset(
    _text_config(corpus, seq_len=seq_len, packing=False),
    "train",
    global_batch_size=4,
    shard_index=0,
    shard_count=1,
    num_epochs=1,
  )
  with caplog.at_level(logging.WARNING):
    rows = np.concatenate([b["segment_ids"] for b in it])
  it.close()
  assert rows.any(axis=1).sum() == len(corpus["train"])
  assert it.num_truncated == expected == it.get_state()["num_truncated"]
  assert "truncated" in caplog.text


def test_any_tfds_text_dataset_is_read_by_name(tmp_path):
  config = dict(name="tfds:iha_test_corpus", seq_len=32, data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="--name=tfds:iha_test_corpus"):
    data.make_dataset(config, "train", global_batch_size=2, shard_index=0, shard_count=1)
  data.prepare("tfds:iha_test_corpus", str(tmp_path))
  it = data.make_dataset(
    dict(config, text_key="sentence", packing=False),
    "train",
    global_batch_size=2,
    shard_index=0,
    shard_count=1,
    num_epochs=1,
  )
  tok = tokenizers.ByteTokenizer()
  texts = sorted(
    tok.decode(row[seg > 0])
    for batch in it
    for row, seg in zip(batch["inputs"], batch["segment_ids"])
  )
  it.close()
  assert texts == sorted(f"sentence number {i}" for i in range(10))


def test_missing_text_key_lists_the_features(corpus):
  with pytest.raises(ValueError, match=r"no feature 'content'.*\['text'\]"):
    data.make_dataset(
      _text_config(corpus, seq_len=8, text_key="content"),
      "train",
      global_batch_size=1,
      shard_index=0,
      shard_count=1,
    )


def test_bpe_tokenizer_json_trained_by_the_cli_round_trips(corpus, tmp_path):
  """A byte-level BPE saved as a Hugging Face tokenizer.json, built locally."""
  train_tokenizer.main(
    [
      "--name=local_text/lines",
      f"--data_dir={corpus['data_dir']}",
      f"--output={tmp_path / 'bpe'}",
      "--vocab_size=300",
      "--format=tokenizer.json",
    ]
  )
  path = str(tmp_path / "bpe.json")
  assert tokenizers.tokenizer_format(open(path, "rb").read()) == "tokenizer.json"
  tok = pickle.loads(pickle.dumps(data.load_tokenizer(path)))
  assert isinstance(tok, data.HuggingFaceTokenizer)
  assert tok.vocab_size == 300 == data.vocab_size(_text_config(corpus, seq_len=32, tokenizer=path))
  assert (tok.bos_id, tok.eos_id) == (tokenizers.BOS_ID, tokenizers.EOS_ID)
  for text in corpus["validation"]:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() > tokenizers.EOS_ID
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text


def _tiktoken_file(path, merges=(b"al", b"ph", b"alph", b"alpha", b" beta")):
  """A tiktoken BPE ranks file: every byte, then `merges` (base64 token, rank)."""
  tokens = [bytes([b]) for b in range(256)] + list(merges)
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
  return str(path), len(tokens)


def test_tiktoken_bpe_file_has_llama3_special_ids(tmp_path):
  path, ranks = _tiktoken_file(tmp_path / "tokenizer.model")
  tok = pickle.loads(pickle.dumps(data.load_tokenizer(path)))
  assert isinstance(tok, data.TiktokenTokenizer)
  # Llama 3: the ranks, then 256 special ids starting with BOS, EOS (128,000 + 256).
  assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (ranks + 256, ranks, ranks + 1)
  text = "alpha beta <|begin_of_text|> é"
  ids = tok.encode(text)
  assert ids[0] == ranks - 2 and ids[1] == ranks - 1  # "alpha", " beta"
  assert ids.max() < ranks  # special-token text in a document is ordinary text
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text


@pytest.mark.full
def test_training_on_a_local_bpe_tokenizer(corpus, tmp_path):
  """The model's vocabulary is read from the tokenizer file (model.vocab_size = -1)."""
  from configs import tiny  # pylint: disable=import-outside-toplevel
  from iha_jax.train import model_config, train  # pylint: disable=import-outside-toplevel

  texts = corpus["train"]
  path = train_tokenizer.train_bpe_json(iter(texts), tmp_path / "bpe", vocab_size=280)
  config = tiny.get_config()
  config.data.update(
    name="local_text/lines", data_dir=corpus["data_dir"], tokenizer=path, seq_len=32
  )
  config.data.options = {}
  config.train.update(total_steps=3, warmup_steps=1)
  config.mesh.fsdp, config.eval_every = 1, 0
  assert config.model.vocab_size == -1 and model_config(config).vocab_size == 280
  record = train(config, str(tmp_path / "run"))
  assert np.isfinite(record["loss"]) and record["loss"] > 0
