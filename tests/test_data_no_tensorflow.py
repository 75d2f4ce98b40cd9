"""Building and reading every dataset never imports TensorFlow.

A subprocess installs an import hook under which TensorFlow looks installed but any import of it
fails and is recorded, then builds and reads the built-in datasets and a toy TFDS dataset. The toy
is then read back by name in this process, where its builder class was never defined: the path of
"any TFDS dataset prepared in data_dir" (as 'xsum' would be on a machine that has it).
"""

import json
import subprocess
import sys
import textwrap

from spsjax.data import datasets
from tests import xla_env

_SCRIPT = textwrap.dedent('''
    import importlib.abc, importlib.machinery, json, sys

    class Poison(importlib.abc.MetaPathFinder, importlib.abc.Loader):
      attempts = []
      def find_spec(self, name, path=None, target=None):
        if name == 'tensorflow' or name.startswith('tensorflow.'):
          return importlib.machinery.ModuleSpec(name, self)
      def create_module(self, spec):
        self.attempts.append(spec.name)
        raise ImportError(f'{spec.name} is poisoned in this test')
      def exec_module(self, module):
        raise ImportError('unreachable')

    sys.meta_path.insert(0, Poison())
    data_dir = sys.argv[1]

    import tensorflow_datasets as tfds
    from spsjax.data import datasets, python_code

    subset = python_code.PythonCodeConfig(name='json_email', prefixes=('json/', 'email/'))
    out = {
        'python_code': len(datasets.load('python_code', 'train', data_dir, config=subset)),
        'first_path': datasets.load_records('python_code', 'train', data_dir, subset)[0]['path'],
        'humaneval': len(datasets.load('humaneval', 'test', data_dir)),
        'docstrings': len(datasets.load('docstrings', 'test', data_dir, config=subset)),
    }

    class ToyNews(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version('1.0.0')
      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {'document': tfds.features.Text(), 'summary': tfds.features.Text()}))
      def _split_generators(self, dl_manager):
        return {'train': self._generate_examples()}
      def _generate_examples(self):
        for i in range(10):
          yield i, {'document': f'news {i}', 'summary': f'{i}'}

    ToyNews(data_dir=data_dir, file_format='array_record').download_and_prepare()
    out['toy_news'] = sorted(datasets.load('toy_news', 'train', data_dir, 'document'))
    out['attempts'] = Poison.attempts
    out['tensorflow_modules'] = [m for m in sys.modules if m.split('.')[0] == 'tensorflow']
    print('RESULT', json.dumps(out))
''')


def test_build_and_read_without_tensorflow(tmp_path):
  run = subprocess.run([sys.executable, '-c', _SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, env=xla_env.subprocess_env(), timeout=120, check=False)
  lines = [l for l in run.stdout.splitlines() if l.startswith('RESULT ')]
  assert run.returncode == 0 and lines, run.stderr[-3000:]
  out = json.loads(lines[-1][len('RESULT '):])
  assert out['attempts'] == [] and out['tensorflow_modules'] == []
  assert out['python_code'] > 5 and out['first_path'].startswith(('email/', 'json/'))
  assert out['humaneval'] == 164 and out['docstrings'] > 0
  assert out['toy_news'] == [f'news {i}' for i in range(10)]
  # Here ToyNews was never defined: TFDS finds it as a dataset prepared in data_dir.
  assert sorted(datasets.load('toy_news', 'train', str(tmp_path), text_field='summary')) == [
      str(i) for i in range(10)]
