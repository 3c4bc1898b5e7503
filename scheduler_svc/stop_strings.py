"""Stop strings on streamed text: the output ends where one is first completed, and no part of it
is ever streamed. Text that could still grow into a stop string (a suffix that is the start of
one) is held back until the next text decides; everything before it goes out at once, as vLLM
and TGI stream. Works on decoded text, so token boundaries and multi-byte characters do not
matter: the detokenizer only ever hands over whole characters."""


class StopStrings:
    def __init__(self, stops: tuple[str, ...], include_in_output: bool):
        self.stops = stops
        self.include_in_output = include_in_output
        self.held = ""  # text not streamed yet: it may be the start of a stop string

    def push(self, text: str, armed: bool = True) -> tuple[str, str | None]:
        """Adds new text; returns the text that may be streamed and the stop string completed
        (None if none). With a match the output ends: the text stops before the stop string (or
        after it, with include_in_output). Unarmed (min_tokens not reached), nothing matches."""
        buffer = self.held + text
        if armed:
            found = [(start, stop) for stop in self.stops if (start := buffer.find(stop)) >= 0]
            if found:
                # The earliest in the text; of two starting there, the shorter (completed first).
                start, stop = min(found, key=lambda match: (match[0], len(match[1])))
                self.held = ""
                return buffer[:start] + (stop if self.include_in_output else ""), stop
        keep = self._longest_partial_match(buffer)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], None

    def flush(self) -> str:
        """The text held back, when the output ends without a match."""
        held, self.held = self.held, ""
        return held

    def _longest_partial_match(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with (the whole stop
        string excluded: that would have matched)."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - length:]):
                    longest = length
                    break
        return longest
