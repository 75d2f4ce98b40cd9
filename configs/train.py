"""Training a target or a draft: `--config=configs/train.py:size=tiny,model=target`.

Arguments:
  size: tiny | demo | reference. `tiny` trains each model in a few minutes on a 2-core CPU (the
    tests); `demo` is the README's main job (`make demo`: a 5M target of ~6 minutes, whose decode
    step outweighs the fixed costs of a step, and a one-layer draft distilled from it in ~2);
    `reference` is the pair the README's tables are measured on.
  model: target | draft_wide | draft_mid | draft_deep | draft_trunc | feature | falcon | heads |
    mlp
    (presets `<size>_target`, `<size>_draft`, `<size>_draft_mid`, `<size>_draft_deep`,
    `<size>_draft_trunc`): the wide-shallow draft is ~0.75 of the target's width (0.5 for demo) and 1/4 (tiny), 1/6 (demo)
    or 1/8 (reference) of its depth; the deep draft (4 narrow layers) and the mid one (2 layers)
    have about the wide one's parameter count: the draft-topology sweep's three shapes. The
    truncated draft is the target's first layer at its full width and starts from the trained
    target's embedding, layer 0 and final norm (so the target must be trained first).
    `feature` (an EAGLE head: `head_layers` decoder blocks, default 1) and `heads` (parallel
    Medusa/MTP heads, `head_layers` of them, default 6) read the trained target's features and
    share its embedding and output layer; they train on the KL to the target's next-token law
    plus `feature_weight` (default 0.1) times a regression to its features (`train.head_losses`);
    `mlp` (an MLP speculator, IBM's: `head_layers` stages, default 6, each a [D, D] product in
    and out of a GELU state) reads them too and trains likewise, stage i on the corpus tokens
    before its own (teacher forcing). `falcon` (a Falcon head: gated cells, then `head_layers`
    blocks, default 1) drafts `per_pass` tokens a pass (default 2, Falcon's; the name gains
    `_pass3` for another) and trains likewise, each pair on the features and law `per_pass`
    positions on.
    `hass=N` adds N runs on the head's own predicted features as drafting feeds them (HASS,
    EAGLE-3's training-time test; feature only).
    `taps=1+3+6` (feature only): the head reads the target's residual stream at those depths
    (i < layers: layer i's input; the number of layers: its last output), projected together
    (EAGLE-3's multi-layer features; `TransformerConfig.feature_taps`); train it with `hass=1`
    or more, as it reads its own predictions when drafting.
    `hass_decay=0.8`: own-step run j weighs decay^j in the loss (EAGLE-3's 0.8; default 1).
    `vocab=512` (any head): the head drafts from its own output layer over the 512 tokens
    most frequent in its training data (EAGLE-3's draft vocabulary; `TransformerConfig.
    draft_vocab_size`), a quarter of the vocabulary's product per draft step; 0 (default) reads
    the target's output layer. Checkpoint names add `_decay0.8`, `_v512`.
  distill: 0 trains on the language-model loss; a value in (0, 1] is the weight of distillation
    from the family's trained target (DistillSpec), the rest the LM loss.
  divergence: forward_kl (KL(p_target || q_draft), the default) | reverse_kl | tv (total
    variation = 1 - the acceptance probability of speculative sampling).
  distill_data: corpus (the training batches, default) | student | teacher (on-policy: each
    batch row's first `prompt_len` tokens continued by the draft being trained, or by the target,
    sampling at temperature 1). A head (model=feature, heads or mlp) takes corpus or teacher: it
    then trains on the target's own samples (IBM's speculator's second phase), the name gaining
    `_teacher`.
  prompt_len: the on-policy prompts' length in tokens (default 32).
  distill_rows: the divergence on the batch's first rows only (0: all; the LM loss keeps every
    row): bounds the teacher's cost per step to that fraction of a batch.
  root: the family directory (tokenizer and checkpoints); default checkpoints/<size>.
  name: the run's checkpoint directory under root (default: the model, with `_distill` and any
    non-default divergence and data appended, as below); give one to keep a longer or otherwise
    different run beside the default one (e.g. `steps=3000,name=draft_wide_distill_3000`).
  steps: overrides the size's number of steps (the reference target's default is 2000, a
    background run of ~50 min that resumes if interrupted; its drafts' 600).
  runlocal: a few steps on a small part of the data, in checkpoints/<size>_runlocal, for a smoke
    run.
  data, model_axis: mesh axes.

Distilled drafts get their own directory (`draft_wide_distill`; with another divergence or data,
e.g. `draft_wide_distill_tv_student`), so the kinds can be compared.
"""

import ml_collections

from spsjax.config_args import parse_arg
from spsjax.data import python_code
from spsjax.models import presets

_PRESET = {'target': 'target', 'draft_wide': 'draft', 'draft_mid': 'draft_mid',
           'draft_deep': 'draft_deep', 'draft_trunc': 'draft_trunc'}
# Heads over the trained target's features (`models.feature_head`), and their default number of
# blocks (feature: EAGLE's one decoder layer), heads or stages (one per draft position, k <= 6).
_HEADS = {'feature': 1, 'falcon': 1, 'heads': 6, 'mlp': 6}
_FROM_TARGET = ('draft_trunc',)  # Models that start from the trained target's parameters.

# Per size: batch (sequences), sequence length, steps, warm-up, peak learning rate.
_SIZES = {
    'tiny': dict(batch_size=16, seq_len=128, steps=600, warmup_steps=60, learning_rate=3e-3),
    # Demo: 300 steps (~6 min for the target on 2 cores), so that `make demo` stays well within 20
    # minutes from a fresh clone.
    'demo': dict(batch_size=16, seq_len=128, steps=300, warmup_steps=30, learning_rate=2e-3),
    # Reference: the drafts 600 steps (~5 min each); the target 2000 steps (4.1M tokens, ~50 min
    # on 2 cores at ~1450 tokens/s, so that target and drafts retrain within one session on a new
    # machine; saves every 100 steps, ~1.5 min). 600 target steps reached a held-out loss of
    # 4.64-4.89, barely better than the drafts; 6000 (~3 h, over four sessions) reached 3.62.
    # Peak 1e-3: at 2e-3 an earlier 1200-step run stalled near 4.99 for 240 steps.
    'reference': dict(batch_size=8, seq_len=256, steps=600, target_steps=2000, warmup_steps=60,
                      target_warmup_steps=200, learning_rate=1e-3),
}


def _taps(text: str, model: str, target_layers: int) -> tuple[int, ...]:
  """`taps=1+3+6` as increasing residual-stream indices of the target (ValueError otherwise)."""
  if not text:
    return ()
  if model != 'feature':
    raise ValueError(f'taps are what an EAGLE head (model=feature) reads; got model={model}.')
  try:
    taps = tuple(int(t) for t in text.split('+'))
  except ValueError:
    taps = ()
  if not taps or list(taps) != sorted(set(taps)) or not 0 <= taps[0] <= taps[-1] <= target_layers:
    raise ValueError(f'taps={text}: want increasing indices in 0 .. {target_layers} (the '
                     f'target\'s layers; {target_layers} its last output) joined by +, e.g. '
                     f'1+{target_layers // 2}+{target_layers}.')
  return taps


def get_config(arg=None):
  a = parse_arg(arg, size='tiny', model='target', distill=0.0, root='', steps=0, seed=0,
                data=1, model_axis=1, runlocal=False, divergence='forward_kl',
                distill_data='corpus', prompt_len=32, distill_rows=0, name='', head_layers=0,
                hass=0, feature_weight=0.1, taps='', hass_decay=1.0, vocab=0, per_pass=2)
  if a.size not in _SIZES:
    raise ValueError(f'size must be one of {sorted(_SIZES)}, got {a.size!r}.')
  if a.model not in _PRESET and a.model not in _HEADS:
    raise ValueError(f'model must be one of {sorted(_PRESET) + sorted(_HEADS)}, got {a.model!r}.')
  head = a.model in _HEADS
  if head and a.distill:
    raise ValueError(f'model={a.model} trains on the target\'s features and laws; distill is for '
                     f'transformer drafts.')
  if not head and (a.vocab or a.hass_decay != 1.0):
    raise ValueError(f'vocab and hass_decay are a head\'s (model=feature, heads or mlp); got '
                     f'model={a.model}.')
  if a.model == 'falcon' and a.per_pass < 2 or a.model != 'falcon' and a.per_pass != 2:
    raise ValueError(f'per_pass is a Falcon head\'s drafts a pass, >= 2 (model=falcon); got '
                     f'{a.per_pass} with model={a.model}.')
  if a.hass_decay != 1.0 and not a.hass:
    raise ValueError('hass_decay weighs the own-step runs: it needs hass >= 1.')
  size = _SIZES[a.size]
  c = ml_collections.ConfigDict()
  taps = _taps(a.taps, a.model, presets.get(f'{a.size}_target')['num_layers'])
  if head:  # The target's shape, its number of layers the head's blocks (or heads).
    c.model = dict(presets.get(f'{a.size}_target'), num_layers=a.head_layers or _HEADS[a.model],
                   feature_taps=taps, draft_vocab_size=a.vocab,
                   drafts_per_pass=a.per_pass if a.model == 'falcon' else 1)
  else:
    c.model = presets.get(f'{a.size}_{_PRESET[a.model]}')
  c.root = a.root or f'checkpoints/{a.size}' + ('_runlocal' if a.runlocal else '')
  c.name = a.model
  if head:  # e.g. feature_hass1, heads_4, feature_taps1-3-6_hass1_decay0.8_v512.
    c.name += ''.join(part for part, on in (
        (f'_{c.model["num_layers"]}', a.head_layers), (f'_pass{a.per_pass}', a.per_pass != 2),
        (f'_taps{"-".join(map(str, taps))}', taps),
        (f'_hass{a.hass}', a.hass), (f'_decay{a.hass_decay:g}', a.hass_decay != 1.0),
        (f'_v{a.vocab}', a.vocab), (f'_{a.distill_data}', a.distill_data != 'corpus')) if on)
  if a.distill > 0:
    c.name += '_distill' + ''.join(
        f'_{v}' for v, default in ((a.divergence, 'forward_kl'), (a.distill_data, 'corpus'))
        if v != default)
  if a.name:
    if a.name == 'target' and a.model != 'target' or '/' in a.name or a.name.startswith('.'):
      raise ValueError(f'name must be a directory name other than the target\'s, got {a.name!r}.')
    c.name = a.name
  c.teacher = 'target' if a.distill > 0 or a.model in _FROM_TARGET or head else ''
  # runlocal trains on a small part of the stdlib (python_code.SMALL); '' means default.
  c.data = dict(name='python_code', text_field='', train_split='train', eval_split='validation',
                data_dir='', config=python_code.SMALL.name if a.runlocal else '')

  def own(key):  # A size may give its target a longer schedule than its drafts (`target_steps`).
    return size.get(f'{a.model}_{key}', size[key])

  steps = 8 if a.runlocal else (a.steps or own('steps'))
  c.train = dict(
      batch_size=size['batch_size'], seq_len=size['seq_len'], seed=a.seed,
      log_every=1 if a.runlocal else 20, eval_every=max(1, min(steps // 5, 500)), eval_batches=4,
      save_every=4 if a.runlocal else 100, keep=3, distill_weight=a.distill,
      distill_temperature=1.0, distill_divergence=a.divergence, distill_data=a.distill_data,
      distill_prompt_len=a.prompt_len, distill_rows=a.distill_rows,
      init_from_teacher=a.model in _FROM_TARGET, head=a.model if head else '',
      head_feature_weight=a.feature_weight, head_own_steps=a.hass,
      head_own_step_decay=a.hass_decay)
  c.optimizer = dict(learning_rate=size['learning_rate'],
                     warmup_steps=min(own('warmup_steps'), steps // 2), total_steps=steps,
                     final_fraction=0.1, weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95)
  c.tokenizer_seed = 0
  c.mesh = dict(data=a.data, model=a.model_axis)
  return c
