"""The drafter a config names (`drafter=` in the binaries' configs): `build`."""

from spsjax.sampling.drafters import Drafter, Hybrid, ModelDrafter, PromptLookup
from spsjax.sampling.feature_drafters import (FalconDrafter, FeatureDrafter,
                                              FeatureDynamicDrafter, FeatureTreeDrafter,
                                              HeadsDrafter, HeadsTreeDrafter, MlpDrafter,
                                              MlpTreeDrafter)
from spsjax.sampling.tree_drafters import DynamicTreeDrafter, TreeDrafter

KINDS = ('model', 'lookup', 'hybrid', 'feature', 'falcon', 'heads', 'mlp', 'tree')
# The kinds whose draft is a head over the target's features (`models.feature_head`), not a
# transformer: the binaries load their checkpoint as one.
HEAD_KINDS = ('feature', 'falcon', 'heads', 'mlp')


def build(kind: str = 'model', *, max_ngram: int = 3, min_ngram: int = 1,
          stop_below: float = 0.0, alternatives: int = 0, branching: str = '',
          tree_nodes: int = 0, tree_width: int = 4, per_pass: int = 2) -> Drafter:
  """`model` (with `stop_below` > 0: dynamic k), `lookup` (n-grams from `max_ngram` down to
  `min_ngram`), `hybrid` (both), `feature` (an EAGLE head), `heads` (parallel heads), `mlp`
  (an MLP speculator: a chain, stage by stage), `falcon` (a Falcon head: a chain, `per_pass`
  drafts a head call); with
  `alternatives` > 0 all but `lookup` propose a tree, that many other tokens beside each draft;
  `feature`, `heads` or `mlp` with `branching` drafts a full tree (EAGLE's static tree,
  Medusa's, the MLP speculator's stage by stage);
  or `tree` (the draft
  model drafts a full tree, `branching` children per node at each depth, e.g. '3+2+1' (default
  `TreeDrafter`'s 2+2+1+1): k must be its depth). `tree` or `feature` with `tree_nodes` N > 0
  grows each row's own tree of N nodes, depth k at most (EAGLE-2's dynamic tree,
  `sampling.dynamic_trees`; `tree_width` candidates per expanded node)."""
  if kind not in KINDS:
    raise ValueError(f'Unknown drafter {kind!r}; known: {list(KINDS)}.')
  if per_pass != 2 and kind != 'falcon':
    raise ValueError(f'per_pass={per_pass} is a Falcon head\'s drafts a pass (drafter falcon), '
                     f'not the {kind} drafter\'s.')
  if tree_nodes and kind not in ('tree', 'feature'):
    raise ValueError(f'tree_nodes={tree_nodes}: dynamic trees are grown by the draft model '
                     f'(drafter tree) or an EAGLE head (drafter feature), not the {kind} '
                     'drafter.')
  if tree_nodes and (branching or alternatives):
    raise ValueError(f'tree_nodes={tree_nodes} grows a dynamic tree: it takes no branching '
                     f'({branching!r}) or alternatives ({alternatives}).')
  if tree_nodes:
    return (DynamicTreeDrafter if kind == 'tree' else FeatureDynamicDrafter)(
        nodes=tree_nodes, width=tree_width)
  if alternatives and kind not in ('model', 'hybrid') + HEAD_KINDS:
    raise ValueError(f'alternatives={alternatives}: alternatives are drawn from a draft law '
                     f'(drafter model, hybrid, feature or heads), not by the {kind} drafter.')
  if branching and kind not in ('tree',) + HEAD_KINDS:
    raise ValueError(f'branching={branching!r}: branching factors are the tree drafters\' '
                     f'(drafter tree, feature, heads or mlp), not the {kind} drafter\'s.')
  if stop_below and kind == 'lookup':
    raise ValueError(f'stop_below={stop_below}: prompt lookup has no draft model whose '
                     f'confidence could stop it; use drafter hybrid or model.')
  if stop_below and kind in HEAD_KINDS + ('tree',):
    raise ValueError(f'stop_below={stop_below}: dynamic k is implemented for draft models '
                     f'(drafter model or hybrid), not for the {kind} drafter.')
  if kind == 'falcon':
    if alternatives or branching:
      raise ValueError('A Falcon drafter drafts a chain: it takes no alternatives or branching.')
    return FalconDrafter(per_pass=per_pass)
  if kind == 'model':
    return ModelDrafter(stop_below=stop_below, alternatives=alternatives)
  if kind == 'hybrid':
    return Hybrid(stop_below=stop_below, max_ngram=max_ngram, min_ngram=min_ngram,
                  alternatives=alternatives)
  if kind == 'lookup':
    return PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
  if kind == 'tree':
    return TreeDrafter(branching_factors(branching)) if branching else TreeDrafter()
  if branching:
    tree_drafter = {'feature': FeatureTreeDrafter, 'heads': HeadsTreeDrafter,
                    'mlp': MlpTreeDrafter}[kind]
    return tree_drafter(alternatives=alternatives, branching=branching_factors(branching))
  return {'feature': FeatureDrafter, 'heads': HeadsDrafter, 'mlp': MlpDrafter}[kind](
      alternatives=alternatives)


def branching_factors(text: str) -> tuple[int, ...]:
  """'3+2+1' -> (3, 2, 1); ValueError for anything else."""
  try:
    factors = tuple(int(b) for b in text.split('+'))
  except ValueError:
    factors = ()
  if not factors or min(factors) < 1:
    raise ValueError(f'branching must be integers >= 1 joined by + (e.g. 3+2+1), got {text!r}.')
  return factors
