"""Figure 1 sweeps: `--config=configs/sweep.py:sweep=k` (the reference pair).

Arguments: root (family; default checkpoints/reference), sweep (k | draft | temperature | drafter
| drafter_k | lenience), draft (the draft model of every sweep but `draft`; default the family's
best, `spsjax.config_args.best_draft`), drafts (the draft sweep's checkpoints, '+'-separated;
default all three topologies), k (of the draft, temperature and lenience sweeps), prompts
(HumanEval prompts), batch (prompts per timed call, default 1; the first prompts // batch
batches), max_new_tokens (128 as in the paper), temperature (of every sweep but `temperature`),
seed, results, runlocal; ks and thresholds ('+'-separated) for the drafter
sweep: model, prompt lookup and hybrid drafters at each k, then dynamic k (a model draft that stops
below each confidence threshold) at the largest k, and the ragged ones (lookup, dynamic k) again
with `trim_score` (the target scores only the positions proposed). drafter_k: the draft model
and the head checkpoints named by feature (an EAGLE head), falcon (a Falcon head, 2 drafts a
pass), heads (parallel heads) and mlp (an MLP speculator) at each k of
ks (draft=none: the heads only), with a figure of tokens per loop against k, a line per
drafter. The k, drafter and drafter_k sweeps end with k = 'auto' points (`bench.auto_k`, up to
the largest k; auto=0: none), each calibrated on the first batch (cached on disk; recalibrate:
measured again). The lenience sweep is LOSSY below 1 and reports each point's total variation
from the target's law.
hf_target, hf_draft: Hugging Face checkpoint directories in place of root's target and draft (the
draft sweep then has that one draft).
The swept points are `points(sweep, ...)` below: a list of overrides, one per point.
"""

import os

import ml_collections

from spsjax.config_args import REFERENCE_ROOT, best_draft, default_pair_note, parse_arg

DRAFTS = ('draft_wide', 'draft_mid', 'draft_deep', 'draft_wide_distill')


SWEEPS = ('k', 'draft', 'temperature', 'drafter', 'drafter_k', 'lenience')
MODEL = dict(kind='model', max_ngram=3, min_ngram=1, stop_below=0.0)


def points(sweep: str, k: int, draft: str, temperature: float,
           drafts: tuple[str, ...] = DRAFTS, ks: tuple[int, ...] = (2, 4, 6),
           thresholds: tuple[float, ...] = (0.1, 0.2, 0.4),
           heads: tuple[tuple[str, str], ...] = (), auto: bool = True) -> list[dict]:
  point = lambda label, **kw: dict(dict(label=label, k=k, draft=draft, temperature=temperature,
                                        drafter=MODEL, lenience=1.0, trim_score=False,
                                        auto=False), **kw)
  if sweep == 'k':  # Then k = 'auto' up to the largest.
    return [point(str(i), k=i) for i in range(1, 9)] + (
        [point('auto', k=8, auto=True)] if auto else [])
  if sweep == 'draft':
    return [point(d, draft=d) for d in drafts]
  if sweep == 'temperature':
    return [point(str(t), temperature=t) for t in (0.0, 0.5, 0.8, 1.0)]
  if sweep == 'drafter':  # Drafter x k, then dynamic k's threshold at the largest k; the ragged
    # ones (lookup, dynamic k) also with the target scoring only the positions they proposed.
    kinds = [point(f'{kind} k={i}', k=i, drafter=dict(MODEL, kind=kind))
             for kind in ('model', 'lookup', 'hybrid') for i in ks]
    kinds += [point(f'dynamic {t} k={max(ks)}', k=max(ks), drafter=dict(MODEL, stop_below=t))
              for t in thresholds]
    ragged = [p for p in kinds if p['drafter']['kind'] == 'lookup' or p['drafter']['stop_below']]
    return kinds + [dict(p, label=p['label'] + ' trimmed', trim_score=True) for p in ragged] + (
        [point(f'{kind} auto', k=max(ks), drafter=dict(MODEL, kind=kind), auto=True)
         for kind in ('model', 'lookup', 'hybrid')] if auto else [])
  if sweep == 'drafter_k':  # The draft model (unless 'none') and each head checkpoint ((kind,
    # name)) at each k, then k = 'auto' up to the largest.
    pairs = ((('model', draft),) if draft != 'none' else ()) + heads
    return [point(f'{name} k={i}', k=i, draft=name, drafter=dict(MODEL, kind=kind))
            for kind, name in pairs for i in ks] + (
        [point(f'{name} auto', k=max(ks), draft=name, drafter=dict(MODEL, kind=kind), auto=True)
         for kind, name in pairs] if auto else [])
  if sweep == 'lenience':  # LOSSY below 1: each point reports its total variation from p.
    return [point(str(l), lenience=l) for l in (1.0, 0.8, 0.5, 0.3)]
  raise ValueError(f'sweep must be one of {list(SWEEPS)}, got {sweep!r}.')


def _values(name, text, kind, valid, what):
  """'+'-separated values of one kind, or a ValueError naming the argument."""
  try:
    values = tuple(kind(x) for x in str(text).split('+') if x)
  except ValueError:
    values = ()
  if not values or not all(valid(v) for v in values):
    raise ValueError(f'{name} must be \'+\'-separated {what}, got {text!r}.')
  return values


def get_config(arg=None):
  a = parse_arg(arg, root=REFERENCE_ROOT, sweep='k', draft='', k=4, prompts=16, batch=1,
                max_new_tokens=128, temperature=0.8, seed=0, results='', runlocal=False,
                drafts='+'.join(DRAFTS), data=1, model_axis=1, draft_weights='w8a8',
                ks='2+4+6', thresholds='0.1+0.2+0.4', hf_target='', hf_draft='', feature='',
                heads='', falcon='', mlp='', auto=True, recalibrate=False)
  drafts = (a.hf_draft,) if a.hf_draft else tuple(d for d in a.drafts.split('+') if d)
  ks = _values('ks', a.ks, int, lambda k: k >= 1, 'integers >= 1')
  thresholds = _values('thresholds', a.thresholds, float, lambda t: 0 < t <= 1,
                       'numbers in (0, 1]')
  if not drafts:
    raise ValueError('drafts names no checkpoint.')
  heads = tuple((kind, name) for kind, name in (
      ('feature', a.feature), ('falcon', a.falcon), ('heads', a.heads), ('mlp', a.mlp)) if name)
  if heads and a.sweep != 'drafter_k':
    raise ValueError(f'feature=, falcon=, heads= and mlp= name head checkpoints for '
                     f'sweep=drafter_k, not sweep={a.sweep}.')
  c = ml_collections.ConfigDict()
  c.note = default_pair_note(arg, ('root', 'draft', 'drafts', 'hf_target', 'hf_draft'))
  c.root = a.root
  c.target = a.hf_target or 'target'
  c.sweep = a.sweep
  c.draft_weights = a.draft_weights  # The drafts' packed weights (native CPU path).
  c.points = points(a.sweep, a.k, a.hf_draft or a.draft or best_draft(a.root), a.temperature,
                    drafts, ks, thresholds, heads, a.auto)
  if a.runlocal:
    c.points = c.points[:2]
  c.batch = a.batch  # Prompts per timed call.
  c.recalibrate = a.recalibrate  # auto points: measure the costs again.
  c.prompts = 2 * a.batch if a.runlocal else a.prompts
  if not 1 <= c.batch <= c.prompts:
    raise ValueError(f'batch must be in [1, prompts = {c.prompts}], got {c.batch}.')
  c.max_new_tokens = 16 if a.runlocal else a.max_new_tokens
  c.top_p = 0.95  # HumanEval's nucleus, as in the paper.
  c.seed = a.seed
  c.mesh = dict(data=a.data, model=a.model_axis)  # data must divide batch.
  c.results = a.results or os.path.join(
      'results', f'sweep_{a.sweep}_' + os.path.basename(os.path.normpath(a.hf_target or a.root)))
  return c
