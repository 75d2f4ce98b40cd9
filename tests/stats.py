"""The exactness statistics the sampler tests use (`spsjax.eval.exactness`), under the name the
tests import them by."""

from spsjax.eval.exactness import (detectable_tv, exact_sequence_law, g_test_pvalue,
                                   scaled_model, sequence_counts, truncated_at_eos,
                                   two_sample_pvalue)

__all__ = ['detectable_tv', 'exact_sequence_law', 'g_test_pvalue', 'scaled_model',
           'sequence_counts', 'truncated_at_eos', 'two_sample_pvalue']
