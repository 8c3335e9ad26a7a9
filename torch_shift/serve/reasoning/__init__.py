"""Reasoning separated from the answer (`--reasoning-parser`, vLLM's names), for models that think between
`<think>` and `</think>`: whole (`parse`) or streamed (`feed` pieces of any size, then `finish`), the same
either way. The answer alone (the content) goes on to tool-call parsing.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): everything up to `</think>` is reasoning, whether or not
  the output begins with `<think>` (newer templates put it in the prompt; a `<think>` later in the reasoning is
  dropped, the text around it kept); no `</think>`: all reasoning; but where
  the prompt's last thinking marker is `</think>` (thinking turned off in the template), the output is content.
- `qwen3` (Qwen3, Qwen3-Thinking-2507, Qwen3.5): the output is reasoning up to `</think>` when it begins with
  `<think>` or when the rendered prompt ends inside an open `<think>` (templates that start the thinking
  themselves; a later `<think>` dropped as for `deepseek_r1`); otherwise all of it is content, as with
  `chat_template_kwargs={"enable_thinking": false}`, where the template closes an empty thinking block in the prompt.
  A thinking block the model never closes ends at its first `<tool_call>`, the call beginning the content (vLLM
  0.32's qwen3 takes every `<tool_call>` so; here one inside a block that does close stays reasoning).
"""

from __future__ import annotations

from torch_shift.serve.tool_parsers.base import held_marker_prefix
from torch_shift.serve.tool_parsers.json_calls import WHITESPACE

START, END = "<think>", "</think>"


class ReasoningParser:
    """One output's reasoning and content; make one per choice."""

    name = ""
    end = END  # the text that ends the reasoning (a constrained output's grammar waits for it)
    # markers that begin the content where the reasoning never ends: held from there until END comes (reasoning
    # after all) or the output ends (content)
    implicit_ends: tuple[str, ...] = ()

    def __init__(self, prompt: str = ""):
        # "opening": the output may begin with <think>; "reasoning" until </think>; then "content"
        self._state = "opening"
        self._buffer = ""
        self._after_opening = "reasoning" if self.starts_in_reasoning(prompt) else "content"
        # reasoning that did not begin with <think>: the marker, where it comes before </think>, is dropped and
        # the text on both sides of it kept as reasoning (vLLM's streamed deepseek_r1 output; its whole-output
        # parse drops the text before the marker)
        self._unopened = False

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether an output that does not begin with <think> is reasoning."""
        raise NotImplementedError

    @staticmethod
    def prompt_closed_reasoning(prompt: str) -> bool:
        """Whether the prompt's last thinking marker closes a block: the answer follows at once."""
        return prompt.rfind(END) > prompt.rfind(START)

    def feed(self, text: str) -> tuple[str, str]:
        """Read more of the output: the (reasoning, content) text that can be sent now."""
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    @classmethod
    def parse(cls, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """A whole output's (reasoning, content); None where there is none."""
        parser = cls(prompt)
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "opening":
            text = self._buffer.lstrip(WHITESPACE)
            if text.startswith(START):
                self._buffer, self._state = text[len(START):], "reasoning"
            elif not final and START.startswith(text):
                return "", ""  # whitespace or the start of <think>: undecided
            else:
                self._state = self._after_opening
                self._unopened = self._state == "reasoning"
        if self._state == "reasoning":
            end = self._buffer.find(END)
            if self._unopened:
                start = self._buffer.find(START)
                if 0 <= start and (end < 0 or start < end):
                    self._buffer = self._buffer[:start] + self._buffer[start + len(START):]
                    self._unopened = False
                    end = self._buffer.find(END)
                elif end >= 0:
                    self._unopened = False
            implicit = min((i for i in map(self._buffer.find, self.implicit_ends) if i >= 0), default=-1)
            if end < 0 and implicit >= 0:
                reasoning, self._buffer = self._buffer[:implicit], self._buffer[implicit:]
                if not final:
                    return reasoning, ""
                self._state = "content"
            elif end < 0:
                keep = 0 if final else max(held_marker_prefix(self._buffer, END),
                                           held_marker_prefix(self._buffer, START) if self._unopened else 0,
                                           *(held_marker_prefix(self._buffer, m) for m in self.implicit_ends))
                reasoning = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            else:
                reasoning, self._buffer, self._state = self._buffer[:end], self._buffer[end + len(END):], "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def starts_in_reasoning(self, prompt: str) -> bool:
        return not self.prompt_closed_reasoning(prompt)  # a template that closed the block: the answer follows


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)  # a call in a block the model never closed: the answer (vLLM 0.32's qwen3)

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt.rfind(START) > prompt.rfind(END)  # the prompt ends inside an open thinking block


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; torch_shift has "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
