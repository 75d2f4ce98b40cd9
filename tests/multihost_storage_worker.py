"""One process of `test_multihost_storage.py`: one writer, datasets built once, hashes compared.

  python tests/multihost_storage_worker.py COORDINATOR_ADDRESS PROCESS_ID OUT_DIR

Two processes (one CPU device each, gloo) on a fake gs:// bucket (`fake_gcs`, mapped onto
OUT_DIR/gcs) that records each process's writes:
- both call every writer of results (`storage.write_text` / `write_json`, the sweep's CSV and
  figure, a profiler trace, `Tokenizer.save`) and `experiment.family_tokenizer`;
- both load a dataset from one shared data directory, then from a directory of their own each
  (as hosts with local disks; the host names are faked apart), where process 1 builds HumanEval
  with one prompt changed.
Each writes what it saw (its writes to the bucket, the datasets it built, the errors it got) to
OUT_DIR/observed_<PROCESS_ID>.json.
"""

import json
import os
import socket
import sys
import sysconfig
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top,wrong-import-position

from spsjax import distributed, storage  # pylint: disable=wrong-import-position
from spsjax.bench import sweep, trace  # pylint: disable=wrong-import-position
from spsjax.data import datasets, humaneval  # pylint: disable=wrong-import-position
from spsjax.train import experiment  # pylint: disable=wrong-import-position
from tests import fake_gcs  # pylint: disable=wrong-import-position

BUCKET = 'gs://spsjax-multihost'
POINT = sweep.Point(label='k=2', k=2, draft='draft', temperature=0.8, mean_seconds=0.2,
                    std_seconds=0.01, tokens_per_loop=2.0, loop_seconds=0.05,
                    acceptance_rate=0.5, alpha=0.6, ars_seconds=0.3)


def _stdlib_json_sources() -> list[str]:
  """Text for a small tokenizer: the sources of the stdlib's json package."""
  folder = os.path.join(sysconfig.get_paths()['stdlib'], 'json')
  texts = []
  for name in sorted(os.listdir(folder)):
    if name.endswith('.py'):
      with open(os.path.join(folder, name), encoding='utf-8') as f:
        texts.append(f.read())
  return texts


def write_results(process_id: int) -> dict:
  """Every results writer, called by both processes; what each saw."""
  results = f'{BUCKET}/results'
  storage.write_text(f'{results}/table.md', f'written by process {process_id}\n')
  storage.write_json(f'{results}/table.json', dict(process=process_id))
  sweep.write_csv([POINT], f'{results}/points.csv')
  sweep.plot([POINT], f'{results}/figure1.png', 'one point', 'k')
  _, xplane, _ = trace.record(lambda: jnp.arange(8.0) * 2, f'{results}/trace')
  trained = []

  def texts():
    trained.append(process_id)
    return _stdlib_json_sources()

  tok = experiment.family_tokenizer(f'{BUCKET}/family/tokenizer.model', texts, vocab_size=512)
  distributed.check_same('tokenizer', tok.to_bytes())  # All read the one process 0 wrote.
  tok.save(f'{BUCKET}/export/spsjax_tokenizer.model')
  return dict(trained_tokenizer=bool(trained), xplane=xplane)


def build_counted(name: str, data_dir: str) -> dict:
  """Loads `name`'s test split; how many times this process built it, or the error it got."""
  built = []
  original = tfds.core.DatasetBuilder.download_and_prepare

  def counted(self, *args, **kwargs):
    built.append(self.name)
    return original(self, *args, **kwargs)

  with mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare', counted):
    try:
      records = datasets.load_records(name, 'test', data_dir)
      return dict(builds=len(built), records=len(records), error=None)
    except ValueError as e:
      return dict(builds=len(built), records=None, error=str(e))


def main(address: str, process_id: int, out_dir: str) -> None:
  distributed.initialize(distributed.Options(address, num_processes=2, process_id=process_id))
  assert jax.process_count() == 2
  observed = {}
  with fake_gcs.mapped(os.path.join(out_dir, 'gcs')) as bucket:
    observed.update(write_results(process_id))
    observed['shared_dir'] = build_counted('humaneval', os.path.join(out_dir, 'data'))
    # Hosts with a data directory each; process 1's HumanEval has another first prompt.
    distributed.host_leader.cache_clear()
    problems = humaneval.read_problems()
    if process_id == 1:
      problems[0] = dict(problems[0], prompt='def changed():\n')
    with mock.patch.object(socket, 'gethostname', lambda: f'host-{process_id}'), \
        mock.patch.object(humaneval, 'read_problems', lambda path=None: problems):
      observed['own_dirs'] = build_counted('humaneval',
                                           os.path.join(out_dir, f'data_{process_id}'))
    observed['bucket_writes'] = bucket.writes
  with open(os.path.join(out_dir, f'observed_{process_id}.json'), 'w', encoding='utf-8') as f:
    json.dump(observed, f)  # The test's own report, local.
  distributed.barrier('worker done')
  distributed.print0('worker done')


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
