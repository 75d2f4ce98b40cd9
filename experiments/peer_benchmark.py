"""spsjax against transformers on the same weights and prompts: ArS and SpS beside transformers'
ArS and assisted generation (`assistant_model=`), batch 1, greedy and nucleus, on CPU.

  pip install -e '.[hf]'      # torch (CPU) and transformers: not core dependencies
  python experiments/export_hf.py --config=configs/export_hf.py:checkpoint=checkpoints/reference_600/target
  python experiments/export_hf.py --config=configs/export_hf.py:checkpoint=checkpoints/reference_600/draft_wide_distill
  python experiments/peer_benchmark.py --config=configs/peer.py

Both frameworks get the token ids of the same HumanEval prompts (spsjax's tokenizer), generate
exactly max_new_tokens (no eos), and take turns prompt by prompt; transformers' assistant drafts a
constant k tokens per round (no confidence stop), as spsjax's SpS does. Report:
`spsjax.bench.peer`, printed and in <results>/table.md (local or a URI; process 0 writes).
"""

import time

from absl import app
import jax
import numpy as np
from ml_collections import config_flags

from spsjax import cli, distributed, sampling, storage
from spsjax.bench import peer, timing
from spsjax.data import humaneval, prompts as prompts_lib
from spsjax.sampling import speculative
from spsjax.train import load

print0 = distributed.print0
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_RUNTIME = distributed.define_flags()


def _hf_models(c):
  for name, path in (('hf_target', c.hf_target), ('hf_draft', c.hf_draft)):
    if not load.is_hf(path):
      raise app.UsageError(f'{name}={path} is not a Hugging Face checkpoint directory (no '
                           f'config.json); write one with experiments/export_hf.py.')
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise app.UsageError(f'The peer benchmark needs the hf extra (pip install -e ".[hf]"): '
                         f'{e}.') from e
  if c.threads:
    torch.set_num_threads(c.threads)
  load_hf = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32).eval()
  return torch, transformers, load_hf(c.hf_target), load_hf(c.hf_draft)


def main(argv):
  distributed.start(argv, _RUNTIME())
  c = _CONFIG.value
  torch, transformers, hf_target, hf_draft = _hf_models(c)
  target, drafts, tok, _ = load.load_family('', c.hf_target, [c.hf_draft])
  draft = drafts[c.hf_draft]
  texts = [p['prompt'] for p in humaneval.read_problems()[:c.prompts]]
  room = prompts_lib.prompt_room([('target', target.config.max_seq_len),
                                  ('draft', draft.config.max_seq_len)], c.max_new_tokens,
                                 speculative.headroom(c.k))
  prompts, lengths = prompts_lib.encode_prompts(tok, texts, max_len=room.positions)
  print0(f'{c.hf_target} and {c.hf_draft}: {len(texts)} HumanEval prompts, {c.max_new_tokens} '
         f'tokens, k = {c.k}; torch {torch.__version__} ({torch.get_num_threads()} threads), '
         f'transformers {transformers.__version__}, JAX {jax.__version__}', flush=True)
  rows, records = [], []
  for decoding, settings in c.decodings.items():
    config = sampling.SamplingConfig(**settings)
    if config.sequence_bias or config.ban_before_new or config.ban_before_length:
      # sequence_bias's form differs between transformers versions; it runs without eos.
      raise ValueError(f'{decoding}: the peer benchmark does not pass sequence_bias or bans by '
                       'position to transformers; run it without.')
    greedy = config.temperature == 0
    hf_kw = dict(max_new_tokens=c.max_new_tokens, min_new_tokens=c.max_new_tokens,
                 eos_token_id=None, pad_token_id=0, do_sample=not greedy,
                 repetition_penalty=config.repetition_penalty,
                 no_repeat_ngram_size=config.no_repeat_ngram_size)
    if not greedy:
      hf_kw.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                   min_p=config.min_p or None, typical_p=config.typical_p,
                   epsilon_cutoff=config.epsilon_cutoff, eta_cutoff=config.eta_cutoff)
    assisted_kw = dict(assistant_model=hf_draft, num_assistant_tokens=c.k,
                       num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0.0)
    outputs = {m: {} for m in peer.METHODS}

    def run(method, i):
      prompts_1xP, lengths_1 = prompts_lib.for_call(prompts, lengths, [i])
      if method.startswith('hf_'):
        ids = torch.tensor(prompts_1xP[:, :lengths_1[0]], dtype=torch.long)
        torch.manual_seed(c.seed + i)
        with torch.no_grad():
          out = hf_target.generate(ids, **hf_kw, **(assisted_kw if method == 'hf_assisted'
                                                    else {}))
        new = out[:, ids.shape[1]:].numpy().astype(np.int32)
        return sampling.SampleOutput(tokens=new, num_generated=np.array([new.shape[1]], np.int32))
      key = jax.random.fold_in(jax.random.key(c.seed), i)
      kw = dict(max_new_tokens=c.max_new_tokens, sampling=config)
      if method == 'ars':
        return sampling.autoregressive_sample(target, prompts_1xP, lengths_1, key, **kw)
      return sampling.speculative_sample(target, draft, prompts_1xP, lengths_1, key, k=c.k, **kw)

    def seen(method, i, out):
      outputs[method][i] = np.asarray(out.tokens[0, :int(out.num_generated[0])]).tolist()

    started = time.time()
    width = lambda i: prompts_lib.for_call(prompts, lengths, [i])[0].shape[1]
    timings = timing.time_interleaved({m: (lambda i, m=m: run(m, i)) for m in peer.METHODS},
                                      len(texts), bucket=width, ks={'sps': c.k}, on_output=seen)
    identical = (sum(len({tuple(outputs[m][i]) for m in peer.METHODS}) == 1
                     for i in range(len(texts))) if greedy else None)
    row = peer.Row(decoding=decoding, timings=timings, identical=identical, prompts=len(texts))
    rows.append(row)
    records.append(dict(decoding=decoding, identical=identical, **{
        m: dict(tokens_per_second=row.tokens_per_second(m), speedup=row.speedup(m),
                timing=timings[m].summary()) for m in peer.METHODS}))
    print0(f'{decoding}: spsjax SpS {row.tokens_per_second("sps"):.1f} tokens/s, transformers '
           f'assisted {row.tokens_per_second("hf_assisted"):.1f} ({row.sps_over_assisted:.2f}x) '
           f'[{time.time() - started:.0f} s]', flush=True)
  table = peer.markdown(rows)
  print0(table)
  storage.write_text(storage.join(c.results, 'table.md'), table + '\n')
  storage.write_json(storage.join(c.results, 'table.json'), dict(config=c.to_dict(), rows=records),
                     indent=1)
  print0(f'Wrote {c.results}/table.md and table.json.')


if __name__ == '__main__':
  cli.run(main)
