"""A `gs://` bucket served from a local directory, like a gcsfuse mount, for offline tests.

`mount(monkeypatch, root)` makes every layer that reaches storage for a `gs://` URL use
`root/BUCKET/PATH` instead of the network:
- etils.epath (Orbax's and TFDS's paths, our metrics, TensorBoard, eval outputs) reaches
  `gs://` through an fsspec filesystem (gcsfs): it gets `FakeGcs`, a `DirFileSystem` over
  `root` that, like GCS, refuses to append to an object;
- Orbax hands array data to TensorStore's own GCS driver: its kvstore spec becomes the
  local "file" driver at the same place, after recording the URL it was given;
- Orbax asks the GCS API whether a bucket has a hierarchical namespace: it has not.
ArrayRecord's reader and writer talk to GCS themselves, so data dirs stay local in tests.
"""

from __future__ import annotations

import os
from typing import Any

from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils


class FakeGcs(DirFileSystem):
  """`gs://B/x` <-> `ROOT/B/x`; names come back as `B/x`, as gcsfs returns them."""

  protocol = ("gs", "gcs")
  cachable = False
  root = ""

  def __init__(self, *args: Any, **kwargs: Any):  # gcsfs options (finalize_on_close, ...)
    del args, kwargs
    super().__init__(path=self.root, fs=LocalFileSystem(auto_mkdir=True))

  def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any):
    if "a" in mode:
      raise NotImplementedError(f"GCS objects cannot be appended to (mode {mode!r}): {path}")
    return super().open(path, mode, *args, **kwargs)


def mount(monkeypatch: Any, root: str) -> dict[str, list[str]]:
  """Serves `gs://` from `root` for this test (monkeypatch undoes it); returns the URLs
  TensorStore was asked to open."""
  os.makedirs(root, exist_ok=True)
  monkeypatch.setattr(FakeGcs, "root", root)
  fake, backend = FakeGcs(), epath_backend.fsspec_backend
  real_fs = type(backend).fs
  monkeypatch.setattr(
    backend,
    "fs",
    lambda path: fake if os.fspath(path).startswith("gs://") else real_fs(backend, path),
  )
  seen: dict[str, list[str]] = {"tensorstore": []}

  def kvstore(ckpt_path: str) -> dict[str, Any]:
    seen["tensorstore"].append(ckpt_path)
    bucket, path = gcs_utils.parse_gcs_path(ckpt_path, add_trailing_slash=False)
    return {"driver": "file", "path": os.path.join(root, bucket, path)}

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  return seen
