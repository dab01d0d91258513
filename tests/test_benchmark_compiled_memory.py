"""benchmarks/probe_compiled_memory.py's reading of Inductor's generated code: what a forward graph keeps for the
backward, counted by whole buffers (a returned view keeps its buffer alive: what hid a compiled d768 step's extra
1.15 GiB from a count of the saved tensors' own bytes)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import probe_compiled_memory as probe  # noqa: E402

FORWARD = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((5, 8), (8, 1), torch.float32)
            kernel_0.run(primals_1, buf0, 40, stream=stream0)
            buf1 = empty_strided_cuda((5, 1), (1, 1), torch.float32)
            buf2 = empty_strided_cuda((4, 8), (8, 1), torch.bfloat16)
            buf3 = empty_strided_cuda((4, 8), (8, 1), torch.bfloat16)
            extern_kernels.mm(buf2, primals_2, out=buf3)
        return (buf3, primals_2, reinterpret_tensor(buf0, (1, 8), (8, 1), 32), buf1, )
'''


def test_a_forward_graph_keeps_whole_buffers_and_not_its_inputs():
    kept = probe.kept_by_forward_graph(FORWARD)
    # buf0 is returned as a one-row view: its 5 x 8 float32 storage counts whole; buf2 is not returned
    assert kept == {((5, 8), "float32"): [1, 160], ((5, 1), "float32"): [1, 20], ((4, 8), "bfloat16"): [1, 64]}


def test_a_backward_graph_keeps_nothing():
    backward = FORWARD.replace("primals_1, primals_2 = args", "primals_1, tangents_1 = args")
    assert probe.kept_by_forward_graph(backward) == {}
    assert probe.kept_by_forward_graph("def f():\n    return (1, )\n") == {}
