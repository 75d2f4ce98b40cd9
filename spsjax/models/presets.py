"""Named model sizes shared by configs: keyword arguments for `TransformerConfig`.

`tiny_*` run the README's main job and the tests on a 2-core CPU; `bench150m` is the ~150M-parameter
model of the decode benchmark. Draft presets are wide and shallow relative to their target, as in
Chen et al. (2023): about 0.75 of the width and 1/8 to 1/10 of the depth.
"""

import copy

PRESETS = {
    'tiny_target': dict(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        d_ff=512, max_seq_len=512),
    'tiny_draft': dict(vocab_size=512, d_model=96, num_layers=1, num_heads=4, num_kv_heads=2,
                       d_ff=384, max_seq_len=512),
    'bench150m': dict(vocab_size=32_000, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                      max_seq_len=2048, tie_embeddings=False),
}


def get(name: str) -> dict:
  if name not in PRESETS:
    raise ValueError(f'Unknown model preset {name!r}; known: {sorted(PRESETS)}.')
  return copy.deepcopy(PRESETS[name])
