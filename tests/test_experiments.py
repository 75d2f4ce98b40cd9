"""The binaries start, parse their configs and run end to end (smallest settings).

Runs that sample, train or write start a fresh interpreter each; runs that must end in a one-line
error before any model runs are forked from one interpreter that has imported what the binaries
import (`tests/binary_launcher.py`), since those imports were most of their time.
"""

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spsjax import models
from spsjax.data import tokenizer
from spsjax.train import checkpoint
from tests import binary_launcher, xla_env

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  return subprocess.run([sys.executable, *args], cwd=_REPO, env=xla_env.subprocess_env(),
                        capture_output=True, text=True, timeout=300, check=False)


# The binaries whose one-line errors the tests below check, started by `tests/binary_launcher.py`.
_ERROR_BINARIES = ('sample', 'evaluate', 'sweep', 'peer_benchmark', 'speedup_table', 'train')


@pytest.fixture(scope='module', name='run_to_error')
def fixture_run_to_error(tmp_path_factory):
  """`_run` for runs that end in an error before any model runs: each binary runs in a child
  forked from one interpreter that has imported what the binaries import (its own code runs in
  the child as in a fresh process), not in a fresh interpreter (~3 s of imports each)."""
  with binary_launcher.started([f'experiments/{b}.py' for b in _ERROR_BINARIES],
                               tmp_path_factory.mktemp('launcher'), cwd=_REPO,
                               env=xla_env.subprocess_env()) as run:
    yield run


def test_sample_sps_on_random_models_with_k_auto(tmp_path):
  """k=auto (with an alternative beside each draft: a tree at every k): the cost model is
  measured, written under SPSJAX_CACHE_DIR and printed with the policy's choice, and each call's
  k is reported (fixed k: the other drafters' test below)."""
  run = subprocess.run(
      [sys.executable, 'experiments/sample.py',
       '--config=configs/sample.py:method=sps,k=auto,k_max=2,batch=2,runlocal,alternatives=1',
       '--config.repeats=1'], cwd=_REPO, capture_output=True, text=True, timeout=300,
      check=False, env=dict(xla_env.subprocess_env(), SPSJAX_CACHE_DIR=str(tmp_path)))
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'NOTE: randomly initialised' in run.stdout and run.stdout.count('--- row ') == 2
  cached = list((tmp_path / 'costs').glob('*.json'))
  assert len(cached) == 1 and f'k=auto: cost model {cached[0]}' in run.stdout, run.stdout
  assert 'cost model, batch 2, 16 tokens per row: ArS ' in run.stdout and 'k=2 ' in run.stdout
  assert 'auto chooses k = ' in run.stdout and 'k=auto chose k = [' in run.stdout


def test_sample_takes_sequence_biases():
  run = _run('experiments/sample.py', '--config=configs/sample.py:method=sps,k=2,batch=1,runlocal,'
             'temperature=0,sequence_bias=5_9:-inf+7:2.5', '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert ('Sampling: SamplingConfig(temperature=0.0, sequence_bias=(((5, 9), -inf), ((7,), '
          '2.5)))') in run.stdout, run.stdout


@pytest.mark.parametrize('drafter,name', [
    ('lookup', 'PromptLookup(max_ngram=3'),
    ('hybrid,stop_below=0.2,lenience=0.5', 'Hybrid(stop_below=0.2'),
    ('tree,branching=2+1+1', 'TreeDrafter(branching=(2, 1, 1))'),
    ('tree,tree_nodes=5,tree_width=2', 'DynamicTreeDrafter(nodes=5, width=2)'),
    ('heads,alternatives=2', 'HeadsDrafter(alternatives=2)')])
def test_sample_sps_with_other_drafters(drafter, name):
  run = _run('experiments/sample.py',
             f'--config=configs/sample.py:method=sps,k=3,batch=2,runlocal,drafter={drafter}',
             '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'drafter {name}' in run.stdout and run.stdout.count('--- row ') == 2, run.stdout[-2000:]
  assert ('LOSSY: lenience 0.5' in run.stdout) == ('lenience' in drafter)
  ragged = drafter.startswith(('lookup', 'hybrid'))
  assert ('proposed-drafts histogram [' in run.stdout) == ragged



def test_bad_config_argument_is_a_clear_error(run_to_error):
  run = run_to_error('experiments/train.py', '--config=configs/train.py:size=huge')
  _one_line_error(run, "--config=configs/train.py:size=huge: size must be one of ['demo', "
                  "'reference', 'tiny'], got 'huge'.")


@pytest.fixture(scope='module', name='family')
def fixture_family(tmp_path_factory):
  """A family root with a random `target` (max_seq_len 64), the same model as `draft_wide`, and
  their tokenizer: enough to sample and sweep."""
  root = str(tmp_path_factory.mktemp('family'))
  stdlib = sysconfig.get_paths()['stdlib']
  texts = []
  for name in sorted(os.listdir(os.path.join(stdlib, 'json'))):
    if name.endswith('.py'):
      with open(os.path.join(stdlib, 'json', name), encoding='utf-8') as f:
        texts.append(f.read())
  tok = tokenizer.Tokenizer.train(texts, 512)
  config = models.TransformerConfig(vocab_size=tok.vocab_size, d_model=16, num_layers=1,
                                    num_heads=2, d_ff=32, max_seq_len=64)
  shapes = jax.eval_shape(lambda key: models.init_params(config, key), jax.random.key(0))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape), s.dtype), shapes)
  head_config = models.feature_head.head_config(config)
  head = models.feature_head.init_head('feature', head_config, jax.random.key(1))
  # The draft is the target itself (enough to run SpS), `feature` a random EAGLE head.
  for name, c, p, extra in (('target', config, params, {}), ('draft_wide', config, params, {}),
                            ('feature', head_config, head, {'head': 'feature'})):
    mngr = checkpoint.manager(os.path.join(root, name))
    checkpoint.save(mngr, 0, {'params': p}, {}, checkpoint.encode_meta(c, tok.to_bytes(), extra),
                    force=True)
    mngr.wait_until_finished()
    mngr.close()
  return root


def _one_line_error(run, *parts):
  """The run failed with a single line `<binary>: error: ...` holding every part, no traceback."""
  assert run.returncode == 1, run.stderr[-3000:]
  assert 'Traceback' not in run.stderr, run.stderr[-3000:]
  last = run.stderr.strip().splitlines()[-1]
  assert ': error: ' in last and all(p in last for p in parts), last
  return last


@pytest.mark.parametrize('args, parts', [
    (['experiments/sample.py', '--config=configs/sample.py', '--config.bogus=3'],
     ["--config.bogus=3: configs/sample.py has no field 'bogus'", 'batch, draft']),
    (['experiments/sample.py', '--config=configs/sample.py', '--config.sampling.temprature=1'],
     ["under 'sampling' has no field 'temprature' (did you mean 'temperature'?)"]),
    (['experiments/evaluate.py', '--config=configs/evaluate.py:batch_size=abc'],
     ["Config argument batch_size='abc': expected int."]),
    (['experiments/evaluate.py', '--config=configs/evaluate.py:tasks=humaneval+xsum'],
     ["tasks: unknown task 'xsum'; known: ['code_completion', 'docstrings', 'humaneval']."]),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,drafter=lookup,'
      'stop_below=0.5'],
     ['stop_below=0.5: prompt lookup has no draft model']),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,drafter=ngram'],
     ["Unknown drafter 'ngram'; known: ['model', 'lookup', 'hybrid', 'feature', 'falcon', "
      "'heads', 'mlp', 'tree']."]),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,drafter=tree,'
      'branching=2+1'],
     ['branching=2+1 drafts trees of depth 2: pass that as k (got k=4).']),
    (['experiments/sample.py', '--config=configs/sample.py:sequence_bias=5_9:x'],
     ["sequence_bias='5_9:x': want pairs joined by +, each token ids >= 0 joined by _, a colon "
      "and a bias (e.g. 5_9:-inf+7:2.5); got '5_9:x'."]),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,k=auto,drafter=tree,'
      'branching=2+1'],
     ["k=auto chooses k from 1 to k_max (or ArS); a tree drafter's depth is fixed by its "
      "branching, a dynamic tree's bound with its nodes: pass k, or use alternatives=."]),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,k=auto,drafter=feature,'
      'tree_nodes=6'],
     ["a dynamic tree's bound with its nodes: pass k"]),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,drafter=heads,'
      'tree_nodes=6'],
     ['tree_nodes=6: dynamic trees are grown by the draft model (drafter tree) or an EAGLE head '
      '(drafter feature), not the heads drafter.']),
    (['experiments/sample.py', '--config=configs/sample.py:method=sps,k=0'],
     ["k must be an integer >= 1 or auto, got '0'."]),
    (['experiments/sweep.py', '--config=configs/sweep.py:sweep=drafter,ks=2+x'],
     ["ks must be '+'-separated integers >= 1, got '2+x'."]),
    (['experiments/sweep.py', '--config=configs/sweep.py:sweep=k,feature=feature'],
     ['feature=, falcon=, heads= and mlp= name head checkpoints for sweep=drafter_k, not '
      'sweep=k.']),
    (['experiments/sweep.py', '--config=configs/sweep.py:sweep=k,batch=8,prompts=4'],
     ['batch must be in [1, prompts = 4], got 8.']),
    (['experiments/peer_benchmark.py', '--config=configs/peer.py:hf_target=/nope'],
     ['hf_target=/nope is not a Hugging Face checkpoint directory (no config.json)']),
    (['experiments/sweep.py', '--config=configs/nope.py'],
     ['--config=configs/nope.py: no such file']),
    (['experiments/speedup_table.py'],
     ['--config is required, e.g. python experiments/speedup_table.py --config=configs/']),
])
def test_config_mistakes_are_one_line(run_to_error, args, parts):
  _one_line_error(run_to_error(*args), *parts)


def test_missing_checkpoint_is_one_line(run_to_error, tmp_path):
  _one_line_error(run_to_error('experiments/sample.py',
                               f'--config=configs/sample.py:root={tmp_path}'),
                  f'Checkpoint directory {tmp_path}/target does not exist.')


def test_batch_beyond_the_humaneval_prompts_is_refused_before_loading(run_to_error, tmp_path):
  # The root does not exist: the batch is checked before any checkpoint is read.
  _one_line_error(run_to_error('experiments/sample.py',
                               f'--config=configs/sample.py:root={tmp_path},batch=200'),
                  'batch=200', 'there are 164', 'use batch in [1, 164]')


def test_max_new_tokens_beyond_max_seq_len_is_refused(run_to_error, family):
  _one_line_error(
      run_to_error('experiments/sample.py', f'--config=configs/sample.py:root={family},'
                   'method=ars,max_new_tokens=100000'),
      'max_new_tokens=100000 is too large', "target's max_seq_len 64", 'max_new_tokens <= 63')
  _one_line_error(  # Random models: SpS needs k - 1 more positions.
      run_to_error('experiments/sample.py', '--config=configs/sample.py:method=sps,k=4,'
                   'prompt_len=16,max_new_tokens=500'),
      'prompt_len=16 does not fit', "max_seq_len 512 - max_new_tokens 500 - (k - 1 = 3",
      'leaves 9 positions')


def test_cut_prompts_are_reported(family):
  run = _run('experiments/sample.py', f'--config=configs/sample.py:root={family},method=ars,'
             'batch=2,max_new_tokens=40', '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert ('NOTE: 2 of 2 prompts cut to their last 24 tokens (row 0 from ' in run.stdout
          and "the target's max_seq_len 64 - max_new_tokens 40 leaves 24 positions" in run.stdout)
  assert run.stdout.count('--- row ') == 2


def test_evaluate_measures_alpha_along_the_target_s_samples(family):
  """The family's draft is its target (its weights kept float32, not quantized as drafts are by
  default): alpha 1 under both decodings, on every generated token."""
  run = _run('experiments/evaluate.py', f'--config=configs/evaluate.py:root={family},'
             'drafts=draft_wide,batches=0,num=3,max_new_tokens=8,task_batch=2,'
             'draft_weights=float32')
  assert run.returncode == 0, run.stderr[-3000:]
  lines = [l for l in run.stdout.splitlines() if 'along the target' in l]
  assert len(lines) == 1 and 'from 3 humaneval prompts (max_new_tokens 8)' in lines[0], run.stdout
  assert 'nucleus 1.000 (' in lines[0] and 'greedy 1.000 (' in lines[0]
  assert 'held-out' not in run.stdout


def test_train_config_names_a_heads_taps_and_refuses_bad_ones():
  config = _config_module('train')
  taps = config.get_config('size=demo,model=feature,taps=1+3+6,hass=1')
  assert taps.name == 'feature_taps1-3-6_hass1' and tuple(taps.model.feature_taps) == (1, 3, 6)
  assert tuple(config.get_config('size=demo,model=feature').model.feature_taps) == ()
  eagle3 = config.get_config('size=demo,model=feature,taps=1+3+6,hass=2,hass_decay=0.8,vocab=512')
  assert eagle3.name == 'feature_taps1-3-6_hass2_decay0.8_v512'
  assert eagle3.model.draft_vocab_size == 512 and eagle3.train.head_own_step_decay == 0.8
  mlp = config.get_config('size=demo,model=mlp')
  assert mlp.name == 'mlp' and mlp.model.num_layers == 6 and mlp.train.head == 'mlp'
  for arg, message in (('model=heads,taps=1+2', 'model=feature'),
                       ('model=draft_wide,vocab=512', "a head's"),
                       ('model=feature,hass_decay=0.8', 'needs hass >= 1'),
                       ('model=feature,taps=3+1', '0 .. 6'), ('model=feature,taps=1+7', '0 .. 6'),
                       ('model=feature,taps=x', '0 .. 6')):
    with pytest.raises(ValueError, match=message):
      config.get_config('size=demo,' + arg)


def test_speedup_table_title_says_what_the_demo_is():
  config = _config_module('speedup')
  demo = config.get_config('root=checkpoints/demo,draft=draft_wide_distill,demo')
  title = demo.title.format(**demo)  # As experiments/speedup_table.py writes it.
  assert title.startswith('# Table 1 (Chen et al., 2023): ArS vs SpS, checkpoints/demo/target '
                          'and draft draft_wide_distill, k = 4 (draft weights stored in w8a8 '
                          'on the native CPU path)\n\nDemo run (`make demo`)')
  assert 'pipeline-sized check' in title
  full = config.get_config('root=checkpoints/reference,draft_weights=float32')
  assert full.title.format(**full) == ('# Table 1 (Chen et al., 2023): ArS vs SpS, '
                                       'checkpoints/reference/target and draft '
                                       'draft_trunc_distill_3000, k = 4 '
                                       '(draft weights stored in float32 on the native CPU path)')
  lossy = config.get_config('root=checkpoints/reference,drafter=hybrid,lenience=0.5')
  title = lossy.title.format(**lossy)
  assert '\n\nDrafter: hybrid (n-grams 3 down to 1; ' in title
  assert '\n\nLOSSY: lenience 0.5 accepts a draft with probability min(1, p / (0.5 q))' in title
  # Laws beside the paper's: warpers on the sampled decoding, processors on both, named.
  other = config.get_config('root=checkpoints/demo,top_p=1.0,typical_p=0.9,'
                            'no_repeat_ngram_size=3')
  assert other.title.endswith("\n\nSampling beside the paper's: top_p 1.0, typical_p 0.9 "
                              '(nucleus); no_repeat_ngram_size 3 (nucleus and greedy).')
  assert dict(other.tasks['docstrings']['nucleus']) == dict(
      temperature=1.0, top_k=0, top_p=1.0, typical_p=0.9, no_repeat_ngram_size=3)
  assert dict(other.greedy) == dict(temperature=0.0, top_k=0, top_p=1.0, no_repeat_ngram_size=3)
  assert dict(full.tasks['humaneval']['nucleus']) == dict(temperature=0.8, top_k=0, top_p=0.95)


def test_sweep_runs_sharded_on_a_mesh(family, tmp_path):
  """The sweep binary with the `model` axis over 4 fake devices: it loads, samples and writes,
  here the drafter_k sweep (the draft model and an EAGLE head at k = 2) and its k figure."""
  run = subprocess.run(
      [sys.executable, 'experiments/sweep.py',
       f'--config=configs/sweep.py:root={family},runlocal,model_axis=4,results={tmp_path},'
       'sweep=drafter_k,feature=feature,ks=2', '--config.max_new_tokens=8'],
      cwd=_REPO, env=xla_env.subprocess_env(devices=4), capture_output=True, text=True,
      timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'mesh' in run.stdout and "'model': 4" in run.stdout, run.stdout[-2000:]
  assert (tmp_path / 'points.csv').exists() and (tmp_path / 'figure1.png').exists()
  assert (tmp_path / 'tokens_per_loop.png').exists()
  table = (tmp_path / 'points.md').read_text()
  assert table.startswith('| point | k | draft | drafter | c |')
  assert '| draft_wide k=2 | 2 | draft_wide | ModelDrafter(' in table, table
  assert '| feature k=2 | 2 | feature | FeatureDrafter(' in table, table


def test_export_hf_writes_a_llama_directory_that_loads_back(family, tmp_path):
  """The exported directory is the model (transformers' side: tests/test_hf.py, `save_llama`)
  with spsjax's tokenizer, and the binaries load it as a Hugging Face checkpoint."""
  out = str(tmp_path / 'exported')
  run = _run('experiments/export_hf.py',
             f'--config=configs/export_hf.py:checkpoint={family}/target,out={out}')
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'Wrote {out}: ' in run.stdout and 'as LlamaForCausalLM' in run.stdout
  from spsjax.train import load  # pylint: disable=g-import-not-at-top
  exported, tok, meta = load.load_model(out)
  original, original_tok, _ = load.load_model(os.path.join(family, 'target'))
  assert meta['hf']['architectures'] == ['LlamaForCausalLM'] and load.is_hf(out)
  assert exported.config == original.config and tok.to_bytes() == original_tok.to_bytes()
  jax.tree.map(np.testing.assert_array_equal, exported.params, original.params)
  with open(os.path.join(out, 'generation_config.json'), encoding='utf-8') as f:
    assert json.load(f)['eos_token_id'] == tok.eos_id


def test_sampling_as_a_checkpoints_generation_config(tmp_path):
  """hf_sampling: the law transformers' `generate` would sample for the checkpoint (its file,
  then transformers' defaults: top_k 50), less the settings hf_ignore drops."""
  target = shutil.copytree(os.path.join(_REPO, 'tests', 'fixtures', 'hf', 'llama_gqa'),
                           tmp_path / 'llama')
  (target / 'generation_config.json').write_text(json.dumps(
      {'do_sample': True, 'temperature': 0.7, 'top_p': 0.9, 'min_p': 0.05,
       'repetition_penalty': 1.1, 'no_repeat_ngram_size': 3, 'suppress_tokens': [5],
       'min_new_tokens': 2, 'eos_token_id': 3, 'forced_eos_token_id': 3}))
  run = _run('experiments/sample.py', f'--config=configs/sample.py:hf_target={target},'
             'hf_sampling=true,hf_ignore=forced_eos_token_id,batch=1,max_new_tokens=4,'
             'min_new_tokens=3',
             '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert (f'Sampling as {target}/generation_config.json asks: SamplingConfig(temperature=0.7, '
          'top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, no_repeat_ngram_size=3, '
          "sequence_bias=(((5,), -inf),), ban_before_new=(((3,), 2),)) "
          '(dropped: forced_eos_token_id)') in run.stdout
  # min_new_tokens adds the tokenizer's eos ids to the file's bans.
  assert re.search(r'Sampling: .*ban_before_new=\(\(\(3,\), 2\), \(\([0-9, ]+\), 3\)\)\)',
                   run.stdout), run.stdout


def test_binaries_take_hugging_face_directories():
  """The sampling binary here; the Table 1 binary on the same two directories (copied into a fake
  bucket, its table and traces written there) in tests/test_storage.py."""
  target, draft = (os.path.join(_REPO, 'tests', 'fixtures', 'hf', n)
                   for n in ('llama_gqa', 'llama_tied_mqa'))
  run = _run('experiments/sample.py', f'--config=configs/sample.py:hf_target={target},'
             f'hf_draft={draft},method=sps,k=3,batch=2,max_new_tokens=8', '--config.repeats=1')
  assert run.returncode == 0, run.stderr[-3000:]
  assert f'Trained target {target} (80,192 parameters) and draft {draft}' in run.stdout
  assert run.stdout.count('--- row ') == 2 and 'acceptance rate' in run.stdout
  # The sweep binary loads through the same `load.load_family` (run end to end above on our
  # own checkpoints): here, that its config names the directories.
  c = _config_module('sweep').get_config(f'hf_target={target},hf_draft={draft},sweep=draft')
  assert c.target == target and [p['draft'] for p in c.points] == [draft]
  assert c.results == 'results/sweep_draft_llama_gqa'


def _config_module(name):
  spec = importlib.util.spec_from_file_location(f'{name}_config',
                                                os.path.join(_REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_measuring_configs_default_to_the_reference_pair_and_say_so():
  """No arguments: the reference target and its best draft, and a line saying so; a root alone:
  that family's best draft, silently."""
  for name in ('speedup', 'sweep', 'evaluate'):
    config = _config_module(name)
    plain, demo = config.get_config(None), config.get_config('root=checkpoints/demo')
    draft = lambda c: c.get('draft') or (c.get('drafts') or [None])[0] or c.points[0]['draft']
    assert (plain.root, draft(plain)) == ('checkpoints/reference', 'draft_trunc_distill_3000')
    assert plain.note.startswith('Defaults: the reference target (checkpoints/reference/target) '
                                 'and its best draft (draft_trunc_distill_3000)'), name
    assert (demo.root, draft(demo), demo.note) == ('checkpoints/demo', 'draft_wide_distill', '')


def test_train_config_names_each_kind_of_run_and_takes_an_explicit_name():
  config = _config_module('train')
  name = lambda arg: config.get_config(arg).name
  assert name('size=reference,model=draft_wide') == 'draft_wide'
  assert name('size=reference,model=draft_mid,distill=1') == 'draft_mid_distill'
  assert (name('size=reference,model=draft_wide,distill=1,divergence=tv,distill_data=student')
          == 'draft_wide_distill_tv_student')
  long = config.get_config('size=reference,model=draft_wide,distill=1,steps=3000,name=long')
  assert long.name == 'long' and long.teacher == 'target'
  assert long.optimizer.total_steps == 3000
  for bad in ('target', '../x', '.hidden'):
    with pytest.raises(ValueError, match='name must be a directory name'):
      config.get_config(f'size=reference,model=draft_wide,name={bad}')


@pytest.mark.parametrize('size', ['tiny', 'demo', 'reference'])
def test_train_config_starts_the_truncated_draft_from_the_target(size):
  """`model=draft_trunc` is the target's first layer at its width, started from the target (its
  teacher, with or without distillation); the other drafts start at random."""
  from spsjax.train import experiment  # pylint: disable=import-outside-toplevel
  config = _config_module('train')
  for arg in (f'size={size},model=draft_trunc', f'size={size},model=draft_trunc,distill=1'):
    exp = experiment.from_config(config.get_config(arg))
    assert exp.teacher == 'target' and exp.train.init_from_teacher
    target = experiment.from_config(config.get_config(f'size={size},model=target'))
    assert exp.train.model == dataclasses.replace(target.train.model, num_layers=1)
  wide = experiment.from_config(config.get_config(f'size={size},model=draft_wide'))
  assert not wide.train.init_from_teacher and wide.teacher is None
