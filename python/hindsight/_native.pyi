"""Type stubs for the Rust extension. Use the wrappers in `hindsight` instead."""

import builtins
import os
from collections.abc import Callable
from typing import Any, Literal, Self, TypeAlias, final

FORMAT_VERSION: int
DEFAULT_STAGING_BYTES: int

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "FORMAT_VERSION",
    "AdaptivePolicy",
    "Buffer",
    "CheckpointId",
    "CheckpointPolicy",
    "DataClient",
    "DataDispatcher",
    "DataUnit",
    "Divergence",
    "Iteration",
    "JobSpec",
    "LogDb",
    "LogRecord",
    "LogValue",
    "ProjectPaths",
    "ReplayPlan",
    "SaveHandle",
    "Store",
    "UnitWork",
    "WorkerPlan",
    "checkpoint_exit_code",
    "checkpoint_names",
    "data_checkpoint_name",
    "data_example_seed",
    "data_latest_checkpoint",
    "project_paths",
    "run_cli",
    "run_data_dispatcher",
    "serve_data_worker",
    "store_location",
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
    def staging_bytes(self) -> int: ...
    def staging_in_use(self) -> int: ...
    def save(
        self,
        name: str,
        state: Any,
        describe: Callable[[Any, str], tuple[Any, ...]],
        materialize: Callable[[Any], tuple[int, Any, Callable[[], object] | None]],
        before_copy: Callable[[], None],
        device_fingerprint: Callable[[Any, Any | None], tuple[bool, Any]],
        meta: dict[str, str] | None = None,
        skip_unchanged: bool = True,
        copy_threads: int | None = None,
        handle_out: list[SaveHandle] | None = None,
    ) -> SaveHandle: ...
    def load(
        self,
        name: str,
        make_array: Callable[..., Any],
        unpickle: Callable[[bytes, str], Any],
        path: list[str] | None = None,
        threads: int | None = None,
    ) -> Any: ...
    def list(self) -> builtins.list[str]: ...
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
    ) -> builtins.list[str]: ...

def run_cli(args: list[str]) -> tuple[int, str, str]: ...

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
def checkpoint_names(location: str) -> list[str]: ...
def store_location(location: str, what: str, local: bool = False) -> str: ...
def checkpoint_exit_code(explicit: int | None = None) -> int: ...

_Ctx: TypeAlias = list[tuple[str, int]]

@final
class LogDb:
    """The run and log database (SQLite) of a project."""

    def __new__(cls, path: str) -> Self: ...
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
    def run(self, run_id: str) -> dict[str, Any]: ...
    def runs(self, limit: int | None = None) -> list[dict[str, Any]]: ...
    def latest_run(self, script_abs: str | None = None) -> dict[str, Any] | None: ...
    def run_to_resume(self, resume_key: str, explicit: bool = False) -> dict[str, Any] | None: ...
    def put_source(self, files: dict[str, str]) -> str: ...
    def get_source(self, hash: str) -> dict[str, str]: ...
    def append_logs(self, run_id: str, phase_name: str, rows: list[tuple[str, _Ctx, int, str]]) -> None: ...
    def logs(self, run_id: str, names: list[str] = ...) -> list[LogRecord]: ...
    def values(self, run_id: str, names: list[str] = ...) -> list[LogValue]: ...
    def check_integrity(self) -> None: ...
    def log_names(self, run_id: str) -> list[str]: ...
    def divergences(self, run_id: str, after: int | None = None) -> list[Divergence]: ...
    def last_seq(self, run_id: str) -> int: ...
    def record_iteration(
        self,
        run_id: str,
        loop_name: str,
        idx: int,
        seconds: float,
        checkpoint: str | None = None,
        materialize_seconds: float | None = None,
    ) -> None: ...
    def set_restore_seconds(self, run_id: str, loop_name: str, idx: int, seconds: float) -> None: ...
    def iterations(self, run_id: str, loop_name: str) -> list[Iteration]: ...
    def plan_replay(
        self,
        run_id: str,
        loop_name: str,
        in_store: set[str],
        selected: list[bool],
        needs_inner: bool,
        needs_start: bool = False,
        workers: int = 1,
    ) -> ReplayPlan: ...

@final
class AdaptivePolicy:
    """Flor's adaptive checkpoint period (the Joint Invariant)."""

    def __new__(cls, epsilon: float = ...) -> Self: ...
    def observe_iteration(self, compute_secs: float, expected_materialize_secs: float) -> bool: ...
    def observe_materialize(self, actual_secs: float) -> None: ...
    def observe_restore(self, restore_secs: float, materialize_secs: float) -> None: ...
    def overhead(self) -> float: ...
    @property
    def c(self) -> float: ...
    @property
    def epsilon(self) -> float: ...

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
class Iteration:
    """One recorded outer-loop iteration."""

    @property
    def idx(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def checkpoint(self) -> str | None: ...
    @property
    def materialize_seconds(self) -> float | None: ...
    @property
    def restore_seconds(self) -> float | None: ...

@final
class WorkerPlan:
    """What one replay worker does; its JSON is the worker protocol."""

    @staticmethod
    def from_json(text: str) -> WorkerPlan: ...
    def to_json(self, progress_fd: int | None = None) -> str: ...
    @property
    def run_id(self) -> str: ...
    @property
    def worker(self) -> int: ...
    @property
    def loop_name(self) -> str: ...
    @property
    def modes(self) -> dict[int, str]: ...
    @property
    def checkpoints(self) -> dict[int, str]: ...
    @property
    def progress_fd(self) -> int | None: ...

@final
class ReplayPlan:
    @property
    def kind(self) -> str: ...
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
        no_worker_wait: float = 60.0,
        connect_timeout: float = 3.0,
        warn_nondeterministic: bool = False,
        shared_dir: str | os.PathLike[str] | None = None,
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
    code_version: str,
    produce: Callable[[UnitWork], memoryview],
    *,
    bind: str = "127.0.0.1:0",
    advertise: str | None = None,
    ready: Callable[[str, str], object] | None = None,
    parent_pid: int | None = None,
    shared_dir: str | os.PathLike[str] | None = None,
) -> None: ...
def run_data_dispatcher(
    journal_dir: str | os.PathLike[str], *, bind: str = "0.0.0.0:50051", heartbeat_timeout: float = 1.0
) -> None: ...
