"""Peer benchmark: `--config=configs/peer.py:hf_target=DIR,hf_draft=DIR` (needs the `hf` extra).

Arguments: hf_target, hf_draft (Llama directories, e.g. from experiments/export_hf.py; default the
600-step reference pair exported to exports/), prompts (HumanEval prompts, one call each),
max_new_tokens, k (drafts per loop; transformers' assistant drafts k tokens per round, constant),
threads (torch's intra-op threads; 0: torch's default), seed, results.
Decodings: greedy, and HumanEval's nucleus (temperature 0.8, top_p 0.95).
"""

import ml_collections

from spsjax.config_args import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, hf_target='exports/reference_600_target',
                hf_draft='exports/reference_600_draft_wide_distill', prompts=16,
                max_new_tokens=128, k=4, threads=2, seed=0, results='results/peer')
  c = ml_collections.ConfigDict(dict(a))
  c.decodings = dict(greedy=dict(temperature=0.0), nucleus=dict(temperature=0.8, top_p=0.95))
  return c
