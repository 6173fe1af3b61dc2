"""Replaying (a worker started by `hindsight replay`, env HINDSIGHT_REPLAY):
the outer loop visits only the iterations of this worker's plan. In
"restore" iterations the inner loop yields nothing and the state comes from
that iteration's checkpoint instead, so the code after it (and any new
`hs.log` there) runs on exactly the recorded state; in "execute" iterations
it runs. The worker protocol (plan file, progress lines) is documented with
`WorkerPlan` in the engine (`runs::replay`)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hindsight import _native
from hindsight._run import files
from hindsight._run.common import Run, inherited_pipe, job_part
from hindsight._run.logwriter import Row
from hindsight._state import capture_grads, rng_as_recorded, set_rng_state
from hindsight._store import Store
from hindsight.errors import HindsightError, ReplayError

#: A worker's exit status when what it computed differs from the recording (the engine's).
EXIT_DIVERGED = _native.EXIT_DIVERGED
# How often a worker looks for a value it computed otherwise than the recording.
VALUE_CHECK_SECS = 0.5


class ReplayRun(Run):
    """The frame and state plumbing of a replay worker; which iterations it
    visits, restores or executes, and what it must prove, is its session's
    (`_native.ReplaySession`, core `runs::session`)."""

    phase = "replay"
    #: When the outer loop first started (the worker's time before it is start-up).
    outer_t0: float | None = None

    def __init__(self, plan_path: str) -> None:
        with open(plan_path) as f:
            self.plan = _native.WorkerPlan.from_json(f.read())
        super().__init__()
        self.run_id = self.plan.run_id
        row = self.db.run_at(self.run_id, str(self.root))  # where the project is now
        self.recorded_store = row.store
        self.args = json.loads(row.args_json or "{}")
        # A run of several ranks replays on as many (the driver launches
        # its workers under torchrun), or on one process where the worker
        # only restores: any other number is refused here.
        versions = self.db.run(self.run_id).versions_json or "{}"
        size = 1 if self.ranks is None else self.ranks.size
        world = _native.check_replay_world(self.run_id, versions, size, self.plan.restores_only)
        self.session = _native.ReplaySession(self.plan)
        # The checkpoints resharded onto this one process; it must never
        # execute training (the cost rule would: the ranks are not here).
        self.reshard = world == "one_process"
        if self.reshard:
            self.session.set_cost_rule(False)
            n = json.loads(versions).get("world_size")
            print(
                f"hindsight: this replay worker only restores run {self.run_id}'s checkpoints (saved by "
                f'{n} ranks): on one process, resharded onto it; values logged with rank="all" are its own, '
                "and epoch code whose values depend on the world size (a collective, a DistributedSampler) "
                "stops it (hindsight replay --recorded-ranks runs it on the recorded ranks); recorded values are "
                "still checked",
                file=sys.stderr,
                flush=True,
            )
            _refuse_world_values((self.root, self.script.parent), self.run_id, n)
        # Rank 0 reports the worker's progress (and stages its values).
        fd = self.plan.progress_fd
        self.progress: int | None = inherited_pipe(fd) if fd is not None and self.leads else None
        # The staged values checked so far against the recording.
        self.checked_seq = 0
        self.next_value_check = 0.0
        self.noted_clock = False
        self.replay_id: int | None = self.plan.replay_id
        # Writes go to this worker's own mirror of the recorded directory.
        files.mirror_worker(self.home)
        atexit.register(self.finish)

    def _log_db_path(self) -> str:
        # A Slurm task writes its own database, which the driver merges.
        return self.plan.log_db or super()._log_db_path()

    def arg(self, name: str, default: Any) -> Any:
        return self.args.get(name, default)

    def parse_args(self, parser: Any, argv: list[str] | None) -> Any:
        """The recorded values, on what the recorded command line parses to.

        Parsing the recorded argv satisfies required and positional arguments
        and gives options added since the recording their defaults; the
        recorded values then win over anything the parse produced (type
        conversions of the original parse, values of `hs.args(parser, argv)`
        given by the script)."""
        versions = json.loads(self.db.run(self.run_id).versions_json or "{}")
        recorded = list(versions.get("argv") or [])[1:]
        ns = _parse_quietly(parser, recorded)
        for k, v in self.args.items():
            setattr(ns, k, v)
        return ns

    def _open_store(self) -> tuple[str, str | None]:
        # Replay reads where the run wrote, never through a local-first cache (core `runs::store_choice`).
        return _native.choose_store(self.paths.home, self.recorded_store or None, replay=True).location, None

    def _progress(self, line: str) -> None:
        if self.progress is None:
            return
        try:
            os.write(self.progress, line.encode())
        except OSError:
            self.progress = None  # the driver went away; replay still finishes

    def _apply_vars(self, state: dict[str, Any]) -> None:
        super()._apply_vars(state)
        lv = self.pos.block_vars
        if not (self.pos.block_live and lv is not None):
            return
        missing = lv.unkept_reads((state.get("vars") or {}).get("block") or {}, self.objects, self.transient)
        if missing:
            raise ReplayError(
                f"the replayed code reads {', '.join(missing)} after the steps of loop '{lv.loop_name}' before "
                "assigning it again, but the recording did not keep its value (the recorded code did not read it "
                "there): with the steps skipped it would hold an older value. Log what you need from it inside the "
                "steps (a parallel replay), or record again with the read in place"
            )

    def _finish(self, status: str) -> None:
        run = 0.0 if self.outer_t0 is None else time.perf_counter() - self.outer_t0
        self._progress(self.session.summary(run))
        super()._finish(status)

    def _outer_starts(self, name: str, length: int | None) -> None:
        if self.outer_t0 is None:
            self.outer_t0 = time.perf_counter()
        if self.ranks is not None:
            self.ranks.check()
        self.session.outer_start(name)

    def _visit(self, i: int) -> Any:
        visit = self.session.iteration_start(i)
        self.past_plan = self.session.past_plan
        if visit.kind == _native.VisitKind.RUN_FROM_START:
            rng = self._recorded_start_rng()
            if rng is not None:
                set_rng_state(rng)
        return visit

    def _recorded_start_rng(self) -> dict[str, Any] | None:
        """The RNG states the recording's first iteration began with
        (`RecordRun.start_rng`), from any checkpoint this worker knows."""
        name = next(iter(self.session.start_state_sources()), None)
        if name is None:
            return None
        # A multi-rank checkpoint keeps each rank's start states with its own part.
        path = ["start_rng"]
        if self.store.meta(name).get(_native.META_WORLD) is not None:
            from hindsight import dist

            path = [dist._RANK_STATE, str(self.rank_index), *path]
        try:
            rng: dict[str, Any] = self.store.load(name, path=path)
        except HindsightError:
            return None  # recorded before start states were kept
        return rng

    def _write_logs(self, rows: list[Row]) -> None:
        # Staged: they become results only after the driver's check.
        if not self.leads:
            return
        if self.replay_id is None:
            self.db.append_logs(self.run_id, self.phase, rows)
        else:
            self.db.append_replay_logs(self.replay_id, self.run_id, rows)

    def _block_starts(self, i: int, iterable: Any) -> tuple[Any, int] | None:
        # Each rank checks its own batches against what it recorded.
        block = self.session.block_start(i, self.db.batch_digests(self.run_id, i, self.rank_index, "batch"))
        if block.kind == _native.BlockKind.RESTORE:
            self._restore(block.checkpoint)
            return None
        return iter(iterable), 0

    def _step_loop(self, i: int, it: Iterator[Any], start: int, entry: list[Any]) -> _native.StepLoop:
        # Each step's fingerprint is checked natively; a difference calls `_diverged`.
        return self._new_step_loop(i, it, start, entry, session=self.session, prints="replay", boundary="none")

    def _keeps_start(self) -> bool:
        # A replay takes no checkpoint, and the state it is checked against
        # leaves the iteration's start out (`checkpoint::compare`).
        return False

    def _end_block(self, i: int, at: str = "block") -> None:
        if self.finished:
            return  # diverged: the block closes on the way out, nothing more to check
        super()._end_block(i, at)
        end = self.session.block_end(i, at == "iteration")
        if end.kind == _native.EndKind.RESTORE:
            # No inner loop to skip (one step per iteration): the body ran;
            # the state after it is the checkpoint's.
            self._restore(end.checkpoint)
        elif end.kind == _native.EndKind.CHECK and end.checkpoint is not None and self.objects:
            self._check_state(i, end.checkpoint)

    def _check_state(self, i: int, name: str) -> None:
        """Stop unless the state this worker computed is the one the
        recording checkpointed at this point (the engine's rule:
        `checkpoint::compare`). Where it is not, every value computed from
        here on would be another run's."""
        t0 = time.perf_counter()
        state = self.capture()
        grads = capture_grads(self.objects)
        if grads is not None:
            state["grads"] = grads
        check = self._check_against(name, rng_as_recorded(state, self.store.info(name)["entries"]))
        self.session.checked_in(time.perf_counter() - t0)
        if check.notes and not self.noted_clock:
            self.noted_clock = True
            n = check.notes[0]
            print(
                f"hindsight: note: after {self.pos.outer_name} {i}, the loop variable at '{n.path}' differs from "
                f"checkpoint {name} ({n.detail}); a float that differs on every run (a clock reading) is not "
                "compared",
                file=sys.stderr,
            )
        if check.first is not None:
            self._diverged(self.session.state_differs(i, name, check.first.path, check.first.detail))

    def _check_against(self, name: str, state: dict[str, Any]) -> _native.StateCheck:
        """This process's state against checkpoint ``name``: the whole of
        it, or, for a checkpoint of several ranks, the objects against the
        job's and the rest against this rank's own part (what the recording
        saved where: `RecordRun._save`)."""
        store: Store = self.store
        # Checked as it was saved: by the job's layout where several ranks,
        # or DTensors on one, saved it (`RecordRun._save`).
        if self.ranks is None and store.meta(name).get(_native.META_WORLD) is None:
            return store.check_state(name, state)
        from hindsight import dist

        # The gradients are compared where the recording put them (older
        # recordings put every rank's with the job's).
        job_grads = any(e[0].startswith(f"{dist._STATE}/grads/") for e in store.info(name)["entries"])
        shared = job_part(state, job_grads)
        # FSDP2's shards: each rank's own, against the pieces the recording saved.
        check = dist.check_own_pieces(store, name, shared, [dist._STATE])
        if check.first is not None:
            return check
        return store.check_state(name, state, path=[dist._RANK_STATE, str(self.rank_index)])

    def _end_iteration(self, i: int, closing: bool = False) -> None:
        if not (closing and self.ranks is not None):  # no collective where one rank may be alone
            self._gather_ranks_values()
        self.flush_logs()  # the driver may read the logs as soon as it sees the line
        # A query a step would cost a loop of millisecond iterations a tenth
        # of its time: the worker looks for a differing value at most every
        # VALUE_CHECK_SECS (it only stops sooner; the driver compares every
        # value before any is kept: replay.py's verdict).
        now = time.monotonic()
        if now >= self.next_value_check:
            self.next_value_check = now + VALUE_CHECK_SECS
            self._check_values()
        self._progress(self.session.iteration_end(i))

    def _check_values(self) -> None:
        """Stop at the first value the recording logged that this replay computed otherwise."""
        if self.replay_id is None or not self.leads:
            return
        check = self.db.replay_divergences(self.replay_id, self.checked_seq)
        self.checked_seq = check.last_seq
        if check.divergences:
            d = check.divergences[0]
            where = ", ".join(f"{k}={v}" for k, v in d.ctx) or "top level"
            self._diverged(self.session.value_differs(d.name, where, d.record_value, d.replay_value))

    def _diverged(self, e: BaseException) -> None:
        """Leave with EXIT_DIVERGED, naming the difference: what follows would be wrong."""
        # Every rank's standard error reaches the driver as one stream.
        whose = f"rank {self.rank_index}: " if self.ranks is not None else ""
        print(f"hindsight: {whose}{e}", file=sys.stderr)
        sys.stderr.flush()
        self.finished = True  # nothing more is written for this worker
        # SystemExit, not an exception the script's own `except Exception` could swallow.
        raise SystemExit(EXIT_DIVERGED)

    def _restore(self, name: str | None) -> None:
        if name is None:
            raise ReplayError(f"replay plan has no checkpoint for {self.pos.outer_name} {self.pos.outer_idx} (a bug)")
        t0 = time.perf_counter()
        state = self.load_checkpoint(name, self.reshard)
        # The recorded world size, or a checkpoint between iterations
        # resharded onto one process: never skipped.
        assert state is not None, name
        self._apply(state, name)
        took = time.perf_counter() - t0
        self.session.restored_in(took)
        if not self.leads:
            return
        try:
            self.db.set_restore_seconds(self.run_id, self.pos.outer_name or "", self.pos.outer_idx, took)
        except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
            print(f"hindsight: could not record the restore time of {name}: {e}", file=sys.stderr)


def _parse_quietly(parser: Any, argv: list[str]) -> Any:
    """`parser.parse_known_args(argv)`, or, where the parser now rejects it
    (an argument made required since the recording), a namespace of the
    parser's defaults: the recorded values are laid over it either way."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return parser.parse_known_args(argv)[0]
        except SystemExit:
            pass
    ns = argparse.Namespace()
    for action in parser._actions:
        if action.dest is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS:
            setattr(ns, action.dest, action.default)
    return ns


# Collectives whose result depends on how many ranks take part.
_WORLD_VALUES = (
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)


def _refuse_world_values(project: tuple[Path, ...], run_id: str, world: object) -> None:
    """On one process standing for a multi-rank run: a collective that the
    project's own code calls would compute one process's value where the
    recording's ranks computed the job's (an all_reduce of a validation
    loss), and a DistributedSampler iterated would give one process's share;
    wrong values with no recorded ones to check them against. They stop
    the worker, naming the call and the way to replay it exactly. Calls
    from torch itself (FSDP gathering its shards) compute the same on any
    world size and go through."""
    import torch.distributed as dist

    here = tuple(str(d.resolve()) + os.sep for d in project)
    ours = str(Path(__file__).resolve().parents[1]) + os.sep  # hindsight's own gathers (an editable install)

    def own(filename: str) -> bool:
        """The project's code (the script, its modules), not a library's."""
        path = os.path.realpath(filename)
        return path.startswith(here) and "-packages" + os.sep not in path and not path.startswith(ours)

    for name in _WORLD_VALUES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def trap(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if own(caller.f_code.co_filename):
                raise ReplayError(
                    f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} calls "
                    f"torch.distributed.{_name}, whose value depends on the world size: this replay worker runs "
                    f"run {run_id} (recorded by {world} ranks) on one process, where it would compute one "
                    "process's value. Replay with hindsight replay --recorded-ranks to run it on the recorded ranks"
                )
            return _original(*args, **kwargs)

        functools.update_wrapper(trap, original)
        setattr(dist, name, trap)

    # A DistributedSampler's share: one process's is the whole data set. The
    # inner loop's is never iterated here (it is restored); a loader that
    # is (a validation set's, an epoch-end pass) gives other values.
    from torch.utils.data.distributed import DistributedSampler

    sampler_iter = DistributedSampler.__iter__

    def share(self: Any) -> Any:
        if str(self.num_replicas) != str(world):
            raise ReplayError(
                f"epoch code iterates a DistributedSampler over {self.num_replicas} replica(s): this replay worker "
                f"runs run {run_id} (recorded by {world} ranks) on one process, where each share is another "
                "set of examples than the recording's ranks saw. Replay with hindsight replay --recorded-ranks "
                "to run it on the recorded ranks"
            )
        return sampler_iter(self)

    DistributedSampler.__iter__ = functools.update_wrapper(share, sampler_iter)  # type: ignore[method-assign]
