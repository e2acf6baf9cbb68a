"""Messages between the roles (frozen attrs values; they cross the wire)."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..actors import Request
from ._completions import SampleCompletion


def _floats(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


@attrs.frozen
class RoleStatistics:
    """What a station did so far: ``busy_s`` computing, ``wait_s`` blocked on the TQ or slots.

    ``version``: the policy version it holds (``None``: a role without a policy, such as the
    advantage). ``extra`` holds role-specific counters (e.g. ``partial_samples`` for rollout).
    ``waits``: what it waits on now, in words (a claim, a weight sync's phase and receivers, a
    pause): the watchdog's diagnosis quotes them.
    """

    role: str
    worker: str
    version: int | None
    samples: int
    tokens: int
    steps: int
    busy_s: float
    wait_s: float
    extra: Mapping[str, float] = attrs.field(factory=dict, converter=_floats)
    waits: tuple[str, ...] = ()


@attrs.frozen
class GetRoleStats(Request[RoleStatistics]):
    pass


@attrs.frozen
class StepAck:
    """The Driver's answer to ``StepDone``: ``stop`` once the run has trained enough."""

    stop: bool


@attrs.frozen
class TrainedSamples:
    """The samples of one step, for the sample ledger: one entry per sample in each field
    (columns, so that a step's thousands of samples cross the wire as a few lists). ``prompt``,
    ``attempt`` and ``admitted``: the group's ``prompt_key``; ``index``: the sample's place in its
    group; ``oldest`` / ``newest``: its tokens' oldest and newest policy version."""

    prompt: tuple[int, ...] = ()
    attempt: tuple[int, ...] = ()
    admitted: tuple[int, ...] = ()
    index: tuple[int, ...] = ()
    oldest: tuple[int, ...] = ()
    newest: tuple[int, ...] = ()
    reward: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.prompt)


@attrs.frozen
class StepDone(Request[StepAck]):
    """The Trainer finished global batch ``version - 1`` and now holds ``version``.

    ``groups``: the rollout groups it trained (the Driver retires their prompts);
    ``staleness``: how many trained samples lagged by 0, 1, 2, ... versions (oldest token);
    ``metrics``: loss and reward figures of the step (plain floats); ``trained``: each sample
    trained, for the sample ledger; ``completions``: a few samples as text, on the steps that
    report them (``report.log_completions_every``).
    """

    version: int
    samples: int
    tokens: int
    groups: tuple[int, ...]
    staleness: tuple[int, ...]
    metrics: Mapping[str, float] = attrs.field(converter=_floats)
    trained: TrainedSamples = attrs.field(factory=TrainedSamples)
    completions: tuple[SampleCompletion, ...] = ()


@attrs.frozen
class StepTrained(Request[None]):
    """The Trainer took optimizer step ``version`` (before it acks the step's leases, with
    ``train.auto_resume``): the Driver retires ``groups`` and remembers them, with their
    ``samples`` (TQ indexes), until a checkpoint holds the step; a Trainer that dies before
    that loses the step, and the Driver injects its prompts again (``_driver_resume``)."""

    version: int
    groups: tuple[int, ...]
    samples: tuple[int, ...]


@attrs.frozen
class SyncReport:
    """How the weight sync to ``version`` went: phase seconds (``sync_pause`` ... ``sync_total``)
    and bytes, as ``checkpoint.SyncResult.metrics()`` gives them."""

    version: int
    metrics: Mapping[str, float] = attrs.field(converter=_floats)


@attrs.frozen
class SyncWeights(Request[SyncReport]):
    """Driver → Trainer: send the weights of ``version`` to every rollout and forward worker."""

    version: int


@attrs.frozen
class ResendWeights(Request[SyncReport]):
    """Driver → Trainer: send the weights the Trainer holds now, tagged with its version, to
    every rollout and forward worker (a restarted worker holds the initial ones)."""


@attrs.frozen
class NeedWeights(Request[None]):
    """Rollout → Driver (asked: ``_ask_again.tell_driver``): ``worker``, an incarnation that has received no weights yet,
    waits for a version it does not hold: it was restarted, and no sync may come before it
    generates (the trainer waits for its groups)."""

    worker: str


@attrs.frozen
class GroupGone(Request[None]):
    """Rollout → Driver (asked: ``_ask_again.tell_driver``): the group ``group_id`` no longer exists in the queue when
    ``worker`` came to write it (evicted, lost, abandoned, or shrunk or discarded to nothing),
    so its prompt lives on only in the Driver, which injects it again. The queue's events
    report most such groups too; re-injection happens once, whichever comes first."""

    group_id: int
    worker: str


@attrs.frozen
class AdoptVersion(Request[int]):
    """Colocated mode: the target's model *is* the trainer's; take ``version`` without bytes."""

    version: int


@attrs.frozen
class SaveCheckpoint(Request[str]):
    """Driver → Trainer: write model, optimizer, version and RNG under ``directory``; with
    ``version``, only if the Trainer still holds that version (else it answers ``""``)."""

    directory: str
    version: int | None = None


@attrs.frozen
class Stopped:
    """The Driver's answer to ``StopRun``: the ``version`` saved in ``checkpoint`` (the newest
    checkpoint of the run, ``""`` if none), or ``pending``: the Trainer had moved on, and the
    Driver saves at that step instead (``DriverHooks.done`` is set then)."""

    version: int
    checkpoint: str
    pending: bool = False


@attrs.frozen
class StopRun(Request[Stopped]):
    """Pipeline → Driver: stop the run cleanly: save a checkpoint unless the newest one holds
    the last step, and end the run (``StepAck(stop=True)`` to the Trainer's next step)."""


@attrs.frozen
class Scored:
    """A group's rewards, each reward function's values per sample (``nan``: no score), and
    ``dropped``: why the group is not to be trained (``reward.on_error = "drop"``), or
    ``failed``: the one line that fails the run (``"raise"``)."""

    rewards: tuple[float, ...]
    parts: tuple[tuple[float, ...], ...] = ()
    dropped: str | None = None
    failed: str | None = None


@attrs.frozen
class Score(Request[Scored]):
    """Rollout → Reward: score ``responses`` to one prompt against its ``answer``; ``record``:
    the prompt's columns as JSON (what reward functions get by name)."""

    prompt: str
    answer: str
    responses: tuple[str, ...]
    record: str = "{}"


@attrs.frozen
class GroupDropped(Request[None]):
    """Rollout → Driver (asked: ``_ask_again.tell_driver``): group ``group_id`` was not written because its reward failed
    (``reward.on_error = "drop"``; the worker shrank it to nothing): the Driver frees its
    slots and admits a new prompt in its place. ``fatal``: ``on_error = "raise"``; the Driver
    fails the run with ``reason``."""

    group_id: int
    worker: str
    reason: str
    fatal: bool = False


@attrs.frozen
class Evaluated:
    """An evaluation's figures (``eval/<name>``) and the weights' version it ran on."""

    metrics: Mapping[str, float] = attrs.field(converter=_floats)
    version: int


@attrs.frozen
class Evaluate(Request[Evaluated]):
    """Driver → Rollout: generate the evaluation prompts (rendered texts, with their records as
    JSON) ``n`` times each (1: greedy) and score them; ``threshold``: the total reward at which
    a sample passes (pass@k)."""

    prompts: tuple[str, ...]
    records: tuple[str, ...]
    n: int
    threshold: float
