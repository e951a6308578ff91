"""Stop strings, matched on the decoded text across token boundaries.

Text that could still be the start of a stop string is held back until it can be ruled out,
so a stop string never reaches the client unless the request asks for it
(``include_stop_str_in_output``), and then exactly once, ending the text.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings in streamed text deltas, holding back what could start one."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop = include_stop
        self._pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). After a stop, the
        emitted text ends just before the stop string (just after it with ``include_stop``)."""
        if not self.stops:  # nothing to look for (most requests): every delta goes out as is
            return delta, False
        text = self._pending + delta
        hits = [(index, len(stop)) for index, stop in
                ((text.find(s), s) for s in self.stops) if index >= 0]
        if hits:
            self._pending = ""
            index, length = min(hits)
            return text[:index + (length if self.include_stop else 0)], True
        held = self._held_suffix(text)
        self._pending = text[len(text) - held:]
        return text[:len(text) - held], False

    def flush(self) -> str:
        """The held-back text, once the sequence ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
