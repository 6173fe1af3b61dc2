"""Type stubs for the Rust extension. Use the wrappers in `hindsight` instead."""

import builtins
import os
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal, Self, TypeAlias, final

FORMAT_VERSION: int
TORCH_DTYPES: list[str]
DEFAULT_STAGING_BYTES: int
DEVICE_FP_BLOCK_WORDS: int
STATE_ORIGIN_KEY: str

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEVICE_FP_BLOCK_WORDS",
    "EXIT_DIVERGED",
    "FORMAT_VERSION",
    "META_REPLICATED",
    "META_WORLD",
    "STATE_ORIGIN_KEY",
    "TORCH_DTYPES",
    "AbandonedError",
    "ArrayView",
    "BatchPrinter",
    "BlockEnd",
    "BlockKind",
    "BlockSave",
    "BlockStart",
    "Buffer",
    "CancelledError",
    "CheckpointId",
    "CheckpointPolicy",
    "CliCall",
    "ConcurrentChangeError",
    "CorruptError",
    "DataClient",
    "DataDispatcher",
    "DataError",
    "DataMismatchError",
    "DataPipelineError",
    "DataServiceError",
    "DataUnit",
    "DataUnreachableError",
    "DatabaseError",
    "DeviceCopyError",
    "DispatcherArgs",
    "Divergence",
    "DivergenceError",
    "EndKind",
    "Finish",
    "FitChoice",
    "HindsightError",
    "InternalError",
    "InvalidArgumentError",
    "Iteration",
    "IterationEnd",
    "JobSpec",
    "LeaseLostError",
    "LeftOut",
    "LogDb",
    "LogRecord",
    "LogValue",
    "NoDataWorkersError",
    "NonDeterministicDataError",
    "NotFoundError",
    "PartialTree",
    "Pickled",
    "Progress",
    "ProjectPaths",
    "RecordArgs",
    "RecordSession",
    "Region",
    "RegionRequest",
    "ReplayArgs",
    "ReplayCheck",
    "ReplayError",
    "ReplayPlan",
    "ReplayReport",
    "ReplaySession",
    "ReplayThreads",
    "ReplicaPlan",
    "ResumeWalk",
    "Retention",
    "RunInfo",
    "RunLease",
    "SaveHandle",
    "SeriesArgs",
    "Setting",
    "StateCheck",
    "StateDifference",
    "StepAction",
    "StepLoop",
    "StorageError",
    "StorageFullError",
    "StoragePermissionError",
    "Store",
    "StoreChoice",
    "StoreClosedError",
    "TokenArgs",
    "UnitWork",
    "UnsupportedTypeError",
    "Verdict",
    "Visit",
    "VisitKind",
    "WorkerArgs",
    "WorkerCommand",
    "WorkerEnd",
    "WorkerPlan",
    "World",
    "WrongProcessError",
    "batch_digest",
    "check_replay_world",
    "checked_every",
    "checkpoint_exit_code",
    "checkpoint_meta",
    "checkpoint_names",
    "choose_fit",
    "choose_store",
    "data_checkpoint_name",
    "data_example_seed",
    "data_job_token",
    "data_latest_checkpoint",
    "default_retention_spread",
    "device_fingerprint_of",
    "device_fingerprint_table",
    "launch_world",
    "parse_cli",
    "parse_date",
    "part_name",
    "plan_replicated",
    "project_paths",
    "put_back_files",
    "replay_report",
    "replay_threads",
    "replay_unproduced",
    "replay_unrestorable",
    "resume_fit",
    "resume_key",
    "run_data_dispatcher",
    "serve_data_worker",
    "setting_value",
    "settings",
    "store_location",
    "watch_opens",
]

@final
class SaveHandle:
    """Tracks one background save until it is durable."""

    @property
    def name(self) -> str: ...
    @property
    def setup_seconds(self) -> float: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> dict[str, float] | None:
        """Block until durable (GIL released); raise the save's error; None on timeout."""

@final
class Buffer:
    def __len__(self) -> int: ...

@final
class CheckpointId:
    """The engine's checkpoint naming rule: ``<prefix>.<loop>-<index:06>``, with
    ``.step-<step:09>`` (inside an iteration) or ``.end`` (after it) for interim ones."""

    def __new__(cls, prefix: str, loop_name: str, index: int, kind: str = "block", step: int | None = None) -> Self: ...
    @staticmethod
    def parse(name: str) -> CheckpointId | None: ...
    @property
    def name(self) -> str: ...
    @property
    def prefix(self) -> str: ...
    @property
    def loop_name(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def step(self) -> int | None: ...
    def meta(self) -> dict[str, str]: ...
    def __lt__(self, other: CheckpointId, /) -> bool: ...
    def __le__(self, other: CheckpointId, /) -> bool: ...
    def __gt__(self, other: CheckpointId, /) -> bool: ...
    def __ge__(self, other: CheckpointId, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Store:
    def __new__(
        cls,
        path: str,
        create: bool = True,
        compression: str | None = None,
        zstd_level: int | None = None,
        chunk_size: int | None = None,
        staging_bytes: int | None = None,
        threads: int | None = None,
        local_first: str | None = None,
    ) -> Self: ...
    @property
    def path(self) -> str: ...
    @property
    def local_first(self) -> str | None: ...
    def uploads_pending(self) -> int: ...
    @property
    def compression(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def background_cpu_seconds(self) -> float: ...
    @property
    def staging_bytes(self) -> int: ...
    def staging_in_use(self) -> int: ...
    def save(
        self,
        name: str,
        state: Any,
        describe: Callable[[Any, str], Any],
        materialize: Callable[[Any], tuple[int, Any, Callable[[], object] | None]],
        before_copy: Callable[[], None],
        device_fingerprints: Callable[[list[Any]], list[list[int]]],
        meta: dict[str, str] | None = None,
        skip_unchanged: bool = True,
        copy_threads: int | None = None,
        handle_out: list[SaveHandle] | None = None,
        part: bool = False,
    ) -> SaveHandle: ...
    def check_state(
        self,
        name: str,
        state: Any,
        describe: Callable[[Any, str], Any],
        materialize: Callable[[Any], tuple[int, Any, None]],
        path: list[str] | None = None,
    ) -> StateCheck: ...
    def load(
        self,
        name: str,
        make_array: Callable[..., Any],
        unpickle: Callable[[bytes, str], Any],
        path: list[str] | None = None,
        threads: int | None = None,
    ) -> Any: ...
    def load_leaving_out(
        self,
        name: str,
        make_array: Callable[..., Any],
        unpickle: Callable[[bytes, str], Any],
        path: builtins.list[str],
        skip: builtins.list[builtins.list[str]],
    ) -> PartialTree: ...
    def list(self) -> builtins.list[str]: ...
    def read_regions(
        self, name: str, wanted: builtins.list[RegionRequest], threads: int | None = None
    ) -> builtins.list[Region]: ...
    def commit_parts(self, name: str, world: int, attempt: str, timeout: float) -> dict[str, str]: ...
    def export_safetensors(self, name: str, path: builtins.list[str], out: str) -> dict[str, Any]: ...
    def meta(self, name: str) -> dict[str, str]: ...
    def info(self, name: str) -> dict[str, Any]: ...
    def flush(self, timeout: float | None = None) -> bool: ...
    def remove(self, name: str) -> None: ...
    def verify(self, names: builtins.list[str] | None = None) -> tuple[int, builtins.list[str]]: ...
    def gc(self) -> dict[str, int]: ...
    def usage(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def forget_unchanged(self) -> None: ...
    def checkpoints(self, prefix: str) -> builtins.list[CheckpointId]: ...
    def apply_retention(
        self,
        prefix: str,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_mode: str = "min",
        keep_every: int | None = None,
        metrics: dict[int, float] | None = None,
        monitor: str | None = None,
        keep_spread: int | None = None,
    ) -> builtins.list[str]: ...

def default_retention_spread(len: int | None) -> int | None: ...
def parse_cli(args: list[str]) -> CliCall: ...
def watch_opens(watcher: Callable[[Any, Any, Any], object]) -> None: ...
def device_fingerprint_table() -> Buffer: ...
def device_fingerprint_of(data: Any) -> list[int]: ...

@final
class ProjectPaths:
    """A project home and the files in it (the engine's rule)."""

    @property
    def home(self) -> str: ...
    @property
    def db(self) -> str: ...
    @property
    def store(self) -> str: ...

def project_paths(start: str, home: str | None = None) -> ProjectPaths: ...

@final
class StoreChoice:
    """Which store a run writes to, and through which local directory (the engine's rule)."""

    @property
    def location(self) -> str: ...
    @property
    def local_first(self) -> str | None: ...
    @property
    def declined(self) -> str | None: ...

def choose_store(
    home: str | os.PathLike[str],
    recorded: str | None = None,
    explicit: str | None = None,
    local_first: str | None = None,
    replay: bool = False,
) -> StoreChoice: ...
def checkpoint_names(location: str) -> list[str]: ...
def checkpoint_meta(location: str, name: str) -> dict[str, str]: ...
def store_location(location: str, what: str, local: bool = False) -> str: ...
def checkpoint_exit_code(explicit: int | None = None) -> int: ...

@final
class World:
    """This process's place in a multi-process launch (torchrun, srun)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def launcher(self) -> str: ...
    @property
    def leads(self) -> bool: ...

def launch_world() -> World | None: ...
def resume_fit(checkpoint: str, saved: int | None, now: int, reshard: bool) -> Literal["same", "reshard", "skip"]: ...
def check_replay_world(run_id: str, versions_json: str, now: int, restores_only: bool) -> str: ...

@final
class Setting:
    """One HINDSIGHT_* environment variable (the engine's table)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> Literal["path", "location", "flag", "int", "float", "text"]: ...
    @property
    def default(self) -> str: ...
    @property
    def doc(self) -> str: ...
    @property
    def internal(self) -> bool: ...

def settings() -> list[Setting]: ...
def setting_value(name: str) -> bool | int | float | str | None: ...

_Ctx: TypeAlias = list[tuple[str, int]]

@final
class RunLease:
    @staticmethod
    def hold(home: str | os.PathLike[str], run_id: str) -> RunLease: ...
    @staticmethod
    def share(home: str | os.PathLike[str], run_id: str) -> RunLease: ...
    def release(self) -> None: ...

@final
class LogDb:
    """The run and log database (SQLite) of a project."""

    def __new__(cls, path: str, checked: bool = False) -> Self: ...
    def create_run(
        self,
        script: str,
        script_abs: str,
        project_root: str,
        source_hash: str,
        args_json: str,
        host: str,
        versions_json: str,
        git_commit: str | None = None,
        git_dirty: bool | None = None,
        resume_key: str | None = None,
    ) -> str: ...
    def set_status(self, run_id: str, status_name: str, ended: bool = True) -> None: ...
    def set_args(self, run_id: str, args_json: str) -> None: ...
    def set_store(self, run_id: str, store: str) -> None: ...
    def run(self, run_id: str) -> RunInfo: ...
    def runs(self, limit: int | None = None) -> list[RunInfo]: ...
    def latest_run(self) -> RunInfo | None: ...
    def delete_run(self, run_id: str) -> None: ...
    def select_runs(
        self,
        script_abs: str,
        root: str,
        home: str,
        runs: list[str] | None = None,
        run: list[str] | None = None,
        since: str | None = None,
    ) -> list[RunInfo]: ...
    def worker_command(
        self, run_id: str, root: str, script: str, python: str, restores_only: bool
    ) -> WorkerCommand: ...
    def runs_of(self, script_abs: str | os.PathLike[str], root: str | os.PathLike[str]) -> list[RunInfo]: ...
    def run_at(self, run_id: str, root: str | os.PathLike[str]) -> RunInfo: ...
    def run_to_resume(
        self, resume_key: str, root: str, script: str, args: list[str], explicit: bool = False
    ) -> RunInfo | None: ...
    def put_source(self, files: dict[str, str]) -> str: ...
    def get_source(self, hash: str) -> dict[str, str]: ...
    def append_logs(self, run_id: str, phase_name: str, rows: list[tuple[str, _Ctx, int, str]]) -> None: ...
    def logs(self, run_id: str, names: list[str] = ...) -> list[LogRecord]: ...
    def values(self, run_id: str, names: list[str] = ...) -> list[LogValue]: ...
    def check_integrity(self) -> None: ...
    def log_names(self, run_id: str) -> list[str]: ...
    def require_logged(self, runs: list[str], names: list[str]) -> list[str]: ...
    def divergences(self, run_id: str, after: int | None = None) -> list[Divergence]: ...
    def export_run(self, run_id: str, dest: str | os.PathLike[str]) -> None: ...
    def import_replay(self, run_id: str, src: str | os.PathLike[str], replay_id: int) -> int: ...
    def last_seq(self, run_id: str) -> int: ...
    def begin_replay(self, run_id: str, exact: bool) -> int: ...
    def append_replay_logs(self, replay_id: int, run_id: str, rows: list[tuple[str, _Ctx, int, str]]) -> None: ...
    def replay_divergences(self, replay_id: int, after: int = 0) -> ReplayCheck: ...
    def finish_replay(self, replay_id: int, keep: str | None = None) -> int: ...
    def record_batches(
        self, run_id: str, outer: int, rank: int, kind: Literal["batch", "order"], rows: list[tuple[int, str]]
    ) -> None: ...
    def batch_digests(self, run_id: str, outer: int, rank: int, kind: Literal["batch", "order"]) -> dict[int, str]: ...
    def has_batch_digests(self, run_id: str) -> bool: ...
    def record_iteration(
        self,
        run_id: str,
        loop_name: str,
        idx: int,
        seconds: float,
        checkpoint: str | None = None,
        materialize_seconds: float | None = None,
        value: int | None = None,
    ) -> None: ...
    def record_iterations(self, run_id: str, loop_name: str, rows: list[Iteration]) -> None: ...
    def set_restore_seconds(self, run_id: str, loop_name: str, idx: int, seconds: float) -> None: ...
    def outer_loops(self, run_id: str) -> list[str]: ...
    def iterations(self, run_id: str, loop_name: str) -> list[Iteration]: ...
    def plan_replay(
        self,
        run_id: str,
        loop_name: str,
        in_store: set[str],
        selected: list[bool],
        needs_inner: bool,
        needs_start: bool = False,
        location: str | None = None,
        workers: int = 1,
    ) -> ReplayPlan: ...

@final
class Retention:
    """A checked retention policy (the engine's one rule for its arguments)."""

    @staticmethod
    def checked(
        call: str,
        metric_arg: str,
        mode_arg: str,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        keep_every: int | None = None,
    ) -> Retention: ...
    def is_empty(self) -> bool: ...
    @property
    def keep_last(self) -> int | None: ...
    @property
    def keep_best(self) -> int | None: ...
    @property
    def best_mode(self) -> str: ...
    @property
    def keep_every(self) -> int | None: ...
    @property
    def keep_spread(self) -> int | None: ...
    @property
    def metric(self) -> str | None: ...

@final
class VisitKind:
    """What an outer iteration about to start does."""

    RUN: ClassVar[VisitKind]
    RUN_STALE: ClassVar[VisitKind]
    RUN_FROM_START: ClassVar[VisitKind]
    RERUN: ClassVar[VisitKind]
    RESTORE: ClassVar[VisitKind]
    SKIP: ClassVar[VisitKind]
    STOP: ClassVar[VisitKind]
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class BlockKind:
    """What an iteration's steps do."""

    RUN: ClassVar[BlockKind]
    RESTORE: ClassVar[BlockKind]
    RESUME_STEPS: ClassVar[BlockKind]
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class EndKind:
    """A replay worker's action after an iteration's steps."""

    NOTHING: ClassVar[EndKind]
    RESTORE: ClassVar[EndKind]
    CHECK: ClassVar[EndKind]
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Visit:
    """What to do with an outer iteration (its `kind`, and the checkpoint it reads)."""

    @property
    def kind(self) -> VisitKind: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def stale(self) -> bool: ...

@final
class BlockStart:
    """What to do with an iteration's steps (its `kind`, the checkpoint and step)."""

    @property
    def kind(self) -> BlockKind: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def step(self) -> int: ...

@final
class StepAction:
    @property
    def prepare(self) -> bool: ...
    @property
    def save(self) -> str | None: ...
    @property
    def wait(self) -> bool: ...
    @property
    def exit(self) -> int | None: ...

@final
class BlockSave:
    @property
    def name(self) -> str: ...
    @property
    def wait(self) -> bool: ...

@final
class IterationEnd:
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def apply_retention(self) -> bool: ...
    @property
    def save(self) -> str | None: ...
    @property
    def exit(self) -> int | None: ...

@final
class Finish:
    @property
    def discard(self) -> str | None: ...
    @property
    def apply_retention(self) -> bool: ...

@final
class BlockEnd:
    """A replay worker's action after an iteration's steps (its `kind`, the checkpoint)."""

    @property
    def kind(self) -> EndKind: ...
    @property
    def checkpoint(self) -> str | None: ...

@final
class RecordSession:
    """A recording process's lifecycle (core runs::session): events in, actions out."""

    @staticmethod
    def from_env(run_id: str, now: float) -> RecordSession: ...
    @staticmethod
    def for_framework(prefix: str, now: float) -> RecordSession: ...
    def set_framework_periods(self, every_epochs: int | None, every_steps: int | None, from_step: int) -> None: ...
    def set_objects(self, any: bool) -> None: ...
    def set_every(self, every: int) -> None: ...
    def set_exit_code(self, code: int | None) -> None: ...
    def set_safety_minutes(self, minutes: float) -> None: ...
    def set_retention(self, policy: Retention) -> None: ...
    @property
    def retention(self) -> Retention: ...
    @property
    def exit_code(self) -> int: ...
    @property
    def every(self) -> int | None: ...
    @property
    def epsilon(self) -> float: ...
    @property
    def contention(self) -> float: ...
    @property
    def pending_signal(self) -> int | None: ...
    def signal(self, signum: int) -> None: ...
    def outer_start(self, loop_name: str, length: int | None) -> None: ...
    def resume_from(self, name: str, at_iteration_end: bool) -> None: ...
    def iteration_start(self, i: int) -> Visit: ...
    def block_start(self, i: int) -> BlockStart: ...
    def step_boundary(self, i: int, j: int, now: float) -> StepAction | None: ...
    def overhead(self, total_secs: float) -> None: ...
    def started(self, secs: float) -> None: ...
    def restore_measured(self, read_secs: float) -> None: ...
    def block_end(
        self, i: int, compute_secs: float, background_total: float | None, first_estimate: float
    ) -> BlockSave | None: ...
    def block_end_decided(self, i: int, due: bool) -> BlockSave | None: ...
    def join(self, run_id: str, now: float) -> None: ...
    def saved(self, blocked_secs: float, now: float) -> None: ...
    def checkpoint_size(self, nbytes: int) -> None: ...
    def start_unkept(self, i: int) -> None: ...
    def block_closed(self, i: int) -> None: ...
    def iteration_continues(self) -> None: ...
    def iteration_end(self, i: int, closing: bool) -> IterationEnd: ...
    def outer_end(self) -> str | None: ...
    def resumed_batch(self, i: int, j: int, rank: int | None, recorded: str | None, digest: str) -> None: ...
    def take_decision(self) -> str | None: ...
    def start_line(self, script: str, home: str, objects: list[str], resumed: bool) -> str: ...
    def summary(self, status: str, script: str, bytes_written: int | None, now: float) -> str: ...
    def finish(self, status: str) -> Finish: ...

@final
class ReplaySession:
    """A replay worker's lifecycle: its plan's execution and its proofs (core runs::session)."""

    def __new__(cls, plan: WorkerPlan) -> ReplaySession: ...
    def set_cost_rule(self, on: bool) -> None: ...
    @property
    def last_needed(self) -> int | None: ...
    @property
    def past_plan(self) -> bool: ...
    @property
    def steps_executed(self) -> int: ...
    @property
    def restored(self) -> int: ...
    def outer_start(self, loop_name: str) -> None: ...
    def iteration_start(self, i: int) -> Visit: ...
    def start_state_sources(self) -> list[str]: ...
    def block_start(self, i: int, expected: dict[int, str]) -> BlockStart: ...
    def step(self, i: int, j: int, digest: str) -> None: ...
    def restored_in(self, secs: float) -> None: ...
    def checked_in(self, secs: float) -> None: ...
    def block_end(self, i: int, at_iteration: bool) -> BlockEnd: ...
    def state_differs(self, i: int, name: str, path: str, detail: str) -> BaseException: ...
    def value_differs(self, name: str, at: str, recorded: str, replayed: str) -> BaseException: ...
    def iteration_end(self, i: int) -> str: ...
    def summary(self, run_secs: float) -> str: ...

@final
class LogRecord:
    @property
    def name(self) -> str: ...
    @property
    def ctx(self) -> _Ctx: ...
    @property
    def rep(self) -> int: ...
    @property
    def value_json(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def created_ms(self) -> int: ...
    @property
    def flag(self) -> str | None: ...

@final
class LogValue:
    @property
    def name(self) -> str: ...
    @property
    def ctx(self) -> _Ctx: ...
    @property
    def rep(self) -> int: ...
    @property
    def value_json(self) -> str: ...
    @property
    def recorded(self) -> str | None: ...
    @property
    def replayed(self) -> str | None: ...
    @property
    def diverged(self) -> bool: ...
    @property
    def replay_flag(self) -> str | None: ...

@final
class Divergence:
    @property
    def name(self) -> str: ...
    @property
    def ctx(self) -> _Ctx: ...
    @property
    def record_value(self) -> str: ...
    @property
    def replay_value(self) -> str: ...

@final
class ReplayCheck:
    @property
    def divergences(self) -> list[Divergence]: ...
    @property
    def last_seq(self) -> int: ...

@final
class RunInfo:
    """One run of the project, as the run database holds it."""

    @property
    def id(self) -> str: ...
    @property
    def script(self) -> str: ...
    @property
    def script_abs(self) -> str: ...
    @property
    def project_root(self) -> str: ...
    @property
    def source_hash(self) -> str: ...
    @property
    def git_commit(self) -> str | None: ...
    @property
    def git_dirty(self) -> bool | None: ...
    @property
    def args_json(self) -> str: ...
    @property
    def status(self) -> Literal["running", "completed", "failed", "interrupted"]: ...
    @property
    def started_ms(self) -> int: ...
    @property
    def ended_ms(self) -> int | None: ...
    @property
    def host(self) -> str: ...
    @property
    def versions_json(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def resume_key(self) -> str | None: ...
    @property
    def store(self) -> str | None: ...

@final
class Iteration:
    """One recorded outer-loop iteration."""

    def __new__(
        cls,
        idx: int,
        seconds: float,
        value: int | None = None,
        checkpoint: str | None = None,
        materialize_seconds: float | None = None,
        restore_seconds: float | None = None,
    ) -> Self: ...
    @property
    def idx(self) -> int: ...
    @property
    def value(self) -> int | None: ...
    @property
    def seconds(self) -> float: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def materialize_seconds(self) -> float | None: ...
    @property
    def restore_seconds(self) -> float | None: ...

@final
class ArrayView:
    """A tensor or array as a save reads it (what `describe` answers)."""

    def __new__(
        cls,
        *,
        lib: str,
        dtype: str,
        shape: list[int],
        ptr: int,
        nbytes: int,
        owner: Any,
        device: str,
        host: bool,
        version: int | None = None,
        global_shape: list[int] | None = None,
        offset: list[int] | None = None,
    ) -> Self: ...
    @property
    def global_shape(self) -> list[int] | None: ...
    @property
    def offset(self) -> list[int] | None: ...
    @property
    def lib(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def owner(self) -> Any: ...
    @property
    def device(self) -> str: ...
    @property
    def host(self) -> bool: ...
    @property
    def version(self) -> int | None: ...

@final
class Pickled:
    """An object stored as pickled bytes (only where the caller allowed it)."""

    def __new__(cls, data: bytes) -> Self: ...
    @property
    def data(self) -> bytes: ...

@final
class StateDifference:
    """One difference between a checkpoint and a live state."""

    @property
    def path(self) -> str: ...
    @property
    def detail(self) -> str: ...

@final
class StateCheck:
    """A live state compared with a checkpoint (`Store.check_state`)."""

    @property
    def first(self) -> StateDifference | None: ...
    @property
    def notes(self) -> list[StateDifference]: ...

@final
class ReplayThreads:
    """The thread rule of a replay: workers at once, each run's threads and exactness."""

    @property
    def budget(self) -> int: ...
    @property
    def widest(self) -> int | None: ...
    @property
    def threads(self) -> list[int]: ...
    @property
    def exact(self) -> list[bool]: ...
    @property
    def task_cpus(self) -> int: ...
    @property
    def notes(self) -> list[str]: ...

def replay_threads(
    cores: int,
    jobs: int,
    workers: list[int],
    recorded: list[int | None],
    ranks: list[int],
    fast: bool,
    local: bool,
    run_ids: list[str],
) -> ReplayThreads: ...
def replay_unrestorable(run_id: str, iterations: int, checkpointed: int, location: str | None) -> str | None: ...

@final
class Progress:
    """A replay worker's progress lines, read."""

    def __new__(cls) -> Progress: ...
    def read(self, text: str) -> None: ...
    @property
    def done(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def bodies(self) -> int: ...
    @property
    def restored(self) -> int: ...

@final
class Verdict:
    """What a run's replay is worth once its workers ended."""

    @property
    def failed(self) -> list[int]: ...
    @property
    def diverged(self) -> bool: ...
    @property
    def keep(self) -> str | None: ...
    @property
    def exit(self) -> int: ...

@final
class WorkerEnd:
    """One replay worker as it ended."""

    def __new__(
        cls,
        index: int,
        first: int | None,
        last: int | None,
        returncode: int | None,
        stderr_tail: str,
        progress: Progress,
    ) -> WorkerEnd: ...

@final
class ReplayReport:
    """What `hindsight replay` says of a run's replay, and what it is worth."""

    @property
    def warnings(self) -> list[str]: ...
    @property
    def summary(self) -> list[str]: ...
    @property
    def verdict(self) -> Verdict: ...

def replay_report(
    run_id: str,
    names: list[str],
    total: int,
    workers: list[WorkerEnd],
    check: ReplayCheck,
    allow_divergence: bool,
    exact: bool,
    wall_secs: float,
) -> ReplayReport: ...
def replay_unproduced(run_id: str, names: list[str], have: list[str]) -> list[str]: ...

EXIT_DIVERGED: int

@final
class WorkerCommand:
    """How a replay worker starts: its command line and working directory."""

    @property
    def ranks(self) -> int: ...
    @property
    def torchrun(self) -> bool: ...
    @property
    def argv(self) -> list[str]: ...
    @property
    def cwd(self) -> str: ...

@final
class WorkerPlan:
    """What one replay worker does; its JSON is the worker protocol."""

    @staticmethod
    def from_json(text: str) -> WorkerPlan: ...
    def to_json(
        self,
        progress_fd: int | None = None,
        log_db: str | os.PathLike[str] | None = None,
        replay_id: int | None = None,
        exact: bool = True,
    ) -> str: ...
    def execute_instead(self, i: int, measured: float | None = None) -> str | None: ...
    def state_check(self, i: int) -> str | None: ...
    @property
    def replay_id(self) -> int | None: ...
    @property
    def run_id(self) -> str: ...
    @property
    def worker(self) -> int: ...
    @property
    def loop_name(self) -> str: ...
    @property
    def restores_only(self) -> bool: ...
    @property
    def modes(self) -> dict[int, str]: ...
    @property
    def checkpoints(self) -> dict[int, str]: ...
    @property
    def progress_fd(self) -> int | None: ...
    @property
    def log_db(self) -> str | None: ...

@final
class FitChoice:
    """Which Lightning fit a ``Trainer.fit`` continues."""

    @property
    def resume(self) -> CheckpointId | None: ...
    @property
    def latest(self) -> CheckpointId | None: ...
    @property
    def fresh_prefix(self) -> str: ...

def choose_fit(names: list[str], base: str) -> FitChoice: ...

@final
class ResumeWalk:
    """The checkpoints a continuing process tries, newest first."""

    @staticmethod
    def run(names: list[str], run_id: str) -> ResumeWalk: ...
    @staticmethod
    def fit(names: list[str], base: str, loop_name: str) -> ResumeWalk: ...
    @staticmethod
    def given(order: list[str]) -> ResumeWalk: ...
    @property
    def order(self) -> list[str]: ...
    def __iter__(self) -> ResumeWalk: ...
    def __next__(self) -> str: ...
    @staticmethod
    def damaged(name: str, why: str) -> str: ...

@final
class ReplayPlan:
    @property
    def kind(self) -> str: ...
    @property
    def note(self) -> str | None: ...
    @property
    def workers(self) -> list[WorkerPlan]: ...

# The input service (hindsight.data).

@final
class JobSpec:
    dataset: str
    dataset_args: str
    code_version: str
    seed: int
    length: int
    global_batch: int
    split_batches: int
    drop_last: bool
    shuffle: bool
    shards: list[int]
    def __new__(
        cls,
        *,
        dataset: str,
        dataset_args: str,
        code_version: str,
        seed: int,
        length: int,
        global_batch: int,
        split_batches: int,
        drop_last: bool,
        shuffle: bool,
        shards: list[int] = ...,
    ) -> Self: ...
    def job_id(self) -> str: ...
    def differences(self, other: JobSpec) -> list[str]: ...
    def batches_per_epoch(self) -> int: ...
    def batch_indices(self, epoch: int, batch: int, rank: int, world: int) -> list[int]: ...

@final
class DataUnit:
    epoch: int
    batch: int
    indices: list[int]
    digest: bytes
    payload: Buffer

@final
class DataClient:
    def __new__(
        cls,
        dispatcher: str,
        spec: JobSpec,
        *,
        rank: int = 0,
        world: int = 1,
        expect_job_id: str | None = None,
        window_splits: int = 4,
        stall_timeout: float = 0.5,
        unit_deadline: float | None = None,
        no_worker_wait: float = 60.0,
        connect_timeout: float = 3.0,
        warn_nondeterministic: bool = False,
        shared_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> Self: ...
    @property
    def job_id(self) -> str: ...
    def start_epoch(self, epoch: int, from_batch: int) -> None: ...
    def stop_epoch(self) -> None: ...
    def next(self) -> DataUnit | None: ...
    def stats(self) -> dict[str, int | float]: ...
    def close(self) -> None: ...

@final
class DataDispatcher:
    def __new__(
        cls, journal_dir: str | os.PathLike[str], *, bind: str = "127.0.0.1:0", heartbeat_timeout: float = 1.0
    ) -> Self: ...
    @property
    def address(self) -> str: ...
    @property
    def token(self) -> str: ...
    def stop(self) -> None: ...

def data_example_seed(seed: int, epoch: int, index: int) -> int: ...

@final
class UnitWork:
    """What a worker's pipeline is asked for: one rank's slice of one global batch."""

    job_id: str
    epoch: int
    batch: int
    split: int
    split_start: int
    split_end: int
    indices: list[int]
    seeds: list[int]
    shards: list[int]
    offsets: list[int]

@final
class CheckpointPolicy:
    """Worker checkpoints: when one pays, from what this worker measured."""

    def __new__(cls, max_overhead: float = 0.05) -> Self: ...
    def observe_read(self, n: int, secs: float) -> None: ...
    def observe_unit(self, secs: float) -> None: ...
    def observe_checkpoint(self, records: int, secs: float) -> None: ...
    def decide(self, read: int, kept: int, since: int) -> Literal["checkpoint", "wait", "never"]: ...
    @property
    def read_s_per_record(self) -> float | None: ...
    @property
    def stall_s_per_record(self) -> float | None: ...
    @property
    def gave_up(self) -> bool: ...

def data_checkpoint_name(job_id: str, epoch: int, split: int, batch: int) -> str: ...
def data_latest_checkpoint(names: list[str], job_id: str, epoch: int, split: int, batch: int) -> str | None: ...
def serve_data_worker(
    dispatcher: str,
    dataset: str,
    dataset_args: str,
    code_version: str,
    produce: Callable[[UnitWork], memoryview],
    *,
    bind: str = "127.0.0.1:0",
    advertise: str | None = None,
    ready: Callable[[str, str], object] | None = None,
    parent_pid: int | None = None,
    shared_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
) -> None: ...
def run_data_dispatcher(
    journal_dir: str | os.PathLike[str], *, bind: str = "127.0.0.1:50051", heartbeat_timeout: float = 1.0
) -> None: ...
def checked_every(call: str, arg: str, value: object) -> int: ...
def data_job_token(dataset: str, journal_dir: str | os.PathLike[str] | None = None) -> str: ...
def parse_date(text: str) -> int: ...
def batch_digest(parts: list[str | Any]) -> str: ...

@final
class BatchPrinter:
    """Fingerprints what one training step consumed (`_run.batches`)."""

    def __new__(
        cls,
        plain_tensors: list[type],
        leaf_types: list[type],
        strided: object | None,
        full_bytes: int,
        leaf: Callable[[Any], list[Any]],
    ) -> BatchPrinter: ...
    def digest(self, batch: object) -> str: ...

@final
class StepLoop:
    """A block's training steps, started and ended natively (`Run._block`)."""

    def __new__(
        cls,
        it: Iterator[Any],
        *,
        i: int,
        start: int,
        entry: list[Any],
        reps: dict[Any, Any],
        run: object,
        printer: Callable[[], BatchPrinter],
        session: RecordSession | ReplaySession,
        prints: Literal["record", "replay"],
        boundary: Literal["none", "session", "run"],
        rank: int = 0,
        tap: object | None = None,
        beat_fd: int | None = None,
    ) -> StepLoop: ...
    def __iter__(self) -> StepLoop: ...
    def __next__(self) -> Any: ...
    def close(self) -> None: ...

def resume_key(script: str, root: str, args: list[str]) -> str: ...
def put_back_files(
    root: str | os.PathLike[str], files: dict[str, bytes], protected: list[str | os.PathLike[str]], checkpoint: str
) -> None: ...

# Exception classes, created by the binding (errors.rs); hindsight.errors re-exports them.
class HindsightError(Exception):
    """Base class of every hindsight error. Errors from the engine carry what
    they are about as attributes (None where it does not apply)."""

    #: True when the error happened in a background save and is reported late.
    background: bool
    #: The file or object (``s3://...``) the error is about.
    path: str | None
    #: The checkpoint the error is about.
    checkpoint: str | None
    #: The key path inside the checkpoint (``model/layer.weight``).
    key_path: str | None
    #: The argument an ``InvalidArgumentError`` names.
    arg: str | None
    #: The run a ``ReplayError`` or ``DivergenceError`` is about.
    run: str | None

class NotFoundError(HindsightError, LookupError):
    """A store, checkpoint or key path that does not exist."""

class CorruptError(HindsightError):
    """Stored bytes fail their checksum or do not parse. Nothing wrong is returned."""

class UnsupportedTypeError(HindsightError, TypeError):
    """A value the format cannot hold; pass allow_pickle=True to pickle it."""

class InvalidArgumentError(HindsightError, ValueError):
    """A bad name, option or argument."""

class StorageError(HindsightError, OSError):
    """An I/O error from the storage."""

class StorageFullError(StorageError):
    """The disk or quota is full. No partial checkpoint became visible."""

class StoragePermissionError(StorageError, PermissionError):
    """Storage refused access: missing permission or credentials."""

class ConcurrentChangeError(StorageError):
    """A conditional write lost a race: another process changed the object first."""

class LeaseLostError(StorageError):
    """The lease protecting a save or gc on object storage was lost; nothing was committed under it."""

class WrongProcessError(HindsightError):
    """A Store used in a process other than the one that opened it (e.g. a fork)."""

class DatabaseError(HindsightError):
    """The run/log database failed (locked too long, unreadable, newer schema)."""

class ReplayError(HindsightError):
    """A replay cannot run as asked (script changed beyond logging, missing checkpoint, ...)."""

class DivergenceError(ReplayError):
    """A replay or a resume computed something other than the recording: a
    step consumed other data, a logged value differs, or the state at a
    checkpoint differs. Raised at the first difference, naming it; nothing
    computed after it is presented as a result."""

class CancelledError(HindsightError):
    """The operation was interrupted or abandoned."""

class StoreClosedError(CancelledError):
    """The store (or its writer) was closed."""

class AbandonedError(CancelledError):
    """A save that never committed: an earlier step of it failed or was interrupted."""

class DeviceCopyError(HindsightError):
    """The device-to-host copy of a save failed (e.g. a CUDA error); the save did not commit."""

class InternalError(HindsightError):
    """A broken invariant inside hindsight (a bug): reported, never papered over."""

class DataError(HindsightError):
    """An error of the input service (``hindsight.data``)."""

    #: The dispatcher or worker address the error is about.
    address: str | None
    #: The dataset factory (``module:factory``) the error is about.
    dataset: str | None

class DataUnreachableError(DataError, ConnectionError):
    """Nothing answered at the dispatcher or worker address in time."""

class DataMismatchError(DataError, ValueError):
    """A job, protocol or code version that differs from the other side's; the message names the difference."""

class DataPipelineError(DataError):
    """The dataset factory or pipeline raised in a worker; the message holds its traceback."""

class NonDeterministicDataError(DataError):
    """A recomputed unit differs from its first computation: the pipeline is not deterministic."""

class NoDataWorkersError(DataError):
    """No live worker served the dataset within the wait."""

class DataServiceError(DataError):
    """A call inside the input service failed in a way no retry fixes."""

@final
class Region:
    """A box of an array read from a checkpoint (row-major bytes)."""

    @property
    def lib(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def data(self) -> Buffer: ...

@final
class LeftOut:
    """An array a load left out: its key path from the root, its whole shape."""

    @property
    def path(self) -> list[str]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...

@final
class PartialTree:
    """A load without some of its arrays (None in their places)."""

    @property
    def tree(self) -> Any: ...
    @property
    def left_out(self) -> list[LeftOut]: ...

@final
class RegionRequest:
    """Which box of which array to read."""

    def __new__(cls, *, path: list[str], whole: list[int], offset: list[int], shape: list[int]) -> Self: ...
    @property
    def path(self) -> list[str]: ...
    @property
    def whole(self) -> list[int]: ...
    @property
    def offset(self) -> list[int]: ...
    @property
    def shape(self) -> list[int]: ...

@final
class ReplicaPlan:
    """Which rank writes each replicated item, and their digest."""

    @property
    def owners(self) -> list[int]: ...
    @property
    def digest(self) -> str: ...

def plan_replicated(items: list[str], sizes: list[int], world: int) -> ReplicaPlan: ...
def part_name(name: str, rank: int, world: int, attempt: str) -> str: ...

META_REPLICATED: str
META_WORLD: str

@final
class CliCall:
    """What `parse_cli` did: a command run here (its exit code and output,
    or its help or usage error), or a Python command's parsed `args`."""

    code: int
    out: str
    err: str
    args: ReplayArgs | SeriesArgs | RecordArgs | DispatcherArgs | WorkerArgs | TokenArgs | None
    store_given: bool

@final
class ReplayArgs:
    script: str
    run: builtins.list[str] | None
    runs: builtins.list[str] | None
    since: str | None
    jobs: int
    where: str | None
    force: bool
    allow_divergence: bool
    fast: bool
    recorded_ranks: bool
    quiet: bool
    launcher: str
    sbatch: builtins.list[str] | None
    home: str | None

@final
class SeriesArgs:
    command: str
    names: builtins.list[str]
    run: builtins.list[str]
    output: str | None
    tensorboard: str | None
    home: str | None

@final
class RecordArgs:
    explain: bool
    command: builtins.list[str]

@final
class DispatcherArgs:
    journal: str
    port: int
    host: str
    heartbeat_timeout: float

@final
class WorkerArgs:
    dispatcher: str
    dataset: str
    args: str
    collate: str | None
    bind: str
    advertise: str | None
    parent_pid: int | None
    checkpoints: str | None
    checkpoint_overhead: float
    shared_dir: str | None

@final
class TokenArgs:
    dataset: str
    journal: str | None
