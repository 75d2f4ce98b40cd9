"""A fake `gs://` for tests: etils.epath's backends mapped onto a local directory.

Inside `mapped(local_root)`, `gs://bucket/x` is `<local_root>/bucket/x` to everything that goes
through epath, orbax's checkpoints included, while `open` and `os.path` given the same string see
the local relative path `gs:/bucket/x`: a read fails, and a write lands under the working
directory, where `stray_writes` finds it. A test whose locations are gs:// therefore fails where any
code reaches them without epath.

What is real and what is replaced. Real: epath's API and orbax's own gs:// code (no renames; a step
is complete once its `commit_success.txt` is written). Replaced, since they would reach the
network: epath's gs:// backend (gcsfs) by the local directory; orbax's probe for a
hierarchical-namespace bucket (a GCS API call), which answers False; tensorstore's `gcs` kvstore
(orbax's arrays), by tensorstore's `file` driver on the mapped directory. A real bucket is never
reached. The two orbax functions are private (`orbax.checkpoint._src.path.gcs_utils`): should an
orbax release rename them, patching fails loudly here rather than reaching for the network.

Every write-like call on a gs:// path (open for writing, makedirs, rename, remove, ...) is
recorded in `Mapped.writes`, so a test can also see which process wrote what.

A binary runs under it with `python tests/fake_gcs.py LOCAL_ROOT experiments/x.py --flags...`.
"""

import contextlib
import dataclasses
import os
import runpy
import sys
from collections.abc import Iterator
from unittest import mock

from etils.epath import testing as epath_testing

PREFIX = 'gs://'
_WRITES = ('makedirs', 'mkdir', 'remove', 'rename', 'replace', 'rmtree', 'copy')
_TWO_PATHS = ('rename', 'replace', 'copy')  # Calls whose second argument is a path too.


@dataclasses.dataclass
class Mapped:
  """Where gs:// lives while `mapped` is active, and the write-like calls made there."""
  local_root: str
  writes: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  def local(self, location) -> str:
    """The local path of a gs:// location (other paths unchanged)."""
    location = os.fspath(location)
    if location.startswith(PREFIX):
      return os.path.join(self.local_root, location[len(PREFIX):])
    return location

  def remote(self, local: str) -> str:
    """The gs:// location of a local path under `local_root` (other paths unchanged)."""
    local = os.fspath(local)
    if local == self.local_root or local.startswith(self.local_root + os.sep):
      return PREFIX + os.path.relpath(local, self.local_root)
    return local


def _backend_functions(m: Mapped) -> dict:
  """epath backend functions (`epath.testing.mock_epath`'s signature: the original first) that
  read and write gs:// paths under `m.local_root`."""

  def plain(name):
    def call(original, path, *args, **kwargs):
      mode = args[0] if name == 'open' else ''
      if os.fspath(path).startswith(PREFIX) and (name in _WRITES or set(mode) & set('wax+')):
        m.writes.append((name, os.fspath(path)))
      if name in _TWO_PATHS:
        args = (m.local(args[0]),) + args[1:]
      return original(m.local(path), *args, **kwargs)
    return call

  def glob(original, pattern):
    return [m.remote(p) for p in original(m.local(pattern))]

  def walk(original, top, **kwargs):
    for root, dirs, files in original(m.local(top), **kwargs):
      yield m.remote(root), dirs, files

  names = ('open', 'exists', 'isdir', 'listdir', 'makedirs', 'mkdir', 'remove', 'rename',
           'replace', 'rmtree', 'stat', 'copy')
  return dict({name: plain(name) for name in names}, glob=glob, walk=walk)


@contextlib.contextmanager
def mapped(local_root: str) -> Iterator[Mapped]:
  """gs:// mapped onto `local_root` (module docstring) while the context is active."""
  from orbax.checkpoint._src.path import gcs_utils  # pylint: disable=g-import-not-at-top
  m = Mapped(os.path.abspath(local_root))
  os.makedirs(m.local_root, exist_ok=True)
  with contextlib.ExitStack() as stack:
    # TensorFlow's gfile, where TensorFlow is installed, would take gs:// over from the mock.
    stack.enter_context(mock.patch.dict(os.environ, EPATH_USE_TF='false'))
    stack.enter_context(epath_testing.mock_epath(**_backend_functions(m)))
    stack.enter_context(mock.patch.object(gcs_utils, 'is_hierarchical_namespace_enabled',
                                          lambda path: False))
    stack.enter_context(mock.patch.object(
        gcs_utils, 'get_kvstore_for_gcs',
        lambda path: {'driver': 'file', 'path': m.local(path)}))
    yield m


def stray_writes(directory: str) -> list[str]:
  """What code that took a gs:// location for a local path wrote under `directory` (the working
  directory it ran in): everything under `directory/gs:`."""
  stray = os.path.join(directory, 'gs:')
  return [os.path.join(root, f) for root, _, files in os.walk(stray) for f in files] + (
      [stray] if os.path.exists(stray) else [])


def main(argv: list[str]) -> None:
  """Runs the script `argv[2]` as `__main__` with the arguments after it, under
  `mapped(argv[1])`."""
  local_root, script = argv[1], argv[2]
  sys.argv = [script] + argv[3:]
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with mapped(local_root):
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
  main(sys.argv)
