"""``PipelineConfig``: a run as one frozen value, loadable from TOML and checked before anything
starts.

```toml
mode = "async"          # sync | colocated | one_step_off | async
staleness = 1           # async only: versions rollout may run ahead (0: on-policy)
run_dir = "runs/exp1"

[model]                 # models.TinyDecoder, init = "policy.safetensors", or hf = "folder"
                        # (impl = "hf" | "native": a Llama folder as the built-in model)
[task]                  # kind = "addition" | "longtail" | "jsonl" | "dataset"; [task.options]
                        # reward = "my_rewards:correct" (or a list), reward_weights; [task.dataset]
[reward]                # on_error = "raise" | "zero" | "drop", concurrency, timeout
[eval]                  # dataset, every, samples, greedy
[rollout]               # group_size, max_new_tokens, workers, engines, pause_mode, reward ...
[algorithm]             # advantage, clip_low/high, kl_coef, is_level ...
[train]                 # steps, prompts_per_step, mini_batches, lr, checkpoint_every ...
[report]                # report_to = ["tensorboard", "wandb", ...], log_completions_every ...
[placement]             # default = "local" | "process"; [placement.roles]; [placement.nodes]
[watchdog]              # enabled, warn_s, fail_s, first_step_s: a stalled run's diagnosis
```

Every problem raises ``PipelineConfigError`` naming the dotted key: an unknown key, a value of
the wrong type, a value out of range, a mode that contradicts the staleness, an impossible
placement.
"""

from __future__ import annotations

import os
import re
import sys
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ..roles._report_settings import ReportSettings
from ..roles._settings import (
    AlgorithmSettings,
    ModelSettings,
    RolloutSettings,
    RunSpec,
    SettingsError,
    TaskSettings,
    TrainSettings,
    _one_of,
    _positive,
)
from ..tasks._settings import EvalSettings, RewardSettings
from ._watchdog import WatchdogConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODES = ("sync", "colocated", "one_step_off", "async")
ROLES = ("rollout", "reward", "actor_fwd", "ref_fwd", "advantage", "trainer")
DRIVER = "driver"  # the placement of a role run in the driver's own process
FUSED = "actor_fwd"  # the advantage's placement inside the ActorForward stations
TRAINER = "trainer"  # a station's placement inside the trainer (ActorForward, Advantage)
_ADDRESS = re.compile(r"^(tcp://[^:/\s]+:\d+|ipc://\S+)$")


class PipelineConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key."""


@attrs.frozen
class PlacementConfig:
    """Where the roles run.

    ``default``: ``"local"`` (every role in this process: tests) or ``"process"`` (each role —
    each rollout and forward worker — in its own local node process: the CPU default, so that
    rollout and training really run in parallel). ``roles`` overrides it per role with
    ``"driver"`` (this process) or a node name; a node name listed in ``nodes`` is a node
    started by hand (``python -m asyncflow_actors.node``) at that address, any other name a
    local node process of that name (roles placed on one name share that process).
    ``tq_units`` storage units, in this process or (``tq_placement = "process"``) their own.

    Two stations can also be folded into another role instead of running on their own:
    ``roles.advantage = "actor_fwd"`` or ``"trainer"``, and ``roles.actor_fwd = "trainer"`` (the
    trainer computes the old log-probs itself, as verl's colocated actor does). A folded
    station costs no queue traffic and no process; on small models that traffic costs more
    than the station's compute (``docs/pipeline.md`` §4).
    """

    default: Literal["local", "process"] = attrs.field(
        default="process", validator=_one_of("local", "process")
    )
    roles: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    nodes: Mapping[str, str] = attrs.field(factory=dict, converter=dict)
    transport: Literal["ipc", "tcp"] = attrs.field(default="ipc", validator=_one_of("ipc", "tcp"))
    tq_units: int = attrs.field(default=1, validator=_positive)
    tq_placement: Literal["local", "process"] = attrs.field(
        default="local", validator=_one_of("local", "process")
    )


@attrs.frozen
class PipelineConfig:
    """A whole run (see the module docstring and ``docs/pipeline.md``).

        ``progress``: ``"auto"`` (a rich display on a terminal, plain lines otherwise), ``"rich"``,
        ``"plain"`` or ``"none"``. ``observe``: trace spans and metrics of every process into
        ``run_dir`` (``docs/observability.md``); ``plot``: write ``run_dir/curves.png`` at the end (and
    every ``report.plot_every`` steps); ``report``: trackers and sample completions.
    """

    mode: Literal["sync", "colocated", "one_step_off", "async"] = "async"
    staleness: int | None = None
    run_dir: str | None = None
    progress: Literal["auto", "rich", "plain", "none"] = attrs.field(
        default="auto", validator=_one_of("auto", "rich", "plain", "none")
    )
    observe: bool = False
    plot: bool = True
    model: ModelSettings = attrs.field(factory=ModelSettings)
    task: TaskSettings = attrs.field(factory=TaskSettings)
    rollout: RolloutSettings = attrs.field(factory=RolloutSettings)
    algorithm: AlgorithmSettings = attrs.field(factory=AlgorithmSettings)
    train: TrainSettings = attrs.field(factory=TrainSettings)
    reward: RewardSettings = attrs.field(factory=RewardSettings)
    eval: EvalSettings = attrs.field(factory=EvalSettings)
    report: ReportSettings = attrs.field(factory=ReportSettings)
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    watchdog: WatchdogConfig = attrs.field(factory=WatchdogConfig)

    def __attrs_post_init__(self) -> None:
        _check(self)

    @property
    def effective_staleness(self) -> int:
        """0 for sync and colocated, 1 for one-step-off, ``staleness`` (default 1) for async."""
        fixed = {"sync": 0, "colocated": 0, "one_step_off": 1}.get(self.mode)
        if fixed is not None:
            return fixed
        return 1 if self.staleness is None else self.staleness

    def run_spec(self, *, start_version: int = 0, resume_from: str | None = None) -> RunSpec:
        """What every role of this run is given."""
        return RunSpec(
            mode=self.mode,
            staleness=self.effective_staleness,
            stage_barrier=self.mode != "async",
            colocated=self.mode == "colocated",
            fused_advantage=self.fused_advantage,
            trainer_forward=self.trainer_forward,
            trainer_advantage=self.trainer_advantage,
            model=self.model,
            task=self.task,
            rollout=self.rollout,
            algorithm=self.algorithm,
            train=self.train,
            reward=self.reward,
            eval=self.eval,
            report=self.report,
            run_dir=self.run_dir,
            run_id=uuid.uuid4().hex,
            start_version=start_version,
            resume_from=resume_from,
            processes=self.processes,
        )

    @property
    def processes(self) -> int:
        """The run's processes that compute: the driver's and one per node its roles use (each
        rank of a rank group beyond the first counted too): what ``train.torch_threads =
        "auto"`` shares the CPUs among."""
        instances = self.instances()
        places = {self.placement_of(role, worker) for role, worker in instances}
        forwards = sum(role in ("actor_fwd", "ref_fwd") for role, _ in instances)
        ranks = self.train.ranks - 1 + (self.train.forward_ranks - 1) * forwards
        return len(places | {DRIVER}) + ranks

    @property
    def fused_advantage(self) -> bool:
        """``placement.roles.advantage = "actor_fwd"``: the ActorForward stations compute the
        advantages too (no Advantage station)."""
        return self.placement.roles.get("advantage") == FUSED

    @property
    def trainer_forward(self) -> bool:
        """``placement.roles.actor_fwd = "trainer"``: the trainer computes the old log-probs
        (no ActorForward station)."""
        return self.placement.roles.get("actor_fwd") == TRAINER

    @property
    def trainer_advantage(self) -> bool:
        """``placement.roles.advantage = "trainer"``: the trainer computes the advantages of
        the whole groups it takes (no Advantage station)."""
        return self.placement.roles.get("advantage") == TRAINER

    def instances(self) -> list[tuple[str, str]]:
        """Every role instance of the run as ``(role, worker name)``, in start order."""
        out = []
        if self.rollout.reward == "actor":
            out.append(("reward", "reward-0"))
        out += [("rollout", f"rollout-{i}") for i in range(self.rollout.workers)]
        if not self.trainer_forward:
            out += [("actor_fwd", f"actor_fwd-{i}") for i in range(self.train.forward_workers)]
        if self.algorithm.kl_coef > 0:
            out.append(("ref_fwd", "ref_fwd-0"))
        if not (self.fused_advantage or self.trainer_advantage):
            out.append(("advantage", "advantage-0"))
        out.append(("trainer", "trainer-0"))
        return out

    def placement_of(self, role: str, worker: str) -> str:
        """The node a role instance runs on (``"driver"``: this process)."""
        chosen = self.placement.roles.get(role)
        if chosen is not None:
            return chosen
        if self.placement.default == "local":
            return DRIVER
        if self.mode == "colocated" and role in ("rollout", "actor_fwd", "trainer"):
            return "colocated"
        return worker

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> PipelineConfig:
        """From a parsed TOML document; raises ``PipelineConfigError`` naming the key."""
        built: PipelineConfig = _build(cls, table, "")
        return built

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> PipelineConfig:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise PipelineConfigError(f"{os.fspath(path)}: not valid TOML: {exc}") from exc
        except FileNotFoundError as exc:
            raise PipelineConfigError(f"no such file: {os.fspath(path)}") from exc
        except OSError as exc:
            raise PipelineConfigError(f"{os.fspath(path)}: {exc.strerror or exc}") from exc
        return cls.from_dict(data)


def _check(config: PipelineConfig) -> None:
    staleness = config.staleness
    if staleness is not None and (
        isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0
    ):
        raise PipelineConfigError(f"staleness: expected an int >= 0, got {staleness!r}")
    if config.mode not in MODES:
        raise PipelineConfigError(f"mode: expected one of {list(MODES)}, got {config.mode!r}")
    fixed = {"sync": 0, "colocated": 0, "one_step_off": 1}.get(config.mode)
    if fixed is not None and staleness not in (None, fixed):
        raise PipelineConfigError(
            f"staleness: mode {config.mode!r} runs at staleness {fixed}; got {config.staleness} "
            "(use mode = 'async' for another window)"
        )
    place = config.placement
    for role, where in place.roles.items():
        if role not in ROLES:
            raise PipelineConfigError(
                f"placement.roles.{role}: unknown role (roles: {list(ROLES)})"
            )
        if not isinstance(where, str) or not where:
            raise PipelineConfigError(
                f"placement.roles.{role}: expected 'driver' or a node name, got {where!r}"
            )
    for name, address in place.nodes.items():
        if not isinstance(address, str) or not _ADDRESS.match(address):
            raise PipelineConfigError(
                f"placement.nodes.{name}: expected an address like 'tcp://host:5555' or "
                f"'ipc:///path', got {address!r}"
            )
    if place.roles.get("reward") == TRAINER or place.roles.get("ref_fwd") == TRAINER:
        role = "reward" if place.roles.get("reward") == TRAINER else "ref_fwd"
        raise PipelineConfigError(
            f"placement.roles.{role}: only actor_fwd and advantage fold into the trainer"
        )
    if config.fused_advantage and config.trainer_forward:
        raise PipelineConfigError(
            "placement.roles.advantage: 'actor_fwd' runs inside the trainer "
            "(placement.roles.actor_fwd = 'trainer'): fold the advantage into 'trainer'"
        )
    if config.algorithm.kl_coef == 0 and "ref_fwd" in place.roles:
        raise PipelineConfigError(
            "placement.roles.ref_fwd: this run has no RefForward (algorithm.kl_coef = 0)"
        )
    if config.rollout.reward == "inline" and "reward" in place.roles:
        raise PipelineConfigError(
            "placement.roles.reward: rewards are scored inline (rollout.reward = 'inline')"
        )
    if config.mode == "colocated":
        if config.rollout.workers != 1 or config.rollout.engines != 1:
            raise PipelineConfigError(
                "rollout.workers: colocated mode shares one model between one engine and the "
                "trainer: rollout.workers and rollout.engines must be 1"
            )
        if config.train.forward_workers != 1:
            raise PipelineConfigError("train.forward_workers: colocated mode needs exactly 1")
        shared = (
            ("rollout", "trainer")
            if config.trainer_forward
            else ("rollout", "actor_fwd", "trainer")
        )
        homes = {r: config.placement_of(r, f"{r}-0") for r in shared}
        if len(set(homes.values())) != 1:
            role = next(r for r in shared[1:] if homes[r] != homes["rollout"])
            raise PipelineConfigError(
                f"placement.roles.{role}: colocated mode shares one model, so rollout, "
                f"actor_fwd and trainer must run in one process (got {homes})"
            )
    if config.train.forward_ranks > 1:
        _check_forward_ranks(config)
    if config.model.native:
        _check_native(config)
    hf = config.model.transformers
    if hf != (config.rollout.engine in ("hf", "vllm")):
        raise PipelineConfigError(
            f"rollout.engine: {config.rollout.engine!r} "
            + ("cannot serve a Hugging Face model.hf: use 'hf' or 'vllm'" if hf
               else "serves a Hugging Face policy: set model.hf to its folder")
        )  # fmt: skip
    if config.mode == "colocated" and hf:
        raise PipelineConfigError("model.hf: colocated mode shares the built-in tiny model only")
    if config.train.sft_warmup_steps and hf:
        raise PipelineConfigError(
            "train.sft_warmup_steps: the warm-up trains the built-in tiny policy; warm a "
            "Hugging Face model up beforehand (e.g. TRL's SFTTrainer) and set model.hf to it"
        )
    if config.train.sft_warmup_steps and not config.run_dir:
        raise PipelineConfigError(
            "train.sft_warmup_steps: needs a run_dir (every role loads the warmed-up model "
            "from run_dir/warmup/)"
        )
    tiny = config.model.init is None and config.model.hf is None
    if tiny and config.model.max_seq_len <= config.rollout.max_new_tokens:
        raise PipelineConfigError(
            f"rollout.max_new_tokens: {config.rollout.max_new_tokens} leaves no room for the "
            f"prompt within model.max_seq_len = {config.model.max_seq_len}"
        )


def _check_native(config: PipelineConfig) -> None:
    """``model.impl="native"``: the folder runs as the tiny policy, so what needs a
    transformers model is refused by name."""
    refused = {
        "rollout.engine": config.rollout.engine != "builtin"
        and f"{config.rollout.engine!r} serves transformers models; native runs the built-in "
        "engine (rollout.engine='builtin')",
        "model.lora": config.model.lora.r > 0 and "LoRA adapters need peft on a transformers model",
        "train.sft_warmup_steps": bool(config.train.sft_warmup_steps)
        and "the warm-up writes a tiny-model file, not the folder",
        "train.gradient_checkpointing": config.train.gradient_checkpointing
        and "needs a transformers model",
    }
    for field, why in refused.items():
        if why:
            raise PipelineConfigError(f"{field}: model.impl='native': {why}; use model.impl='hf'")


def _check_forward_ranks(config: PipelineConfig) -> None:
    """``train.forward_ranks`` > 1: a process holds one torch.distributed group, so each
    forward station on ranks (and a trainer on ranks) needs a process of its own."""
    from ..roles._rank_settings import uses_ranks

    if config.mode == "colocated":
        raise PipelineConfigError(
            "train.forward_ranks: colocated mode shares one model; use another mode"
        )
    groups = [(r, w) for r, w in config.instances() if r in ("actor_fwd", "ref_fwd")]
    if not groups:
        raise PipelineConfigError("train.forward_ranks: this run has no forward station")
    trainer = types.SimpleNamespace(train=config.train, model=config.model, resume_from=None)
    if uses_ranks(trainer):
        groups.append(("trainer", "trainer-0"))
    homes: dict[str, str] = {}
    for role, worker in groups:
        home = config.placement_of(role, worker)
        if home in homes:
            raise PipelineConfigError(
                f"placement.roles.{role}: {worker} and {homes[home]} each hold a rank group "
                f"(train.forward_ranks), and a process holds one: place them apart (got {home!r})"
            )
        homes[home] = worker


def _build(cls: type, table: Any, where: str) -> Any:
    """``cls(**table)`` with every key and type checked, errors naming the dotted key."""
    if not isinstance(table, Mapping):
        raise PipelineConfigError(
            f"{where.rstrip('.') or 'config'}: expected a table, got {table!r}"
        )
    attrs.resolve_types(cls)
    fields = attrs.fields_dict(cls)
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            raise PipelineConfigError(f"{where}{key}: unknown key (known: {sorted(fields)})")
        if isinstance(field.type, type) and attrs.has(field.type):
            kwargs[key] = _build(field.type, value, f"{where}{key}.")
            continue
        if not _matches(field.type, value):
            raise PipelineConfigError(
                f"{where}{key}: expected {_describe(field.type)}, got {value!r}"
            )
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except PipelineConfigError:
        raise
    except (SettingsError, ValueError, TypeError) as exc:
        prefix = where.rstrip(".")
        raise PipelineConfigError(f"{prefix}.{exc}" if prefix else str(exc)) from exc


def _matches(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(arg, value) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return isinstance(value, Mapping)
    if origin in (tuple, list):  # tuple[X, ...]: a TOML array of X, or one X
        item = typing.get_args(tp)[0]
        if isinstance(value, (list, tuple)):
            return all(_matches(item, v) for v in value)
        return _matches(item, value)
    return isinstance(tp, type) and isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + str(list(typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "nothing"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "a table"
    if origin in (tuple, list):
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ')}"
    return f"a {getattr(tp, '__name__', tp)}"
