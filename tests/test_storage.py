"""Every location a user names works as a gs:// URI, and only through epath (`spsjax.storage`).

A tiny family is trained into a fake bucket (`tests/fake_gcs.py`: epath mapped onto a local
directory that `open` and `os.path` cannot see under the gs:// name): its tokenizer, a target and
a draft distilled from it, checkpoints and all; then loaded back, sampled from by the sampling
binary, and exported as a Hugging Face directory by its binary and read back. The Table 1 binary
benchmarks a pair of Hugging Face directories in the bucket (the GQA and tied-MQA checkpoints of
tests/fixtures/hf: also the binaries' Hugging Face test, `test_experiments.py`) and writes its
table and traces into the bucket. Code that reached a gs://
location with `open` or `os.path` would fail to read it, or write under the working directory as
`gs:/...`, which the test checks stays empty. The sweep's writers (CSV, Markdown, figure) run on
the fake bucket in `tests/test_multihost_storage.py`. TFDS data stays local: array_record cannot
use a URI (`data.datasets`), which the last test checks is said before anything is built.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

from etils import epath
import jax
import numpy as np
import pytest

from spsjax.data import datasets, python_code
from spsjax.train import experiment, load
from tests import data_helpers, fake_gcs, train_helpers

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIGS = os.path.join(_REPO, 'configs')
_ROOT = 'gs://spsjax-test/family'


def test_paths_keep_uris_and_make_local_paths_absolute(tmp_path, monkeypatch):
  from spsjax import storage  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)
  assert os.fspath(storage.path('gs://b/x/../y')) == 'gs://b/x/../y'
  assert os.fspath(storage.path('rel/dir')) == os.path.join(str(tmp_path), 'rel', 'dir')
  assert os.fspath(storage.path('~/x')) == os.path.join(os.path.expanduser('~'), 'x')
  assert storage.join('gs://b/root', 'target', 'x') == 'gs://b/root/target/x'
  assert storage.join('rel', 'target') == 'rel/target'


@pytest.fixture(name='bucket')
def fixture_bucket(tmp_path, monkeypatch):
  """gs:// mapped onto tmp_path/gcs, the test running in tmp_path/cwd; nothing may land there."""
  data_helpers.data_dir()  # Built before the fake starts: the data is local, by design.
  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  with fake_gcs.mapped(str(tmp_path / 'gcs')) as m:
    yield m
  assert fake_gcs.stray_writes(str(cwd)) == []


def _run_binary(bucket, script, *args):
  """A binary under the fake gs:// (a subprocess: its own JAX, flags and working directory)."""
  run = subprocess.run(
      [sys.executable, os.path.join(_REPO, 'tests', 'fake_gcs.py'), bucket.local_root,
       os.path.join(_REPO, script), *args],
      cwd=os.getcwd(), capture_output=True, text=True, timeout=300, check=False,
      env=dict(data_helpers.subprocess_env(), PYTHONPATH=_REPO))
  assert run.returncode == 0, run.stderr[-3000:]
  assert fake_gcs.stray_writes(os.getcwd()) == [], run.stderr[-3000:]
  return run


def _experiment(name: str, **train) -> experiment.Experiment:
  steps = 2
  config = dataclasses.replace(
      train_helpers.CONFIG, optimizer=dataclasses.replace(train_helpers.CONFIG.optimizer,
                                                          warmup_steps=1, total_steps=steps),
      log_every=1, eval_every=steps, eval_batches=1, save_every=steps, **train)
  data = experiment.DataConfig(config=python_code.SMALL.name, data_dir=data_helpers.data_dir())
  return experiment.Experiment(train=config, data=data, root=_ROOT, name=name,
                               teacher='target' if train else None)


def test_a_family_lives_in_a_bucket(bucket):
  experiment.run(_experiment('target'))
  experiment.run(_experiment('draft_wide', distill_weight=0.5))  # Reads the teacher from there.
  local = bucket.local(_ROOT)
  assert sorted(os.listdir(local)) == ['draft_wide', 'target', 'tokenizer.model']
  # A step of orbax's gs:// way: complete once its commit file is written (no rename).
  assert os.path.exists(os.path.join(local, 'target', '2', 'commit_success.txt'))
  assert all(path.startswith(_ROOT) for _, path in bucket.writes)

  _, drafts, tok, meta = load.load_family(_ROOT, 'target', ['draft_wide'])
  assert tok.to_bytes() == epath.Path(f'{_ROOT}/tokenizer.model').read_bytes()
  assert meta['data']['config'] == python_code.SMALL.name and set(drafts) == {'draft_wide'}

  run = _run_binary(bucket, 'experiments/sample.py',
                    f'--config={_CONFIGS}/sample.py:root={_ROOT},method=sps,k=2,batch=1,'
                    'max_new_tokens=6', '--config.repeats=1')
  assert f'Trained target {_ROOT}/target' in run.stdout and 'acceptance rate' in run.stdout

  exported = 'gs://spsjax-test/exported'
  _run_binary(bucket, 'experiments/export_hf.py',
              f'--config={_CONFIGS}/export_hf.py:checkpoint={_ROOT}/target,out={exported}')
  hf_model, hf_tok, hf_meta = load.load_model(exported)
  assert load.is_hf(exported) and hf_meta['hf']['architectures'] == ['LlamaForCausalLM']
  assert hf_tok.to_bytes() == tok.to_bytes()
  jax.tree.map(np.testing.assert_array_equal, hf_model.params,
               load.load_model(f'{_ROOT}/target')[0].params)

  # Table 1 of two Hugging Face checkpoints in the bucket, as tests/test_experiments.py's
  # test_binaries_take_hugging_face_directories had it run from local directories.
  hf = 'gs://spsjax-test/hf'
  target, draft = (f'{hf}/{name}' for name in ('llama_gqa', 'llama_tied_mqa'))
  for location in (target, draft):
    shutil.copytree(os.path.join(_REPO, 'tests', 'fixtures', 'hf', location.split('/')[-1]),
                    bucket.local(location))
  results = 'gs://spsjax-test/results'
  _run_binary(bucket, 'experiments/speedup_table.py',
              f'--config={_CONFIGS}/speedup.py:hf_target={target},hf_draft={draft},humaneval=2,'
              f'docstrings=2,code=2,batches=1,results={results}/table',
              '--config.tasks.humaneval.max_new_tokens=8',
              '--config.tasks.docstrings.max_new_tokens=8',
              '--config.tasks.code_completion.max_new_tokens=8', '--config.cost_repeats=2')
  table_md = epath.Path(f'{results}/table/table.md').read_text()
  assert table_md.startswith('# Table 1')
  assert f'ArS vs SpS, {target} and draft {draft}' in table_md
  assert '| humaneval | greedy | 1 |' in table_md
  assert '| code_completion | nucleus | 1 | SpS | chrF ' in table_md and 'next-line EM' in table_md
  table = json.loads(epath.Path(f'{results}/table/table.json').read_text())
  assert len(table['rows']) == 6
  assert [r['task'] for r in table['rows'][::2]] == ['humaneval', 'docstrings', 'code_completion']
  assert all(set(r['parity']) >= {'log p'} and len(r['SpS']['logprobs']) == 2
             for r in table['rows'][4:])  # A log p for each code prompt.
  traces = list(epath.Path(f'{results}/table/traces').iterdir())
  assert len(traces) == 6 and all(
      list(t.glob('plugins/profile/*/*.xplane.pb')) for t in traces), traces
  assert {r['loop_profile']['trace_dir'].split('/plugins/')[0] for r in table['rows']} == {
      os.fspath(t) for t in traces}



def test_a_uri_data_dir_is_refused_before_anything_is_built(bucket):
  with pytest.raises(ValueError, match='gs://spsjax-test/data is a URI: .*array_record'):
    datasets.load('humaneval', 'test', 'gs://spsjax-test/data')
  assert not bucket.writes
