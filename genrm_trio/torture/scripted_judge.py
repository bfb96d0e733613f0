"""The local driver's judge: answers, fails, hangs, crashes or returns NaN as the schedule's
``JudgeMode`` says, after the schedule's delays, and records every call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio
import trio.testing

from genrm_trio import scoring
from genrm_trio.errors import JudgeFailed
from genrm_trio.server.judge import JudgeRequest
from genrm_trio.torture.contract import PROMPTS, reference_verdict
from genrm_trio.torture.schedules import EVALUATION_TIMEOUT_S


@dataclass(slots=True)
class JudgeCall:
    """One comparison the registry asked for: when it started (virtual time) and the
    coordinates of both answers, read back from their text (see :func:`answer_text`)."""

    started_at: float
    group: int
    attempt: int
    prompt: int
    first: tuple[int, int]  # (slot, variant) of response_1
    second: tuple[int, int]

    @classmethod
    def of(cls, request: JudgeRequest, now: float) -> JudgeCall:
        def coords(text: str) -> tuple[int, int, int, int]:
            g, a, s, v = text.split(":", 1)[0].split(" ")
            return int(g[1:]), int(a[1:]), int(s[1:]), int(v[1:])

        g, a, s1, v1 = coords(request.response_1)
        _, _, s2, v2 = coords(request.response_2)
        prompt_text = request.history[0]["content"] if request.history else ""
        prompt = PROMPTS.index(prompt_text) if prompt_text in PROMPTS else -1
        return cls(now, g, a, prompt, (s1, v1), (s2, v2))


class ScriptedJudge:
    """A pair judge whose behaviour per group the schedule sets (see :class:`JudgeMode`).

    Verdicts are the heuristic judge's, so rewards can be recomputed. ``trouble`` remembers the
    groups whose calls could fail the cohort (a failing mode, or a delay past the evaluation
    deadline), ``crashed`` those that raised a non-judge error.
    """

    def __init__(self) -> None:
        self.modes: dict[int, tuple[str, float]] = {}
        self.calls = 0
        self.trouble: set[int] = set()
        self.crashed: set[int] = set()
        self.log: list[JudgeCall] = []

    async def judge_pair(self, request: JudgeRequest, group: object = None,
                         trace: object = None) -> scoring.Verdict:
        group = int(request.response_1.split(" ", 1)[0][1:])
        mode, delay_s = self.modes.get(group, ("ok", 0.0))
        self.calls += 1
        self.log.append(JudgeCall.of(request, trio.current_time()))
        if mode != "ok" or delay_s >= EVALUATION_TIMEOUT_S:
            self.trouble.add(group)
        if mode in ("crash", "nan"):
            self.crashed.add(group)
        if delay_s:
            await trio.sleep(delay_s)
        if mode == "fail":
            raise JudgeFailed(f"scripted judge failure for group {group}")
        if mode == "hang":
            await trio.sleep_forever()
        if mode == "crash":
            raise RuntimeError(f"scripted judge crash for group {group}")
        if mode == "nan":
            return scoring.Verdict(math.nan, 3.0, 3.5)
        return reference_verdict(request.history, request.response_1, request.response_2)
