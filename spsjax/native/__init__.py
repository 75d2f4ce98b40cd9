"""The native CPU path: C++ kernels for few-row products and cached attention, through `jax.ffi`.

- `library`: finds the built library, registers its FFI targets, says which instruction sets run
  and how many threads a call uses;
- `packed`: weights packed in panels (`PackedWeight`) and the product against them;
- `attention`: a few new positions rotated, written into the KV cache and attending over it;
- `lookup`: rows of an embedding table;
- `distribution`: the sampling distribution (temperature, top-k, top-p) and a draw from it, and
  speculative sampling's accept step;
- `threefry`: JAX's random bits hashed without a loop on the CPU.

The model asks for a product or an attention and never for a kernel: each function falls back to
XLA's ops for many rows, on other platforms and without the library. XLA's own ops stay the path
on TPU/GPU and for sharded models.
"""

from spsjax.native.attention import (attend, cached_attention, rope, rope_frequencies, tree_slots,
                                     write_rows)
from spsjax.native.distribution import accept, probabilities_and_draw
from spsjax.native.library import ISAS, available, isas
from spsjax.native.lookup import take_rows
from spsjax.native.packed import (PANEL, WEIGHT_DTYPES, PackedWeight, matmul, pack,
                                  quantize_rows, rms_norm, silu_gate, unpack)

__all__ = ['ISAS', 'PANEL', 'PackedWeight', 'accept', 'attend', 'available', 'cached_attention',
           'isas', 'matmul', 'pack', 'probabilities_and_draw', 'quantize_rows', 'rms_norm',
           'rope', 'rope_frequencies', 'silu_gate', 'take_rows', 'tree_slots', 'unpack',
           'WEIGHT_DTYPES', 'write_rows']
