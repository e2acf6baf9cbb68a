"""What every role of a run needs to know: frozen, wire-safe settings.

These values cross the wire to the nodes that host the roles (no pickle: plain fields, tuples,
nested attrs classes), so each station can rebuild its model, task and loss from them. The
pipeline's ``PipelineConfig`` (TOML) is made of the same sections; ``RunSpec`` bundles them with
what the mode decides (staleness, whole-batch stages, colocation).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ..tasks._settings import DatasetSettings, EvalSettings, RewardSettings
from ._report_settings import ReportSettings

if TYPE_CHECKING:
    from ..rl import Task


class SettingsError(ValueError):
    """A setting is out of range or inconsistent; the message names the key."""


DRIVER_FILE = "driver.json"  # a checkpoint's Driver state
FINAL = "final"  # the run's last model, under run_dir
CHECKPOINTS = "checkpoints"  # the intermediate ones, under run_dir

DEFAULT_ENGINE_ROWS = 256
"""The most rows an engine gets by default (``RolloutSettings.max_batch`` unset)."""


def _positive(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SettingsError(f"{attribute.name}: expected a number > 0, got {value!r}")


def _non_negative(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise SettingsError(f"{attribute.name}: expected a number >= 0, got {value!r}")


def _threads(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A number > 0 or ``"auto"``."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(f"{attribute.name}: expected an int > 0 or 'auto', got {value!r}")


def _fraction(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise SettingsError(f"{attribute.name}: expected a number in (0, 1], got {value!r}")


def _below_one(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A number in [0, 1) (a clip range below the ratio 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SettingsError(f"{attribute.name}: expected a number in [0, 1), got {value!r}")


def _resources(inst: object, attribute: attrs.Attribute[Any], value: Mapping[str, Any]) -> None:
    bad = {k: v for k, v in value.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0}  # fmt: skip
    if bad:
        raise SettingsError(f"{attribute.name}: amounts must be numbers >= 0, got {bad}")


def _one_of(*choices: str) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise SettingsError(f"{attribute.name}: expected one of {list(choices)}, got {value!r}")

    return check


_DEVICE = re.compile(r"^(cpu|cuda|npu|xpu|mps|meta)(:\d+)?$")


def _device(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not _DEVICE.match(value):
        raise SettingsError(
            f"{attribute.name}: expected a torch device ('cpu', 'cuda', 'cuda:1', 'npu'...), "
            f"got {value!r}"
        )


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""``rl.AGG_MODES``, spelled out here: the settings load without torch."""


@attrs.frozen
class LoraSettings:
    """LoRA adapters (``peft``) on an HF policy (``model.lora``): rank ``r`` (0: off),
    ``alpha``, the ``target_modules`` (module name suffixes), ``dropout``. Only the adapters
    train and sync (docs/training.md)."""

    r: int = attrs.field(default=0, validator=_non_negative)
    alpha: float = attrs.field(default=16.0, validator=_positive)
    target_modules: tuple[str, ...] = attrs.field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"), converter=tuple
    )
    dropout: float = attrs.field(default=0.0, validator=_non_negative)

    @property
    def enabled(self) -> bool:
        return self.r > 0


def _lora(value: Any) -> LoraSettings:
    return LoraSettings(**value) if isinstance(value, Mapping) else value


@attrs.frozen
class ModelSettings:
    """The policy: a ``TinyDecoder`` built from ``seed`` (same weights in every process), or
    loaded from ``init``, a file written by ``models.save_model`` (with its tokenizer); or,
    with ``hf``, a local Hugging Face folder (``AutoModelForCausalLM`` and its tokenizer; the
    ``hf`` extra), on ``device`` in the trainer and forward stations. ``lora``: LoRA
    adapters on an HF policy (``r > 0``). ``impl``: how ``hf`` runs: ``"hf"`` (transformers)
    or ``"native"`` (a Llama folder read into the tiny model and run as the tiny policy;
    ``roles._native_policy``)."""

    d_model: int = attrs.field(default=64, validator=_positive)
    n_layers: int = attrs.field(default=2, validator=_positive)
    n_heads: int = attrs.field(default=4, validator=_positive)
    max_seq_len: int = attrs.field(default=32, validator=_positive)
    seed: int = 0
    init: str | None = None
    hf: str | None = None
    device: str = attrs.field(default="cpu", validator=_device)
    lora: LoraSettings = attrs.field(factory=LoraSettings, converter=_lora)
    impl: str = attrs.field(default="hf", validator=_one_of("hf", "native"))

    @property
    def transformers(self) -> bool:
        """The policy is a transformers model (``hf`` set, ``impl="hf"``)."""
        return self.hf is not None and self.impl == "hf"

    @property
    def native(self) -> bool:
        """The policy is ``hf``'s folder as the tiny model (``impl="native"``)."""
        return self.hf is not None and self.impl == "native"

    def __attrs_post_init__(self) -> None:
        if self.impl == "native" and self.hf is None:
            raise SettingsError("model.impl='native' reads model.hf: set it to the folder")
        if self.d_model % self.n_heads:
            raise SettingsError(
                f"n_heads: d_model = {self.d_model} does not split into {self.n_heads} heads "
                "(d_model must be divisible by n_heads)"
            )


def _reward_paths(value: Any) -> tuple[str, ...]:
    """``task.reward``: one path or function, or a list of them, as import paths."""
    from ..tasks._functions import function_path

    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(function_path(item) for item in items)


def _weights(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in value
    ):
        raise SettingsError(f"reward_weights must be a list of numbers, got {value!r}")
    return tuple(float(w) for w in value)


@attrs.frozen
class TaskSettings:
    """The prompt source and verifier: ``kind`` ``"addition"`` (``rl.AdditionTask``),
    ``"longtail"`` (``rl.LongTailTask``), ``"jsonl"`` (``rl.load_jsonl_task``, option
    ``path``) or ``"dataset"`` (``dataset``: a jsonl, parquet or Hugging Face dataset, see
    ``tasks.DatasetSettings``); ``options`` are the task's constructor keywords. ``seed`` draws
    the prompts.

    ``reward``: reward functions by import path (``"my_rewards:correct"`` or
    ``"path/to/file.py:correct"``; function objects given from Python become their paths),
    summed with ``reward_weights`` (default 1 each) into a sample's reward; without any, the
    task's own ``score`` rewards. See ``docs/tasks.md``.
    """

    kind: str = attrs.field(
        default="addition", validator=_one_of("addition", "longtail", "jsonl", "dataset")
    )
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    seed: int = 0
    dataset: DatasetSettings = attrs.field(factory=DatasetSettings)
    reward: tuple[str, ...] = attrs.field(default=(), converter=_reward_paths)
    reward_weights: tuple[float, ...] | None = attrs.field(default=None, converter=_weights)

    def __attrs_post_init__(self) -> None:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise SettingsError(
                f"reward_weights: {len(self.reward_weights)} weights for "
                f"{len(self.reward)} reward functions"
            )
        if self.kind == "dataset" and not self.dataset.path:
            raise SettingsError("dataset.path: a dataset task needs a path")

    def build(self) -> Task:
        """The task (imports ``rl``, hence torch). Raises ``SettingsError`` for bad options."""
        from .. import rl

        if self.kind == "dataset":
            from ..tasks import DatasetTask

            try:
                return DatasetTask.read(self.dataset)
            except ValueError as exc:
                raise SettingsError(f"task.dataset: {exc}") from exc
        try:
            if self.kind == "addition":
                return rl.AdditionTask(**self.options)
            if self.kind == "longtail":
                return rl.LongTailTask(**self.options)
            options = dict(self.options)
            path = options.pop("path", None)
            if not isinstance(path, str):
                raise SettingsError("task.options.path: a jsonl task needs a path")
            return rl.load_jsonl_task(path, **options)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"task.options: {exc}") from exc


@attrs.frozen
class RolloutSettings:
    """Generation: ``group_size`` samples per prompt, ``max_new_tokens`` each, sampled with
    ``temperature``, ``top_p`` and ``top_k`` (0: off).

    ``workers`` rollout actors, each serving ``engines`` engines (``max_batch`` rows each; by
    default as many as the FlowControl admits, see :attr:`RunSpec.engine_rows`) of kind
    ``engine``: ``"builtin"`` (the tiny model), ``"hf"`` or ``"vllm"`` (with ``model.hf``;
    ``vllm_args`` are vLLM's engine arguments, e.g. ``gpu_memory_utilization``); ``reward``
    ``"inline"`` (scored in the rollout worker) or ``"actor"`` (a separate Reward actor, for
    expensive rewards). ``pause_mode``: how engines pause for a weight sync; ``"none"`` (the
    default) does not pause them: the stations load new weights lazily, at their next group or
    batch boundary, so nothing needs to stop while the bytes arrive. ``vllm_lora`` (with
    ``engine = "vllm"`` and ``model.lora``): vLLM serves the base model with the adapter and
    each sync sends the adapters alone (``docs/training.md``); off, it gets merged weights.
    """

    group_size: int = attrs.field(default=8, validator=_positive)
    max_new_tokens: int = attrs.field(default=8, validator=_positive)
    temperature: float = attrs.field(default=1.0, validator=_positive)
    top_p: float = attrs.field(default=1.0, validator=_fraction)
    top_k: int = attrs.field(default=0, validator=_non_negative)
    workers: int = attrs.field(default=1, validator=_positive)
    engines: int = attrs.field(default=1, validator=_positive)
    max_batch: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    max_run_seconds: float = attrs.field(default=0.02, validator=_positive)
    reward: str = attrs.field(default="inline", validator=_one_of("inline", "actor"))
    engine: str = attrs.field(default="builtin", validator=_one_of("builtin", "hf", "vllm"))
    vllm_args: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    vllm_lora: bool = False
    pause_mode: str = attrs.field(
        default="none", validator=_one_of("none", "drain", "abort", "keep", "wait_batch")
    )

    @property
    def pauses(self) -> bool:
        """Whether a weight sync pauses the engines and forward workers."""
        return self.pause_mode != "none"


@attrs.frozen
class AlgorithmSettings:
    """The loss (``rl``): ``advantage`` estimator, PPO clip range, aggregation, KL to the
    reference (``kl_coef > 0`` starts the RefForward role), entropy bonus, and the off-policy
    correction of stale rollouts (``is_level`` ``"none"``, ``"token"`` or ``"sequence"``).
    ``anchor``: the policy PPO's ratio and clip are taken against (``rl.PPOLossConfig``):
    ``"proximal"`` (the old log-probs: the trainer's or ActorForward's forward), ``"behaviour"``
    (the engine's own log-probs) or ``"auto"``: ``"behaviour"`` when the run trains stale
    samples (staleness > 0) and asks no importance weights (``is_level = "none"``), else
    ``"proximal"`` (``anchor_of``; docs/pipeline.md says why)."""

    advantage: str = attrs.field(default="grpo", validator=_one_of("grpo", "dr_grpo", "rloo"))
    clip_low: float = attrs.field(default=0.2, validator=_below_one)
    clip_high: float = attrs.field(default=0.2, validator=_non_negative)
    agg: str = attrs.field(default="token-mean", validator=_one_of(*AGG_MODES))
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    kl_estimator: str = attrs.field(default="k3", validator=_one_of("k1", "k2", "k3"))
    entropy_coef: float = attrs.field(default=0.0, validator=_non_negative)
    is_level: str = attrs.field(default="none", validator=_one_of("none", "token", "sequence"))
    is_threshold: float = attrs.field(default=2.0, validator=_positive)
    anchor: str = attrs.field(default="auto", validator=_one_of("auto", "proximal", "behaviour"))

    def __attrs_post_init__(self) -> None:
        if self.anchor == "behaviour" and self.is_level != "none":
            raise SettingsError(
                f"anchor: 'behaviour' takes the ratio against the engine's log-probs, the "
                f"importance weight already; it needs is_level = 'none', got {self.is_level!r}"
            )

    def anchor_of(self, staleness: int) -> str:
        """The anchor a run at ``staleness`` uses (``"auto"`` resolved)."""
        if self.anchor != "auto":
            return self.anchor
        return "behaviour" if staleness > 0 and self.is_level == "none" else "proximal"


@attrs.frozen
class TrainSettings:
    """Training: ``steps`` global batches of ``prompts_per_step`` groups, each split into
    ``mini_batches`` optimizer updates (AdamW, ``lr``) repeated ``epochs`` times.

    ``forward_batch``: the most samples a forward or advantage station takes at a time when
    stages stream (async): it takes every whole group ready, up to that (default: a global
    batch), so a station that falls behind catches up in fewer, larger steps instead of paying
    a queue round trip per group; ``checkpoint_every``: save a resumable checkpoint every so many
    steps (0: never; the run's last step is always saved, in ``run_dir/final``), the newest
    ``keep_last`` of them kept (0: all). ``torch_threads``: intra-op threads in every process
    of the run, or ``"auto"`` (``_threads``: every CPU when the run is on-policy, else the CPUs
    shared among the run's processes). ``auto_resume``: a Trainer that dies is started again from the newest
    checkpoint (the run's start without one), at most ``auto_resume_retries`` times; the
    samples in the TransferQueue stay (``pipeline._resume``); a Driver that raises is resumed
    from the state it held, at most as many times again (``pipeline._driver_resumer``).
    ``stream``: when stages stream (async) and a global batch is one update (``mini_batches``
    and ``epochs`` 1), the trainer runs the forward and backward of the groups already complete
    while the others are still generating, accumulating the gradient, and takes the one
    optimizer step once the last group arrived (``RunSpec.streams_updates``).
    ``ranks`` > 1 (or ``dtype``, ``micro_batch_size``, ``gradient_checkpointing``, LoRA): the
    trainer is a group of ranks on torch.distributed (``sharding`` ``"fsdp"`` or ``"ddp"``,
    every collective bounded by ``collective_timeout`` seconds; docs/training.md).
    ``sft_warmup_steps`` > 0: before the first rollout, the built-in policy learns the task's
    reference answers by supervised steps (at most that many, ``sft_warmup_lr``), stopping
    once it answers ``sft_warmup_accuracy`` of held-out problems exactly (greedy): GRPO learns
    nothing from groups whose rewards are all equal, which is every group of a random policy
    (``pipeline._warmup``; a resume never repeats it).
    ``forward_ranks`` > 1: each forward station's model is sharded over that many ranks.
    """

    steps: int = attrs.field(default=20, validator=_positive)
    prompts_per_step: int = attrs.field(default=8, validator=_positive)
    mini_batches: int = attrs.field(default=1, validator=_positive)
    epochs: int = attrs.field(default=1, validator=_positive)
    lr: float = attrs.field(default=5e-4, validator=_positive)
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)
    max_grad_norm: float = attrs.field(default=1.0, validator=_positive)
    forward_batch: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    forward_workers: int = attrs.field(default=1, validator=_positive)
    checkpoint_every: int = attrs.field(default=0, validator=_non_negative)
    keep_last: int = attrs.field(default=0, validator=_non_negative)
    torch_threads: int | str = attrs.field(default=1, validator=_threads)
    # a Trainer that dies restarts from the newest checkpoint, a Driver that raises from its
    # state (docs/pipeline.md, "Automatic resume"), at most ``auto_resume_retries`` times each
    auto_resume: bool = True
    auto_resume_retries: int = attrs.field(default=3, validator=_non_negative)
    stream: bool = True
    seed: int = 0
    shuffle_rewards: bool = False  # a control arm: rewards permuted within the batch (piece)
    # the trainer's ranks (docs/training.md): processes, sharding, precision, memory, timeout
    ranks: int = attrs.field(default=1, validator=_positive)
    sharding: str = attrs.field(default="fsdp", validator=_one_of("fsdp", "ddp"))
    dtype: str = attrs.field(default="fp32", validator=_one_of("fp32", "bf16"))
    gradient_checkpointing: bool = False
    micro_batch_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    collective_timeout: float = attrs.field(default=300.0, validator=_positive)
    # each forward station (ActorForward, RefForward) as a group of ranks (FSDP2, forward only)
    forward_ranks: int = attrs.field(default=1, validator=_positive)
    # where ranks 1..N-1 run: child processes of the Trainer's, or Ray actors in a placement
    # group (one bundle of ``ray_rank_resources`` per rank, ``ray_strategy``; docs/training.md)
    rank_launcher: str = attrs.field(default="process", validator=_one_of("process", "ray"))
    ray_strategy: str = attrs.field(
        default="PACK", validator=_one_of("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
    )
    ray_rank_resources: Mapping[str, float] = attrs.field(
        factory=lambda: {"CPU": 1.0}, converter=dict, validator=_resources
    )
    ray_address: str = "auto"
    sft_warmup_steps: int = attrs.field(default=0, validator=_non_negative)
    sft_warmup_accuracy: float = attrs.field(default=1.0, validator=_fraction)
    sft_warmup_lr: float = attrs.field(default=1e-3, validator=_positive)


@attrs.frozen
class RunSpec:
    """Everything a role needs: the sections plus what the mode decides.

    ``stage_barrier``: stations take whole global batches and each waits for the previous
    stage's column (sync, colocated, one-step-off); otherwise they stream in ``forward_batch``
    pieces and run in parallel. ``fused_advantage``: the ActorForward stations also compute the
    advantages (of whole groups) on the batches they fetch; no Advantage station runs.
    ``trainer_forward``: no ActorForward station; the trainer takes its own policy's log-probs
    before its first update of a batch as the old log-probs. ``trainer_advantage``: no
    Advantage station; the trainer computes the advantages of the whole groups it takes.
    ``start_version``/``resume_from``: a resumed run. ``processes``: the run's processes that
    compute (the driver's and its nodes'; what ``train.torch_threads = "auto"`` divides).
    """

    mode: str
    staleness: int
    stage_barrier: bool
    colocated: bool
    fused_advantage: bool = False
    trainer_forward: bool = False
    trainer_advantage: bool = False
    model: ModelSettings = attrs.field(factory=ModelSettings)
    task: TaskSettings = attrs.field(factory=TaskSettings)
    rollout: RolloutSettings = attrs.field(factory=RolloutSettings)
    algorithm: AlgorithmSettings = attrs.field(factory=AlgorithmSettings)
    train: TrainSettings = attrs.field(factory=TrainSettings)
    reward: RewardSettings = attrs.field(factory=RewardSettings)
    eval: EvalSettings = attrs.field(factory=EvalSettings)
    report: ReportSettings = attrs.field(factory=ReportSettings)
    run_dir: str | None = None
    run_id: str = ""
    start_version: int = 0
    resume_from: str | None = None
    processes: int = 1

    @property
    def batch_size(self) -> int:
        """Samples in a global batch (one policy version)."""
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def engine_rows(self) -> int:
        """Rows each engine decodes at once: ``rollout.max_batch``, or by default every sample
        the FlowControl admits (``(staleness + 1) x batch``) spread over the engines (one when
        colocated: the trainer's model is the only engine), at most
        ``DEFAULT_ENGINE_ROWS``. An engine smaller than what is admitted decodes a step's
        samples in waves (on the addition task, 64 rows for 256 admitted samples took twice the
        rollout's CPU a step); the cap bounds the KV cache a default can allocate."""
        if self.rollout.max_batch is not None:
            return self.rollout.max_batch
        engines = self.rollout.workers * (1 if self.colocated else self.rollout.engines)
        admitted = -(-(self.staleness + 1) * self.batch_size // engines)
        return max(self.rollout.group_size, min(DEFAULT_ENGINE_ROWS, admitted))

    @property
    def streams_updates(self) -> bool:
        """Whether the trainer takes a global batch piece by piece (``TrainSettings.stream``):
        stages stream, the batch is one optimizer update, and the loss's normaliser splits
        over pieces (not ``seq-mean-token-sum-norm``, whose default length is the padded
        width of what is trained at once); colocated runs share the model with the rollout
        and take the batch whole."""
        train = self.train
        return (
            train.stream
            and not self.stage_barrier
            and not self.colocated
            and train.mini_batches == 1
            and train.epochs == 1
            and self.algorithm.agg != "seq-mean-token-sum-norm"
        )

    @property
    def advantage_station(self) -> bool:
        """Whether an Advantage station of its own computes the advantages."""
        return not (self.fused_advantage or self.trainer_advantage)

    @property
    def use_ref(self) -> bool:
        return self.algorithm.kl_coef > 0

    @property
    def fetch_size(self) -> int:
        """The most samples a forward or advantage station takes at a time (whole groups)."""
        if self.stage_barrier:
            return self.batch_size
        n = self.rollout.group_size
        most = self.batch_size if self.train.forward_batch is None else self.train.forward_batch
        return max(n, most // n * n)
