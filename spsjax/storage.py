"""The locations a user names (family roots, checkpoints, tokenizers, Hugging Face directories,
results), read and written through `etils.epath`, so that a `gs://` bucket works wherever a local
directory does.

`path(location)` is the way in: a URI (`gs://...`) stays as given; a local path has `~` expanded
and is made absolute, as it always was. What lies under it is read and written with epath's methods
(`read_bytes`, `open`, `exists`, `is_dir`, ...), never with `open` or `os.path`, which take
'gs://b/x' for the local relative path 'gs:/b/x'.

One writer: `write_bytes`, `write_text`, `write_json` and `copy_dir` write from process 0 only and
return at once on the others, since several processes writing one file of shared storage race. A
caller whose other processes then read what was written waits at `distributed.barrier` first.

What a `gs://` location needs installed (the `gcs` extra of setup.py): epath reaches it through
gcsfs (or TensorFlow's gfile where TensorFlow is installed); orbax's checkpoints also list steps
with google-cloud-storage and write arrays with tensorstore's own GCS driver. TFDS data is the
exception: array_record reads and writes local files only, so a data directory is local or mounted
(`data.datasets`).
"""

import io
import json
import os
import uuid

from etils import epath

from spsjax import distributed


def is_uri(location: epath.PathLike) -> bool:
  """Whether `location` names a file system by scheme (`gs://b/x`) rather than a local path."""
  return '://' in os.fspath(location)


def path(location: epath.PathLike) -> epath.Path:
  """`location` as an epath.Path: a URI as given, a local path absolute with `~` expanded."""
  if is_uri(location):
    return epath.Path(location)
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(location))))


def join(location: epath.PathLike, *names: str) -> str:
  """`location/names...` as a string (what configs, logs and orbax take), a URI kept a URI."""
  return os.fspath(epath.Path(location).joinpath(*names))


def write_bytes(location: epath.PathLike, data: bytes, *, atomic: bool = False) -> None:
  """Writes `data` to `location` (process 0 only), making its directory first. `atomic`: written
  under a temporary name beside it, then renamed, so a reader never sees half a file."""
  if not distributed.is_main():
    return
  target = path(location)
  target.parent.mkdir(parents=True, exist_ok=True)
  if not atomic:
    target.write_bytes(data)
    return
  temporary = target.parent / f'.{target.name}.{uuid.uuid4().hex}.tmp'
  temporary.write_bytes(data)
  temporary.replace(target)


def write_text(location: epath.PathLike, text: str, *, atomic: bool = False) -> None:
  """`write_bytes` of `text` in UTF-8."""
  write_bytes(location, text.encode('utf-8'), atomic=atomic)


def write_json(location: epath.PathLike, value, **dump_kwargs) -> None:
  """`write_text` of `value` as JSON (`json.dump`'s keyword arguments)."""
  out = io.StringIO()
  json.dump(value, out, **dump_kwargs)
  write_text(location, out.getvalue())


def copy_dir(local_dir: str, location: epath.PathLike) -> None:
  """Copies the files under the local directory `local_dir` to `location` (process 0 only), for
  writers that need a real directory (the profiler): they write locally, then this copies."""
  if not distributed.is_main():
    return
  target = path(location)
  for root, _, files in os.walk(local_dir):
    into = target.joinpath(os.path.relpath(root, local_dir))
    into.mkdir(parents=True, exist_ok=True)
    for name in files:
      with open(os.path.join(root, name), 'rb') as f:  # Our own local temporary files.
        into.joinpath(name).write_bytes(f.read())
