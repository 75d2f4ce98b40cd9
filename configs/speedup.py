"""Table 1 for a trained family: `--config=configs/speedup.py` (the reference pair) or
`--config=configs/speedup.py:root=checkpoints/demo,draft=draft_wide_distill`.

Arguments: root (family directory; default checkpoints/reference), draft (checkpoint name of the
draft; default the family's best: draft_trunc_distill_3000 for the reference family,
draft_wide_distill for demo, draft_wide for tiny; random: a useless draft, `load.random_draft`),
k (or auto: `spsjax.bench.auto_k`, each row calibrated on its first prompts, each call at k in
0 .. k_max, 0 being ArS), k_max, recalibrate (auto: measure the costs again rather than read
them from the disk cache), humaneval /
docstrings / code (number of examples of each task; 0: all; code is `code_completion`, held-out
functions cut in half), batches ('+'-separated, e.g. 1+8), seed, results (output
directory; default results/speedup_<family>), runlocal (a few examples, for a smoke run), demo
(the README's main job: 8 examples per task, batch 1), draft_weights (how the native CPU path stores
the draft's packed weights: w8a8 by default, int8 weights by inputs quantized to int8 in
integer arithmetic; int8 the same weights in float32 arithmetic; bfloat16 half the bytes of
float32; SpS stays exact, the target is float32 either way; float32 for the draft as trained);
drafter (model | lookup |
hybrid | feature | falcon | heads | mlp: `spsjax.sampling.drafter_config`; feature, falcon, heads
and mlp take a head trained by configs/train.py model=feature, falcon, heads or mlp as `draft`;
per_pass: a Falcon head's drafts a pass, 2 as trained by default), max_ngram, min_ngram,
stop_below (dynamic k),
alternatives (a tree of drafts: that many other tokens beside each), branching (drafter tree,
feature or heads: children per node at each depth joined by +, k its length), tree_nodes and
tree_width (drafter tree or feature: each row's own tree of tree_nodes nodes, depth k at most,
EAGLE-2's dynamic tree, tree_width candidates per expanded node), lenience (in
(0, 1]; below 1 is LOSSY, labelled in the title and the SpS rows with its total variation);
hf_target, hf_draft (Hugging Face checkpoint directories in place of root's target and draft);
sampling settings beside the paper's (each off by default, named in the title): top_p (in place
of each task's; -1: the task's), min_p, typical_p, epsilon_cutoff and eta_cutoff for the sampled
decoding, repetition_penalty and no_repeat_ngram_size for both.
The table (printed and in `table.md`) opens with `title`, a template of config fields (`{root}`),
and for the demo and runlocal variants a note that they check the pipeline and measure little.
Paper settings by default: k = 4; HumanEval at temperature 0.8, top_p 0.95; summarisation
(docstrings) at top_p 0.8; greedy for both.
"""

import os

import ml_collections

from spsjax.config_args import (REFERENCE_ROOT, best_draft, default_pair_note, lookahead,
                                parse_arg)
from spsjax.eval import tasks


def get_config(arg=None):
  a = parse_arg(arg, root=REFERENCE_ROOT, draft='', k='4', k_max=8, humaneval=164,
                docstrings=200, code=200, batches='1+8', seed=0, results='', runlocal=False, demo=False,
                data=1, model_axis=1, draft_weights='w8a8', drafter='model', max_ngram=3,
                min_ngram=1, stop_below=0.0, alternatives=0, branching='', tree_nodes=0,
                tree_width=4, per_pass=2, lenience=1.0, hf_target='', hf_draft='',
                recalibrate=False, top_p=-1.0, min_p=0.0,
                typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
                no_repeat_ngram_size=0)
  if a.demo:
    a.humaneval, a.docstrings, a.code, a.batches = 8, 8, 8, '1'
  c = ml_collections.ConfigDict()
  c.note = default_pair_note(arg, ('root', 'draft', 'hf_target', 'hf_draft'))
  c.root = a.root
  c.target = a.hf_target or 'target'
  c.draft = a.hf_draft or a.draft or best_draft(a.root)
  c.target_path = a.hf_target or os.path.join(a.root, 'target')
  c.draft_weights = a.draft_weights  # The draft's packed weights (native CPU path).
  c.drafter = dict(kind=a.drafter, max_ngram=a.max_ngram, min_ngram=a.min_ngram,
                   stop_below=a.stop_below, alternatives=a.alternatives,
                   branching=a.branching, tree_nodes=a.tree_nodes, tree_width=a.tree_width,
                   per_pass=a.per_pass)
  c.lenience = a.lenience  # < 1: LOSSY.
  c.k = lookahead(a)
  c.k_max = a.k_max  # k=auto: each row calibrates, then each call runs at k in 0 .. k_max.
  c.recalibrate = a.recalibrate
  c.seed = a.seed
  c.batches = [int(b) for b in a.batches.split('+') if b]
  nums = dict(humaneval=4 if a.runlocal else a.humaneval,
              docstrings=8 if a.runlocal else a.docstrings,
              code_completion=8 if a.runlocal else a.code)
  # Settings beside the paper's: warpers for the sampled decoding, processors for both.
  both = {name: getattr(a, name) for name, off in (('repetition_penalty', 1.0),
                                                   ('no_repeat_ngram_size', 0))
          if getattr(a, name) != off}
  sampled = dict(both, **{name: getattr(a, name) for name, off in (
      ('top_p', -1.0), ('min_p', 0.0), ('typical_p', 1.0), ('epsilon_cutoff', 0.0),
      ('eta_cutoff', 0.0)) if getattr(a, name) != off})
  c.tasks = {name: dict(num=num, **tasks.PAPER_SETTINGS[name]) for name, num in nums.items()}
  for task in c.tasks.values():
    task['nucleus'] = dict(task['nucleus'], **sampled)
  c.greedy = dict(tasks.GREEDY, **both)
  c.data_config = ''  # A TFDS config of `docstrings` and `code_completion`; '' is the stdlib's.
  c.cost_repeats = 20
  c.mesh = dict(data=a.data, model=a.model_axis)  # 1 x 1: one device (the native CPU path).
  c.results = a.results or os.path.join(
      'results', 'speedup_' + os.path.basename(os.path.normpath(a.hf_target or a.root)))
  c.title = ('# Table 1 (Chen et al., 2023): ArS vs SpS, {target_path} and draft {draft}, k = {k}'
             ' (draft weights stored in {draft_weights} on the native CPU path)')
  if a.drafter != 'model' or a.stop_below or a.alternatives:
    dynamic = (f'; dynamic trees of {a.tree_nodes} nodes, width {a.tree_width}'
               if a.tree_nodes else '')
    c.title += (f'\n\nDrafter: {a.drafter} (n-grams {a.max_ngram} down to {a.min_ngram}; '
                f'dynamic k below confidence {a.stop_below}; 0: fixed k; '
                f'{a.alternatives} alternatives a slot; tree branching {a.branching or "-"}'
                f'{dynamic}).')
  if a.alternatives or a.branching or a.drafter == 'tree' or a.tree_nodes:
    c.title += ('\n\nA tree of drafts: s is the target\'s call on the tree\'s nodes, a level-by-'
                'level drafter\'s calls count as draft steps by their time, alpha is the '
                'acceptance per depth and the tokens per loop predicted a chain\'s at that alpha.')
  if sampled:
    named = lambda d: ', '.join(f'{name} {value}' for name, value in d.items())
    warpers = {name: v for name, v in sampled.items() if name not in both}
    c.title += ('\n\nSampling beside the paper\'s: '
                + '; '.join(filter(None, [warpers and named(warpers) + ' (nucleus)',
                                          both and named(both) + ' (nucleus and greedy)']))
                + '.')
  if a.lenience < 1:
    c.title += (f'\n\nLOSSY: lenience {a.lenience} accepts a draft with probability '
                f'min(1, p / ({a.lenience} q)); SpS does not sample the target\'s law. TV: the mean '
                'total variation of a draft slot\'s law from the target\'s along the outputs.')
  if a.demo:
    c.title += ('\n\nDemo run (`make demo`): 8 prompts per task at batch 1 on the demo pair (a 5M '
                'target and a 0.5M draft distilled from it, trained for minutes). It is a '
                'pipeline-sized check that everything runs end to end and SpS keeps ArS\'s '
                'results; the speedups are measured on the reference pair (docs/results.md).')
  elif a.runlocal:
    c.title += ('\n\nSmoke run (`runlocal`): a few examples per task; the numbers check that the '
                'pipeline runs, they do not measure the speedup.')
  return c
