"""How a step's outputs cross the pipe of ``engine_core="process"`` (what a server over a process
core streams): plain token outputs as compact tuples, everything else as the output itself."""
from __future__ import annotations

import pickle

from hearth_llm.engine.core_process.messages import Outputs, compact, expanded
from hearth_llm.engine.outputs import Logprob, StreamOutput, Usage


def test_a_plain_token_output_crosses_as_a_tuple_and_comes_back_equal():
    output = StreamOutput("cmpl-1", " the", [1234, 9], index=2)
    entry = compact(7, output)
    assert entry == (7, " the", [1234, 9], 2)
    received = pickle.loads(pickle.dumps(Outputs([entry]))).items[0]
    assert expanded("cmpl-1", received) == output


def test_outputs_with_more_than_tokens_cross_whole():
    last = StreamOutput("cmpl-1", "!", [5], finish_reason="length", finished=True, usage=Usage(3, 4, 0))
    finishing_sample = StreamOutput("cmpl-1", "", [2], index=1, finish_reason="stop", stop_reason=2)
    with_logprobs = StreamOutput("cmpl-1", "a", [6], logprobs=[{6: Logprob(-0.5, 1, "a")}])
    error = ValueError("prompt too long")
    for item in (last, finishing_sample, with_logprobs, error):
        assert compact(3, item) == (3, item)
        assert expanded("cmpl-1", compact(3, item)) is item
