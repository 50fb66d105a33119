"""What a campaign found: trials, kills, violations per invariant, and how to replay them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import AsientoError
from .invariants import INVARIANTS, Violation


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run of a campaign: its seed or case, and per operation the fault and the outcome."""

    run_id: str
    seed: int | None
    case: str | None
    ops: tuple[tuple[str, str | None, str], ...]  # (operation, fault, outcome or "killed")


class CampaignFailed(AsientoError, AssertionError):
    """A campaign found violations; the message lists them with their replay commands.

    Also an ``AssertionError``, so that pytest reports it as a failed check.
    """


@dataclass
class Report:
    """One campaign on one backend.

    ``trials``: runs driven to their end (matrix: one per crash-point case);
    ``kills``: SIGKILLs that landed; ``faults``: everything done to the runs,
    by kind; ``missed``: matrix cases whose crash point was never reached
    (the app is not deterministic, or a point moved); ``coverage``: for each
    crash point, the passages the dry run went through.
    """

    campaign: str
    backend: str
    trials: int = 0
    kills: int = 0
    operations: int = 0
    seconds: float = 0.0
    seed: int | None = None
    violations: list[Violation] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    missed: list[str] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    runs: list[RunSummary] = field(default_factory=list)

    @property
    def by_invariant(self) -> dict[str, int]:
        """Violations per invariant, every invariant listed (zero included)."""
        counts = Counter(v.invariant for v in self.violations)
        names = list(INVARIANTS) + sorted(set(counts) - set(INVARIANTS))
        return {name: counts[name] for name in names}

    def merge(self, other: Report) -> None:
        """Add another report's counts (same campaign and backend) to this one."""
        self.trials += other.trials
        self.kills += other.kills
        self.operations += other.operations
        self.seconds += other.seconds
        self.violations += other.violations
        self.faults.update(other.faults)
        self.missed += other.missed
        self.notes += other.notes
        self.runs += other.runs

    def row(self) -> dict[str, Any]:
        """The report as one row of the reliability table."""
        return {
            "campaign": self.campaign,
            "backend": self.backend,
            "trials": self.trials,
            "kills": self.kills,
            "violations": len(self.violations),
            "seconds": round(self.seconds, 1),
        }

    def summary(self, limit: int = 20) -> str:
        """Counts, then the first violations with their replay commands."""
        head = (
            f"{self.campaign} on {self.backend}: {self.trials} trials, {self.kills} kills, "
            f"{self.operations} operations, {len(self.violations)} violations in "
            f"{self.seconds:.1f} s" + (f" (seed {self.seed})" if self.seed is not None else "")
        )
        lines = [head]
        if self.faults:
            lines.append("faults: " + ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())))
        if self.missed:
            lines.append(f"crash points never reached: {self.missed[:limit]}")
        lines += self.notes
        for v in self.violations[:limit]:
            lines.append(f"  {v}")
            if v.replay:
                lines.append(f"    replay: {v.replay}")
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        return "\n".join(lines)

    def raise_if_violations(self) -> None:
        """Raise ``CampaignFailed`` if any invariant was violated or a case was missed."""
        if self.violations or self.missed:
            raise CampaignFailed(self.summary())
