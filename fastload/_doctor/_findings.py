"""What a check found: a typed finding with a severity, what is wrong and what to change."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Severity(enum.IntEnum):
    """How much a finding matters: ``INFO`` is said for completeness, ``WARNING`` will slow the
    run or put it at risk, ``ERROR`` will make it fail."""

    INFO = 0
    WARNING = 1
    ERROR = 2


@dataclass(frozen=True)
class Finding:
    """One check's result: ``check`` names the check (``"shm"``, ``"open-files"``, ...),
    ``message`` says what was found with its numbers, ``remedy`` what to change (empty for
    ``INFO``)."""

    check: str
    severity: Severity
    message: str
    remedy: str = ""

    def __str__(self) -> str:
        text = f"[{self.severity.name.lower()}] {self.check}: {self.message}"
        return f"{text}\n    -> {self.remedy}" if self.remedy else text


@dataclass(frozen=True)
class Report:
    """Every finding of ``fastload.doctor``, most severe first. ``ok`` is ``True`` when none is
    a warning or an error; ``str()`` is the report ``fastload doctor`` prints."""

    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def problems(self) -> tuple[Finding, ...]:
        """The warnings and errors."""
        return tuple(f for f in self.findings if f.severity >= Severity.WARNING)

    def __str__(self) -> str:
        if not self.findings:
            return "fastload doctor: nothing to report"
        head = (
            "fastload doctor: no problems found"
            if self.ok
            else f"fastload doctor: {len(self.problems)} problem(s) to fix before the first step"
        )
        return "\n".join([head, *(str(f) for f in self.findings)])


def sort(findings: list[Finding]) -> tuple[Finding, ...]:
    return tuple(sorted(findings, key=lambda f: -f.severity))


__all__ = ["Finding", "Report", "Severity", "sort"]
