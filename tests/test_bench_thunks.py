"""Reading XLA:GPU's thunk sequence: what one iteration of a loop launches."""

import pytest

from spsjax.bench import thunks

# The layout XLA:GPU writes (JAX 0.11.2, deviceless H100), names and grids shortened: a command
# buffer before the loop, then a loop whose condition runs alone and whose body is a command
# buffer, a copy outside it and an inner loop with a kernel outside any graph.
SEQUENCE = '''\
000: kCommandBuffer [source       | next=004 (1) ] 
    001: kCustomKernel [source       | next=002 (1)] input_reduce_fusion grid: [63, 1, 1]
    002: kCustomKernel [prev=001 (1) | next=003 (1)] loop_select_fusion grid: [2, 1, 1]
    003: kCustomKernel [prev=002 (1) | sink        ] sort_2_1 grid: [288, 1, 1]
004: kWhile         [prev=000 (1) | next=014 (1)]   
condition:
    005: kCustomKernel [source | sink] wrapped_not grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | sink] 
        006: kCustomKernel [source        | next=007 (1) ] input_reduce_fusion_78 grid: [1, 1, 1]
        007: kCustomKernel [prev=006 (1) | next=008 (1) ] sort_17_1 grid: [32, 1, 1]
        008: kCustomKernel [prev=007 (1) | sink          ] sort_17_1__1 grid: [128, 1, 1]
    009: kCopy          [prev=000 (1) | next=010 (1)] kCopy
    010: kWhile         [prev=009 (1) | sink        ]   
    condition:
        011: kCustomKernel [source | sink] wrapped_not_1 grid: [1, 1, 1]
      body:
        000: kCommandBuffer [source | sink] 
            012: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1]
        013: kCustomKernel [source | sink] fusion_9 grid: [4, 1, 1]
014: kCopy          [prev=004 (1) | sink         ] kCopy
'''


def test_one_iteration_of_the_loop_that_launches_most():
  # Condition 1, body: 3 kernels in a graph, a copy, an inner loop once (its condition, a
  # kernel in a graph and one outside): 8 launches, 2 graphs, 4 outside (condition, copy, the
  # inner condition and the inner kernel outside its graph).
  assert thunks.main_loop(SEQUENCE) == thunks.Loop(launches=8, graphs=2, outside=4,
                                                   inner_loops=1)


def test_a_program_without_a_loop_has_none_and_a_stray_label_is_an_error():
  assert thunks.main_loop(SEQUENCE.split('004:')[0]) is None
  with pytest.raises(ValueError, match='outside a loop'):
    thunks.parse('body:\n    001: kCustomKernel [source | sink] f grid: [1, 1, 1]\n')
