"""docstrings: exact input text up to the opening quotes, one-line references, test split only."""

import textwrap

from spsjax.data import datasets, docstrings, python_code
from tests import data_helpers

SOURCE = textwrap.dedent('''\
    import functools

    @functools.cache
    @staticmethod
    def decorated(a,
                  b=1) -> int:
        """Adds things.

        More text.
        """
        def inner():
            r"""  Raw inner.  """

    class Box:
        def method(self):  # café
            """
            Summary after a blank line.
            """
        async def single(self):
            \'\'\'Single quotes are not taken.\'\'\'
        def empty(self):
            """   """
        def no_doc(self):
            return 1
    def one_line(): """Same line."""
    ''')


def test_extract_from_a_known_source():
  examples = docstrings.extract(SOURCE, 'm.py')
  assert [e['name'] for e in examples] == [
      'decorated', 'decorated.<locals>.inner', 'Box.method', 'one_line']
  assert examples[0]['input'] == (
      '@functools.cache\n@staticmethod\ndef decorated(a,\n              b=1) -> int:\n    """')
  assert examples[0]['reference'] == 'Adds things.'
  assert examples[1]['input'] == '    def inner():\n        r"""'
  assert examples[1]['reference'] == 'Raw inner.'
  assert examples[2]['input'] == '    def method(self):  # café\n        """'
  assert examples[2]['reference'] == 'Summary after a blank line.'
  assert examples[3]['input'] == 'def one_line(): """'
  assert all(e['path'] == 'm.py' for e in examples)


def test_extract_keeps_crlf_and_skips_files_that_do_not_parse():
  crlf = 'def f():\r\n    """Doc."""\r\n'
  assert docstrings.extract(crlf, 'c.py')[0]['input'] == 'def f():\r\n    """'
  assert docstrings.extract('def f(:\n  """x"""\n', 'bad.py') == []


def test_built_examples_are_well_formed():
  data_dir = data_helpers.data_dir()
  records = datasets.load_records('docstrings', 'test', data_dir, data_helpers.SUBSET)
  code = datasets.load_records('python_code', 'test', data_dir, data_helpers.SUBSET)
  files = {code[i]['path']: code[i]['text'] for i in range(len(code))}
  assert len(records) >= 10
  for i in range(len(records)):
    record = records[i]
    assert set(record) == {'input', 'reference', 'path', 'name'}
    assert python_code.split_of(record['path']) == 'test'
    assert record['input'] in files[record['path']]
    assert record['input'].endswith('"""') and 'def ' in record['input']
    assert f"def {record['name'].split('.')[-1]}(" in record['input']
    assert record['reference'] and record['reference'] == record['reference'].strip()
    assert '\n' not in record['reference']
  assert datasets.load('docstrings', 'test', data_dir, config=data_helpers.SUBSET)[0] == \
      records[0]['input']
