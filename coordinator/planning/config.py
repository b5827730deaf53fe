"""The job config: one typed, frozen description of a training job, validated once.

A :class:`JobConfig` is what a job spec file holds (YAML or JSON, ``cellmesh run job.yaml``),
what a job module's ``job()`` returns, what :class:`~coordinator.runtime.job.Job` is built
from and what the command line's settings change. Its sections:

- ``model``, ``data``, ``loss``: the factories the workers import by name
  (``"package.module:function"``) and their keyword arguments; ``data`` also holds the
  global batch, the sample count, the shuffle and the seed;
- ``eval`` (optional, unset by default): held-out data evaluated on the training plan every
  N steps and at the end of ``fit`` (``coordinator/runtime/evaluation.py``);
- ``optimizer``: a ``torch.optim`` class name and its arguments, a learning-rate scheduler,
  clipping by the global gradient norm and gradient accumulation;
- ``plan``: the plan fields to fix (:class:`PlanConfig`; the planner chooses the rest);
- ``checkpoint``: where checkpoints go, how often, how many are kept
  (``coordinator/runtime/checkpoints.py``);
- ``logging``: where the run's output goes and how it logs (run directory, log level and
  format, metrics port, TensorBoard directory), acted on by the commands;
- ``runtime``: local workers, communication backend, timeouts and where the job's own
  modules are found.

Every model is strict (``extra="forbid"``: a misspelt key is an error, never a silent
default) and frozen. Rules between fields are model validators whose messages name the
keys to change. :func:`parse_config` turns a pydantic error into one line per bad key
(:func:`describe_validation`).

[Note: one field list] The fields are declared here and nowhere else. The command line's
flags (``--plan.num-stages``), the ``--set key=value`` keys, ``Job``'s keyword fields
(:data:`FLAT_KEYS`) and the planner's request are all derived from these models.

This module imports pydantic, PyYAML and the standard library only, so the command line
builds its parser without torch. (The schedule names are :data:`SCHEDULE_NAMES`, the keys of
``schedules.SCHEDULES``, whose action types import torch; ``schedules.py`` checks the two agree.)
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

__all__ = [
    "FLAT_KEYS",
    "SCHEDULE_NAMES",
    "CheckpointConfig",
    "CommBackend",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FactoryKwargs",
    "JobConfig",
    "LoggingConfig",
    "LossConfig",
    "Mode",
    "ModelConfig",
    "OptimizerConfig",
    "PlanConfig",
    "Precision",
    "RuntimeConfig",
    "SchedulerConfig",
    "SchedulerKwargs",
    "Strategy",
    "ZeroStage",
    "apply_settings",
    "describe_validation",
    "from_flat",
    "parse_config",
    "section_of",
    "settable_fields",
    "setting_value",
]

Mode = Literal["collective", "parameter_server"]
SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
"""The pipeline schedules ``plan.schedule`` may name (``coordinator/planning/schedules.py`` builds them)."""
Strategy = Literal["auto", "data_parallel", "pipeline"]
CommBackend = Literal["auto", "zmq", "gloo", "nccl"]  # comm/factory.py: [Note: a group's backend]
Device = Literal["auto", "cpu", "cuda"]  # coordinator/planning/devices.py: [Note: where a stage runs]
# the same values as services.protocol.Precision (a unit test keeps them equal; that module imports torch)
Precision = Literal["fp32", "bf16", "fp16"]
# what a stage's replicas shard: nothing; the optimizer state; + the gradients; + the parameters
ZeroStage = Literal[0, 1, 2, 3]
NonFinite = Literal["stop", "skip"]  # see coordinator/runtime/nonfinite.py: [Note: a step that is not finite]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
# the same union as services.protocol.FactoryKwargs (a unit test keeps them equal; that module imports torch)
FactoryKwargs = dict[str, str | int | float | bool | list[int] | list[float] | list[str]]
OptimizerKwargs = dict[str, float | int | bool | list[float]]
# the same union as services.protocol.SchedulerKwargs (a unit test keeps them equal)
SchedulerKwargs = dict[str, str | int | float | bool | list[int] | list[float]]
FactoryName = Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
def _not_a_bool(value: Any) -> Any:
    """A count given as true/false (YAML's ``yes``) is a mistake, not 1 or 0."""
    if isinstance(value, bool):
        raise ValueError(f"give a number, not {str(value).lower()}")
    return value


Positive = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=1)]
DEFAULT_STEPS = 100
_DEFAULT_LR: OptimizerKwargs = {"lr": 0.01}


class ConfigError(ValueError):
    """A job config is invalid: the message names every bad key, its value and what is wrong."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The model factory: a sequence of modules or cells, or any nn.Module torch.fx traces (docs/models.md).
    """

    factory: FactoryName = Field(description="the model factory, 'package.module:function'")
    kwargs: FactoryKwargs = Field(default_factory=dict, description="its keyword arguments (plain values)")
    leaves: list[str] = Field(default_factory=list,
                              description="submodules traced as one node each, by qualified name "
                                          "(an untraceable one, e.g. 'blocks.0.router') or class name "
                                          "(every submodule of the class, e.g. 'Router')")


class DataConfig(_Section):
    """The data factory and how its samples make the global batches."""

    factory: FactoryName = Field(description="the data factory: (inputs, targets), or a load(indices) "
                                             "callable")
    kwargs: FactoryKwargs = Field(default_factory=dict, description="its keyword arguments (plain values)")
    global_batch: Positive = Field(default=32, description="samples per step over all replicas")
    num_samples: Positive | None = Field(default=None, description="samples a load(indices) factory serves")
    shuffle: bool = Field(default=True, description="a new permutation of the samples every epoch")
    seed: int = Field(default=0, description="seeds the model and data factories and the sample order")


class LossConfig(_Section):
    """The loss factory: ``loss(output, targets) -> scalar`` (a loss class works: ``torch.nn:MSELoss``)."""

    factory: FactoryName = Field(description="the loss factory, 'package.module:function'")
    kwargs: FactoryKwargs = Field(default_factory=dict, description="its keyword arguments (plain values)")


class EvalConfig(_Section):
    """Held-out data, evaluated on the training plan after every N steps and at the end of ``fit``.

    The factory has ``data.factory``'s contract (seeded alike, ``num_samples`` for a loader); the
    whole held-out set is evaluated in order, in batches of ``global_batch`` (the last may be
    short). The reported loss and metric are means over the held-out samples
    (``coordinator/runtime/evaluation.py``).
    """

    factory: FactoryName = Field(description="the held-out data factory: (inputs, targets), or a "
                                             "load(indices) callable")
    kwargs: FactoryKwargs = Field(default_factory=dict, description="its keyword arguments (plain values)")
    every_steps: Positive | None = Field(default=None, description="evaluate after every N steps (and always "
                                                                   "at the end of fit)")
    global_batch: Positive | None = Field(default=None, description="held-out samples per evaluation step "
                                                                    "(default data.global_batch)")
    num_samples: Positive | None = Field(default=None, description="held-out samples a load(indices) "
                                                                   "factory serves")
    metric: FactoryName | None = Field(default=None,
                                       description="a factory returning metric(output, targets) -> one "
                                                   "value per sample, or their mean (reported as its mean "
                                                   "over the held-out samples)")


class SchedulerConfig(_Section):
    """A ``torch.optim.lr_scheduler`` class by name and its arguments (checked before any worker starts:
    ``coordinator/runtime/preflight.py``)."""

    name: str = Field(pattern=r"^[A-Za-z_]\w*$", description="a torch.optim.lr_scheduler class name")
    kwargs: SchedulerKwargs = Field(default_factory=dict, description="its arguments")


class OptimizerConfig(_Section):
    """A ``torch.optim`` optimizer by class name (checked where torch is imported: ``Job``), its
    learning-rate scheduler, clipping and gradient accumulation.

    [Note: optimizer steps] One step is one optimizer update, whatever ``accumulate`` is: it
    trains on ``accumulate`` global batches (each split into the plan's replicas and
    microbatches as usual), so its loss, samples and samples/s cover them all, and
    ``steps``, checkpoints (the data position: ``step * accumulate`` global batches),
    progress and resume count updates. The scheduler steps once per step, clipping applies
    to each step's gradient.
    """

    name: str = Field(default="SGD", pattern=r"^[A-Za-z_]\w*$", description="a torch.optim class name")
    kwargs: OptimizerKwargs = Field(default_factory=lambda: _DEFAULT_LR.copy(),
                                    description="its arguments (lists become tuples: betas: [0.9, 0.95])")
    scheduler: SchedulerConfig | None = Field(
        default=None, description="a torch.optim.lr_scheduler class stepped once per step, after the update: "
                                  "{name: StepLR, kwargs: {step_size: 2, gamma: 0.5}}")
    clip_grad_norm: float | None = Field(
        default=None, gt=0, description="clip the gradients to this global L2 norm (over every stage and "
                                        "shard) before each update, as torch.nn.utils.clip_grad_norm_")
    accumulate: Positive = Field(default=1, description="global batches per step (one optimizer update); "
                                                        "the gradient is their mean loss's")


class PlanConfig(_Section):
    """The plan fields to fix; ``None`` (and ``strategy: auto``) leave the choice to the planner.

    What the planner makes of them, and what it refuses given the model and the workers, is
    :func:`coordinator.planning.planner.choose_plan`'s; the rules here need neither.
    """

    strategy: Strategy = Field(default="auto", description="auto searches every plan; data_parallel fixes "
                                                          "one stage, pipeline one replica")
    data_parallel: Positive | None = Field(default=None, description="fix the number of replicas")
    num_stages: Positive | None = Field(default=None, description="fix the number of pipeline stages")
    mode: Mode | None = Field(default=None, description="fix the gradient path between replicas")
    num_microbatches: Positive | None = Field(default=None,
                                              description="fix the microbatches per replica per step")
    schedule: str | None = Field(default=None, description="fix the pipeline schedule, by its name")
    chunks: Positive | None = Field(default=None,
                                    description="fix the stages each worker holds (interleaved-1f1b: >= 2; "
                                                "1: a worker per stage)")
    balance: list[Positive] | None = Field(default=None, min_length=1,
                                           description="fix the cells per stage, e.g. [2, 3]")
    cutter: str = Field(default="minmax", description="the registered cutter that places stage boundaries")
    max_microbatches: Positive = Field(default=64,
                                       description="the most microbatches searched when not fixed")
    # mixed precision (docs/running.md, "Mixed precision"): every plan trains in it
    precision: Precision = Field(default="fp32",
                                 description="fp32; or bf16 / fp16 autocast over float32 master weights "
                                             "(fp16 with a dynamic loss scale)")
    # memory (docs/running.md, "Sharding, offload and recompute"): None leaves the choice to the planner
    zero: ZeroStage | None = Field(default=None,
                                   description="fix the ZeRO stage of collective mode: 0 replicates; 1 "
                                               "shards the optimizer state, 2 also the gradients, 3 also "
                                               "the parameters across a stage's replicas")
    shard_factor: Positive | None = Field(default=None,
                                          description="replicas per sharding group (hybrid sharding: shard "
                                                      "inside a group, replicate across groups); None: all "
                                                      "replicas of a stage")
    recompute: bool | None = Field(default=None, description="recompute each cell's activations in the "
                                                             "backward (torch.utils.checkpoint)")
    offload: bool | None = Field(default=None, description="keep the optimizer state and master parameters "
                                                           "in host memory and step them there")
    gather_bytes: Positive = Field(default=4 << 20,
                                   description="ZeRO-1/2: the most bytes of a bucket of the parameters' "
                                               "all-gather after a step, each gathered behind the next "
                                               "forward; ZeRO-3: of a unit of consecutive cells gathered "
                                               "in one collective (a larger cell is a unit alone)")
    staleness: int = Field(default=0, ge=0, description="parameter-server mode: the most steps a replica "
                                                        "may run ahead of the slowest (0: synchronous)")

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str | None) -> str | None:
        if value is not None and value not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {value!r}; use one of {SCHEDULE_NAMES}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PlanConfig:
        if self.strategy == "data_parallel" and self.num_stages not in (None, 1):
            raise ValueError(f"strategy='data_parallel' means num_stages=1, not {self.num_stages}: "
                             "change plan.strategy or plan.num_stages")
        if self.strategy == "pipeline" and self.data_parallel not in (None, 1):
            raise ValueError(f"strategy='pipeline' means data_parallel=1, not {self.data_parallel}: "
                             "change plan.strategy or plan.data_parallel")
        if self.strategy == "data_parallel" and self.balance is not None and len(self.balance) != 1:
            raise ValueError(f"strategy='data_parallel' means one stage, but balance has "
                             f"{len(self.balance)}: change plan.strategy or plan.balance")
        if self.zero and self.mode == "parameter_server":
            raise ValueError(f"plan.zero={self.zero} shards state across collective replicas; "
                             "parameter-server mode shards it on its servers already: drop plan.zero or "
                             "plan.mode")
        if self.shard_factor is not None and self.zero == 0:
            raise ValueError("plan.shard_factor sizes the sharding groups of plan.zero 1, 2 or 3, and "
                             "plan.zero is 0: drop one of them")
        if self.staleness and self.mode != "parameter_server":
            raise ValueError(f"plan.staleness={self.staleness} bounds the asynchronous parameter server: "
                             "set plan.mode: parameter_server, or plan.staleness: 0")
        if self.balance is not None and self.num_stages not in (None, len(self.balance)):
            raise ValueError(f"balance has {len(self.balance)} stages but num_stages={self.num_stages}: "
                             "change plan.balance or plan.num_stages")
        return self


class CheckpointConfig(_Section):
    """Checkpoints (``coordinator/runtime/checkpoints.py``): with a directory, one at the end of every
    ``fit`` and every ``every_steps`` steps and/or ``every_seconds`` seconds; the newest ``keep`` stay."""

    directory: str | None = Field(default=None, description="where checkpoints go (cellmesh run: the run "
                                                            "directory's checkpoints/ by default)")
    every_steps: Positive | None = Field(default=None, description="a checkpoint every N steps")
    every_seconds: float | None = Field(default=None, gt=0, description="a checkpoint every T seconds")
    keep: Positive = Field(default=1, description="how many checkpoints to keep")


class LoggingConfig(_Section):
    """Where the run's output goes and how it logs: run directory, log level and format, metrics, TensorBoard.

    The one declaration of these settings: ``cellmesh run``, ``demo`` and ``coordinator`` act
    on them (``coordinator/commands/output.py``), and their short flags (``--run-dir``,
    ``--log-level``, ``--log-format``, ``--metrics-port``, ``--tensorboard``) are aliases of
    the generated ones. ``level`` and ``format`` left unset fall back to ``CELLMESH_LOG_LEVEL``
    and ``CELLMESH_LOG_FORMAT``, then to the defaults (``comm/logs.py``): flag > spec > env > default.
    Relative directories are relative to the directory ``cellmesh`` runs in, as ``out/`` is.
    """

    level: LogLevel | None = Field(
        default=None,
        description="the level of the run's log files and workers, and of the terminal when set (default "
                    "$CELLMESH_LOG_LEVEL, else INFO in the files, WARNING on the terminal)")
    format: Literal["human", "json"] | None = Field(
        default=None,
        description="log lines for people (human) or one JSON object a line (json), in the log files and "
                    "on stderr (default $CELLMESH_LOG_FORMAT, else human)")
    run_dir: str | None = Field(
        default=None, description="the run directory: plan, logs, trace, run record, state_dict "
                                  "(default out/<job>-<YYYYmmdd-HHMMSS>)")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve Prometheus /metrics, /healthz and /readyz over HTTP on this port while the job "
                    "runs (0: any free port): cellmesh run on 127.0.0.1, cellmesh coordinator on "
                    "--health-host, where the kubelet probes them")
    tensorboard_dir: str | None = Field(
        default=None, description="write loss and samples/s per step as TensorBoard scalars here (needs "
                                  "cellmesh[tensorboard])")

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class RuntimeConfig(_Section):
    """How the job runs: local workers, communication, timeouts, where its own modules are."""

    workers: Positive = Field(default=2,
                              description="local worker processes (a cluster's: how many to wait for)")
    comm_backend: CommBackend = Field(default="auto", description="the workers' communication backend (auto: "
                                                               "nccl for a group all on CUDA, else zmq)")
    # -- devices (coordinator/planning/devices.py) --
    device: Device = Field(default="auto", description="where the stages run: cuda on the workers the "
                                                       "resource list gives GPUs (auto: if their torch has "
                                                       "CUDA), or cpu")
    pipeline_backend: CommBackend | None = Field(default=None,
                                                 description="the pipelines' backend (default comm_backend)")
    data_parallel_backend: CommBackend | None = Field(
        default=None, description="the data-parallel groups' backend (default comm_backend)")
    step_timeout_s: float = Field(default=300.0, gt=0, description="bounds each round of a step, in seconds")
    lease_ttl_s: float = Field(default=5.0, gt=0,
                               description="a dead worker is noticed within this, in seconds")
    max_restarts: int = Field(default=3, ge=0,
                              description="lost workers a run survives (replaced or planned without); one "
                                          "more ends it, naming each failure")
    replace_timeout_s: float = Field(default=60.0, gt=0,
                                     description="how long to wait for a lost worker's replacement before "
                                                 "planning again on the workers left, in seconds")
    nonfinite: NonFinite = Field(default="stop", description="a step whose loss or gradients are NaN or Inf: "
                                                             "stop the job there, or skip its update")
    code_dir: str | None = Field(default=None, description="where the job's own modules are found "
                                                           "(default: the job file's directory)")
    steps_per_request: int = Field(default=0, ge=0, le=64,
                                   description="steps the coordinator hands the stages in one request, which "
                                               "then commit each step but the last themselves (collective, "
                                               "ZeRO-1 at most, no fp16; others take 1). 0: as many as take "
                                               "about a second, by the last step's time; 1: one request per "
                                               "step")
    detail_replies: int = Field(default=10_000, ge=0,
                                description="stage replies whose detail (actions' timings, counters) the "
                                            "step records keep: the latest steps' (at least the last "
                                            "one's); older records keep loss, samples and times")
    memory_cap: bool = Field(default=False, description="cap each local CPU worker's process at its "
                                                        "resource's memory_bytes: an allocation beyond it "
                                                        "fails the step")


class JobConfig(_Section):
    """A training job: what to train, on what, how to plan and run it.

    Attributes:
        version: The format (2: sections).
        name: The job's name (registry prefix, output file name); the job file's stem by default.
        steps: Steps to train (``Job.fit``'s default).
    """

    version: Literal[2] = 2
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="the job's name (registry prefix, output file; default the job "
                                         "file's stem)")
    steps: int = Field(default=DEFAULT_STEPS, ge=0, description="steps to train")
    model: ModelConfig
    data: DataConfig
    loss: LossConfig
    eval: EvalConfig | None = None
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="after")
    def _enough_samples(self) -> JobConfig:
        n, batch = self.data.num_samples, self.data.global_batch
        if n is not None and n < batch:
            raise ValueError(f"data.num_samples={n} is below data.global_batch={batch}: lower "
                             "data.global_batch or give more samples")
        return self

    def updated(self, settings: Mapping[str, Any]) -> JobConfig:
        """This config with ``settings`` (dotted keys, see :func:`apply_settings`) applied and validated.

        Raises:
            ConfigError: A key is unknown or a value invalid (the message names the key).
        """
        return parse_config(apply_settings(self.model_dump(), settings))


def parse_config(raw: Any) -> JobConfig:
    """Validate ``raw`` (a mapping, as read from a spec file) as a :class:`JobConfig`.

    Raises:
        ConfigError: ``raw`` is invalid; the message names every bad key (:func:`describe_validation`).
    """
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation(exc, raw)) from None


def apply_settings(raw: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with each dotted key of ``settings`` set (``plan.num_stages``, ``model.kwargs.lr``).

    Sections and mappings on the way are created when absent; validation is the caller's
    (an unknown key is then an "unknown field" error naming it).

    Raises:
        ConfigError: A key runs through a value that is not a mapping (``steps.x``) or is empty.
    """
    out = _copy(raw)
    for key, value in settings.items():
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"setting {key!r}: not a dotted key like plan.num_stages")
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:  # absent, or an optional section left unset (eval: null)
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                raise ConfigError(f"setting {key!r}: {'.'.join(parts[:i + 1])!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _copy(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def settable_fields() -> Iterator[tuple[str, FieldInfo]]:
    """Every field a setting may name, as ``(dotted key, field)``: top-level values, then each section's."""
    for name, info in JobConfig.model_fields.items():
        section = section_of(info)
        if section is None:
            if name != "version":
                yield name, info
            continue
        for field, sub in section.model_fields.items():
            yield f"{name}.{field}", sub


def section_of(info: FieldInfo) -> type[_Section] | None:
    """The section model of a :class:`JobConfig` field (an optional one's too: ``eval``), else None."""
    kind = info.annotation
    if get_origin(kind) in (Union, types.UnionType):
        kinds = [a for a in get_args(kind) if a is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else None
    return kind if isinstance(kind, type) and issubclass(kind, _Section) else None


def setting_value(key: str, text: str) -> Any:
    """The value of ``key=text`` on the command line: YAML (``2``, ``[2, 3]``, ``{lr: 0.1}``, ``null``).

    A text field (a name, a path, a choice) keeps the text as given (``--name 007`` is ``"007"``);
    ``null`` unsets an optional field.

    Raises:
        ConfigError: ``text`` is not valid YAML.
    """
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        why = " ".join(str(exc).split())
        raise ConfigError(f"setting {key!r}: {text!r} is not a YAML value ({why})") from None
    field = dict(settable_fields()).get(key)
    if value is not None and field is not None and _textual(field.annotation):
        return text
    return value


def _textual(annotation: Any) -> bool:
    """Whether a field takes text only: ``str``, a ``Literal`` of strings, or either or None."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return len(args) == 1 and _textual(args[0])
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    return annotation is str


# sections whose fields are vague alone (level, format, directory, keep): flat, they keep the section's name
_PREFIXED_SECTIONS = ("checkpoint", "logging", "eval")


def _flat_name(key: str) -> str:
    """``Job``'s keyword for the dotted ``key`` (the rule of :data:`FLAT_KEYS`)."""
    section, _, field = key.rpartition(".")
    if not section:
        return field
    if field in ("factory", "name"):
        return section
    return f"{section}_{field}" if field == "kwargs" or section in _PREFIXED_SECTIONS else field


def _flat_keys() -> dict[str, str]:
    """See :data:`FLAT_KEYS`."""
    flat: dict[str, str] = {}
    for key, _ in settable_fields():
        name = _flat_name(key)
        if name in flat:
            raise AssertionError(f"flat keyword {name!r} names both {flat[name]} and {key}")
        flat[name] = key
    return flat


# Job(**fields), one keyword per field: a section's factory or name is the section's name (model=,
# optimizer=, eval=); its kwargs, and every field of the checkpoint, logging and eval sections, are
# <section>_<field> (model_kwargs=, logging_level=, checkpoint_keep=, eval_every_steps=); any other
# field is its own name, wherever it sits (global_batch -> data.global_batch, num_stages ->
# plan.num_stages, workers -> runtime.workers).
FLAT_KEYS: dict[str, str] = _flat_keys()


def from_flat(fields: Mapping[str, Any]) -> JobConfig:
    """The config of ``Job(**fields)``'s keywords (see :data:`FLAT_KEYS`).

    Raises:
        ConfigError: A keyword is unknown, or the config is invalid (naming its dotted key).
    """
    unknown = sorted(set(fields) - set(FLAT_KEYS))
    if unknown:
        raise ConfigError(f"unknown job field(s) {unknown}; the fields are {', '.join(FLAT_KEYS)}")
    return parse_config(apply_settings({}, {FLAT_KEYS[k]: v for k, v in fields.items()}))


def describe_validation(exc: ValidationError, raw: Any) -> str:
    """A pydantic error about ``raw`` as one ``field 'x.y': what is wrong`` per key, joined by ``"; "``.

    A value matching no member of a union (``lr: fast``) gives one entry naming the members.
    """
    problems: dict[str, list[tuple[str, str, str, Any]]] = {}  # key -> (type, message, union tag, input)
    for err in exc.errors():
        loc = tuple(err["loc"])
        path, tags = _walk(raw, loc) if err["type"] not in ("missing", "extra_forbidden") else (loc, ())
        where = ".".join(str(p) for p in path) or "the config"
        tag = ".".join(str(t) for t in tags)
        problems.setdefault(where, []).append((err["type"], err["msg"], tag, err.get("input")))
    parts = []
    for where, errs in problems.items():
        kind, msg, _, value = errs[0]
        if kind == "extra_forbidden":
            parts.append(f"field {where!r}: unknown field (misspelt?)")
        elif kind == "missing":
            parts.append(f"field {where!r}: missing (required)")
        elif len(errs) > 1:
            members = ", ".join(tag for _, _, tag, _ in errs if tag)
            parts.append(f"field {where!r}: {_short(value)} is none of the accepted types ({members})")
        elif kind == "model_type":  # a section given as one value (a format 1 spec: ``model: pkg:fn``)
            parts.append(f"field {where!r}: a section, give its fields as a mapping (see docs/running.md; "
                         f"got {_short(value)})")
        elif kind == "value_error" and isinstance(value, dict):  # a rule between fields names them itself
            parts.append(f"{where}: {msg.removeprefix('Value error, ')}")
        else:
            parts.append(f"field {where!r}: {msg.removeprefix('Value error, ')} (got {_short(value)})")
    return "; ".join(parts)


def _walk(raw: Any, loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Split an error location into the path present in ``raw`` and the union tags after it."""
    node = raw
    for i, part in enumerate(loc):
        present = (part in node if isinstance(node, dict)
                   else isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if present:
            node = node[part]
        else:
            return loc[:i], loc[i:]
    return loc, ()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
