"""A rule of an attempt: what it reads, what it decides and when it next needs to look.

Every policy module that decides something about a live attempt (or one between attempts) exports its
rules as ``RULES``, each a ``Rule``: a function of the shared observation (``Attempt``) that computes the
facts the rule reads, a function of those facts that returns an ``Outcome`` (or None: not this rule's
call), and a function that says in how many seconds the rule needs another look. policies/registry.py
gathers the rules of every module in their order; reconcile.py walks them, turns the first outcome into
a Decision, and looks again at the earliest moment any rule asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Generic, Literal, TypeVar

from ddp_operator.decision import DEFAULT_TIMING, NO_KUEUE_ACTIONS, Deletes, KueueActions, TimingRules
from ddp_operator.kueue import QueueObservation
from ddp_operator.observe import PodObservation
from ddp_operator.policies.accounting import NOTHING_NEW, RestartAccounting
from ddp_operator.policies.failure import RankFailure
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.spec import JobSpec

Phase = Literal["live", "restarting"]
# An attempt whose pods should exist (Pending, Queued, Starting, Running), and the wait between two.
LIVE: Final[Phase] = "live"
RESTARTING: Final[Phase] = "restarting"

F = TypeVar("F")


@dataclass(frozen=True)
class Attempt:
    """What every rule of an attempt reads, gathered once by reconcile.py; a rule's own facts are a
    function of it in the rule's module, computed once per decision (``facts``)."""

    job: JobSpec
    old: Mapping[str, Any]  # the status before this decision
    now: datetime
    pods: Sequence[PodObservation]  # every pod of this job object
    current: Sequence[PodObservation]  # the pods of the attempt in status
    stale: Sequence[PodObservation]  # pods of other attempts, or of ranks beyond replicas
    attempt: int
    restarts: int  # status.restarts with what this read of rank 0 adds
    to_create: tuple[int, ...]
    failures: Sequence[RankFailure]
    # The pods of the attempt that run (or whose trainer succeeded), none being deleted.
    running: Sequence[PodObservation]
    # Every rank's pod runs; an elastic job's group once enough run (policies.elastic).
    can_train: bool
    # Rank pods of this attempt Kueue still gates: the group is not admitted (yet, or again).
    kueue_gated: int
    timing: TimingRules = DEFAULT_TIMING
    progress: ProgressObservation | None = None  # of this attempt only
    queue: QueueObservation | None = None  # Kueue's view of the job's group, when read
    # In-place restarts rank 0 reported since the last decision (already in ``restarts``), and the
    # new status.lastRestart they make; the job's goodput from the same read.
    accounting: RestartAccounting = NOTHING_NEW
    goodput: float | None = None
    # status.ranksCreated after this decision: this attempt once every rank's pod has been observed.
    ranks_created: int | None = None
    _facts: dict[Callable[[Attempt], Any], Any] = field(default_factory=dict, compare=False, repr=False)

    def facts(self, of: Callable[[Attempt], F]) -> F:
        """``of(self)``, computed the first time a rule (or the status) asks for it."""
        if of not in self._facts:
            self._facts[of] = of(self)
        value: F = self._facts[of]
        return value


# What a rule may decide. The attempt ends: the job finishes (Succeeded or Failed) or the whole gang
# restarts. The attempt goes on: ranks are replaced alone, or the rule holds everything back a while.
@dataclass(frozen=True)
class Finish:
    phase: str  # Succeeded or Failed
    reason: str
    message: str


@dataclass(frozen=True)
class Restart:
    """The gang is torn down and the next attempt created. ``counted``: spends backoffLimit (a
    preemption does not); ``failure``: the one that decided; ``hung``: pods deleted without a grace
    period, their processes stopped answering."""

    reason: str
    message: str
    counted: bool = True
    failure: RankFailure | None = None
    hung: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplaceAlone:
    """New pods for ``ranks`` alone; the survivors restart in place and wait for them. ``cause``: the
    restart's reason; ``what``: what happened, for the Event; ``slow_node``: a straggler's node (no
    backoffLimit spent, the job avoids the node from now on)."""

    ranks: tuple[int, ...]
    failure: RankFailure
    cause: str
    what: str
    delete: Deletes
    kueue: KueueActions = NO_KUEUE_ACTIONS
    slow_node: str | None = None


@dataclass(frozen=True)
class Hold:
    """Nothing is created and the status stays; ``kueue`` goes first, and the rule looks again after
    ``look_after`` seconds."""

    kueue: KueueActions
    look_after: float


Outcome = Finish | Restart | ReplaceAlone | Hold


def no_facts(live: Attempt) -> None:
    """The facts of a rule that reads nothing beyond the shared observation."""
    return None


def never(live: Attempt, facts: object) -> float | None:
    """The next look of a rule that no clock brings due (pod events bring it)."""
    return None


@dataclass(frozen=True)
class Rule(Generic[F]):
    """One rule: ``name`` (its row in docs/architecture.md's rules table), ``order`` (the walk's: the
    first rule whose outcome is not None decides), the phases it is asked in, and its three functions."""

    name: str
    order: int
    facts: Callable[[Attempt], F]
    decide: Callable[[Attempt, F], Outcome | None]
    next_look: Callable[[Attempt, F], float | None]
    phases: frozenset[Phase] = frozenset({LIVE})

    def outcome(self, live: Attempt) -> Outcome | None:
        return self.decide(live, live.facts(self.facts))

    def look(self, live: Attempt) -> float | None:
        return self.next_look(live, live.facts(self.facts))
