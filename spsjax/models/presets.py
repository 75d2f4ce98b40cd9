"""Named model sizes shared by configs: keyword arguments for `TransformerConfig`.

`tiny_*` run the README's main job and the tests on a 2-core CPU; `bench150m` is the ~150M-parameter
model of the decode benchmark, `llama1b` a 1.2B model of Llama 3.2 1B's shape for accelerators. Draft presets are wide and shallow relative to their target, as in
Chen et al. (2023): about 0.75 of the width and 1/8 to 1/10 of the depth.
"""

import copy

PRESETS = {
    # Tiny pair: trains in minutes on a 2-core CPU. The draft is wide-shallow (0.75 width, 1/4
    # depth: one layer is the floor); the deep draft has about the same parameter count.
    'tiny_target': dict(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        d_ff=384, max_seq_len=512),
    'tiny_draft': dict(vocab_size=2048, d_model=96, num_layers=1, num_heads=4, num_kv_heads=2,
                       d_ff=288, max_seq_len=512),
    'tiny_draft_deep': dict(vocab_size=2048, d_model=64, num_layers=4, num_heads=2,
                            num_kv_heads=1, d_ff=192, max_seq_len=512),
    'tiny_draft_mid': dict(vocab_size=2048, d_model=80, num_layers=2, num_heads=4,
                           num_kv_heads=2, d_ff=240, max_seq_len=512),
    # Demo pair (`make demo`): a target big enough that its step (~0.35-0.5 ms here) outweighs
    # the fixed costs of a step (the tiny target's does not), and a one-layer draft at half its
    # width, ~1/10 of its step; trained in minutes, the draft distilled from the target.
    'demo_target': dict(vocab_size=2048, d_model=256, num_layers=6, num_heads=4, num_kv_heads=2,
                        d_ff=768, max_seq_len=512),
    'demo_draft': dict(vocab_size=2048, d_model=128, num_layers=1, num_heads=4, num_kv_heads=2,
                       d_ff=384, max_seq_len=512),
    'demo_draft_deep': dict(vocab_size=2048, d_model=80, num_layers=4, num_heads=4,
                            num_kv_heads=2, d_ff=240, max_seq_len=512),
    'demo_draft_mid': dict(vocab_size=2048, d_model=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, d_ff=288, max_seq_len=512),
    # Reference pair: a target whose decode step (~4 ms here) dwarfs dispatch overheads and that
    # trains (600 steps) in under an hour on 2 cores; drafts at 0.75 width and 1/8 depth (wide)
    # or with the wide draft's parameter count (deep), and one in between (mid: 2 layers), for the
    # draft-topology sweep. Sizes and timings: docs/training.md, "Trained models".
    'reference_target': dict(vocab_size=4096, d_model=384, num_layers=8, num_heads=6,
                             num_kv_heads=2, d_ff=1024, max_seq_len=1024),
    'reference_draft': dict(vocab_size=4096, d_model=288, num_layers=1, num_heads=6,
                            num_kv_heads=2, d_ff=768, max_seq_len=1024),
    'reference_draft_deep': dict(vocab_size=4096, d_model=160, num_layers=4, num_heads=5,
                                 num_kv_heads=1, d_ff=480, max_seq_len=1024),
    'reference_draft_mid': dict(vocab_size=4096, d_model=224, num_layers=2, num_heads=7,
                                num_kv_heads=1, d_ff=608, max_seq_len=1024),
    'bench150m': dict(vocab_size=32_000, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                      max_seq_len=2048, tie_embeddings=False),
    # Llama-3.2-1B's shape (1.24B parameters, GQA 32/8, tied 128k vocabulary): the accelerator
    # check's large model, randomly initialised.
    'llama1b': dict(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=32,
                    num_kv_heads=8, d_ff=8192, max_seq_len=2048, rope_base=500_000.0),
    # Pythia-160M's and Pythia-70M's shapes (GPT-NeoX: LayerNorm, biases, a parallel block, a
    # quarter of each head rotated, GELU with erf): the classic pair of one tokenizer, randomly
    # initialised, for the decode benchmark of those options' paths.
    'pythia160m': dict(vocab_size=50_304, d_model=768, num_layers=12, num_heads=12, d_ff=3072,
                       max_seq_len=2048, tie_embeddings=False, mlp='gelu_exact', norm='layer',
                       norm_eps=1e-5, qkv_bias=True, dense_bias=True, rope_dims=16,
                       parallel_residual=True),
}
PRESETS['pythia160m_draft'] = dict(PRESETS['pythia160m'], d_model=512, num_layers=6, num_heads=8,
                                   d_ff=2048)

# Truncated drafts: a target's first layer at the target's width, started from the trained
# target's embedding, layer 0 and final norm (`models.truncated_params`), then trained.
for _size in ('tiny', 'demo', 'reference'):
  PRESETS[f'{_size}_draft_trunc'] = dict(PRESETS[f'{_size}_target'], num_layers=1)
del _size
# The benchmark models' drafts (the perfect-draft ceiling's): two narrow layers over the target's
# vocabulary, a step reading ~6% of the target's bytes (the output layer is most of it).
PRESETS['bench150m_draft'] = dict(PRESETS['bench150m'], d_model=256, num_layers=2, num_heads=4,
                                  d_ff=1024)
PRESETS['llama1b_draft'] = dict(PRESETS['llama1b'], d_model=512, num_layers=2, num_heads=8,
                                num_kv_heads=2, d_ff=2048)


def get(name: str) -> dict:
  if name not in PRESETS:
    raise ValueError(f'Unknown model preset {name!r}; known: {sorted(PRESETS)}.')
  return copy.deepcopy(PRESETS[name])
