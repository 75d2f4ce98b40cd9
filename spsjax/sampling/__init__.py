"""Samplers: logit processors, autoregressive sampling and speculative sampling."""

from spsjax.sampling.autoregressive import autoregressive_sample
from spsjax.sampling.common import PAD_ID, SampleOutput
from spsjax.sampling.processors import SamplingConfig, probabilities, sample
from spsjax.sampling.speculative import speculative_sample

__all__ = ['PAD_ID', 'SampleOutput', 'SamplingConfig', 'autoregressive_sample', 'probabilities',
           'sample', 'speculative_sample']
