//! The run session (`hindsight_core::runs::session`) for Python: events are
//! methods, actions come back as frozen objects. The binding converts
//! arguments and decides nothing.

use std::collections::BTreeMap;

use hindsight_core::checkpoint::retention::{self, RetentionArgs};
use hindsight_core::runs::cpu::Sampler;
use hindsight_core::runs::session::{self as core, record::Status};
use pyo3::prelude::*;

use crate::errors::IntoPy;
use crate::runs::WorkerPlan;

/// What an outer iteration about to start does (`Visit.kind`).
#[pyclass(module = "hindsight._native", eq, frozen, hash, from_py_object)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum VisitKind {
    #[pyo3(name = "RUN")]
    Run,
    /// Run, but values logged before the steps are dropped.
    #[pyo3(name = "RUN_STALE")]
    RunStale,
    /// Run from the program's own start (a replay worker's first iteration).
    #[pyo3(name = "RUN_FROM_START")]
    RunFromStart,
    /// Put `checkpoint` (its start) back, then run.
    #[pyo3(name = "RERUN")]
    Rerun,
    /// Put `checkpoint` (its end) back; the body does not run.
    #[pyo3(name = "RESTORE")]
    Restore,
    #[pyo3(name = "SKIP")]
    Skip,
    #[pyo3(name = "STOP")]
    Stop,
}

/// What to do with an outer iteration about to start.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct Visit {
    kind: VisitKind,
    /// The checkpoint a RERUN or RESTORE reads.
    checkpoint: Option<String>,
    /// Values logged before the steps are dropped (they would describe the wrong state).
    stale: bool,
}

impl From<core::Visit> for Visit {
    fn from(v: core::Visit) -> Visit {
        let stale = v.stale();
        let (kind, checkpoint) = match v {
            core::Visit::Run => (VisitKind::Run, None),
            core::Visit::RunStale => (VisitKind::RunStale, None),
            core::Visit::RunFromStart => (VisitKind::RunFromStart, None),
            core::Visit::Rerun { checkpoint } => (VisitKind::Rerun, Some(checkpoint)),
            core::Visit::Restore { checkpoint } => (VisitKind::Restore, Some(checkpoint)),
            core::Visit::Skip => (VisitKind::Skip, None),
            core::Visit::Stop => (VisitKind::Stop, None),
        };
        Visit {
            kind,
            checkpoint,
            stale,
        }
    }
}

/// What an iteration's steps do (`BlockStart.kind`).
#[pyclass(module = "hindsight._native", eq, frozen, hash, from_py_object)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum BlockKind {
    #[pyo3(name = "RUN")]
    Run,
    /// Skip them and put `checkpoint` back.
    #[pyo3(name = "RESTORE")]
    Restore,
    /// Put `checkpoint` back and go on at `step`.
    #[pyo3(name = "RESUME_STEPS")]
    ResumeSteps,
}

/// What to do with an iteration's steps.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct BlockStart {
    kind: BlockKind,
    checkpoint: Option<String>,
    step: u64,
}

impl From<core::BlockStart> for BlockStart {
    fn from(b: core::BlockStart) -> BlockStart {
        let (kind, checkpoint, step) = match b {
            core::BlockStart::Run => (BlockKind::Run, None, 0),
            core::BlockStart::Restore { checkpoint } => (BlockKind::Restore, Some(checkpoint), 0),
            core::BlockStart::ResumeSteps { checkpoint, step } => {
                (BlockKind::ResumeSteps, Some(checkpoint), step)
            }
        };
        BlockStart {
            kind,
            checkpoint,
            step,
        }
    }
}

/// What to do between two training steps (`runs::session::StepAction`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct StepAction {
    prepare: bool,
    save: Option<String>,
    wait: bool,
    exit: Option<i32>,
}

/// A block checkpoint to save now (`runs::session::BlockSave`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct BlockSave {
    name: String,
    /// Wait until it is durable (the process leaves after the iteration).
    wait: bool,
}

/// What to do once an outer iteration is over (`runs::session::IterationEnd`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct IterationEnd {
    checkpoint: Option<String>,
    apply_retention: bool,
    save: Option<String>,
    exit: Option<i32>,
}

/// What to do as the run finishes (`runs::session::Finish`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct Finish {
    discard: Option<String>,
    apply_retention: bool,
}

/// A replay worker's action after an iteration's steps (`BlockEnd.kind`).
#[pyclass(module = "hindsight._native", eq, frozen, hash, from_py_object)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum EndKind {
    #[pyo3(name = "NOTHING")]
    Nothing,
    /// Put `checkpoint` back (the state after the steps).
    #[pyo3(name = "RESTORE")]
    Restore,
    /// Compare the state computed with `checkpoint`.
    #[pyo3(name = "CHECK")]
    Check,
}

/// A replay worker's action after an iteration's steps.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct BlockEnd {
    kind: EndKind,
    checkpoint: Option<String>,
}

/// A checked retention policy (`checkpoint::retention::Retention::from_args`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone, Debug)]
pub(crate) struct Retention {
    keep_last: Option<usize>,
    keep_best: Option<usize>,
    best_mode: &'static str,
    keep_every: Option<u64>,
    keep_spread: Option<usize>,
    /// The logged value keep-best ranks by.
    metric: Option<String>,
}

impl Retention {
    fn new(policy: retention::Retention, metric: Option<String>) -> Retention {
        let best_mode = match policy.keep_best {
            Some((_, retention::BestMode::Max)) => "max",
            _ => "min",
        };
        Retention {
            keep_last: policy.keep_last,
            keep_best: policy.keep_best.map(|(k, _)| k),
            best_mode,
            keep_every: policy.keep_every,
            keep_spread: policy.keep_spread,
            metric,
        }
    }

    pub(crate) fn policy(&self) -> retention::Retention {
        let mode = if self.best_mode == "max" {
            retention::BestMode::Max
        } else {
            retention::BestMode::Min
        };
        retention::Retention {
            keep_last: self.keep_last,
            keep_best: self.keep_best.map(|k| (k, mode)),
            keep_every: self.keep_every,
            keep_spread: self.keep_spread,
        }
    }
}

#[pymethods]
impl Retention {
    /// The policy a front end's arguments ask for; errors name `call` and
    /// its `metric_arg`/`mode_arg`.
    #[staticmethod]
    #[pyo3(signature = (call, metric_arg, mode_arg, keep_last=None, keep_best=None, metric=None, mode="min", keep_every=None))]
    #[allow(clippy::too_many_arguments)]
    fn checked(
        call: &str,
        metric_arg: &str,
        mode_arg: &str,
        keep_last: Option<i64>,
        keep_best: Option<i64>,
        metric: Option<String>,
        mode: &str,
        keep_every: Option<i64>,
    ) -> PyResult<Retention> {
        let args = RetentionArgs {
            keep_last,
            keep_best,
            metric: metric.as_deref(),
            mode,
            keep_every,
        };
        let policy =
            retention::Retention::from_args(call, [metric_arg, mode_arg], &args).py_err()?;
        Ok(Retention::new(
            policy,
            metric.filter(|_| keep_best.is_some()),
        ))
    }

    fn is_empty(&self) -> bool {
        self.policy().is_empty()
    }
}

/// A recording process's lifecycle (`runs::session::RecordSession`).
#[pyclass(module = "hindsight._native")]
pub(crate) struct RecordSession(core::RecordSession, Sampler);

#[pymethods]
impl RecordSession {
    /// Configured from the environment; a bad HINDSIGHT_* value is an error naming it.
    #[staticmethod]
    fn from_env(run_id: &str, now: f64) -> PyResult<Self> {
        core::RecordSession::from_env(run_id, now)
            .map(|s| RecordSession(s, Sampler::default()))
            .py_err()
    }

    /// For a framework's callback that names its checkpoints `prefix`.
    #[staticmethod]
    fn for_framework(prefix: &str, now: f64) -> PyResult<Self> {
        core::RecordSession::for_framework(prefix, now)
            .map(|s| RecordSession(s, Sampler::default()))
            .py_err()
    }

    /// The framework's own periods (`runs::session::RecordSession::set_framework_periods`).
    #[pyo3(signature = (every_epochs, every_steps, from_step))]
    fn set_framework_periods(
        &mut self,
        every_epochs: Option<u64>,
        every_steps: Option<u64>,
        from_step: u64,
    ) -> PyResult<()> {
        self.0
            .set_framework_periods(every_epochs, every_steps, from_step)
            .py_err()
    }

    pub(crate) fn set_objects(&mut self, any: bool) {
        self.0.set_objects(any)
    }

    fn set_every(&mut self, every: u64) -> PyResult<()> {
        self.0.schedule_mut().set_every(every).py_err()
    }

    #[pyo3(signature = (code))]
    fn set_exit_code(&mut self, code: Option<i32>) -> PyResult<()> {
        self.0.set_exit_code(code).py_err()
    }

    fn set_safety_minutes(&mut self, minutes: f64) -> PyResult<()> {
        self.0.set_safety_minutes(minutes).py_err()
    }

    fn set_retention(&mut self, policy: &Retention) {
        self.0.set_retention(policy.policy(), policy.metric.clone())
    }

    /// The policy in force (the user's, or the loop's default once it started).
    #[getter]
    fn retention(&self) -> Retention {
        Retention::new(
            self.0.retention().clone(),
            self.0.best_metric().map(str::to_string),
        )
    }

    #[getter]
    fn exit_code(&self) -> i32 {
        self.0.exit_code()
    }

    #[getter]
    fn every(&self) -> Option<u64> {
        self.0.schedule().every()
    }

    #[getter]
    fn epsilon(&self) -> f64 {
        self.0.schedule().policy().epsilon
    }

    #[getter]
    fn contention(&self) -> f64 {
        self.0.schedule().contention()
    }

    #[getter]
    fn pending_signal(&self) -> Option<i32> {
        self.0.pending_signal()
    }

    pub(crate) fn signal(&mut self, signum: i32) {
        self.0.signal(signum)
    }

    #[pyo3(signature = (loop_name, length))]
    fn outer_start(&mut self, loop_name: &str, length: Option<u64>) {
        self.0.outer_start(loop_name, length)
    }

    /// Resume from checkpoint `name` (`at_iteration_end`: taken at the end
    /// of an iteration without an inner loop).
    fn resume_from(&mut self, name: &str, at_iteration_end: bool) -> PyResult<()> {
        self.0
            .resume_from(core::ResumePoint::new(name, at_iteration_end).py_err()?);
        Ok(())
    }

    fn iteration_start(&mut self, i: u64) -> Visit {
        self.0.iteration_start(i).into()
    }

    fn block_start(&mut self, i: u64) -> BlockStart {
        self.0.block_start(i).into()
    }

    /// What to do between two steps; `None` where nothing is (most steps:
    /// no object is made on the training thread's per-step path).
    pub(crate) fn step_boundary(
        &mut self,
        i: u64,
        j: u64,
        now: f64,
    ) -> PyResult<Option<StepAction>> {
        let a = self.0.step_boundary(i, j, now).py_err()?;
        if a.is_nothing() {
            return Ok(None);
        }
        Ok(Some(StepAction {
            prepare: a.prepare,
            save: a.save,
            wait: a.wait,
            exit: a.exit,
        }))
    }

    fn overhead(&mut self, total_secs: f64) {
        self.0.overhead(total_secs)
    }

    fn started(&mut self, secs: f64) {
        self.0.started(secs)
    }

    fn restore_measured(&mut self, read_secs: f64) {
        self.0.restore_measured(read_secs)
    }

    /// The checkpoint to save now that iteration `i`'s steps ended, if due.
    #[pyo3(signature = (i, compute_secs, background_total, first_estimate))]
    fn block_end(
        &mut self,
        i: u64,
        compute_secs: f64,
        background_total: Option<f64>,
        first_estimate: f64,
    ) -> PyResult<Option<BlockSave>> {
        // Sampled here: the contention estimate compares intervals between block ends.
        let cpu = self.1.sample_if_due();
        let save = self
            .0
            .block_end(i, compute_secs, background_total, cpu, first_estimate)
            .py_err()?;
        Ok(save.map(|b| BlockSave {
            name: b.name,
            wait: b.wait,
        }))
    }

    /// A following rank's block end: rank 0 decided whether it is `due`.
    fn block_end_decided(&mut self, i: u64, due: bool) -> PyResult<Option<BlockSave>> {
        let save = self.0.block_end_decided(i, due).py_err()?;
        Ok(save.map(|b| BlockSave {
            name: b.name,
            wait: b.wait,
        }))
    }

    /// The ranks agreed on the run (rank 0's) and a clock, as the loop starts.
    fn join(&mut self, run_id: &str, now: f64) {
        self.0.join(run_id, now)
    }

    fn saved(&mut self, blocked_secs: f64, now: f64) {
        self.0.saved(blocked_secs, now)
    }

    /// The checkpoint just saved holds `nbytes` of state (the budget's measure).
    fn checkpoint_size(&mut self, nbytes: u64) {
        self.0.checkpoint_size(nbytes)
    }

    /// Iteration `i` runs steps but its start state was not kept.
    fn start_unkept(&mut self, i: u64) {
        self.0.start_unkept(i)
    }

    fn block_closed(&mut self, i: u64) {
        self.0.block_closed(i)
    }

    fn iteration_continues(&mut self) {
        self.0.iteration_continues()
    }

    fn iteration_end(&mut self, i: u64, closing: bool) -> PyResult<IterationEnd> {
        let e = self.0.iteration_end(i, closing).py_err()?;
        Ok(IterationEnd {
            checkpoint: e.checkpoint,
            apply_retention: e.apply_retention,
            save: e.save,
            exit: e.exit,
        })
    }

    fn outer_end(&mut self) -> PyResult<Option<String>> {
        self.0.outer_end().py_err()
    }

    #[pyo3(signature = (i, j, rank, recorded, digest))]
    fn resumed_batch(
        &self,
        i: u64,
        j: u64,
        rank: Option<u32>,
        recorded: Option<&str>,
        digest: &str,
    ) -> PyResult<()> {
        self.0.resumed_batch(i, j, rank, recorded, digest).py_err()
    }

    /// Why the last block end saved or did not (once), for `$HINDSIGHT_VERBOSE`.
    fn take_decision(&mut self) -> Option<String> {
        self.0.take_decision()
    }

    /// The line a recording starts with.
    fn start_line(&self, script: &str, home: &str, objects: Vec<String>, resumed: bool) -> String {
        self.0.start_line(script, home, &objects, resumed)
    }

    /// The line a recording ends with.
    #[pyo3(signature = (status, script, bytes_written, now))]
    fn summary(
        &self,
        status: &str,
        script: &str,
        bytes_written: Option<u64>,
        now: f64,
    ) -> PyResult<String> {
        let status: Status = status.parse().py_err()?;
        Ok(self.0.summary(status, script, bytes_written, now))
    }

    fn finish(&mut self, status: &str) -> PyResult<Finish> {
        let status: Status = status.parse().py_err()?;
        let f = self.0.finish(status);
        Ok(Finish {
            discard: f.discard,
            apply_retention: f.apply_retention,
        })
    }
}

/// A replay worker's lifecycle: its plan's execution and its proofs
/// (`runs::session::ReplaySession`).
#[pyclass(module = "hindsight._native")]
pub(crate) struct ReplaySession(core::ReplaySession);

impl ReplaySession {
    /// Step j of iteration i consumed a batch with this fingerprint (an
    /// error of kind `Diverged` where the recording's differs).
    pub(crate) fn step_checked(
        &mut self,
        i: u64,
        j: u64,
        digest: &str,
    ) -> hindsight_core::Result<()> {
        self.0.step(i, j, digest)
    }
}

#[pymethods]
impl ReplaySession {
    #[new]
    fn new(plan: &WorkerPlan) -> Self {
        ReplaySession(core::ReplaySession::new(plan.inner().clone()))
    }

    /// Off for a front end that cannot compare an executed state with the
    /// checkpoint it replaces: the plan's restores are then kept.
    fn set_cost_rule(&mut self, on: bool) {
        self.0.set_cost_rule(on)
    }

    #[getter]
    fn last_needed(&self) -> Option<u64> {
        self.0.last_needed()
    }

    #[getter]
    fn past_plan(&self) -> bool {
        self.0.past_plan()
    }

    #[getter]
    fn steps_executed(&self) -> u64 {
        self.0.steps_executed()
    }

    #[getter]
    fn restored(&self) -> u64 {
        self.0.restored_count()
    }

    fn outer_start(&mut self, loop_name: &str) {
        self.0.outer_start(loop_name)
    }

    fn iteration_start(&mut self, i: u64) -> PyResult<Visit> {
        self.0.iteration_start(i).map(Visit::from).py_err()
    }

    fn start_state_sources(&self) -> Vec<String> {
        self.0.start_state_sources()
    }

    /// `expected`: the recorded batch fingerprints of iteration `i`, by step.
    fn block_start(&mut self, i: u64, expected: BTreeMap<u64, String>) -> PyResult<BlockStart> {
        self.0
            .block_start(i, expected)
            .map(BlockStart::from)
            .py_err()
    }

    fn step(&mut self, i: u64, j: u64, digest: &str) -> PyResult<()> {
        self.step_checked(i, j, digest).py_err()
    }

    fn restored_in(&mut self, secs: f64) {
        self.0.restored(secs)
    }

    fn checked_in(&mut self, secs: f64) {
        self.0.checked(secs)
    }

    fn block_end(&mut self, i: u64, at_iteration: bool) -> PyResult<BlockEnd> {
        let (kind, checkpoint) = match self.0.block_end(i, at_iteration).py_err()? {
            core::BlockEnd::Nothing => (EndKind::Nothing, None),
            core::BlockEnd::Restore { checkpoint } => (EndKind::Restore, Some(checkpoint)),
            core::BlockEnd::Check { checkpoint } => (EndKind::Check, Some(checkpoint)),
        };
        Ok(BlockEnd { kind, checkpoint })
    }

    /// The error to raise: the state after iteration `i` differs from checkpoint `name`.
    fn state_differs(&self, i: u64, name: &str, path: &str, detail: &str) -> PyErr {
        crate::errors::to_py(self.0.state_differs(i, name, path, detail))
    }

    /// The error to raise: a logged value differs from the recorded one.
    fn value_differs(&self, name: &str, at: &str, recorded: &str, replayed: &str) -> PyErr {
        crate::errors::to_py(self.0.value_differs(name, at, recorded, replayed))
    }

    /// The progress line for the driver once iteration `i` is over.
    fn iteration_end(&mut self, i: u64) -> String {
        self.0.iteration_end(i)
    }

    /// The worker's last progress line.
    fn summary(&mut self, run_secs: f64) -> String {
        self.0.summary(run_secs)
    }
}

/// A checkpoint period argument (`runs::schedule::checked_every`): a bool,
/// though Python counts it an int, is no period.
#[pyfunction]
fn checked_every(call: &str, arg: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let whole = if value.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        value.extract::<i64>().ok()
    };
    let shown = value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    hindsight_core::runs::schedule::checked_every(call, arg, &shown, whole).py_err()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(checked_every, m)?)?;
    m.add_class::<VisitKind>()?;
    m.add_class::<BlockKind>()?;
    m.add_class::<EndKind>()?;
    m.add_class::<Visit>()?;
    m.add_class::<BlockStart>()?;
    m.add_class::<StepAction>()?;
    m.add_class::<IterationEnd>()?;
    m.add_class::<BlockSave>()?;
    m.add_class::<Finish>()?;
    m.add_class::<BlockEnd>()?;
    m.add_class::<Retention>()?;
    m.add_class::<RecordSession>()?;
    m.add_class::<ReplaySession>()?;
    Ok(())
}
