"""Sampling (ArS or SpS): `--config=configs/sample.py:method=sps,k=4,root=checkpoints/tiny`.

Arguments: root (a trained family: its `target` and `draft_name` checkpoints and tokenizer; prompts
are the first `batch` HumanEval prompts), or without root: model, draft (preset names, randomly
initialised, random prompts of prompt_len tokens); method (ars|sps), k (or auto: each call
picks k in 0 .. k_max, 0 being ArS, from a cost model measured once on this machine and the
acceptance seen so far, `spsjax.bench.auto_k`; recalibrate measures again), batch, draft_name,
max_new_tokens, temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff,
repetition_penalty, no_repeat_ngram_size, sequence_bias (token ids joined by _, a colon and a
bias, pairs joined by +: 5_9:-inf bans 9 after 5), min_new_tokens (the eos token banned at each
row's first new tokens: the tokenizer's eos ids, or eos_id), seed, data/model_axis (mesh
axes), runlocal (fewer tokens); drafter (model | lookup | hybrid | feature | falcon | heads |
mlp: `spsjax.sampling.drafter_config`; feature, falcon, heads and mlp draft with `draft_name`, a
head trained by configs/train.py model=feature, falcon, heads or mlp, e.g. draft_name=feature;
per_pass: a Falcon head's drafts a pass, 2 by default), max_ngram, min_ngram
(prompt lookup's n-grams), stop_below (dynamic k: a model draft stops below this confidence),
alternatives (a tree: that many other tokens beside each draft of the model, hybrid, feature or
heads drafter), branching (drafter tree, feature or heads: children per node at each depth
joined by +, e.g. 3+2+1, k its length), tree_nodes and tree_width (drafter tree or feature:
each row's own tree of tree_nodes nodes, depth k at most: EAGLE-2's dynamic tree, tree_width
candidates per expanded node),
lenience (in (0, 1]; below 1 is LOSSY: SpS no longer samples the target's law); hf_target,
hf_draft (Hugging Face checkpoint directories with config.json, safetensors and tokenizer.json, in
place of root's target and draft); hf_sampling (sample as the hf_target's generation_config.json
asks, transformers' defaults included, in place of temperature, top_k, top_p, min_p,
typical_p, epsilon_cutoff, eta_cutoff, repetition_penalty and no_repeat_ngram_size;
`spsjax.sampling.generation_config`), hf_ignore (settings of that file to
drop, joined by +, e.g. suppress_tokens).
"""

import ml_collections

from spsjax.config_args import lookahead, parse_arg, sequence_bias
from spsjax.models import presets


def get_config(arg=None):
  a = parse_arg(arg, root='', draft_name='draft_wide', model='tiny_target', draft='tiny_draft',
                method='ars', k='4', k_max=8, recalibrate=False, batch=4, prompt_len=16,
                max_new_tokens=64, temperature=1.0,
                top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0,
                eta_cutoff=0.0, repetition_penalty=1.0, no_repeat_ngram_size=0, sequence_bias='',
                min_new_tokens=0,
                seed=0, data=1,
                model_axis=1, runlocal=False,
                draft_weights='w8a8', drafter='model', max_ngram=3, min_ngram=1,
                stop_below=0.0, alternatives=0, branching='', tree_nodes=0, tree_width=4,
                per_pass=2,
                lenience=1.0, hf_target='',
                hf_draft='', hf_sampling=False, hf_ignore='')
  c = ml_collections.ConfigDict()
  c.root = a.root
  c.target_name = a.hf_target or 'target'
  c.draft_name = a.hf_draft or a.draft_name
  c.draft_weights = a.draft_weights  # The draft's packed weights (native CPU path).
  c.method = a.method
  c.k = lookahead(a)
  c.k_max = a.k_max  # With k=auto: the largest k the policy considers.
  c.recalibrate = a.recalibrate
  c.drafter = dict(kind=a.drafter, max_ngram=a.max_ngram, min_ngram=a.min_ngram,
                   stop_below=a.stop_below, alternatives=a.alternatives,
                   branching=a.branching, tree_nodes=a.tree_nodes, tree_width=a.tree_width,
                   per_pass=a.per_pass)
  c.lenience = a.lenience  # < 1: LOSSY (Leviathan et al.'s lenience), labelled in the output.
  c.model = presets.get(a.model)
  c.draft = presets.get(a.draft)
  c.sampling = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                    typical_p=a.typical_p, epsilon_cutoff=a.epsilon_cutoff,
                    eta_cutoff=a.eta_cutoff, repetition_penalty=a.repetition_penalty,
                    no_repeat_ngram_size=a.no_repeat_ngram_size,
                    sequence_bias=sequence_bias(a.sequence_bias))
  if a.hf_sampling and not a.hf_target:
    raise ValueError('hf_sampling reads the generation_config.json of hf_target; pass hf_target.')
  c.hf_sampling = a.hf_sampling  # main replaces `sampling` by the checkpoint's.
  c.hf_ignore = [name for name in a.hf_ignore.split('+') if name]
  c.draft_sampling = ml_collections.config_dict.placeholder(dict)
  c.batch = a.batch
  c.prompt_len = a.prompt_len
  c.max_new_tokens = 16 if a.runlocal else a.max_new_tokens
  c.min_new_tokens = a.min_new_tokens  # > 0: eos banned before (added to hf_sampling's too).
  c.eos_id = -1  # -1: no eos.
  c.seed = a.seed
  c.mesh = dict(data=a.data, model=a.model_axis)
  c.repeats = 3
  return c
