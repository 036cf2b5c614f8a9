"""Incremental detokenization and stop-string matching for one sequence."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Appends text token by token without replacement characters mid-stream, matches stop strings
    across token boundaries, and holds back text that may still become a stop string.

    >>> detok = IncrementalDetokenizer(tokenizer, stop_strings=("\\n\\n",))
    >>> detok.add_token(token_id)   # → the stop string it hit, or None
    >>> detok.take_stream_delta()   # text that is safe to show now
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self.backend is not None else None
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop_strings), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.num_streamed_chars = 0
        self.is_stopped = False

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string if the text now contains one."""
        self.token_ids.append(token_id)
        previous_len = len(self.text)
        self.text += self._decode_next(token_id)
        if check_stop and self.stop_strings:
            return self._truncate_at_stop(previous_len)
        return None

    def take_stream_delta(self, is_final: bool = False) -> str:
        """New text since the last call, minus a tail that might be the start of a stop string."""
        end = len(self.text) if (is_final or self.is_stopped) else len(self.text) - self._partial_stop_len()
        if end <= self.num_streamed_chars:
            return ""
        delta = self.text[self.num_streamed_chars:end]
        self.num_streamed_chars = end
        return delta

    def _decode_next(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for its remaining bytes
        return full[len(self.text):]

    def _truncate_at_stop(self, previous_len: int) -> str | None:
        search_from = max(0, previous_len - self.max_stop_len + 1)
        best = None
        for stop in self.stop_strings:
            position = self.text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        self.text = self.text[: position + len(stop)] if self.include_stop_str_in_output else self.text[:position]
        self.is_stopped = True
        return stop

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
