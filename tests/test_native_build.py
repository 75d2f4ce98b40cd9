"""spsjax installs where the native kernels do not build, and then runs on XLA's ops.

A copy of the package's sources is installed by pip with a C++ compiler that always fails (this
interpreter, its setuptools and jaxlib, no network): the install succeeds without `_kernels*.so`,
says why in one line, and the installed spsjax, imported in a fresh process, reports no native
library and samples on the XLA path. The same copy built in place (what `pip install -e .` does)
with a failing compiler, or none, leaves no library behind either.
"""

import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests import xla_env

REPO = pathlib.Path(__file__).resolve().parent.parent
BUILD_FAILED = "spsjax: the native CPU kernels did not build"

# Imports the installed spsjax and samples a few rows both ways: the native kernel asked for and
# not built, and XLA's ops.
_SCRIPT = textwrap.dedent('''
    import json
    import jax
    import numpy as np
    import spsjax
    from spsjax import native
    from spsjax.sampling import processors

    keys = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(jax.random.key(1), (3, 50))
    config = processors.SamplingConfig(temperature=0.8, top_k=10, top_p=0.9)
    asked = processors.probabilities_and_sample(keys, logits, config, native_kernel=True)
    xla = processors.probabilities_and_sample(keys, logits, config, native_kernel=False)
    print('RESULT', json.dumps({
        'file': spsjax.__file__,
        'available': native.available(),
        'same': all(np.array_equal(a, b) for a, b in zip(asked, xla)),
        'tokens': np.asarray(asked[1]).tolist(),
    }))
''')


def _sources(tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of what pip builds from (setup.py, pyproject.toml, spsjax/), without built files."""
  src = tmp_path / 'src'
  src.mkdir()
  for name in ('setup.py', 'pyproject.toml'):
    shutil.copy(REPO / name, src / name)
  shutil.copytree(REPO / 'spsjax', src / 'spsjax',
                  ignore=shutil.ignore_patterns('*.so', '__pycache__'))
  return src


def _failing_compiler_env(tmp_path: pathlib.Path, missing: bool = False) -> dict[str, str]:
  """This environment with CC and CXX a compiler that prints an error and exits 1 (or, `missing`,
  a path where there is none)."""
  compiler = tmp_path / 'broken-c++'
  if not missing:
    compiler.write_text('#!/bin/sh\necho "broken-c++: this compiler always fails" >&2\nexit 1\n')
    compiler.chmod(0o755)
  return dict(os.environ, CC=str(compiler), CXX=str(compiler), LDSHARED=f'{compiler} -shared',
              PIP_DISABLE_PIP_VERSION_CHECK='1')


def _setuptools_builds_wheels() -> bool:
  """Whether this environment's setuptools has its own bdist_wheel (70.1 on), which pip needs to
  build a wheel without build isolation; the test extra asks for it."""
  major, minor = importlib.metadata.version('setuptools').split('.')[:2]
  return (int(major), int(minor)) >= (70, 1)


def _libraries(root: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob('_kernels*'))


def test_pip_install_with_a_failing_compiler_uses_xla(tmp_path):
  assert _setuptools_builds_wheels(), "setuptools < 70.1 here: pip install -e '.[test]' upgrades it"
  src, site = _sources(tmp_path), tmp_path / 'site'
  install = subprocess.run(
      [sys.executable, '-m', 'pip', 'install', '-v', '--no-build-isolation', '--no-deps',
       '--no-index', '--no-cache-dir', '--target', str(site), str(src)],
      capture_output=True, text=True, env=_failing_compiler_env(tmp_path), timeout=300,
      check=False)
  log = install.stdout + install.stderr
  assert install.returncode == 0, log[-3000:]
  assert 'broken-c++: this compiler always fails' in log  # The build did try to compile.
  assert sum(BUILD_FAILED in line for line in log.splitlines()) == 1, log[-3000:]
  assert (site / 'spsjax' / 'native' / 'library.py').is_file()
  assert _libraries(site) == []

  # Only the installed copy on the path: not this checkout, whose library may be built.
  env = xla_env.subprocess_env(PYTHONPATH=str(site))
  run = subprocess.run([sys.executable, '-c', _SCRIPT], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120, check=False)
  lines = [l for l in run.stdout.splitlines() if l.startswith('RESULT ')]
  assert run.returncode == 0 and lines, run.stderr[-3000:]
  out = json.loads(lines[-1][len('RESULT '):])
  assert out['file'].startswith(str(site))
  assert out['available'] is False and out['same'] is True
  assert len(out['tokens']) == 3
  # library.py's one warning at load.
  assert 'no kernel library built for this Python' in run.stderr


@pytest.mark.parametrize('missing', [False, True], ids=['failing', 'missing'])
def test_build_in_place_without_a_working_compiler(tmp_path, missing):
  src = _sources(tmp_path)
  build = subprocess.run([sys.executable, 'setup.py', 'build_ext', '--inplace'], cwd=src,
                         capture_output=True, text=True,
                         env=_failing_compiler_env(tmp_path, missing), timeout=120, check=False)
  log = build.stdout + build.stderr
  assert build.returncode == 0, log[-3000:]
  assert BUILD_FAILED in log
  assert _libraries(src) == []


def test_the_built_library_speaks_this_jaxlibs_ffi_api():
  from spsjax.native import library  # pylint: disable=g-import-not-at-top
  built, running = library._library_ffi_api(library.load()), library.runtime_ffi_api()
  assert built is not None and running is not None, (built, running)
  assert library.ffi_api_mismatch(built, running) is None, (built, running)


def test_a_library_compiled_for_a_newer_ffi_api_is_left_for_xla(tmp_path, monkeypatch, caplog):
  """pip's build isolation compiles the kernels against the newest jaxlib's headers; under an
  older jaxlib, XLA would refuse the handlers when it compiles the first program that calls one
  (jaxlib 0.11.2 against 0.12's: "handler's API version (0.5) is incompatible with the framework's
  API version (0.4)"). The library is then not loaded, with a warning saying how to rebuild."""
  from spsjax.native import library  # pylint: disable=g-import-not-at-top
  header = tmp_path / 'c_api.h'
  header.write_text('// ...\n#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 2\n')
  assert library.runtime_ffi_api(str(header)) == (0, 2)
  assert library.runtime_ffi_api(str(tmp_path / 'missing.h')) is None
  assert library.ffi_api_mismatch((0, 5), (0, 4)) and library.ffi_api_mismatch((1, 0), (0, 9))
  assert library.ffi_api_mismatch((0, 4), (1, 0))
  for built, running in [((0, 3), (0, 3)), ((0, 3), (0, 5)), (None, (0, 3)), ((0, 3), None)]:
    assert library.ffi_api_mismatch(built, running) is None, (built, running)
  monkeypatch.setattr(library, 'runtime_ffi_api', lambda: (0, 0))
  with caplog.at_level('WARNING'):
    assert library.load.__wrapped__() is None  # A fresh load: the cached one stays as it is.
  assert 'XLA ops are used instead' in caplog.text and '--no-build-isolation' in caplog.text
  assert library.load() is not None
