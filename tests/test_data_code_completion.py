"""code_completion: held-out functions cut at a statement near their middle, references verbatim."""

import hashlib
import textwrap

from spsjax.data import code_completion, datasets, python_code
from tests import data_helpers

SOURCE = textwrap.dedent('''\
    import functools

    @functools.cache
    def decorated(a,
                  b=1):
        """Docstring lines are
        part of the prompt, not code lines."""
        x = (a +
             b)
        y = x * 2
        if y:
            return y
        return 0

    class Box:
        def method(self):
            first = 1
            second = 2

            third = 3
            return first + second + third

    def too_short():
        a = 1
        return a

    def only_docstring():
        """Nothing else."""
    ''')


def test_extract_from_a_known_source():
  examples = code_completion.extract(SOURCE, 'm.py')
  assert [e['name'] for e in examples] == ['decorated', 'Box.method']
  decorated, method = examples
  # 5 code lines (8 to 14, the continuation line 9 included): the middle is line 11, which starts
  # a statement.
  assert decorated['line'] == 11
  assert decorated['input'] == ('@functools.cache\ndef decorated(a,\n              b=1):\n'
                                '    """Docstring lines are\n    part of the prompt, not code '
                                'lines."""\n    x = (a +\n         b)\n    y = x * 2\n')
  assert decorated['reference'] == '    if y:\n        return y\n    return 0'
  # Code lines 17 to 21 (a blank line among them): middle line 19 is blank, so the cut is the next
  # statement, line 20; the reference stops at the function's end.
  assert method['line'] == 20
  assert method['input'].endswith('        second = 2\n\n')
  assert method['reference'] == '        third = 3\n        return first + second + third'
  assert all(e['input'] + e['reference'] in SOURCE for e in examples)
  assert code_completion.extract('def f(:\n  pass\n', 'bad.py') == []


def test_long_prompts_are_skipped_and_crlf_kept():
  body = ''.join(f'    v{i} = {i}\n' for i in range(2 * code_completion.MAX_PROMPT_LINES))
  assert code_completion.extract('def long():\n' + body, 'l.py') == []
  crlf = 'def f():\r\n    a = 1\r\n    b = 2\r\n    c = 3\r\n    return a\r\n'
  (example,) = code_completion.extract(crlf, 'c.py')
  assert example['input'] == 'def f():\r\n    a = 1\r\n    b = 2\r\n'
  assert example['reference'] == '    c = 3\r\n    return a'


def test_built_examples_are_well_formed_and_in_hash_order():
  data_dir = data_helpers.data_dir()
  records = datasets.load_records('code_completion', 'test', data_dir, data_helpers.SUBSET)
  code = datasets.load_records('python_code', 'test', data_dir, data_helpers.SUBSET)
  files = {code[i]['path']: code[i]['text'] for i in range(len(code))}
  assert len(records) >= 30  # The standard library's: 135 examples on Python 3.11, 47 on 3.13.
  keys = []
  for i in range(len(records)):
    record = records[i]
    assert set(record) == {'input', 'reference', 'path', 'name', 'line'}
    assert python_code.split_of(record['path']) == 'test'
    assert record['input'] + record['reference'] in files[record['path']]
    assert record['input'].endswith('\n') and record['reference'].split('\n')[0].strip()
    assert record['input'].count('\n') <= code_completion.MAX_PROMPT_LINES
    assert len(record['reference'].splitlines()) <= code_completion.REFERENCE_LINES
    keys.append(hashlib.sha256(
        f'{record["path"]}:{record["line"]}:{record["name"]}'.encode()).digest())
  assert keys == sorted(keys) and len(set(keys)) == len(keys)
  # A prefix spreads over files (3.13's standard library: 2 in the first 10, 3.11's: more).
  assert len({records[i]['path'] for i in range(10)}) >= 2
