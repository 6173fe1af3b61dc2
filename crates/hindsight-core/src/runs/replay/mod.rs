//! The replay plan of one recorded run: which outer-loop iterations each
//! worker restores from a checkpoint, which it executes, and which it skips.
//! Computed here, once, from the recorded iterations, the checkpoints still
//! in the store and the iterations the user selected; the driver hands each
//! worker its [`WorkerPlan`] as JSON and the worker follows it.
//!
//! # Worker protocol
//!
//! `hindsight replay` starts one process per worker: the training script,
//! with `$HINDSIGHT_REPLAY` naming a file that holds the worker's plan as
//! JSON (this module's serde form of [`WorkerPlan`]) and `$HINDSIGHT_HOME`
//! the project home. The worker visits only iterations with a mode:
//! `restore` loads that iteration's checkpoint instead of running its inner
//! loop, `execute` runs it. Iterations without a mode are skipped. If the
//! plan has a `progress_fd`, the worker writes one line per finished
//! iteration to it (`<index>\n`) and, before exiting, one summary line
//! `steps <inner steps executed> restored <checkpoints restored>\n`. If it
//! has a `log_db`, the worker reads its run from, and writes its values to,
//! that database instead of the project's (see `LogDb::export_run`).

pub mod driver;
pub mod report;
pub mod schedule;

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use self::schedule::PartialStep;
use crate::error::{Error, Result};
use crate::runs::db::IterationRow;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Restore the iteration's end-of-block checkpoint, skip its inner loop.
    Restore,
    /// Run the iteration's inner loop.
    Execute,
}

/// What one worker process does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerPlan {
    pub run_id: String,
    pub worker: usize,
    /// The outer loop the modes index.
    pub loop_name: String,
    /// Mode of every iteration the worker visits (others are skipped).
    pub modes: BTreeMap<u64, Mode>,
    /// Checkpoint name of every iteration it restores.
    pub checkpoints: BTreeMap<u64, String>,
    /// A file descriptor inherited from the driver for progress lines.
    pub progress_fd: Option<i32>,
    /// Where the worker writes its values when it cannot share the project's
    /// `logs.db` (a Slurm task): a database made by `LogDb::export_run`,
    /// merged back by `LogDb::import_replay`. `None`: the project's own.
    #[serde(default)]
    pub log_db: Option<String>,
    /// The replay (`LogDb::begin_replay`) whose staged values the worker
    /// writes; they become results only after the driver's check.
    #[serde(default)]
    pub replay_id: Option<i64>,
    /// Checkpoint name of every iteration it executes that the recording
    /// checkpointed: the worker compares its state there with it
    /// ([`check_state`](crate::checkpoint::compare::check_state)).
    #[serde(default)]
    pub state_checks: BTreeMap<u64, String>,
    /// Whether the worker runs as the recording did (its thread count):
    /// only then is its state bit-identical to a checkpoint's.
    #[serde(default = "exact_default")]
    pub exact: bool,
    /// Recorded compute seconds of every iteration the worker restores right
    /// after visiting the one before it: it may execute such an iteration
    /// instead, when that costs less than restoring it
    /// ([`execute_instead`](Self::execute_instead)); and of every iteration
    /// it executes and may compare with a checkpoint (how far apart the
    /// comparisons of one-step iterations are).
    #[serde(default)]
    pub seconds: BTreeMap<u64, f64>,
    /// Mean restore time measured by earlier replays of this run, if any.
    #[serde(default)]
    pub restore_seconds: Option<f64>,
}

fn exact_default() -> bool {
    true
}

/// How many times the iteration's recorded time a restore must cost before
/// the iteration is executed instead.
pub const EXECUTE_MARGIN: f64 = 2.0;

/// A replay that executes one-step iterations it could restore compares
/// its state with their checkpoints once the recorded compute since the
/// last comparison is this many times a comparison's cost (at most a
/// twentieth of the replay's time goes to them).
pub const CHECK_SPACING: f64 = 20.0;

impl WorkerPlan {
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self)
            .map_err(|e| Error::internal(format!("replay plan did not serialize: {e}")))
    }

    pub fn from_json(text: &str) -> Result<WorkerPlan> {
        serde_json::from_str(text).map_err(|e| Error::invalid("replay plan", e.to_string()))
    }

    /// The last iteration the worker needs; it can stop after it.
    pub fn last_needed(&self) -> Option<u64> {
        self.modes.keys().next_back().copied()
    }

    /// Iterations the worker visits (restores or executes).
    pub fn visited(&self) -> usize {
        self.modes.len()
    }

    /// The checkpoint to compare the state with after executing iteration
    /// `i`, if any: none where the worker does not run exactly as recorded.
    pub fn state_check(&self, i: u64) -> Option<&str> {
        let executed = self.modes.get(&i) == Some(&Mode::Execute);
        (self.exact && executed)
            .then(|| self.state_checks.get(&i).map(String::as_str))
            .flatten()
    }
}

impl WorkerPlan {
    /// Whether the worker only restores checkpoints (every probe at the
    /// outer loop's level): nothing of the training re-executes.
    pub fn restores_only(&self) -> bool {
        self.modes.values().all(|m| *m == Mode::Restore)
    }

    /// Whether to execute iteration `i` rather than restore it, as planned:
    /// only where the worker runs exactly as recorded and its state is
    /// already the one before `i` (the plan visits `i - 1`; not the first
    /// iteration, whose start state is set before its code runs), and the
    /// restore costs more than the iteration did when recorded. The restore
    /// cost is `measured` (this worker's mean so far), else the earlier
    /// replays' mean; unknown: restore (and measure). Returns the checkpoint
    /// the executed state is then compared with (the one it replaces).
    /// "Costs more" is by [`EXECUTE_MARGIN`]: the executed state must also be
    /// captured and hashed for that comparison, and a restore measured beside
    /// other load must not flip the plan on noise.
    pub fn execute_instead(&self, i: u64, measured: Option<f64>) -> Option<&str> {
        let seconds = *self.seconds.get(&i)?;
        let restore = measured.or(self.restore_seconds)?;
        let may = self.exact
            && i > 0
            && self.modes.get(&i) == Some(&Mode::Restore)
            && self.modes.contains_key(&(i - 1))
            && restore > EXECUTE_MARGIN * seconds;
        may.then(|| self.checkpoints.get(&i).map(String::as_str))
            .flatten()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only outer-loop probes: restore where checkpoints are, one worker.
    Partial,
    /// Inner-loop probes: segments executed by several workers.
    Parallel,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Partial => "partial",
            Kind::Parallel => "parallel",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ReplayPlan {
    pub kind: Kind,
    pub workers: Vec<WorkerPlan>,
}

impl ReplayPlan {
    /// What to say of run `run_id`'s plan asked for `jobs` workers on
    /// `cores`: a parallel replay on one worker re-executes every selected
    /// iteration in turn, where `-j` would split them.
    pub fn note(&self, run_id: &str, jobs: usize, cores: usize) -> Option<String> {
        (self.kind == Kind::Parallel && jobs == 1 && cores > 1).then(|| {
            format!(
                "note: run {run_id}: every selected iteration re-executes; -j N splits them over N workers"
            )
        })
    }
}

/// What to replay of one run.
#[derive(Debug)]
pub struct Request<'a> {
    pub run_id: &'a str,
    pub loop_name: &'a str,
    /// The run's recorded iterations of `loop_name`.
    pub iterations: &'a [IterationRow],
    /// Checkpoints present in the run's store.
    pub in_store: &'a HashSet<String>,
    /// Whether each iteration is wanted (index = iteration); missing = no.
    pub selected: &'a [bool],
    /// New probes inside the inner loop: its steps must run.
    pub needs_inner: bool,
    /// New probes before the inner loop (or where that is unknown): a
    /// selected iteration must start from the state the previous one left,
    /// so the previous iteration is visited too (restored, then its code
    /// after the inner loop runs). Values a worker logs before the inner
    /// loop of an iteration whose predecessor it did not visit are dropped.
    pub needs_start: bool,
    /// The loop's checkpoints were taken at the end of iterations that ran
    /// no inner loop (one step each: minGPT's `while True`): nothing of an
    /// iteration is skipped by restoring it, so a probe anywhere in its body
    /// has it executed, and the selected iterations split over the workers.
    pub whole_iterations: bool,
    pub workers: usize,
}

impl Request<'_> {
    /// Whether every selected iteration's body must run (not only be restored).
    fn executes(&self) -> bool {
        self.needs_inner || (self.whole_iterations && self.needs_start)
    }
}

/// Plan a replay (see the module docs).
pub fn plan(req: &Request<'_>) -> Result<ReplayPlan> {
    let n = match req.iterations.iter().map(|r| r.idx).max() {
        Some(m) => m as usize + 1,
        None => {
            return Err(Error::invalid(
                "replay",
                format!(
                    "run {} recorded no iterations of loop '{}'",
                    req.run_id, req.loop_name
                ),
            ))
        }
    };
    let mut times = vec![0.0; n];
    let mut checkpoints: BTreeMap<u64, String> = BTreeMap::new();
    let restores: Vec<f64> = req
        .iterations
        .iter()
        .filter_map(|r| r.restore_seconds)
        .filter(|s| s.is_finite() && *s >= 0.0)
        .collect();
    let restore_seconds =
        (!restores.is_empty()).then(|| restores.iter().sum::<f64>() / restores.len() as f64);
    for r in req.iterations {
        times[r.idx as usize] = r.seconds;
        if let Some(c) = r.checkpoint.as_ref().filter(|c| req.in_store.contains(*c)) {
            checkpoints.insert(r.idx, c.clone());
        }
    }
    let wanted = |i: usize| req.selected.get(i).copied().unwrap_or(false);
    if !(0..n).any(wanted) {
        return Err(Error::invalid(
            "replay selection",
            format!("selects none of the {n} recorded iterations"),
        ));
    }
    // An executed iteration starts from its predecessor's state anyway (a
    // segment restores or executes the one before it); only then is the
    // predecessor of a one-step iteration not selected itself, so a
    // `--where` range logs no values before it.
    let widen = req.needs_start && !(req.whole_iterations && req.executes());
    let selected: Vec<bool> = (0..n)
        .map(|i| wanted(i) || (widen && wanted(i + 1)))
        .collect();
    let has_ck: Vec<bool> = (0..n as u64)
        .map(|i| checkpoints.contains_key(&i))
        .collect();
    let (kind, per_worker) = if req.executes() {
        let mut by_worker: BTreeMap<usize, BTreeMap<u64, Mode>> = BTreeMap::new();
        for s in schedule::plan_segments(n, &times, &has_ck, &selected, req.workers.max(1)) {
            let modes = by_worker.entry(s.worker).or_default();
            if let Some(r) = s.restore_from {
                modes.entry(r as u64).or_insert(Mode::Restore);
            }
            for i in s.pseudo_resume.chain(s.range) {
                modes.insert(i as u64, Mode::Execute);
            }
        }
        (Kind::Parallel, by_worker.into_values().collect::<Vec<_>>())
    } else {
        let mut modes: BTreeMap<u64, Mode> = BTreeMap::new();
        for (i, step) in schedule::plan_partial(n, &has_ck, &selected)
            .steps
            .into_iter()
            .enumerate()
        {
            let (mode, restore_from) = match step {
                PartialStep::Skip => continue,
                PartialStep::Restore => (Mode::Restore, None),
                PartialStep::Execute { restore_from } => (Mode::Execute, restore_from),
            };
            if let Some(r) = restore_from {
                modes.entry(r as u64).or_insert(Mode::Restore);
            }
            modes.insert(i as u64, mode);
        }
        (Kind::Partial, vec![modes])
    };
    let mut workers = Vec::with_capacity(per_worker.len());
    for (worker, modes) in per_worker.into_iter().enumerate() {
        let mut own = BTreeMap::new();
        let mut state_checks = BTreeMap::new();
        let mut seconds = BTreeMap::new();
        for (&i, &m) in &modes {
            if m == Mode::Restore && i > 0 && modes.contains_key(&(i - 1)) {
                seconds.insert(i, times[i as usize]);
            }
            if m != Mode::Restore {
                if let Some(name) = checkpoints.get(&i) {
                    state_checks.insert(i, name.clone());
                    seconds.insert(i, times[i as usize]);
                }
                continue;
            }
            let name = checkpoints.get(&i).ok_or_else(|| Error::NotFound {
                what: "checkpoint",
                name: format!("{}={i} of run {}", req.loop_name, req.run_id),
                location:
                    "the run's store (removed?); replay an earlier range with --where or re-record"
                        .into(),
            })?;
            own.insert(i, name.clone());
        }
        workers.push(WorkerPlan {
            run_id: req.run_id.into(),
            worker,
            loop_name: req.loop_name.into(),
            modes,
            checkpoints: own,
            progress_fd: None,
            log_db: None,
            replay_id: None,
            state_checks,
            exact: true,
            seconds,
            restore_seconds,
        });
    }
    let plan = ReplayPlan { kind, workers };
    check(req, &plan)?;
    Ok(plan)
}

/// The plan's promises, checked before any worker starts: a probe is
/// answered only by executing its code on the state it reads.
/// - Every selected iteration is visited; with probes inside the inner loop
///   it is executed (restoring it would answer them from a checkpoint).
/// - With probes before the inner loop, it is visited by a worker that also
///   visits the iteration before it (the state it starts from).
/// - A worker executes an iteration only right after visiting the previous
///   one, and restores only iterations it has a checkpoint for.
/// - A worker that executes an iteration the recording checkpointed
///   compares its state there with that checkpoint.
///
/// A violation is a planner bug: [`Error::Internal`], never a wrong value.
pub fn check(req: &Request<'_>, plan: &ReplayPlan) -> Result<()> {
    let bug = |what: String| {
        Err(Error::internal(format!(
            "replay plan of run {}: {what}",
            req.run_id
        )))
    };
    let n = req.iterations.iter().map(|r| r.idx + 1).max().unwrap_or(0);
    for i in 0..n {
        if !req.selected.get(i as usize).copied().unwrap_or(false) {
            continue;
        }
        let visits = |w: &&WorkerPlan| w.modes.contains_key(&i);
        if !plan.workers.iter().any(|w| visits(&w)) {
            return bug(format!("selected iteration {i} is not visited"));
        }
        if req.executes()
            && !plan
                .workers
                .iter()
                .any(|w| w.modes.get(&i) == Some(&Mode::Execute))
        {
            return bug(format!(
                "iteration {i} has probes in its inner loop but is not executed"
            ));
        }
        if req.needs_start
            && i > 0
            && !plan
                .workers
                .iter()
                .any(|w| w.modes.contains_key(&i) && w.modes.contains_key(&(i - 1)))
        {
            return bug(format!(
                "iteration {i} has probes before its inner loop but its start state is not visited"
            ));
        }
    }
    // The checkpoint the recording left after iteration i, if still stored.
    let recorded = |i: u64| {
        req.iterations
            .iter()
            .find(|r| r.idx == i)
            .and_then(|r| r.checkpoint.as_deref())
            .filter(|c| req.in_store.contains(*c))
    };
    for w in &plan.workers {
        for (&i, &mode) in &w.modes {
            match mode {
                Mode::Execute if i > 0 && !w.modes.contains_key(&(i - 1)) => {
                    return bug(format!(
                        "worker {} executes iteration {i} without the state before it",
                        w.worker
                    ));
                }
                Mode::Restore if !w.checkpoints.contains_key(&i) => {
                    return bug(format!(
                        "worker {} restores iteration {i} without a checkpoint",
                        w.worker
                    ));
                }
                Mode::Execute if recorded(i).is_some() && w.state_check(i) != recorded(i) => {
                    return bug(format!(
                        "worker {} executes iteration {i} without comparing its state with checkpoint {}",
                        w.worker,
                        recorded(i).unwrap_or_default()
                    ));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parallel_plan_on_one_worker_says_that_j_splits_it() {
        let plan = |kind| ReplayPlan {
            kind,
            workers: vec![],
        };
        let note = plan(Kind::Parallel).note("r1", 1, 4).unwrap();
        assert!(note.starts_with("note: run r1: every selected iteration re-executes; -j N"));
        assert_eq!(
            plan(Kind::Parallel).note("r1", 2, 4),
            None,
            "asked for workers"
        );
        assert_eq!(
            plan(Kind::Parallel).note("r1", 1, 1),
            None,
            "one core: nothing to split over"
        );
        assert_eq!(
            plan(Kind::Partial).note("r1", 1, 4),
            None,
            "restores: one worker is the plan"
        );
    }

    fn rows(n: u64, every: u64) -> Vec<IterationRow> {
        (0..n)
            .map(|i| IterationRow {
                value: None,
                loop_name: "epoch".into(),
                idx: i,
                seconds: 1.0,
                checkpoint: (i % every == 0).then(|| format!("r.epoch-{i:06}")),
                materialize_seconds: None,
                restore_seconds: None,
            })
            .collect()
    }

    fn store_of(rows: &[IterationRow]) -> HashSet<String> {
        rows.iter().filter_map(|r| r.checkpoint.clone()).collect()
    }

    #[test]
    fn a_plan_that_answers_an_inner_probe_from_a_checkpoint_is_refused() {
        let it = rows(4, 1);
        let store = store_of(&it);
        let selected = [false, false, true, false];
        let req = Request {
            run_id: "r",
            loop_name: "epoch",
            iterations: &it,
            in_store: &store,
            selected: &selected,
            needs_inner: true,
            needs_start: false,
            whole_iterations: false,
            workers: 1,
        };
        let mut p = plan(&req).unwrap();
        assert_eq!(p.workers[0].modes.get(&2), Some(&Mode::Execute));
        // The bug this guards against: iteration 2 restored instead of executed.
        p.workers[0].modes.insert(2, Mode::Restore);
        p.workers[0].checkpoints.insert(2, "r.epoch-000002".into());
        let e = check(&req, &p).unwrap_err();
        assert!(e.to_string().contains("not executed"), "{e}");
        // And one executing an iteration without the state before it.
        p.workers[0].modes.remove(&1);
        p.workers[0].modes.insert(2, Mode::Execute);
        let e = check(&req, &p).unwrap_err();
        assert!(e.to_string().contains("without the state before it"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(500))]
        /// Over loop shapes (lengths, checkpoint patterns, selections,
        /// probe places, worker counts), every plan keeps its promises.
        #[test]
        fn every_plan_executes_or_visits_what_its_probes_need(
            n in 1usize..40,
            ck in proptest::collection::vec(proptest::bool::ANY, 40),
            sel in proptest::collection::vec(proptest::bool::ANY, 40),
            needs_inner in proptest::bool::ANY,
            needs_start in proptest::bool::ANY,
            whole_iterations in proptest::bool::ANY,
            workers in 1usize..6,
            first in 0usize..40,
        ) {
            let it: Vec<IterationRow> = (0..n as u64)
                .map(|i| IterationRow {
                    value: None,
                    loop_name: "epoch".into(),
                    idx: i,
                    seconds: 1.0 + (i % 3) as f64,
                    checkpoint: ck[i as usize].then(|| format!("r.epoch-{i:06}")),
                    materialize_seconds: None,
                    restore_seconds: None,
                })
                .collect();
            let store = store_of(&it);
            let mut selected: Vec<bool> = sel[..n].to_vec();
            selected[first % n] = true;
            let req = Request {
                run_id: "r",
                loop_name: "epoch",
                iterations: &it,
                in_store: &store,
                selected: &selected,
                needs_inner,
                needs_start,
                whole_iterations,
                workers,
            };
            // plan() checks itself: an Err here is a broken promise.
            let p = plan(&req).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            proptest::prop_assert!(check(&req, &p).is_ok());
            // However costly a restore, an iteration executed instead of
            // restored starts from its predecessor's state and is compared
            // with the checkpoint it replaces.
            for w in &p.workers {
                for (&i, &m) in &w.modes {
                    if let Some(c) = w.execute_instead(i, Some(f64::MAX)) {
                        proptest::prop_assert_eq!(m, Mode::Restore);
                        proptest::prop_assert!(i > 0 && w.modes.contains_key(&(i - 1)));
                        proptest::prop_assert_eq!(Some(c), w.checkpoints.get(&i).map(String::as_str));
                    }
                }
            }
        }
    }

    #[test]
    fn a_restore_dearer_than_the_iteration_is_replaced_by_executing_it() {
        let mut it = rows(4, 1);
        let store = store_of(&it);
        let req = |it: &[IterationRow]| {
            plan(&Request {
                run_id: "r",
                loop_name: "epoch",
                iterations: it,
                in_store: &store,
                selected: &[true; 4],
                needs_inner: false,
                needs_start: false,
                whole_iterations: false,
                workers: 1,
            })
            .unwrap()
        };
        let p = req(&it);
        let w = &p.workers[0];
        // Nothing measured yet: restore, and measure.
        assert_eq!(w.execute_instead(2, None), None);
        // A restore measured dearer than twice the recorded 1 s iteration.
        assert_eq!(w.execute_instead(2, Some(2.5)), Some("r.epoch-000002"));
        // About as dear, or cheaper: restored (executing must also check).
        assert_eq!(w.execute_instead(2, Some(1.5)), None);
        assert_eq!(w.execute_instead(2, Some(0.5)), None);
        // Never the first iteration (its start state is set before its code runs).
        assert_eq!(w.execute_instead(0, Some(9.0)), None);
        // Earlier replays' measurements are the prior.
        it[1].restore_seconds = Some(4.0);
        it[3].restore_seconds = Some(2.0);
        let p = req(&it);
        assert_eq!(p.workers[0].restore_seconds, Some(3.0));
        assert_eq!(
            p.workers[0].execute_instead(1, None),
            Some("r.epoch-000001")
        );
        // A worker not running as recorded restores: only then is the state exact.
        let mut w = p.workers[0].clone();
        w.exact = false;
        assert_eq!(w.execute_instead(1, Some(9.0)), None);
    }

    #[test]
    fn outer_probes_restore_every_checkpointed_iteration() {
        let it = rows(5, 1);
        let store = store_of(&it);
        let p = plan(&Request {
            run_id: "r",
            loop_name: "epoch",
            iterations: &it,
            in_store: &store,
            selected: &[true; 5],
            needs_inner: false,
            needs_start: false,
            whole_iterations: false,
            workers: 1,
        })
        .unwrap();
        assert_eq!(p.kind, Kind::Partial);
        let w = &p.workers[0];
        assert!(w.modes.values().all(|m| *m == Mode::Restore));
        assert_eq!(w.checkpoints.len(), 5);
        // The JSON the worker reads round-trips.
        assert_eq!(&WorkerPlan::from_json(&w.to_json().unwrap()).unwrap(), w);
        assert!(w.to_json().unwrap().contains(r#""0":"restore""#));
    }

    #[test]
    fn missing_checkpoints_are_recomputed_and_a_removed_one_is_an_error() {
        let it = rows(5, 2); // checkpoints at 0, 2, 4
        let store = store_of(&it);
        let req = |store: &HashSet<String>, sel: &[bool]| {
            plan(&Request {
                run_id: "r",
                loop_name: "epoch",
                iterations: &it,
                in_store: store,
                selected: sel,
                needs_inner: false,
                needs_start: false,
                whole_iterations: false,
                workers: 1,
            })
        };
        let p = req(&store, &[true; 5]).unwrap();
        let m = &p.workers[0].modes;
        assert_eq!(m[&1], Mode::Execute);
        assert_eq!(m[&3], Mode::Execute);
        assert_eq!(m[&4], Mode::Restore);
        // Nothing selected: a clear error.
        assert!(matches!(
            req(&store, &[false; 5]),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn inner_probes_split_over_workers() {
        let it = rows(8, 1);
        let store = store_of(&it);
        let req = Request {
            run_id: "r",
            loop_name: "epoch",
            iterations: &it,
            in_store: &store,
            selected: &[true; 8],
            needs_inner: true,
            needs_start: false,
            whole_iterations: false,
            workers: 2,
        };
        let p = plan(&req).unwrap();
        assert_eq!(p.kind, Kind::Parallel);
        assert_eq!(p.workers.len(), 2);
        let executed: usize = p
            .workers
            .iter()
            .map(|w| w.modes.values().filter(|m| **m == Mode::Execute).count())
            .sum();
        assert_eq!(executed, 8, "each selected iteration executed once");
        for w in &p.workers {
            for (i, m) in &w.modes {
                assert_eq!(*m == Mode::Restore, w.checkpoints.contains_key(i));
                // Every executed iteration proves its state against its checkpoint.
                let name = format!("r.epoch-{i:06}");
                let want = (*m == Mode::Execute).then_some(name.as_str());
                assert_eq!(w.state_check(*i), want);
            }
            // A worker not running as recorded (another thread count) cannot be bit-exact.
            let inexact = WorkerPlan {
                exact: false,
                ..w.clone()
            };
            assert!(inexact
                .modes
                .keys()
                .all(|i| inexact.state_check(*i).is_none()));
        }
        // A plan whose worker skips a state check is a planner bug.
        let mut bad = p.clone();
        bad.workers[1].state_checks.clear();
        let err = check(&req, &bad).unwrap_err().to_string();
        assert!(err.contains("without comparing its state"), "{err}");
    }

    #[test]
    fn probes_before_the_inner_loop_visit_the_previous_iteration_too() {
        let it = rows(6, 1);
        let store = store_of(&it);
        let visited = |only: usize, needs_start| {
            let mut sel = [false; 6];
            sel[only] = true;
            let p = plan(&Request {
                run_id: "r",
                loop_name: "epoch",
                iterations: &it,
                in_store: &store,
                selected: &sel,
                needs_inner: false,
                needs_start,
                whole_iterations: false,
                workers: 1,
            })
            .unwrap();
            assert!(p.workers[0].modes.values().all(|m| *m == Mode::Restore));
            p.workers[0].modes.keys().copied().collect::<Vec<_>>()
        };
        assert_eq!(visited(3, false), vec![3]);
        // Before the inner loop: iteration 3 starts where 2 ended, so 2 is
        // restored and its code after the inner loop runs first.
        assert_eq!(visited(3, true), vec![2, 3]);
        // Iteration 0 has no predecessor.
        assert_eq!(visited(0, true), vec![0]);
    }

    #[test]
    fn a_probe_in_the_body_of_one_step_iterations_splits_them_over_the_workers() {
        // minGPT's `while True`: a checkpoint every 4th iteration, each at
        // the end of an iteration that ran no inner loop. A probe in the body
        // (before any inner loop: needs_start) cannot be answered by a
        // restore, so each selected iteration runs, on one of the workers.
        let it = rows(40, 4);
        let store = store_of(&it);
        let req = Request {
            run_id: "r",
            loop_name: "epoch",
            iterations: &it,
            in_store: &store,
            selected: &[true; 40],
            needs_inner: false,
            needs_start: true,
            whole_iterations: true,
            workers: 2,
        };
        let p = plan(&req).unwrap();
        assert_eq!(p.kind, Kind::Parallel);
        assert_eq!(p.workers.len(), 2);
        let executed: usize = p
            .workers
            .iter()
            .map(|w| w.modes.values().filter(|m| **m == Mode::Execute).count())
            .sum();
        assert!(executed >= 40 - 1, "{executed}");
        // The second worker starts from a checkpoint, and knows what each
        // checked iteration cost to record (how far apart its checks go).
        let second = &p.workers[1];
        assert_eq!(second.modes.values().next(), Some(&Mode::Restore));
        for i in second.state_checks.keys() {
            assert!(second.seconds.contains_key(i), "{i}");
        }
        // Recorded with an inner loop, the same probe is answered by
        // restores on one worker.
        let p = plan(&Request {
            whole_iterations: false,
            ..req
        })
        .unwrap();
        assert_eq!(p.kind, Kind::Partial);
    }
}
