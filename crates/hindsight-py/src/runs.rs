//! Binding of the run/log database and the replay planner.

// Methods mirror Python signatures (keyword arguments).
#![allow(clippy::too_many_arguments)]

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;

use hindsight_core::runs::dates::now_ms;
use hindsight_core::runs::db::{
    IterationRow, LogDb as CoreDb, LogRow, NewRun, Phase, PrintKind, RunRow, RunStatus, Trust,
};
use hindsight_core::runs::replay;
use pyo3::prelude::*;

use crate::errors::IntoPy;
use crate::interrupt;

/// A log row as `hs.log` buffers it: (name, context, JSON text). A tuple,
/// not a class, on purpose: it is the per-call hot path of `hs.log`, and
/// batches of 1024 cross here at once.
/// (name, [(loop, index), ...], occurrence in that context, value as JSON
/// text): the hot path of `hs.log`, batched, so a plain tuple.
type LogTuple = (String, Vec<(String, i64)>, u32, String);

/// One run of the project, as the run database holds it (core `RunRow`).
#[pyclass(module = "hindsight._native", name = "RunInfo", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct RunInfo {
    id: String,
    /// The script relative to the project root.
    script: String,
    script_abs: String,
    project_root: String,
    source_hash: String,
    git_commit: Option<String>,
    git_dirty: Option<bool>,
    /// The run's `hs.arg` values, as JSON.
    args_json: String,
    /// "running", "completed", "failed" or "interrupted".
    status: &'static str,
    started_ms: u64,
    ended_ms: Option<u64>,
    host: String,
    /// The versions and launch facts the recording noted, as JSON.
    versions_json: String,
    pid: u32,
    resume_key: Option<String>,
    /// Where the run's checkpoints are (None: the project's default store).
    store: Option<String>,
}

impl From<RunRow> for RunInfo {
    fn from(r: RunRow) -> Self {
        RunInfo {
            id: r.id,
            script: r.script,
            script_abs: r.script_abs,
            project_root: r.project_root,
            source_hash: r.source_hash,
            git_commit: r.git_commit,
            git_dirty: r.git_dirty,
            args_json: r.args_json,
            status: r.status.as_str(),
            started_ms: r.started_ms,
            ended_ms: r.ended_ms,
            host: r.host,
            versions_json: r.versions_json,
            pid: r.pid,
            resume_key: r.resume_key,
            store: r.store,
        }
    }
}

fn status(s: &str) -> PyResult<RunStatus> {
    s.parse::<RunStatus>().py_err()
}

fn phase(s: &str) -> PyResult<Phase> {
    s.parse::<Phase>().py_err()
}

/// The project's run and log database (SQLite, WAL). One connection per object.
#[pyclass(module = "hindsight._native", frozen)]
pub struct LogDb {
    db: Mutex<CoreDb>,
}

impl std::fmt::Debug for LogDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogDb")
    }
}

impl LogDb {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CoreDb) -> hindsight_core::Result<T> + Send,
    ) -> PyResult<T> {
        interrupt::run(py, |_| {
            f(&self.db.lock().unwrap_or_else(|p| p.into_inner()))
        })
    }
}

#[pymethods]
impl LogDb {
    /// `checked`: to answer from it (`LogDb::open_checked`: its integrity
    /// is checked first).
    #[new]
    #[pyo3(signature = (path, checked=false))]
    fn new(py: Python<'_>, path: PathBuf, checked: bool) -> PyResult<Self> {
        let db = interrupt::run(py, move |_| {
            if checked {
                CoreDb::open_checked(&path)
            } else {
                CoreDb::open(&path)
            }
        })?;
        Ok(LogDb { db: Mutex::new(db) })
    }

    #[pyo3(signature = (script, script_abs, project_root, source_hash, args_json, host, versions_json, git_commit=None, git_dirty=None, resume_key=None))]
    #[allow(clippy::too_many_arguments)]
    fn create_run(
        &self,
        py: Python<'_>,
        script: String,
        script_abs: String,
        project_root: String,
        source_hash: String,
        args_json: String,
        host: String,
        versions_json: String,
        git_commit: Option<String>,
        git_dirty: Option<bool>,
        resume_key: Option<String>,
    ) -> PyResult<String> {
        let run = NewRun {
            script,
            script_abs,
            project_root,
            source_hash,
            git_commit,
            git_dirty,
            args_json,
            started_ms: None,
            host,
            versions_json,
            pid: std::process::id(),
            resume_key,
        };
        self.with(py, |db| db.create_run(&run))
    }

    #[pyo3(signature = (run_id, status_name, ended=true))]
    fn set_status(
        &self,
        py: Python<'_>,
        run_id: String,
        status_name: &str,
        ended: bool,
    ) -> PyResult<()> {
        let st = status(status_name)?;
        self.with(py, |db| db.set_status(&run_id, st, ended.then(now_ms)))
    }

    /// Delete a run, its logs and iterations (not its checkpoints).
    fn delete_run(&self, py: Python<'_>, run_id: String) -> PyResult<()> {
        self.with(py, |db| db.delete_run(&run_id))
    }

    fn set_args(&self, py: Python<'_>, run_id: String, args_json: String) -> PyResult<()> {
        self.with(py, |db| db.set_args(&run_id, &args_json))
    }

    fn set_store(&self, py: Python<'_>, run_id: String, store: String) -> PyResult<()> {
        self.with(py, |db| db.set_store(&run_id, &store))
    }

    fn run(&self, py: Python<'_>, run_id: String) -> PyResult<RunInfo> {
        Ok(self.with(py, |db| db.run(&run_id))?.into())
    }

    #[pyo3(signature = (limit=None))]
    fn runs(&self, py: Python<'_>, limit: Option<usize>) -> PyResult<Vec<RunInfo>> {
        let rs = self.with(py, |db| db.runs(limit))?;
        Ok(rs.into_iter().map(RunInfo::from).collect())
    }

    fn latest_run(&self, py: Python<'_>) -> PyResult<Option<RunInfo>> {
        Ok(self.with(py, |db| db.latest_run())?.map(RunInfo::from))
    }

    /// The runs of the script now at `script_abs` in the project rooted at
    /// `root`, newest first, with their paths where the project is now (it
    /// may have moved or been copied: the engine's `runs::relocate`).
    fn runs_of(
        &self,
        py: Python<'_>,
        script_abs: PathBuf,
        root: PathBuf,
    ) -> PyResult<Vec<RunInfo>> {
        let rs = self.with(py, |db| db.runs_of(&script_abs, &root))?;
        Ok(rs.into_iter().map(RunInfo::from).collect())
    }

    /// The runs a `hindsight replay` of `script_abs` replays, by its
    /// `--runs`, `--run` and `--since` (core `runs::replay::driver`: one
    /// owner for "which runs"), paths where the project is now.
    #[pyo3(signature = (script_abs, root, home, runs=None, run=None, since=None))]
    #[allow(clippy::too_many_arguments)]
    fn select_runs(
        &self,
        py: Python<'_>,
        script_abs: PathBuf,
        root: PathBuf,
        home: PathBuf,
        runs: Option<Vec<String>>,
        run: Option<Vec<String>>,
        since: Option<String>,
    ) -> PyResult<Vec<RunInfo>> {
        let sel = replay::driver::Selection::from_args(runs, run, since.as_deref()).py_err()?;
        let rs = self.with(py, |db| {
            replay::driver::select_runs(db, &script_abs, &root, &home, &sel)
        })?;
        Ok(rs.into_iter().map(RunInfo::from).collect())
    }

    /// How every replay worker of `run_id` starts (core
    /// `runs::replay::driver::worker_command`): `python script` with the
    /// recorded arguments, in the recorded directory where it still is.
    fn worker_command(
        &self,
        py: Python<'_>,
        run_id: String,
        root: PathBuf,
        script: PathBuf,
        python: PathBuf,
        restores_only: bool,
    ) -> PyResult<WorkerCommand> {
        let run = self.with(py, |db| db.run(&run_id))?.relocated(&root);
        let c = replay::driver::worker_command(&run, &script, &python, restores_only);
        Ok(WorkerCommand {
            argv: c.argv,
            cwd: c.cwd.to_string_lossy().into_owned(),
            ranks: c.ranks,
            torchrun: c.torchrun,
        })
    }

    /// Run `run_id` with its paths where they are now that its project is
    /// rooted at `root` (`runs::relocate`).
    fn run_at(&self, py: Python<'_>, run_id: String, root: PathBuf) -> PyResult<RunInfo> {
        Ok(self.with(py, |db| db.run(&run_id))?.relocated(&root).into())
    }

    /// The run a process started with `resume_key` here continues, if any
    /// (the engine's rule: interrupted, or running but certainly gone), with
    /// its paths where they are now that the project root is `root`.
    #[pyo3(signature = (resume_key, root, script, args, explicit=false))]
    fn run_to_resume(
        &self,
        py: Python<'_>,
        resume_key: String,
        root: PathBuf,
        script: PathBuf,
        args: Vec<String>,
        explicit: bool,
    ) -> PyResult<Option<RunInfo>> {
        use hindsight_core::runs::resume::{Command, Here};
        let here = Here::current();
        let command = Command {
            script_abs: &script,
            root: &root,
            args: &args,
        };
        let r = self.with(py, |db| {
            db.run_to_resume(&resume_key, explicit, &here, &command)
        })?;
        Ok(r.map(|r| r.relocated(&root).into()))
    }

    fn put_source(&self, py: Python<'_>, files: BTreeMap<String, String>) -> PyResult<String> {
        self.with(py, |db| db.put_source(&files))
    }

    fn get_source(&self, py: Python<'_>, hash: String) -> PyResult<BTreeMap<String, String>> {
        self.with(py, |db| db.get_source(&hash))
    }

    /// rows: (name, [(loop, index), ...], occurrence, value as JSON text)
    fn append_logs(
        &self,
        py: Python<'_>,
        run_id: String,
        phase_name: &str,
        rows: Vec<LogTuple>,
    ) -> PyResult<()> {
        let ph = phase(phase_name)?;
        let rows = log_rows(rows);
        self.with(py, |db| db.append_logs(&run_id, ph, &rows))
    }

    /// Start a replay of the run (`exact`: with the recording's thread
    /// count); its id goes into the workers' plans.
    fn begin_replay(&self, py: Python<'_>, run_id: String, exact: bool) -> PyResult<i64> {
        self.with(py, |db| db.begin_replay(&run_id, exact))
    }

    /// Stage values a replay worker computed (rows as for `append_logs`).
    fn append_replay_logs(
        &self,
        py: Python<'_>,
        replay_id: i64,
        run_id: String,
        rows: Vec<LogTuple>,
    ) -> PyResult<()> {
        let rows = log_rows(rows);
        self.with(py, |db| db.append_replay_logs(replay_id, &run_id, &rows))
    }

    /// Staged values of the replay written after `after` that differ from
    /// the recording's.
    #[pyo3(signature = (replay_id, after=0))]
    fn replay_divergences(
        &self,
        py: Python<'_>,
        replay_id: i64,
        after: i64,
    ) -> PyResult<ReplayCheck> {
        let check = self.with(py, |db| db.replay_divergences(replay_id, after))?;
        Ok(ReplayCheck {
            divergences: check
                .divergences
                .into_iter()
                .map(Divergence::from)
                .collect(),
            last_seq: check.last_seq,
        })
    }

    /// End the replay: keep its values with trust `keep` ("exact",
    /// "inexact", "diverged"), or discard them (None). Returns how many joined.
    #[pyo3(signature = (replay_id, keep=None))]
    fn finish_replay(&self, py: Python<'_>, replay_id: i64, keep: Option<&str>) -> PyResult<usize> {
        let keep = keep.map(Trust::parse).transpose().py_err()?;
        self.with(py, |db| db.finish_replay(replay_id, keep))
    }

    /// Fingerprints of rank `rank`'s steps of outer iteration `outer`:
    /// [(step, digest)], of `kind` (`batch` or `order`).
    #[pyo3(signature = (run_id, outer, rank, kind, rows))]
    fn record_batches(
        &self,
        py: Python<'_>,
        run_id: String,
        outer: u64,
        rank: u32,
        kind: &str,
        rows: Vec<(u64, String)>,
    ) -> PyResult<()> {
        let kind = PrintKind::parse(kind).py_err()?;
        self.with(py, |db| {
            db.record_batches(&run_id, outer, rank, kind, &rows)
        })
    }

    /// The recorded fingerprints of `kind` of rank `rank`'s steps of outer
    /// iteration `outer`: {step: digest}.
    fn batch_digests(
        &self,
        py: Python<'_>,
        run_id: String,
        outer: u64,
        rank: u32,
        kind: &str,
    ) -> PyResult<BTreeMap<u64, String>> {
        let kind = PrintKind::parse(kind).py_err()?;
        self.with(py, |db| db.batch_digests(&run_id, outer, rank, kind))
            .map(|rows| rows.into_iter().collect())
    }

    fn has_batch_digests(&self, py: Python<'_>, run_id: String) -> PyResult<bool> {
        self.with(py, |db| db.has_batch_digests(&run_id))
    }

    /// Stored rows ordered by `seq`; empty names = all.
    #[pyo3(signature = (run_id, names=Vec::new()))]
    fn logs(&self, py: Python<'_>, run_id: String, names: Vec<String>) -> PyResult<Vec<LogRecord>> {
        let recs = self.with(py, |db| db.logs(&run_id, &names))?;
        Ok(recs
            .into_iter()
            .map(|r| LogRecord {
                name: r.name,
                ctx: r.ctx,
                rep: r.rep,
                value_json: r.value_json,
                phase: r.phase.as_str(),
                seq: r.seq,
                created_ms: r.created_ms,
                flag: r.flag,
            })
            .collect())
    }

    /// One entry per (name, loop context), both phases merged; `value_json`
    /// is the value to show (the engine's rule: recorded first).
    #[pyo3(signature = (run_id, names=Vec::new()))]
    fn values(
        &self,
        py: Python<'_>,
        run_id: String,
        names: Vec<String>,
    ) -> PyResult<Vec<LogValue>> {
        let values = self.with(py, |db| db.values(&run_id, &names))?;
        Ok(values
            .into_iter()
            .map(|v| LogValue {
                value_json: v.value().to_string(),
                diverged: v.diverged(),
                name: v.name,
                ctx: v.ctx,
                rep: v.rep,
                recorded: v.recorded,
                replayed: v.replayed,
                replay_flag: v.replay_flag,
            })
            .collect())
    }

    /// A fresh database at `dest` holding the run, for a replay worker that
    /// cannot share this one (a Slurm task).
    fn export_run(&self, py: Python<'_>, run_id: String, dest: PathBuf) -> PyResult<()> {
        self.with(py, |db| db.export_run(&run_id, &dest))
    }

    /// Stage the values a worker of replay `replay_id` wrote into `src`
    /// (see `export_run`); returns their number.
    fn import_replay(
        &self,
        py: Python<'_>,
        run_id: String,
        src: PathBuf,
        replay_id: i64,
    ) -> PyResult<usize> {
        self.with(py, |db| db.import_replay(&run_id, &src, replay_id))
    }

    /// The position of the run's latest log row (0 when none).
    fn last_seq(&self, py: Python<'_>, run_id: String) -> PyResult<i64> {
        self.with(py, |db| db.last_seq(&run_id))
    }

    /// SQLite's consistency check plus rows that belong to no run; raises
    /// `CorruptError` naming the database.
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |db| db.check_integrity())
    }

    fn log_names(&self, py: Python<'_>, run_id: String) -> PyResult<Vec<String>> {
        self.with(py, |db| db.log_names(&run_id))
    }

    /// What `runs` logged; NotFoundError naming the `names` none of them
    /// logged (and what they did log).
    fn require_logged(
        &self,
        py: Python<'_>,
        runs: Vec<String>,
        names: Vec<String>,
    ) -> PyResult<Vec<String>> {
        self.with(py, |db| db.require_logged(&runs, &names))
    }

    /// Values both phases logged at the same context that differ, first
    /// differing context first.
    /// `after`: only replayed values written after that position
    /// (`last_seq` before a replay): what that replay wrote.
    #[pyo3(signature = (run_id, after=None))]
    fn divergences(
        &self,
        py: Python<'_>,
        run_id: String,
        after: Option<i64>,
    ) -> PyResult<Vec<Divergence>> {
        let ds = self.with(py, |db| db.divergences_since(&run_id, after))?;
        Ok(ds.into_iter().map(Divergence::from).collect())
    }

    #[pyo3(signature = (run_id, loop_name, idx, seconds, checkpoint=None, materialize_seconds=None, value=None))]
    #[allow(clippy::too_many_arguments)]
    fn record_iteration(
        &self,
        py: Python<'_>,
        run_id: String,
        loop_name: String,
        idx: u64,
        seconds: f64,
        checkpoint: Option<String>,
        materialize_seconds: Option<f64>,
        value: Option<i64>,
    ) -> PyResult<()> {
        let row = IterationRow {
            loop_name,
            idx,
            value,
            seconds,
            checkpoint,
            materialize_seconds,
            restore_seconds: None,
        };
        self.with(py, |db| db.record_iteration(&run_id, &row))
    }

    /// Iterations of `loop_name`, in one transaction (a recording's since
    /// its last hand-over to the log thread).
    fn record_iterations(
        &self,
        py: Python<'_>,
        run_id: String,
        loop_name: String,
        rows: Vec<PyRef<'_, Iteration>>,
    ) -> PyResult<()> {
        let rows: Vec<IterationRow> = rows
            .iter()
            .map(|r| IterationRow {
                loop_name: loop_name.clone(),
                idx: r.idx,
                value: r.value,
                seconds: r.seconds,
                checkpoint: r.checkpoint.clone(),
                materialize_seconds: r.materialize_seconds,
                restore_seconds: r.restore_seconds,
            })
            .collect();
        self.with(py, |db| db.record_iterations(&run_id, &rows))
    }

    fn set_restore_seconds(
        &self,
        py: Python<'_>,
        run_id: String,
        loop_name: String,
        idx: u64,
        seconds: f64,
    ) -> PyResult<()> {
        self.with(py, |db| {
            db.set_restore_seconds(&run_id, &loop_name, idx, seconds)
        })
    }

    /// The outer loops the run recorded iterations of (normally one).
    fn outer_loops(&self, py: Python<'_>, run_id: String) -> PyResult<Vec<String>> {
        self.with(py, |db| db.outer_loops(&run_id))
    }

    /// The recorded iterations of `loop_name`, in order.
    fn iterations(
        &self,
        py: Python<'_>,
        run_id: String,
        loop_name: String,
    ) -> PyResult<Vec<Iteration>> {
        let rows = self.with(py, |db| db.iterations(&run_id, &loop_name))?;
        Ok(rows
            .into_iter()
            .map(|r| Iteration {
                idx: r.idx,
                value: r.value,
                seconds: r.seconds,
                checkpoint: r.checkpoint,
                materialize_seconds: r.materialize_seconds,
                restore_seconds: r.restore_seconds,
            })
            .collect())
    }

    /// The replay plan of a run (`hindsight_core::runs::replay`): which iterations
    /// each worker restores or executes. `selected[i]`: iteration i is wanted;
    /// `needs_start`: new probes run before the inner loop; `location`: the
    /// store of the run's checkpoints (`in_store`: their names), whose
    /// manifests say whether they hold whole iterations.
    #[pyo3(signature = (run_id, loop_name, in_store, selected, needs_inner, needs_start=false, location=None, workers=1))]
    fn plan_replay(
        &self,
        py: Python<'_>,
        run_id: String,
        loop_name: String,
        in_store: HashSet<String>,
        selected: Vec<bool>,
        needs_inner: bool,
        needs_start: bool,
        location: Option<String>,
        workers: usize,
    ) -> PyResult<ReplayPlan> {
        let plan = self.with(py, |db| {
            let iterations = db.iterations(&run_id, &loop_name)?;
            let whole_iterations = location
                .as_deref()
                .is_some_and(|l| replay::driver::whole_iterations(l, &in_store, &iterations));
            replay::plan(&replay::Request {
                run_id: &run_id,
                loop_name: &loop_name,
                iterations: &iterations,
                in_store: &in_store,
                selected: &selected,
                needs_inner,
                needs_start,
                whole_iterations,
                workers,
            })
        })?;
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(ReplayPlan {
            kind: plan.kind.as_str(),
            note: plan.note(&run_id, workers, cores),
            workers: plan.workers.into_iter().map(WorkerPlan).collect(),
        })
    }
}

/// One stored log row (`LogDb.logs`).
#[pyclass(module = "hindsight._native", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct LogRecord {
    name: String,
    /// The loop context, outermost first: `[("epoch", 3), ("step", 17)]`.
    ctx: Vec<(String, i64)>,
    /// Earlier values of this name in this context (0 for the first).
    rep: u32,
    value_json: String,
    /// "record" or "replay".
    phase: &'static str,
    /// Position in the run's write order.
    seq: i64,
    /// When it was written (ms since the Unix epoch, UTC).
    created_ms: u64,
    /// A replayed value that is not exact: "inexact" or "diverged".
    flag: Option<String>,
}

/// A name at one loop context with both phases merged (`LogDb.values`).
#[pyclass(module = "hindsight._native", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct LogValue {
    name: String,
    ctx: Vec<(String, i64)>,
    /// Earlier values of this name in this context (0 for the first).
    rep: u32,
    /// The value to show: recorded if the run logged it, else replayed.
    value_json: String,
    recorded: Option<String>,
    replayed: Option<String>,
    /// Both phases logged it and the values differ.
    diverged: bool,
    /// The replayed value is not exact: "inexact" (another thread count) or
    /// "diverged" (kept on request from a replay that diverged).
    replay_flag: Option<String>,
}

/// A value the record and a replay logged differently (`LogDb.divergences`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Debug, Clone)]
pub(crate) struct Divergence {
    name: String,
    ctx: Vec<(String, i64)>,
    record_value: String,
    replay_value: String,
}

impl From<hindsight_core::runs::db::Divergence> for Divergence {
    fn from(d: hindsight_core::runs::db::Divergence) -> Self {
        Divergence {
            name: d.name,
            ctx: d.ctx,
            record_value: d.record_value,
            replay_value: d.replay_value,
        }
    }
}

/// What a check of a replay's values found (`LogDb.replay_divergences`).
#[pyclass(module = "hindsight._native", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct ReplayCheck {
    /// Values the recording logged that the replay computed differently, first first.
    divergences: Vec<Divergence>,
    /// The newest staged value checked: pass it as `after` next time.
    last_seq: i64,
}

fn log_rows(rows: Vec<LogTuple>) -> Vec<LogRow> {
    rows.into_iter()
        .map(|(name, ctx, rep, value_json)| LogRow {
            name,
            ctx,
            rep,
            value_json,
        })
        .collect()
}

#[pyclass(module = "hindsight._native", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Iteration {
    idx: u64,
    /// The integer iterated over at this position, if it was one.
    value: Option<i64>,
    seconds: f64,
    /// The checkpoint taken at its end, if one was.
    checkpoint: Option<String>,
    /// Seconds the training thread was blocked by that checkpoint.
    materialize_seconds: Option<f64>,
    /// Seconds a replay took to restore it.
    restore_seconds: Option<f64>,
}

#[pymethods]
impl Iteration {
    /// An iteration as a recording writes it (`LogDb.record_iterations`).
    #[new]
    #[pyo3(signature = (idx, seconds, value=None, checkpoint=None, materialize_seconds=None, restore_seconds=None))]
    fn new(
        idx: u64,
        seconds: f64,
        value: Option<i64>,
        checkpoint: Option<String>,
        materialize_seconds: Option<f64>,
        restore_seconds: Option<f64>,
    ) -> Self {
        Iteration {
            idx,
            value,
            seconds,
            checkpoint,
            materialize_seconds,
            restore_seconds,
        }
    }
}

/// A replay plan: its kind and one plan per worker.
#[pyclass(module = "hindsight._native", frozen)]
#[derive(Debug)]
pub(crate) struct ReplayPlan {
    /// "partial" (outer-loop probes) or "parallel" (inner-loop probes).
    #[pyo3(get)]
    kind: &'static str,
    /// What to say of it before it runs (core `ReplayPlan::note`), if anything.
    #[pyo3(get)]
    note: Option<String>,
    workers: Vec<WorkerPlan>,
}

#[pymethods]
impl ReplayPlan {
    #[getter]
    fn workers(&self) -> Vec<WorkerPlan> {
        self.workers.clone()
    }
}

/// What a run's replay is worth once its workers ended (core
/// `runs::replay::driver::verdict`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct Verdict {
    /// Indices of the workers that failed (not a divergence).
    failed: Vec<usize>,
    diverged: bool,
    /// How the staged values are kept: "exact", "inexact", "diverged", or None (discarded).
    keep: Option<&'static str>,
    exit: i32,
}

/// The thread rule of a replay (core `runs::replay::driver::threads`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct ReplayThreads {
    /// Workers at once.
    budget: usize,
    /// `-j` was lowered to `budget` because each worker needs the widest
    /// recording's `widest` threads (None: not lowered).
    widest: Option<usize>,
    /// Per run: each worker's torch threads.
    threads: Vec<usize>,
    /// Per run: whether that is the recording's count (values compared exactly).
    exact: Vec<bool>,
    /// CPUs a batch launcher's task asks for (a worker's ranks x threads).
    task_cpus: usize,
    /// What the replay says of the rule (core `Threads::notes`).
    notes: Vec<String>,
}

/// The thread rule of a replay of runs `run_ids` (core `runs::replay::driver::threads`).
#[pyfunction]
#[pyo3(signature = (cores, jobs, workers, recorded, ranks, fast, local, run_ids))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_threads(
    cores: usize,
    jobs: usize,
    workers: Vec<usize>,
    recorded: Vec<Option<usize>>,
    ranks: Vec<usize>,
    fast: bool,
    local: bool,
    run_ids: Vec<String>,
) -> ReplayThreads {
    let t = replay::driver::threads(cores, jobs, &workers, &recorded, &ranks, fast, local);
    ReplayThreads {
        notes: t.notes(jobs, cores, &run_ids, &recorded),
        budget: t.budget,
        widest: t.capped.map(|(w, _)| w),
        threads: t.runs.iter().map(|r| r.0).collect(),
        exact: t.runs.iter().map(|r| r.1).collect(),
        task_cpus: t.task_cpus,
    }
}

/// Read a replay worker's progress lines (core `runs::replay::driver::Progress`).
#[pyclass(module = "hindsight._native", name = "Progress", skip_from_py_object)]
#[derive(Clone, Debug, Default)]
pub(crate) struct PyProgress(replay::driver::Progress);

#[pymethods]
impl PyProgress {
    #[new]
    fn new() -> Self {
        PyProgress::default()
    }

    /// Whole lines of the worker's progress (none may be cut short).
    fn read(&mut self, text: &str) {
        self.0.read(text)
    }

    #[getter]
    fn done(&self) -> u64 {
        self.0.done
    }

    #[getter]
    fn steps(&self) -> u64 {
        self.0.steps
    }

    /// Iterations without an inner loop whose body was executed.
    #[getter]
    fn bodies(&self) -> u64 {
        self.0.bodies
    }

    #[getter]
    fn restored(&self) -> u64 {
        self.0.restored
    }
}

/// One replay worker as it ended (core `runs::replay::report::WorkerEnd`).
#[pyclass(module = "hindsight._native", frozen, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct WorkerEnd(replay::report::WorkerEnd);

#[pymethods]
impl WorkerEnd {
    /// Worker `index`, which visited iterations `first`..`last` (None:
    /// none), exited with `returncode` (None: never started), left
    /// `stderr_tail`, and reported `progress`.
    #[new]
    #[pyo3(signature = (index, first, last, returncode, stderr_tail, progress))]
    fn new(
        index: usize,
        first: Option<u64>,
        last: Option<u64>,
        returncode: Option<i32>,
        stderr_tail: String,
        progress: PyRef<'_, PyProgress>,
    ) -> Self {
        WorkerEnd(replay::report::WorkerEnd {
            index,
            iterations: first.zip(last),
            returncode,
            stderr_tail,
            progress: progress.0,
        })
    }
}

/// What `hindsight replay` says of a run's replay (core `runs::replay::report`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct ReplayReport {
    /// Standard error before the values are kept or discarded (each ends in a newline).
    warnings: Vec<String>,
    /// Standard output once they are.
    summary: Vec<String>,
    verdict: Verdict,
}

/// The report of run `run_id`'s replay of `names` over `total` iterations:
/// its workers as they ended, the values `check` found different,
/// `--allow-divergence`, whether the workers ran as recorded, its wall time.
#[pyfunction]
#[pyo3(signature = (run_id, names, total, workers, check, allow_divergence, exact, wall_secs))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_report(
    run_id: &str,
    names: Vec<String>,
    total: u64,
    workers: Vec<PyRef<'_, WorkerEnd>>,
    check: PyRef<'_, ReplayCheck>,
    allow_divergence: bool,
    exact: bool,
    wall_secs: f64,
) -> ReplayReport {
    let ends: Vec<_> = workers.iter().map(|w| w.0.clone()).collect();
    let first = check.divergences.first().map(|d| replay::report::Differs {
        name: d.name.clone(),
        ctx: d.ctx.clone(),
        recorded: d.record_value.clone(),
        replayed: d.replay_value.clone(),
    });
    let r = replay::report::report(
        run_id,
        &names,
        total,
        &ends,
        check.divergences.len(),
        first.as_ref(),
        allow_divergence,
        exact,
        wall_secs,
    );
    ReplayReport {
        warnings: r.warnings,
        summary: r.summary,
        verdict: Verdict {
            failed: r.verdict.failed,
            diverged: r.verdict.diverged,
            keep: r.verdict.keep.map(|t| t.as_str()),
            exit: r.verdict.exit,
        },
    }
}

/// Why run `run_id`'s replay can restore nothing (core
/// `runs::replay::driver::unrestorable`), or None.
#[pyfunction]
pub(crate) fn replay_unrestorable(
    run_id: &str,
    iterations: usize,
    checkpointed: usize,
    location: Option<&str>,
) -> Option<String> {
    replay::driver::unrestorable(run_id, iterations, checkpointed, location)
}

/// Notes for the `names` a successful replay of `run_id` left without a
/// value (`have`: the names the run has values of).
#[pyfunction]
pub(crate) fn replay_unproduced(
    run_id: &str,
    names: Vec<String>,
    have: Vec<String>,
) -> Vec<String> {
    replay::report::unproduced(run_id, &names, &have)
}

/// How a replay worker starts: its command line and working directory.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct WorkerCommand {
    argv: Vec<String>,
    cwd: String,
    ranks: u64,
    torchrun: bool,
}

/// What one replay worker does; its JSON form is the worker protocol
/// (see `hindsight_core::runs::replay`).
#[pyclass(module = "hindsight._native", frozen, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct WorkerPlan(replay::WorkerPlan);

impl WorkerPlan {
    pub(crate) fn inner(&self) -> &replay::WorkerPlan {
        &self.0
    }
}

#[pymethods]
impl WorkerPlan {
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        replay::WorkerPlan::from_json(text).map(WorkerPlan).py_err()
    }

    /// The JSON handed to the worker, with the progress descriptor it
    /// inherits and the database it writes to (default: the project's).
    /// `exact`: the worker runs with the recording's thread count.
    #[pyo3(signature = (progress_fd=None, log_db=None, replay_id=None, exact=true))]
    fn to_json(
        &self,
        progress_fd: Option<i32>,
        log_db: Option<PathBuf>,
        replay_id: Option<i64>,
        exact: bool,
    ) -> PyResult<String> {
        let mut p = self.0.clone();
        p.progress_fd = progress_fd;
        p.log_db = log_db.map(|d| d.to_string_lossy().into_owned());
        p.replay_id = replay_id;
        p.exact = exact;
        p.to_json().py_err()
    }

    /// The checkpoint to compare the state with after executing iteration
    /// `i` (`Store.check_state`), or None.
    fn state_check(&self, i: u64) -> Option<&str> {
        self.0.state_check(i)
    }

    /// The checkpoint to compare with after executing iteration `i` instead
    /// of restoring it, where the engine's rule prefers that (`measured`:
    /// this worker's mean restore seconds so far), or None: restore.
    #[pyo3(signature = (i, measured=None))]
    fn execute_instead(&self, i: u64, measured: Option<f64>) -> Option<&str> {
        self.0.execute_instead(i, measured)
    }

    /// The replay whose values the worker stages (`LogDb.begin_replay`).
    #[getter]
    fn replay_id(&self) -> Option<i64> {
        self.0.replay_id
    }

    #[getter]
    fn run_id(&self) -> &str {
        &self.0.run_id
    }

    #[getter]
    fn worker(&self) -> usize {
        self.0.worker
    }

    #[getter]
    fn loop_name(&self) -> &str {
        &self.0.loop_name
    }

    /// The worker only restores checkpoints (core `WorkerPlan::restores_only`).
    #[getter]
    fn restores_only(&self) -> bool {
        self.0.restores_only()
    }

    /// iteration -> "restore" | "execute"; iterations not listed are skipped.
    #[getter]
    fn modes(&self) -> BTreeMap<u64, &'static str> {
        self.0
            .modes
            .iter()
            .map(|(&i, m)| {
                let m = match m {
                    replay::Mode::Restore => "restore",
                    replay::Mode::Execute => "execute",
                };
                (i, m)
            })
            .collect()
    }

    /// iteration -> checkpoint name, for every restored iteration.
    #[getter]
    fn checkpoints(&self) -> BTreeMap<u64, String> {
        self.0.checkpoints.clone()
    }

    #[getter]
    fn progress_fd(&self) -> Option<i32> {
        self.0.progress_fd
    }

    #[getter]
    fn log_db(&self) -> Option<&str> {
        self.0.log_db.as_deref()
    }
}

/// Milliseconds since the epoch of a date typed by the user (UTC), as
/// `hindsight replay --since` takes it (`runs::dates::parse_utc`).
#[pyfunction]
fn parse_date(text: &str) -> PyResult<u64> {
    hindsight_core::runs::dates::parse_utc(text).map_err(crate::errors::to_py)
}

/// Put a checkpoint's files back under `root` (`runs::files::put_back`):
/// all of them, or none and an error naming the first refused entry.
#[pyfunction]
fn put_back_files(
    py: Python<'_>,
    root: PathBuf,
    files: BTreeMap<String, Vec<u8>>,
    protected: Vec<PathBuf>,
    checkpoint: String,
) -> PyResult<()> {
    let files: Vec<(String, Vec<u8>)> = files.into_iter().collect();
    interrupt::run(py, |_| {
        hindsight_core::runs::files::put_back(&root, &files, &protected, &checkpoint)
    })
}

/// The key a starting script finds the run it continues by
/// (`runs::resume::resume_key`).
#[pyfunction]
fn resume_key(script: PathBuf, root: PathBuf, args: Vec<String>) -> String {
    hindsight_core::runs::resume::resume_key(&script, &root, &args)
}

/// A run held by this process (`runs::lease`) until `release` or exit.
#[pyclass(module = "hindsight._native")]
pub(crate) struct RunLease(Option<hindsight_core::runs::lease::RunLease>);

#[pymethods]
impl RunLease {
    /// Hold run `run_id` of project home `home`, or refuse naming its holder.
    #[staticmethod]
    fn hold(py: Python<'_>, home: PathBuf, run_id: String) -> PyResult<Self> {
        let lease = py
            .detach(|| hindsight_core::runs::lease::RunLease::hold(&home, &run_id))
            .py_err()?;
        Ok(RunLease(Some(lease)))
    }

    /// Hold run `run_id` shared, for a replay of it (none held where a
    /// recording holds it alone).
    #[staticmethod]
    fn share(py: Python<'_>, home: PathBuf, run_id: String) -> PyResult<Self> {
        let lease = py
            .detach(|| hindsight_core::runs::lease::RunLease::share(&home, &run_id))
            .py_err()?;
        Ok(RunLease(lease))
    }

    fn release(&mut self) {
        self.0 = None;
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_date, m)?)?;
    m.add_function(wrap_pyfunction!(resume_key, m)?)?;
    m.add_function(wrap_pyfunction!(put_back_files, m)?)?;
    m.add_class::<ReplayCheck>()?;
    m.add_class::<LogDb>()?;
    m.add_class::<RunLease>()?;
    m.add_class::<Iteration>()?;
    m.add_class::<RunInfo>()?;
    m.add_class::<LogRecord>()?;
    m.add_class::<LogValue>()?;
    m.add_class::<Divergence>()?;
    m.add_class::<ReplayPlan>()?;
    m.add_class::<WorkerPlan>()?;
    m.add_class::<WorkerCommand>()?;
    m.add_class::<Verdict>()?;
    m.add_class::<PyProgress>()?;
    m.add_class::<ReplayThreads>()?;
    m.add_function(wrap_pyfunction!(replay_threads, m)?)?;
    m.add_class::<WorkerEnd>()?;
    m.add_class::<ReplayReport>()?;
    m.add_function(wrap_pyfunction!(replay_report, m)?)?;
    m.add_function(wrap_pyfunction!(replay_unproduced, m)?)?;
    m.add_function(wrap_pyfunction!(replay_unrestorable, m)?)?;
    m.add("EXIT_DIVERGED", replay::driver::EXIT_DIVERGED)?;
    Ok(())
}
