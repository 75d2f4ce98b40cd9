"""Config-file arguments in the big_vision style: `--config=configs/x.py:k=4,method=sps,runlocal`.

`parse_arg(arg, **defaults)` turns the text after the colon into a ConfigDict of typed values: each
key must be one of `defaults` and its value is cast to the default's type; a bare key sets a bool.
"""

import ml_collections


def _cast(key, text, default):
  if isinstance(default, bool):
    if text.lower() in ('1', 'true', 'yes', ''):
      return True
    if text.lower() in ('0', 'false', 'no'):
      return False
    raise ValueError(f'Config argument {key}={text!r} is not a boolean.')
  try:
    return type(default)(text)
  except ValueError as e:
    raise ValueError(f'Config argument {key}={text!r}: expected {type(default).__name__}.') from e


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  values = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, _, text = item.partition('=')
    key = key.strip()
    if key not in defaults:
      raise ValueError(f'Unknown config argument {key!r}; known: {sorted(defaults)}.')
    values[key] = _cast(key, text.strip(), defaults[key])
  return ml_collections.ConfigDict(values)
