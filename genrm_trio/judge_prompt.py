"""The ``plain`` judge prompt: standard ``system``/``user`` messages any instruct model can read.

Pure core: no I/O. ``judge.prompt: plain`` renders one comparison through a template into
ordinary chat messages (GenRM's ``response_1``/``response_2``/``principle`` roles are understood
only by a GenRM chat template, and stock servers reject them). The default template is
:data:`DEFAULT_TEMPLATE`; ``judge.prompt_template_file`` replaces it.

Template syntax (Python's :class:`string.Template`): ``${name}`` placeholders, ``$$`` for a
literal dollar sign. Every one of :data:`PLACEHOLDERS` must appear at least once, and no other
name may:

* ``${principle}``: the judging instruction: the request's principle when ``use_principle``,
  else ``default_principle`` (a plain model has no built-in judging instruction);
* ``${conversation}``: the conversation, one ``[role]`` line and its text per message;
* ``${response_1}``, ``${response_2}``: the two final answers.

Optional section lines split the file into messages: a line ``--- system ---`` starts the
system message and a line ``--- user ---`` the user message (text before the first section
line must be blank). A template without section lines is one user message.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PLACEHOLDERS: tuple[str, ...] = ("principle", "conversation", "response_1", "response_2")

SYSTEM_MARKER = "--- system ---"
USER_MARKER = "--- user ---"

#: Largest template file accepted (characters).
MAX_TEMPLATE_CHARS = 64 * 1024

DEFAULT_TEMPLATE = """\
--- system ---
You are an impartial judge of AI assistant answers. You compare two answers to the same
conversation and reply with a single JSON object and nothing else.
--- user ---
${principle}

<conversation>
${conversation}
</conversation>

<response_1>
${response_1}
</response_1>

<response_2>
${response_2}
</response_2>

Rate how helpful each response is as the assistant's next turn, from 1 (useless) to 5
(excellent), and give a ranking from 1 to 6: 1 = response 1 is much better, 2 = better,
3 = slightly better, 4 = response 2 is slightly better, 5 = better, 6 = much better.
Reply with exactly one JSON object of this form and nothing else:
{"score_1": <1-5>, "score_2": <1-5>, "ranking": <1-6>}
"""

VERDICT_SCHEMA_NAME = "genrm_verdict"


def verdict_schema() -> dict[str, object]:
    """The verdict as a JSON schema (a fresh dict each call), for ``judge.structured_output``:
    integer scores 1-5 and ranking 1-6, all three required, nothing else."""
    score = {"type": "integer", "enum": [1, 2, 3, 4, 5]}
    return {
        "type": "object",
        "properties": {
            "score_1": dict(score),
            "score_2": dict(score),
            "ranking": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6]},
        },
        "required": ["score_1", "score_2", "ranking"],
        "additionalProperties": False,
    }


class TemplateError(ValueError):
    """A template that cannot be used; the message names the problem (and the placeholder)."""


@dataclass(frozen=True, slots=True)
class PlainPrompt:
    """A checked template: the system part (None: no system message) and the user part."""

    system: string.Template | None
    user: string.Template

    def render(
        self, history: Sequence[Mapping[str, str]], response_1: str, response_2: str,
        principle: str,
    ) -> list[dict[str, str]]:
        """The messages for one comparison. Never raises for a checked template."""
        values = {
            "principle": principle,
            "conversation": render_conversation(history),
            "response_1": response_1,
            "response_2": response_2,
        }
        messages = []
        if self.system is not None:
            messages.append({"role": "system", "content": self.system.substitute(values)})
        messages.append({"role": "user", "content": self.user.substitute(values)})
        return messages


def render_conversation(history: Sequence[Mapping[str, str]]) -> str:
    """The conversation as text: ``[role]`` then the message, messages one blank line apart."""
    return "\n\n".join(
        f"[{m.get('role', 'user')}]\n{m.get('content', '')}" for m in history
    )


def parse_template(text: str) -> PlainPrompt:
    """Check ``text`` and split it into messages; raises :class:`TemplateError` naming the
    first problem (a missing or unknown placeholder, a bad ``$``, a misplaced section line)."""
    if len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"template is over {MAX_TEMPLATE_CHARS} characters")
    parts: dict[str, list[str]] = {}
    current: list[str] | None = None
    preamble: list[str] = []
    for line in text.splitlines(keepends=True):
        marker = line.strip()
        if marker in (SYSTEM_MARKER, USER_MARKER):
            name = "system" if marker == SYSTEM_MARKER else "user"
            if name in parts:
                raise TemplateError(f"section line {marker!r} appears twice")
            current = parts[name] = []
        elif current is None:
            preamble.append(line)
        else:
            current.append(line)
    if parts and "".join(preamble).strip():
        raise TemplateError("text before the first section line")
    if not parts:
        parts["user"] = preamble
    if "user" not in parts:
        raise TemplateError(f"no {USER_MARKER!r} section")
    system_text = "".join(parts["system"]).strip() if "system" in parts else None
    user_text = "".join(parts["user"]).strip()
    if not user_text:
        raise TemplateError("the user message is empty")
    found: set[str] = set()
    templates: list[string.Template | None] = []
    for section, body in (("system", system_text), ("user", user_text)):
        if body is None:
            templates.append(None)
            continue
        template = string.Template(body)
        if not template.is_valid():
            raise TemplateError(
                f"invalid '$' in the {section} section (write $$ for a literal dollar sign)"
            )
        for name in template.get_identifiers():
            if name not in PLACEHOLDERS:
                raise TemplateError(f"unknown placeholder ${{{name}}}")
            found.add(name)
        templates.append(template)
    for name in PLACEHOLDERS:
        if name not in found:
            raise TemplateError(f"missing placeholder ${{{name}}}")
    system, user = templates
    assert user is not None
    return PlainPrompt(system, user)


DEFAULT_PROMPT = parse_template(DEFAULT_TEMPLATE)
