"""Samplers: logit processors, autoregressive sampling and speculative sampling.

Importing this package makes threefry hash without a loop on XLA:CPU (`native.threefry`): the
samplers draw in every step, and the loop's thunks cost more than the hash.
"""

from spsjax.native import threefry as _threefry

from spsjax.sampling.autoregressive import autoregressive_sample
from spsjax.sampling.common import PAD_ID, SampleOutput
from spsjax.sampling.processors import SamplingConfig, probabilities, sample
from spsjax.sampling.speculative import speculative_sample

_threefry.unroll_on_cpu()

__all__ = ['PAD_ID', 'SampleOutput', 'SamplingConfig', 'autoregressive_sample', 'probabilities',
           'sample', 'speculative_sample']
