"""What gpufeed doctor reports: a :class:`Check` per finding (its status, the fix when not
ok, its numbers) and the :class:`DoctorReport` they make up, with the preflight's exit codes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufeed._version import __version__

__all__ = [
    "EXIT_CONFIG",
    "EXIT_DRIVER_OLD",
    "EXIT_NO_DRIVER",
    "EXIT_OK",
    "FAIL",
    "INFO",
    "OK",
    "WARN",
    "Check",
    "DoctorReport",
]

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
# the preflight's exit codes (entrypoints/preflight.sh)
EXIT_OK, EXIT_CONFIG, EXIT_DRIVER_OLD, EXIT_NO_DRIVER = 0, 2, 3, 4


@dataclass
class Check:
    section: str
    name: str
    status: str
    message: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0  # for a "fail": the exit status it stands for


@dataclass
class DoctorReport:
    checks: list[Check]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        """The first failure's code (as the preflight does), 0 when nothing failed."""
        return next((c.exit_code or 1 for c in self.checks if c.status == FAIL), EXIT_OK)

    def by_name(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {', '.join(c.name for c in self.checks)}")

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARN, FAIL, INFO)}

    def to_json(self) -> dict[str, Any]:
        return {
            "gpufeed": __version__,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "checks": [asdict(c) for c in self.checks],
        }

    def format(self, only_problems: bool = False, data: bool = False) -> str:
        """The report as text: every check (``only_problems``: the warnings and failures and
        the verdict line), with each check's numbers when ``data``."""
        tags = {OK: " OK ", WARN: "WARN", FAIL: "FAIL", INFO: "INFO"}
        lines, section = [] if only_problems else [f"gpufeed doctor ({__version__})"], None
        for c in self.checks:
            if only_problems and c.status not in (WARN, FAIL):
                continue
            if c.section != section:
                section = c.section
                lines.append(f"{section}")
            lines.append(f"  [{tags[c.status]}] {c.message}")
            if c.fix and c.status in (WARN, FAIL):
                lines.append(f"         fix: {c.fix}")
            if data and c.data:
                lines.append(f"         data: {json.dumps(c.data, default=str)}")
        n = self.counts()
        verdict = "hard requirement failed" if not self.ok else "ready"
        lines.append(
            f"{verdict}: {n[OK]} ok, {n[WARN]} warning(s), {n[FAIL]} failed "
            f"(exit {self.exit_code}, {self.seconds:.1f} s)"
        )
        return "\n".join(lines)

    __str__ = format
