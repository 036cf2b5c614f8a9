"""The server's streaming hot path below HTTP: ``RequestStream.batches()`` (every output that
arrived while the reader was busy, as one list) and the per-loop waker (one loop callback per
burst of outputs, not one per output). No engine: a thread plays the engine's part."""
from __future__ import annotations

import asyncio
import threading

import pytest

from hearth_llm.engine import RequestFailedError, StreamOutput
from hearth_llm.engine import streams as streams_module
from hearth_llm.engine.streams import RequestStream


def _stream(aborted: list | None = None) -> RequestStream:
    return RequestStream("r", None, abort=lambda s: (aborted if aborted is not None else []).append(s),
                         is_engine_alive=lambda: True)


def _out(text: str, finished: bool = False) -> StreamOutput:
    return StreamOutput("r", text, [len(text)], finish_reason="length" if finished else None, finished=finished)


def test_outputs_put_before_the_reader_wakes_come_as_one_batch_and_the_stream_ends_at_the_last():
    stream = _stream()
    for text in ("a", "b", "c"):
        stream.put(_out(text))

    async def read():
        batches = []
        async for batch in stream.batches():
            batches.append([out.delta_text for out in batch])
            if len(batches) == 1:  # the engine goes on from its own thread while the reader waits
                threading.Thread(target=lambda: (stream.put(_out("d")), stream.put(_out("e", finished=True)))).start()
        return batches

    batches = asyncio.run(read())
    assert batches[0] == ["a", "b", "c"]
    assert [text for batch in batches[1:] for text in batch] == ["d", "e"]


def test_an_error_after_outputs_is_raised_after_they_are_handed_over():
    stream = _stream()
    stream.put(_out("a"))
    stream.put(RequestFailedError("boom"))
    seen = []

    async def read():
        async for batch in stream.batches():
            seen.extend(out.delta_text for out in batch)

    with pytest.raises(RequestFailedError, match="boom"):
        asyncio.run(read())
    assert seen == ["a"]


def test_a_reader_that_leaves_early_aborts_its_request():
    aborted = []
    stream = _stream(aborted)
    stream.put(_out("a"))

    async def read():
        async for _ in stream.batches():
            break

    asyncio.run(read())
    assert aborted == [stream]


def test_a_burst_of_outputs_for_many_streams_wakes_the_loop_once(monkeypatch):
    num_streams = 64
    streams = [_stream() for _ in range(num_streams)]
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: (calls.append(a), original(*a))[1])
        readers = [asyncio.create_task(anext(aiter(s.batches()))) for s in streams]
        await asyncio.sleep(0.05)  # every reader waits
        done = threading.Event()

        def engine_step():  # holds no lock the loop needs, as the engine thread's dispatch
            for stream in streams:
                stream.put(_out("x", finished=True))
            done.set()

        # the loop is blocked until the whole burst is in: its one scheduled flush wakes every reader
        thread = threading.Thread(target=engine_step)
        thread.start()
        done.wait(5)
        batches = await asyncio.gather(*readers)
        thread.join()
        return batches

    batches = asyncio.run(main())
    assert all([out.delta_text for out in batch] == ["x"] for batch in batches)
    flushes = [call for call in calls if getattr(call[0], "__name__", "") == "_flush"]
    assert len(flushes) == 1  # (the other calls are asyncio's closing of the readers' generators)


def test_a_put_for_a_reader_whose_loop_closed_says_nobody_reads():
    stream = _stream()
    loop = asyncio.new_event_loop()
    reader = aiter(stream.batches())
    task = loop.create_task(anext(reader))
    loop.run_until_complete(asyncio.sleep(0.01))  # the reader waits on its future
    assert not task.done()
    loop.close()  # as a server's loop that is gone while the engine still steps
    assert stream.put(_out("a")) is False
    assert streams_module._LoopWaker(loop).wake(asyncio.Future(loop=loop)) is False


@pytest.mark.parametrize("include_usage", [True, False])
def test_the_fast_completion_chunk_is_the_same_characters_as_the_general_one(include_usage):
    from hearth_llm.engine import SamplingParams
    from hearth_llm.server.completions import _Logprobs, _Reply

    reply = _Reply('cmpl-"x', 123, 'm\u00e9"del', SamplingParams(n=2), False, [[1]], None, include_usage=include_usage)
    for text, finish_reason in (('h\u00e9 "\n\\ \u2028 \x01', None), ("", "length"), ("\U0001F600", "stop")):
        for index in range(2):
            general = reply._chunk([reply._choice(0, index, text, _Logprobs(), finish_reason)])
            assert reply._text_chunk(index, text, finish_reason) == general
