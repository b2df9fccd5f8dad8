"""``--template "Summarise: {title}\\n{body}"``: a prompt made of literal text and
column values.

The only syntax is ``{name}`` (a column, any characters but braces), ``{{`` /
``}}`` for literal braces, and in the template's own text ``\\n``, ``\\t`` and
``\\\\`` for a newline, a tab and a backslash (a shell's double quotes pass
``"{title}\\n{body}"`` on as a backslash and an n). Values are inserted as they
are, never evaluated or formatted: no ``str.format`` attribute, index or
conversion syntax exists here, so ``{a.b}`` or ``{a[0]}`` simply name a column
called that.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.jobs.schema.errors import UsageError

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


@dataclass(frozen=True, slots=True)
class Template:
    parts: tuple[str, ...]  # literal text at even positions, column names at odd ones

    @property
    def columns(self) -> list[str]:
        """The columns it names, first use first, each once."""
        return list(dict.fromkeys(self.parts[1::2]))

    def render(self, values: dict[str, str]) -> str:
        parts = list(self.parts)
        parts[1::2] = [values[name] for name in self.parts[1::2]]
        return "".join(parts)


def parse(text: str) -> Template:
    """The template, or a UsageError saying where it is malformed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("--template: not valid UTF-8 text") from None
    parts: list[str] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "\\" and text[i + 1 : i + 2] in _ESCAPES:
            literal.append(_ESCAPES[text[i + 1]])
            i += 2
        elif char == "{" and text.startswith("{{", i):
            literal.append("{")
            i += 2
        elif char == "}" and text.startswith("}}", i):
            literal.append("}")
            i += 2
        elif char == "{":
            end = text.find("}", i + 1)
            opened = text.find("{", i + 1)
            if end < 0 or 0 <= opened < end:
                raise UsageError(
                    f"--template: '{{' at character {i + 1} is not closed by '}}' "
                    "(write {{ for a literal brace)"
                )
            name = text[i + 1 : end]
            if not name:
                raise UsageError(f"--template: empty {{}} at character {i + 1}; name a column")
            parts += ["".join(literal), name]
            literal = []
            i = end + 1
        elif char == "}":
            raise UsageError(
                f"--template: single '}}' at character {i + 1} (write }}}} for a literal brace)"
            )
        else:
            literal.append(char)
            i += 1
    parts.append("".join(literal))
    if len(parts) == 1:
        raise UsageError("--template names no column; use {column} for a column's value")
    return Template(tuple(parts))
