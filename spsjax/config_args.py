"""Config-file arguments in the big_vision style: `--config=configs/x.py:k=4,method=sps,runlocal`.

`parse_arg(arg, **defaults)` turns the text after the colon into a ConfigDict of typed values: each
key must be one of `defaults` and its value is cast to the default's type; a bare key sets a bool.
The measuring configs default to the documented pair, `REFERENCE_ROOT`'s target and its best draft
`REFERENCE_DRAFT` (what `make train-reference` trains), and to a family's best draft
(`best_draft`) when only its root is named; `default_pair_note` is the line a binary prints when
it runs on the reference pair because nothing else was named.
"""

REFERENCE_ROOT = 'checkpoints/reference'
REFERENCE_DRAFT = 'draft_trunc_distill_3000'
# Each family's best draft, by the family directory's name (`make train-<family>` trains it).
BEST_DRAFTS = {'reference': REFERENCE_DRAFT, 'demo': 'draft_wide_distill', 'tiny': 'draft_wide'}


def best_draft(root: str) -> str:
  """The draft the measuring configs use with `root` when none is named: the family's best
  (`BEST_DRAFTS`, by the directory's name), `draft_wide` for a family of another name."""
  name = root.rstrip('/').rsplit('/', 1)[-1].removesuffix('_runlocal')
  return BEST_DRAFTS.get(name, 'draft_wide')


def given(arg: str | None) -> set[str]:
  """The keys `arg` names."""
  return {item.partition('=')[0].strip() for item in filter(None, (arg or '').split(','))}


def default_pair_note(arg: str | None, keys: tuple[str, ...]) -> str:
  """'' if `arg` names any of `keys` (the model choices), else the line saying which pair runs."""
  if given(arg) & set(keys):
    return ''
  return (f'Defaults: the reference target ({REFERENCE_ROOT}/target) and its best draft '
          f'({REFERENCE_DRAFT}), trained by `make train-reference`; root= and draft= name others.')

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


def sequence_bias(text: str) -> list[list]:
  """`SamplingConfig.sequence_bias` from a config argument: pairs joined by '+', each token ids
  joined by '_', ':' and a bias ('-inf' bans), e.g. '5_9:-inf+7:2.5' ('': none)."""
  pairs = []
  for item in filter(None, text.split('+')):
    ids, colon, bias = item.partition(':')
    try:
      tokens = [int(t) for t in ids.split('_')]
      value = float(bias)
    except ValueError:
      tokens = value = None
    if not colon or tokens is None or min(tokens) < 0 or value != value:
      raise ValueError(f'sequence_bias={text!r}: want pairs joined by +, each token ids >= 0 '
                       f'joined by _, a colon and a bias (e.g. 5_9:-inf+7:2.5); got {item!r}.')
    pairs.append([tokens, value])
  return pairs


def lookahead(a) -> int | str:
  """The k of a sampling config's parsed arguments `a` (k, k_max, drafter, alternatives,
  branching, tree_nodes): an integer >= 1 or 'auto'; ValueError for a bad k or k_max, for k=auto
  with a tree of fixed depth (`branching`: its cost model takes k from 1 to k_max; alternatives
  beside a chain of any k are fine) or a dynamic tree (`tree_nodes`), and for a tree drafter's k
  other than its depth."""
  if a.k != 'auto' and not (a.k.isdigit() and int(a.k) >= 1):
    raise ValueError(f'k must be an integer >= 1 or auto, got {a.k!r}.')
  if a.k_max < 1:
    raise ValueError(f'k_max must be >= 1, got {a.k_max}.')
  if a.k == 'auto' and (a.branching or a.drafter == 'tree' or a.tree_nodes):
    raise ValueError('k=auto chooses k from 1 to k_max (or ArS); a tree drafter\'s depth is fixed '
                     'by its branching, a dynamic tree\'s bound with its nodes: pass k, or use '
                     'alternatives=.')
  depth = len(a.branching.split('+'))
  if a.branching and a.k != str(depth):
    raise ValueError(f'branching={a.branching} drafts trees of depth {depth}: pass that as k '
                     f'(got k={a.k}).')
  return a.k if a.k == 'auto' else int(a.k)
