//! The recording's session: resume, checkpoints, preemption, retention.

use super::{BlockStart, Phase, ResumePoint, Visit};
use crate::checkpoint::naming::{CheckpointId, Kind};
use crate::checkpoint::retention::Retention;
use crate::error::{Error, Result};
use crate::runs::adaptive::{HOOKS_SHARE, UNSEEN_PER_HOOK_SECOND};
use crate::runs::cpu::RunQueue;
use crate::runs::preempt;
use crate::runs::schedule::CheckpointSchedule;
use crate::settings;

/// What to do at a boundary between two training steps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepAction {
    /// Pin host memory for the state now, in the background (the first
    /// boundary: the optimizer's state exists), so the first save does not
    /// wait for it.
    pub prepare: bool,
    /// Save this step checkpoint now (a signal, or the safety timer).
    pub save: Option<String>,
    /// Wait until it is durable (the process is about to leave).
    pub wait: bool,
    /// Then leave with this exit code.
    pub exit: Option<i32>,
}

impl StepAction {
    /// Nothing to do between these steps (most of them).
    pub fn is_nothing(&self) -> bool {
        !self.prepare && self.save.is_none() && self.exit.is_none()
    }
}

/// A block checkpoint to save now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSave {
    pub name: String,
    /// Wait until it is durable (a stop signal: the process leaves after the iteration).
    pub wait: bool,
}

/// When block checkpoints are due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cadence {
    /// The schedule's (`every`, or the adaptive policy).
    Schedule,
    /// After every n-th iteration, counted from one (a framework's period,
    /// as Lightning's `ModelCheckpoint(every_n_epochs=n)` counts it).
    AfterEvery(u64),
    /// Only for a stop signal.
    Never,
}

/// What to do once an outer iteration is over.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IterationEnd {
    /// The checkpoint of the iteration's steps, if one was saved (the
    /// iteration's row names it).
    pub checkpoint: Option<String>,
    /// Apply the retention policy now (a checkpoint was added).
    pub apply_retention: bool,
    /// Save the end-of-iteration checkpoint and wait until it is durable.
    pub save: Option<String>,
    /// Then leave with this exit code.
    pub exit: Option<i32>,
}

/// What to do as the run finishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Finish {
    /// Remove this checkpoint: the steps it followed were left by an
    /// exception, not a `break`, so it is no block end to resume from.
    pub discard: Option<String>,
    /// Apply the retention policy one last time, then collect garbage.
    pub apply_retention: bool,
}

/// How the run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Completed,
    Failed,
    Interrupted,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Interrupted => "interrupted",
        }
    }
}

impl std::str::FromStr for Status {
    type Err = Error;
    fn from_str(s: &str) -> Result<Status> {
        match s {
            "completed" => Ok(Status::Completed),
            "failed" => Ok(Status::Failed),
            "interrupted" => Ok(Status::Interrupted),
            other => Err(Error::invalid(
                "run status",
                format!("{other:?} is not completed, failed or interrupted"),
            )),
        }
    }
}

/// A budget never thins a run's checkpoints below this many.
pub const MIN_KEPT_IN_BUDGET: usize = 8;

/// One recording process's lifecycle. Times are the caller's monotonic
/// clock in seconds, so tests drive it without sleeping.
#[derive(Clone, Debug)]
pub struct RecordSession {
    run_id: String,
    loop_name: String,
    phase: Phase,
    schedule: CheckpointSchedule,
    retention: Retention,
    retention_chosen: bool,
    /// The bytes a run's checkpoints may keep in the store where no
    /// retention was chosen (`$HINDSIGHT_CHECKPOINT_BUDGET`; None: unbounded).
    budget: Option<u64>,
    /// The outer loop's length, if known (its default retention depends on it).
    loop_len: Option<u64>,
    best_metric: Option<String>,
    exit_code: i32,
    safety_secs: Option<f64>,
    has_objects: bool,
    resume: Option<ResumePoint>,
    signal: Option<i32>,
    last_save: f64,
    prepared: bool,
    iterations_seen: u64,
    iter_checkpoint: Option<String>,
    unconfirmed: Option<String>,
    /// The current iteration's start state was not kept (`start_unkept`):
    /// a checkpoint inside it could not be resumed, so none is taken.
    start_unkept: bool,
    cadence: Cadence,
    every_steps: Option<u64>,
    last_step_saved: Option<u64>,
    /// The block ends where the iteration does (a framework's epoch-end
    /// hook runs after validation): a stop signal there saves the block.
    block_is_end: bool,
    /// Checkpoints handed to the writer, and the training thread's time in them.
    saves: u64,
    blocked_secs: f64,
    /// The front end reports its hooks' time (`overhead`): the summary can
    /// then state everything the recording cost, not only its saves.
    hooks_measured: bool,
    started: f64,
    /// Why the last block end saved or did not, for `$HINDSIGHT_VERBOSE`.
    decision: Option<String>,
    /// The training thread's wait for a CPU (`None`: not measured, as in
    /// tests that give compute times of their own), and its reading when
    /// the current iteration started: the policy's compute excludes it.
    run_queue: Option<RunQueue>,
    iter_waited: Option<f64>,
}

impl RecordSession {
    /// A session for `run_id`, started at `now`.
    pub fn new(
        run_id: &str,
        schedule: CheckpointSchedule,
        exit_code: i32,
        safety_secs: Option<f64>,
        now: f64,
    ) -> RecordSession {
        RecordSession {
            run_id: run_id.to_string(),
            loop_name: "loop".into(),
            phase: Phase::Idle,
            schedule,
            retention: Retention::default(),
            retention_chosen: false,
            budget: None,
            loop_len: None,
            best_metric: None,
            exit_code,
            safety_secs,
            has_objects: false,
            resume: None,
            signal: None,
            last_save: now,
            prepared: false,
            iterations_seen: 0,
            iter_checkpoint: None,
            unconfirmed: None,
            start_unkept: false,
            cadence: Cadence::Schedule,
            every_steps: None,
            last_step_saved: None,
            block_is_end: false,
            saves: 0,
            blocked_secs: 0.0,
            hooks_measured: false,
            started: now,
            decision: None,
            run_queue: None,
            iter_waited: None,
        }
    }

    /// A framework's own periods (Lightning's `every_n_epochs`, counted from
    /// one, `None`: never; `every_n_train_steps` of the step numbers the
    /// boundaries carry, after `from_step`, the step a resumed fit starts
    /// at). Its epoch-end hook runs after everything of the epoch, so its
    /// block checkpoint is the iteration's end: a stop signal pending there
    /// saves it and waits, and the process leaves at the iteration's end
    /// without an `.end` checkpoint.
    pub fn set_framework_periods(
        &mut self,
        every_epochs: Option<u64>,
        every_steps: Option<u64>,
        from_step: u64,
    ) -> Result<()> {
        for (arg, v) in [
            ("every_n_epochs", every_epochs),
            ("every_n_train_steps", every_steps),
        ] {
            if v == Some(0) {
                return Err(Error::invalid(arg, "must be at least 1"));
            }
        }
        self.cadence = every_epochs.map_or(Cadence::Never, Cadence::AfterEvery);
        self.every_steps = every_steps;
        self.last_step_saved = Some(from_step);
        self.block_is_end = true;
        Ok(())
    }

    /// A session configured from the environment (`$HINDSIGHT_CHECKPOINT_EVERY`,
    /// `$HINDSIGHT_EPSILON`, `$HINDSIGHT_SAFETY_MINUTES`, the exit code's
    /// sources): a bad value stops the run now, naming the variable, not at
    /// its first checkpoint or preemption.
    pub fn from_env(run_id: &str, now: f64) -> Result<RecordSession> {
        let schedule = CheckpointSchedule::from_env()?;
        let code = preempt::exit_code(None)?;
        let safety = settings::SAFETY_MINUTES.float()?.map(|m| m * 60.0);
        let mut s = RecordSession::new(run_id, schedule, code, safety, now);
        s.budget = budget_from_env()?;
        s.measure_run_queue();
        Ok(s)
    }

    /// Exclude the training thread's wait for a CPU from the policy's
    /// compute ([`RunQueue`]); a session made by `new` takes the compute
    /// times it is given as they are.
    pub(crate) fn measure_run_queue(&mut self) {
        self.run_queue = Some(RunQueue::default());
    }

    /// A session for a framework that names its checkpoints `prefix` and
    /// keeps its own periods ([`RecordSession::set_framework_periods`]); the
    /// exit code still comes from its sources (an error names a bad one).
    pub fn for_framework(prefix: &str, now: f64) -> Result<RecordSession> {
        crate::runs::ranks::refuse_several_ranks("a framework's recording (Lightning)")?;
        let schedule = CheckpointSchedule::new(None, crate::runs::adaptive::DEFAULT_EPSILON)?;
        let mut s = RecordSession::new(prefix, schedule, preempt::exit_code(None)?, None, now);
        s.set_objects(true);
        // A fit's checkpoints are bounded as an `hs.loop` run's are.
        s.budget = budget_from_env()?;
        Ok(s)
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn schedule(&self) -> &CheckpointSchedule {
        &self.schedule
    }

    pub fn schedule_mut(&mut self) -> &mut CheckpointSchedule {
        &mut self.schedule
    }

    // -- configuration (hs.checkpointing) ------------------------------------------

    /// Whether there is state to checkpoint (objects given or found).
    pub fn set_objects(&mut self, any: bool) {
        self.has_objects = any;
    }

    pub fn set_exit_code(&mut self, code: Option<i32>) -> Result<()> {
        self.exit_code = preempt::exit_code(code)?;
        Ok(())
    }

    pub fn exit_code(&self) -> i32 {
        self.exit_code
    }

    /// A checkpoint at least every `minutes` of training (a kill -9 loses at most that much).
    pub fn set_safety_minutes(&mut self, minutes: f64) -> Result<()> {
        if !(minutes.is_finite() && minutes > 0.0) {
            return Err(Error::invalid(
                "safety_minutes",
                format!("{minutes} must be a positive number of minutes"),
            ));
        }
        self.safety_secs = Some(minutes * 60.0);
        Ok(())
    }

    /// The user's retention policy, and the logged name keep-best ranks by.
    pub fn set_retention(&mut self, retention: Retention, best_metric: Option<String>) {
        self.retention_chosen = !retention.is_empty();
        self.retention = retention;
        self.best_metric = best_metric;
    }

    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// The outer-loop-level log keep-best ranks checkpoints by.
    pub fn best_metric(&self) -> Option<&str> {
        self.best_metric.as_deref()
    }

    // -- events ---------------------------------------------------------------------

    /// A stop signal arrived (SIGTERM, SIGUSR1, ...): the session checkpoints
    /// at the next boundary and exits. The first one counts.
    pub fn signal(&mut self, signum: i32) {
        self.signal.get_or_insert(signum);
    }

    pub fn pending_signal(&self) -> Option<i32> {
        self.signal
    }

    /// The outer loop starts (`len`: its length if known). A loop without a
    /// chosen retention gets the core's default for its length.
    pub fn outer_start(&mut self, loop_name: &str, len: Option<u64>) {
        self.loop_name = loop_name.to_string();
        self.loop_len = len;
        if !self.retention_chosen {
            self.retention = Retention::default_for_loop(len);
        }
        self.phase = Phase::Between;
    }

    /// Resume this run from `point`, found when the outer loop starts.
    pub fn resume_from(&mut self, point: ResumePoint) {
        self.resume = Some(point);
    }

    pub fn resuming(&self) -> Option<&ResumePoint> {
        self.resume.as_ref()
    }

    pub fn iteration_start(&mut self, i: u64) -> Visit {
        self.iter_waited = self.run_queue.as_mut().and_then(RunQueue::waited_secs);
        self.iter_checkpoint = None;
        self.start_unkept = false;
        self.iterations_seen = i + 1;
        let visit = match &self.resume {
            None => Visit::Run,
            Some(r) if i < r.first_to_run() => Visit::Skip,
            Some(r) if r.kind == Kind::End => {
                let checkpoint = r.name.clone();
                self.resume = None;
                Visit::Restore { checkpoint }
            }
            // Interrupted inside (or after) the steps of iteration i: the
            // code before them runs again as it first ran (it may make the
            // data iterator, or evaluate when a counter says so).
            Some(r) => Visit::Rerun {
                checkpoint: r.name.clone(),
            },
        };
        if visit != Visit::Skip {
            self.phase = Phase::Iteration(i);
        }
        visit
    }

    pub fn block_start(&mut self, i: u64) -> BlockStart {
        let action = match &self.resume {
            Some(r) if r.index == i && r.kind == Kind::Block => BlockStart::Restore {
                checkpoint: r.name.clone(),
            },
            Some(r) if r.index == i => match r.kind {
                Kind::Step(j) => BlockStart::ResumeSteps {
                    checkpoint: r.name.clone(),
                    step: j + 1,
                },
                _ => BlockStart::Run,
            },
            _ => BlockStart::Run,
        };
        if action != BlockStart::Run {
            self.resume = None;
        }
        self.phase = match action {
            BlockStart::Restore { .. } => Phase::Iteration(i),
            _ => Phase::Steps(i),
        };
        action
    }

    /// Between step `j` and the next of iteration `i`, at `now`.
    /// Iteration `i` runs steps, but the front end kept no state of its
    /// start (it keeps one only where an earlier iteration ran steps: the
    /// copy costs a loop of one-step iterations a tenth of its step). A
    /// checkpoint inside it would resume by running the code before the
    /// steps again from a start state that is not there: none is taken
    /// until the iteration ends. A stop signal inside it exits without a
    /// checkpoint; the resume runs the iteration again from the last one.
    pub fn start_unkept(&mut self, _i: u64) {
        self.start_unkept = true;
    }

    pub fn step_boundary(&mut self, i: u64, j: u64, now: f64) -> Result<StepAction> {
        let mut action = StepAction::default();
        if !self.has_objects || self.start_unkept {
            action.exit = self.signal.map(|_| self.exit_code);
            return Ok(action);
        }
        if !self.prepared {
            self.prepared = true;
            action.prepare = true;
        }
        let due = self.safety_secs.is_some_and(|s| now - self.last_save > s);
        let periodic = self.every_steps.is_some_and(|n| {
            j.is_multiple_of(n) && self.last_step_saved.is_none_or(|last| j > last)
        });
        if self.signal.is_none() && !due && !periodic {
            return Ok(action);
        }
        self.last_step_saved = Some(j);
        action.save = Some(self.id(i, Kind::Step(j))?);
        action.wait = self.signal.is_some();
        action.exit = self.signal.map(|_| self.exit_code);
        Ok(action)
    }

    /// The recording's own time outside saves so far (charged to ε).
    pub fn overhead(&mut self, total_secs: f64) {
        self.hooks_measured = true;
        self.schedule.overhead(total_secs);
    }

    /// The recording's one-time start-up on the training thread took `secs`
    /// (hindsight's import, this session's set-up): charged to ε.
    pub fn started(&mut self, secs: f64) {
        self.schedule.started(secs);
    }

    /// The steps of iteration `i` ended (`at_iteration`: the iteration has no
    /// inner loop, and its body ended). Returns the checkpoint to save now,
    /// if one is due.
    pub fn block_end(
        &mut self,
        i: u64,
        compute_secs: f64,
        background_total: Option<f64>,
        cpu: Option<crate::runs::cpu::CpuSample>,
        first_estimate: f64,
    ) -> Result<Option<BlockSave>> {
        self.phase = Phase::Iteration(i);
        if !self.has_objects {
            return Ok(None);
        }
        let forced = self.block_is_end && self.signal.is_some();
        let compute_secs = self.own_compute(compute_secs);
        let (due, why) = match self.cadence {
            Cadence::Schedule => {
                let due = self.schedule.block_ended(
                    i,
                    compute_secs,
                    background_total,
                    cpu,
                    first_estimate,
                );
                let why = match self.schedule.every() {
                    Some(n) => format!("every {n}"),
                    None => {
                        let p = self.schedule.policy();
                        let (h, t) = (p.hooks_share(), p.threshold());
                        let spacing = match p.restore_secs {
                            Some(r) if !due && !p.pays_back() => format!(
                                "; a restore costs {:.3} s, more than the {:.3} s of compute since the \
                                 last checkpoint",
                                r, p.compute_since_checkpoint
                            ),
                            _ => String::new(),
                        };
                        format!(
                            "adaptive: recording costs {:.1}% of the compute so far (checkpoints \
                             {:.1}%, hooks {:.1}%, charged {:.1}% with the body's time they cost), \
                             bound {:.1}%{}; this iteration computed {compute_secs:.3} s{spacing}",
                            100.0 * p.overhead(),
                            100.0 * p.checkpoint_share(),
                            100.0 * h,
                            100.0 * (h * (1.0 + UNSEEN_PER_HOOK_SECOND)).min(t * HOOKS_SHARE),
                            100.0 * t,
                            if h * (1.0 + UNSEEN_PER_HOOK_SECOND) > t * HOOKS_SHARE {
                                " (the hooks alone take over half of it: checkpoints keep the other half)"
                            } else {
                                ""
                            },
                        )
                    }
                };
                (due, why)
            }
            Cadence::AfterEvery(n) => (
                (i + 1).is_multiple_of(n),
                format!("the framework's every {n}"),
            ),
            Cadence::Never => (false, "the framework saves no epochs".to_string()),
        };
        let unkept = self.start_unkept && !self.block_is_end;
        let (due, forced) = (due && !unkept, forced && !unkept);
        let verdict = if unkept {
            "no checkpoint (this iteration is the first to run steps, and its start was not kept: \
             the next one is checkpointed as the policy says)"
                .to_string()
        } else if forced && !due {
            "checkpoint (a stop signal is pending)".to_string()
        } else if due {
            format!("checkpoint ({why})")
        } else {
            format!("no checkpoint ({why})")
        };
        self.decision = Some(format!("{} {i}: {verdict}", self.loop_name));
        if !(due || forced) {
            return Ok(None);
        }
        self.block_save(i, forced).map(Some)
    }

    /// The block end of a rank that follows rank 0 in a multi-rank job:
    /// rank 0 measured the iteration and decided (`due`), every rank takes
    /// that decision, so all save the same checkpoint or none. The signal
    /// the ranks agreed on still forces a save where it would on one rank.
    /// An iteration's `wall_secs` less the time its thread waited for a
    /// CPU meanwhile: the training's own time. Where others' work kept it
    /// waiting (a process sharing its core, DataLoader workers on every
    /// core), that wait is not compute the recording may spend ε of.
    fn own_compute(&mut self, wall_secs: f64) -> f64 {
        let now = self.run_queue.as_mut().and_then(RunQueue::waited_secs);
        match (self.iter_waited, now) {
            (Some(before), Some(now)) if now > before => (wall_secs - (now - before)).max(0.0),
            _ => wall_secs,
        }
    }

    pub fn block_end_decided(&mut self, i: u64, due: bool) -> Result<Option<BlockSave>> {
        self.phase = Phase::Iteration(i);
        if !self.has_objects {
            return Ok(None);
        }
        let forced = self.block_is_end && self.signal.is_some();
        if !(due || forced) || (self.start_unkept && !self.block_is_end) {
            return Ok(None);
        }
        self.block_save(i, forced).map(Some)
    }

    fn block_save(&mut self, i: u64, wait: bool) -> Result<BlockSave> {
        let name = self.id(i, Kind::Block)?;
        self.iter_checkpoint = Some(name.clone());
        Ok(BlockSave { name, wait })
    }

    /// The ranks of a multi-rank job agreed, as the outer loop starts, on
    /// their run (rank 0's) and on a clock (`now`, the same on every
    /// rank): checkpoints are named after the run, and the safety timer
    /// counts from that clock, so every rank's session decides alike.
    pub fn join(&mut self, run_id: &str, now: f64) {
        self.run_id = run_id.to_string();
        self.started = now;
        self.last_save = now;
    }

    /// A checkpoint of this run read back and verified in `read_secs`: what
    /// a restore costs, which spaces the adaptive checkpoints
    /// ([`CheckpointSchedule::restore_measured`]).
    pub fn restore_measured(&mut self, read_secs: f64) {
        self.schedule.restore_measured(read_secs);
    }

    /// A save finished blocking the training thread after `blocked_secs`, at `now`.
    pub fn saved(&mut self, blocked_secs: f64, now: f64) {
        self.schedule.saved(blocked_secs);
        self.last_save = now;
        self.saves += 1;
        if blocked_secs.is_finite() && blocked_secs > 0.0 {
            self.blocked_secs += blocked_secs;
        }
    }

    /// Bound the store's checkpoints of this run (`None`: unbounded);
    /// [`from_env`](Self::from_env) sets `$HINDSIGHT_CHECKPOINT_BUDGET`.
    pub fn set_budget(&mut self, budget: Option<u64>) {
        self.budget = budget;
    }

    /// A checkpoint just saved holds `bytes` of state. Where no retention was
    /// chosen and the run's checkpoints would outgrow the budget, they are
    /// thinned to a spread of `budget / bytes` (never below
    /// [`MIN_KEPT_IN_BUDGET`]): a replay restores the nearest and executes
    /// the rest.
    pub fn checkpoint_size(&mut self, bytes: u64) {
        let Some(budget) = self.budget.filter(|_| !self.retention_chosen && bytes > 0) else {
            return;
        };
        if self.saves.saturating_mul(bytes) <= budget && self.retention.keep_spread.is_none() {
            return;
        }
        let fit = usize::try_from(budget / bytes)
            .unwrap_or(usize::MAX)
            .max(MIN_KEPT_IN_BUDGET);
        let base = Retention::default_for_loop(self.loop_len)
            .keep_spread
            .unwrap_or(usize::MAX);
        self.retention.keep_spread = Some(fit.min(base));
    }

    /// Why the last block end saved or did not (once; `None` after), for a
    /// recording asked to say each decision (`$HINDSIGHT_VERBOSE`).
    pub fn take_decision(&mut self) -> Option<String> {
        self.decision.take()
    }

    /// The line a recording starts with: the run, where it lives, what its
    /// checkpoints hold (`objects`, empty: none) and when they are taken.
    pub fn start_line(
        &self,
        script: &str,
        home: &str,
        objects: &[String],
        resumed: bool,
    ) -> String {
        let verb = if resumed { "resuming" } else { "recording" };
        let what = if objects.is_empty() || !self.has_objects {
            "nothing is checkpointed (no hs.checkpointing)".to_string()
        } else {
            let when = match (self.cadence, self.schedule.every()) {
                (Cadence::Schedule, Some(n)) => format!("every {n} iterations of the outer loop"),
                (Cadence::Schedule, None) => format!(
                    "adaptive: taken while the recording costs under {:.1}% of the compute; \
                     HINDSIGHT_CHECKPOINT_EVERY=N: every N iterations",
                    100.0 * self.schedule.policy().threshold()
                ),
                (Cadence::AfterEvery(n), _) => format!("every {n} epochs"),
                (Cadence::Never, _) => "on stop signals".to_string(),
            };
            let kept = match self.budget.filter(|_| !self.retention_chosen) {
                Some(b) => format!(
                    "; kept within {} ({}), spread over the run",
                    crate::units::human_size(b),
                    settings::CHECKPOINT_BUDGET.name
                ),
                None => String::new(),
            };
            format!("checkpoints of {}; {when}{kept}", objects.join(", "))
        };
        format!(
            "hindsight: {verb} run {} of {script} in {home}; {what}",
            self.run_id
        )
    }

    /// The line a recording ends with: what it saved, what that cost the
    /// training thread, and what to do next.
    pub fn summary(
        &self,
        status: Status,
        script: &str,
        bytes_written: Option<u64>,
        now: f64,
    ) -> String {
        let secs = (now - self.started).max(0.0);
        let n = self.saves;
        let mut line = format!(
            "hindsight: run {} {} after {secs:.1} s: {n} checkpoint{}",
            self.run_id,
            status.as_str(),
            if n == 1 { "" } else { "s" }
        );
        if let Some(b) = bytes_written {
            line.push_str(&format!(" ({} written)", crate::units::human_size(b)));
        }
        if n > 0 {
            let share = if secs > 0.0 {
                self.blocked_secs / secs
            } else {
                0.0
            };
            let blocked = if self.blocked_secs < 1.0 {
                format!("{:.0} ms", 1000.0 * self.blocked_secs)
            } else {
                format!("{:.2} s", self.blocked_secs)
            };
            line.push_str(&format!(
                ", {blocked} of training time in them ({:.1}%)",
                100.0 * share
            ));
        }
        let p = self.schedule.policy();
        if self.hooks_measured && p.has_compute() {
            // What a user would otherwise measure against the plain script
            // (and could not, on a noisy machine): its own clocks' account.
            // The writer's CPU on cores the training left idle is CPU all
            // the same: stated, though ε was not charged for it.
            let idle = self.schedule.background_uncharged() / p.total_compute_secs;
            line.push_str(&format!(
                "; the recording's own CPU was {:.1}% of the compute (start-up {:.1}%, checkpoints {:.1}%, loop hooks {:.1}%)",
                100.0 * (p.overhead() + idle),
                100.0 * p.startup_share(),
                100.0 * (p.checkpoint_share() + idle),
                100.0 * p.hooks_share()
            ));
            if idle >= 0.0005 {
                line.push_str(&format!(
                    ", {:.1}% of it on cores the training left idle",
                    100.0 * idle
                ));
            }
        }
        if let (Some(r), true) = (p.restore_secs, p.withheld > 0) {
            line.push_str(&format!(
                "; {} more fit the overhead bound but were not taken: restoring one ({:.0} ms) \
                 costs more than the compute since the one before",
                p.withheld,
                1000.0 * r
            ));
        }
        match status {
            Status::Completed => line.push_str(&format!(
                ". Add hs.log(...) lines and replay: hindsight replay {script}"
            )),
            Status::Interrupted => line.push_str(". Run the same command again to resume"),
            Status::Failed => {}
        }
        line
    }

    /// The steps of iteration `i` were left early (a `break`, or an
    /// exception): its checkpoint is kept only if the iteration goes on.
    pub fn block_closed(&mut self, _i: u64) {
        self.unconfirmed = self.iter_checkpoint.clone();
    }

    /// The iteration's body went on after its steps (a `break` then).
    pub fn iteration_continues(&mut self) {
        self.unconfirmed = None;
    }

    /// Outer iteration `i` is over; `closing`: the loop ends inside it.
    pub fn iteration_end(&mut self, i: u64, closing: bool) -> Result<IterationEnd> {
        self.phase = Phase::Between;
        let checkpoint = self.iter_checkpoint.clone();
        let mut end = IterationEnd {
            apply_retention: checkpoint.is_some() && !self.retention.is_empty(),
            checkpoint,
            ..IterationEnd::default()
        };
        if self.signal.is_some() && !closing {
            // After iteration i: the next one starts afresh on resume (from
            // the block checkpoint where that is the iteration's end).
            if self.has_objects && !self.block_is_end {
                end.save = Some(self.id(i, Kind::End)?);
            }
            end.exit = Some(self.exit_code);
        }
        Ok(end)
    }

    /// The outer loop ran out after `iteration_start` of its last iteration.
    /// Returns the checkpoint to put back when the run was interrupted
    /// after its last iteration (the code after the loop reads that state).
    pub fn outer_end(&mut self) -> Result<Option<String>> {
        self.phase = Phase::Ended;
        let Some(r) = self.resume.take() else {
            return Ok(None);
        };
        let n = self.iterations_seen;
        if r.kind == Kind::End && r.index + 1 == n {
            return Ok(Some(r.name));
        }
        Err(Error::Replay {
            what: "resume".into(),
            run: self.run_id.clone(),
            detail: format!(
                "checkpoint {} is at {} {}, but the loop now ends after {n} iterations: the script's \
                 arguments or data changed since the run was interrupted ({}=0 starts a new run)",
                r.name,
                self.loop_name,
                r.index,
                settings::RESUME.name
            ),
        })
    }

    pub fn finish(&mut self, status: Status) -> Finish {
        self.phase = Phase::Finished;
        let unconfirmed = self.unconfirmed.take();
        match status {
            Status::Completed => Finish {
                discard: None,
                apply_retention: !self.retention.is_empty(),
            },
            _ => Finish {
                discard: unconfirmed,
                apply_retention: false,
            },
        }
    }

    /// A resume steps over the batches consumed before the interruption:
    /// the one at step `j` of iteration `i` must be the one recorded there
    /// (`recorded`: its fingerprint, if one was recorded), for each rank of
    /// a job (`rank`: None for a single process).
    pub fn resumed_batch(
        &self,
        i: u64,
        j: u64,
        rank: Option<u32>,
        recorded: Option<&str>,
        digest: &str,
    ) -> Result<()> {
        let whose = rank.map_or_else(|| "the ".to_string(), |r| format!("rank {r}'s "));
        match recorded {
            Some(want) if want != digest => Err(Error::Diverged {
                what: "resume".into(),
                run: self.run_id.clone(),
                at: format!("{} {i}, step {j}", self.loop_name),
                detail: format!(
                    "{whose}batch at {} {i}, step {j} differs from the recorded one: the data loader's order or \
                     content was not restored (a sampler or iterator drawing from a generator hindsight does \
                     not checkpoint, or data that changed on disk); use hs.data.Loader, or a DataLoader with a \
                     seeded generator, or start the epoch afresh ({}=0 starts a new run)",
                    self.loop_name,
                    settings::RESUME.name
                ),
            }),
            _ => Ok(()),
        }
    }

    fn id(&self, i: u64, kind: Kind) -> Result<String> {
        Ok(CheckpointId::new(&self.run_id, &self.loop_name, i, kind)?.name())
    }
}

/// The store budget of a run's checkpoints: `$HINDSIGHT_CHECKPOINT_BUDGET`,
/// else its default (a bad value is an error naming the variable).
fn budget_from_env() -> Result<Option<u64>> {
    Ok(settings::CHECKPOINT_BUDGET
        .bytes()?
        .or_else(|| crate::units::parse_size(settings::CHECKPOINT_BUDGET.default)))
}
