"""Figure 1 for a trained family: SpS time, acceptance and loop time against k, draft, temperature.

  python experiments/sweep.py --config=configs/sweep.py:root=checkpoints/reference,sweep=k
  python experiments/sweep.py --config=configs/sweep.py:root=checkpoints/reference,sweep=draft
  python experiments/sweep.py --config=configs/sweep.py:root=checkpoints/reference,sweep=drafter
  python experiments/sweep.py --config=configs/sweep.py:sweep=drafter_k,feature=feature,ks=2+4+6

Writes `points.csv`, `points.md` and `figure1.png` (drafter_k: also `tokens_per_loop.png`) to the
config's results directory (local or a URI; process 0 writes); each point's ArS time is measured
call by call in turn with its SpS calls.
"""

from ml_collections import config_flags

from spsjax import cli, distributed, sharding, storage
from spsjax.bench import auto_k, sweep
from spsjax.data import humaneval, prompts as prompts_lib
from spsjax.sampling import SamplingConfig, drafter_config, speculative
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  if c.note:
    print0(c.note)
  mesh = sharding.mesh_from_axes(c.mesh.data, c.mesh.model)
  point_drafters = [drafter_config.build(**p['drafter']) for p in c.points]
  names = sorted({p['draft'] for p, d in zip(c.points, point_drafters) if d.needs_model})
  family = c.target if load.is_hf(c.target) else c.root  # What the output names the models by.
  target, drafts, tok, _ = load.load_family(c.root, c.target, names, mesh=mesh,
                                            draft_weights=c.draft_weights)
  print0(f'{family}: sweep of {c.sweep} over {len(c.points)} points, {c.prompts} prompts in '
         f'calls of {c.batch}, '
         + (f'mesh {dict(mesh.shape)}' if mesh else 'one device'))
  texts = [p['prompt'] for p in humaneval.read_problems()[:c.prompts]]
  max_k = max(p['k'] for p in c.points)
  sizes = [('target', target.config.max_seq_len)] + [
      (name, draft.config.max_seq_len) for name, draft in drafts.items()]
  room = prompts_lib.prompt_room(sizes, c.max_new_tokens, speculative.headroom(max_k))
  prompts, lengths = prompts_lib.encode_prompts(tok, texts, max_len=room.positions)
  note = prompts_lib.cut_note(tok, texts, room)
  if note:
    print0(note)
  kw = dict(max_new_tokens=c.max_new_tokens, seed=c.seed, mesh=mesh)
  points = []
  for p, drafter in zip(c.points, point_drafters):
    sampling_config = SamplingConfig(temperature=p['temperature'], top_p=c.top_p)
    draft = drafts[p['draft']] if drafter.needs_model else None
    policy = None
    if p['auto']:  # Calibrated on the first batch (or read from the disk cache).
      first = prompts_lib.for_call(prompts, lengths, list(range(c.batch)))
      costs, path = auto_k.calibrated(target, draft, *first,
                                      k_max=p['k'], drafter=drafter,
                                      sampling_config=sampling_config,
                                      max_new_tokens=c.max_new_tokens,
                                      recalibrate=c.recalibrate)
      policy = auto_k.Policy(costs)
      print0(f'{p["label"]}: cost model {path}\n' + '\n'.join(
          auto_k.report(costs, policy.acceptance)))
    point = sweep.run_point(p['label'], target, draft, p['draft'], prompts,
                            lengths, k=p['k'], sampling_config=sampling_config, drafter=drafter,
                            lenience=p['lenience'], trim_score=p['trim_score'],
                            policy=policy, batch=c.batch, **kw)
    points.append(point)
    lossy = (f', LOSSY: lenience {point.lenience}, total variation from p {point.tv:.4f} per '
             'draft slot' if point.lenience < 1 else '')
    print0(f'{c.sweep}={point.label}: {point.mean_seconds * 1e3:.1f} ± '
           f'{point.std_seconds * 1e3:.1f} ms per call (ArS in turn '
           f'{point.ars_seconds * 1e3:.1f}: {point.speedup:.2f}x), tokens/loop/(k+1) '
           f'{point.accepted_fraction:.3f}, alpha {point.alpha:.3f}, drafts/loop '
           f'{point.drafted_per_loop:.2f}, c {point.c:.3f}, '
           f'{point.loop_seconds * 1e3:.2f} ms per loop{lossy}', flush=True)
  sweep.write_csv(points, storage.join(c.results, 'points.csv'))
  table = sweep.markdown(points)
  print0(table)
  storage.write_text(storage.join(c.results, 'points.md'), table + '\n')
  sweep.plot(points, storage.join(c.results, 'figure1.png'),
             f'{family}: {c.prompts} HumanEval prompts, {c.max_new_tokens} tokens, batch {c.batch}',
             c.sweep)
  written = 'points.csv, points.md and figure1.png'
  if c.sweep == 'drafter_k':
    sweep.plot_tokens_per_loop(points, storage.join(c.results, 'tokens_per_loop.png'),
                               f'{family}: tokens per loop, {c.prompts} HumanEval prompts, '
                               f'T {c.points[0]["temperature"]} / top_p {c.top_p}')
    written = 'points.csv, points.md, figure1.png and tokens_per_loop.png'
  print0(f'Wrote {c.results}/{written}')


if __name__ == '__main__':
  cli.run(main)
