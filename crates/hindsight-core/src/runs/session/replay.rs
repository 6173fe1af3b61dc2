//! A replay worker's session: the execution of its [`WorkerPlan`], and the
//! proofs that what it computes is what was recorded.

use std::collections::BTreeMap;

use super::{BlockStart, Phase, Visit};
use crate::error::{Error, Result};
use crate::runs::replay::{Mode, WorkerPlan, CHECK_SPACING};

/// What to do once an iteration's steps ended (or were restored).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockEnd {
    Nothing,
    /// An iteration without an inner loop, to be restored: its body ran;
    /// put the named checkpoint (the state after it) back.
    Restore {
        checkpoint: String,
    },
    /// Compare the state now with the named checkpoint; stop where it differs.
    Check {
        checkpoint: String,
    },
}

#[derive(Clone, Debug)]
pub struct ReplaySession {
    plan: WorkerPlan,
    loop_name: String,
    phase: Phase,
    /// The plan's modes, where an iteration executed instead of restored
    /// (the cost rule) becomes `Execute`.
    modes: BTreeMap<u64, Mode>,
    /// Iterations executed instead of restored -> the checkpoint they replace.
    instead: BTreeMap<u64, String>,
    last_visited: Option<u64>,
    restore_secs: Vec<f64>,
    /// Times of the state checks so far (`checked`).
    check_secs: Vec<f64>,
    /// The last iteration a one-step body's state was checked at
    /// (`block_end`'s sparse checks).
    last_check: Option<u64>,
    /// The recorded batch fingerprints of the iteration under way.
    expected: BTreeMap<u64, String>,
    steps_executed: u64,
    /// Iterations without an inner loop whose body this worker executed.
    bodies_executed: u64,
    /// The iteration under way ran an inner loop (`block_start`).
    inner_seen: bool,
    restored: u64,
    past_plan: bool,
    cost_rule: bool,
}

impl ReplaySession {
    pub fn new(plan: WorkerPlan) -> ReplaySession {
        ReplaySession {
            loop_name: plan.loop_name.clone(),
            modes: plan.modes.clone(),
            plan,
            phase: Phase::Idle,
            instead: BTreeMap::new(),
            last_visited: None,
            restore_secs: Vec::new(),
            check_secs: Vec::new(),
            last_check: None,
            expected: BTreeMap::new(),
            steps_executed: 0,
            bodies_executed: 0,
            inner_seen: false,
            restored: 0,
            past_plan: false,
            cost_rule: true,
        }
    }

    /// Whether an iteration may be executed instead of restored where that
    /// costs less ([`WorkerPlan::execute_instead`]). A front end that cannot
    /// compare the executed state with the checkpoint it replaces turns it
    /// off: an unchecked execution would be trusted blindly.
    pub fn set_cost_rule(&mut self, on: bool) {
        self.cost_rule = on;
    }

    /// The last iteration the plan needs.
    pub fn last_needed(&self) -> Option<u64> {
        self.plan.last_needed()
    }

    pub fn plan(&self) -> &WorkerPlan {
        &self.plan
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The plan ended before the loop did: what the code after the loop
    /// logs describes this worker's last iteration, not the run's end, so
    /// it is no result (the last worker's is).
    pub fn past_plan(&self) -> bool {
        self.past_plan
    }

    pub fn outer_start(&mut self, loop_name: &str) {
        self.loop_name = loop_name.to_string();
        self.phase = Phase::Between;
    }

    pub fn iteration_start(&mut self, i: u64) -> Result<Visit> {
        if self.plan.last_needed().is_none_or(|last| i > last) {
            self.past_plan = true;
            self.phase = Phase::Ended;
            return Ok(Visit::Stop);
        }
        let Some(&mode) = self.modes.get(&i) else {
            return Ok(Visit::Skip);
        };
        let stale = i > 0 && self.last_visited != Some(i - 1);
        self.last_visited = Some(i);
        self.phase = Phase::Iteration(i);
        self.inner_seen = false;
        if stale && mode == Mode::Execute {
            // The plan visits the predecessor of every executed iteration.
            return Err(Error::internal(format!(
                "replay plan executes {} {i} without the state before it",
                self.loop_name
            )));
        }
        Ok(if stale {
            Visit::RunStale
        } else if i == 0 && mode == Mode::Execute {
            Visit::RunFromStart
        } else {
            Visit::Run
        })
    }

    /// Checkpoints that hold the recording's start RNG states (any of the
    /// plan's: each recording checkpoint keeps them).
    pub fn start_state_sources(&self) -> Vec<String> {
        let restored = self.plan.checkpoints.values().cloned();
        let checked = self
            .modes
            .keys()
            .filter_map(|&i| self.plan.state_check(i).map(str::to_string));
        restored.chain(checked).collect()
    }

    /// `expected`: the batch fingerprints the recording consumed in this iteration.
    pub fn block_start(&mut self, i: u64, expected: BTreeMap<u64, String>) -> Result<BlockStart> {
        self.expected = expected;
        self.inner_seen = true;
        if self.modes.get(&i) != Some(&Mode::Restore) {
            self.phase = Phase::Steps(i);
            return Ok(BlockStart::Run);
        }
        let measured = (!self.restore_secs.is_empty())
            .then(|| self.restore_secs.iter().sum::<f64>() / self.restore_secs.len() as f64);
        if let Some(name) = self
            .plan
            .execute_instead(i, measured)
            .filter(|_| self.cost_rule)
        {
            self.instead.insert(i, name.to_string());
            self.modes.insert(i, Mode::Execute);
            self.phase = Phase::Steps(i);
            return Ok(BlockStart::Run);
        }
        Ok(BlockStart::Restore {
            checkpoint: self.checkpoint(i)?,
        })
    }

    /// Step `j` of iteration `i` is about to run on a batch of fingerprint `digest`.
    pub fn step(&mut self, i: u64, j: u64, digest: &str) -> Result<()> {
        self.steps_executed += 1;
        match self.expected.get(&j) {
            Some(want) if want != digest => Err(self.diverged(
                format!("{} {i}, step {j}", self.loop_name),
                format!(
                    "the batch at {} {i}, step {j} differs from the one the recording consumed: the data \
                     order or content is not what was recorded (data changed on disk, a loader drawing from \
                     a generator that is not checkpointed, or an iterator created before hs.loop that the \
                     restored state does not re-create)",
                    self.loop_name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether to compare the state after one-step iteration `i` with its
    /// checkpoint: a check costs about what a restore does, so one is made
    /// once the recorded compute since the last check (estimated as the
    /// iterations since it times this one's seconds) reaches
    /// [`CHECK_SPACING`] times its cost, and always at the last checkpoint
    /// this worker visits; while no cost is known, at every one. A
    /// divergence in the state persists to the next check (the weights
    /// carry it); the values logged meanwhile are compared with the
    /// recording where it has them.
    fn sparse_check(&self, i: u64) -> bool {
        let newest = |m: &BTreeMap<u64, String>| m.keys().next_back().copied();
        let last = newest(&self.plan.checkpoints).max(newest(&self.plan.state_checks)) == Some(i);
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let cost = mean(&self.check_secs)
            .or_else(|| mean(&self.restore_secs))
            .or(self.plan.restore_seconds);
        let (Some(cost), Some(&secs)) = (cost, self.plan.seconds.get(&i)) else {
            return true;
        };
        let since = i - self
            .last_check
            .map_or(self.plan.modes.keys().next().copied().unwrap_or(0), |c| c);
        last || since as f64 * secs >= CHECK_SPACING * cost
    }

    /// A state check took `secs` (`sparse_check`'s measure).
    pub fn checked(&mut self, secs: f64) {
        if secs.is_finite() && secs >= 0.0 {
            self.check_secs.push(secs);
        }
    }

    /// A checkpoint was put back in `secs` (the cost rule's measure).
    pub fn restored(&mut self, secs: f64) {
        self.restored += 1;
        self.restore_secs.push(secs);
    }

    pub fn block_end(&mut self, i: u64, at_iteration: bool) -> Result<BlockEnd> {
        self.phase = Phase::Iteration(i);
        if at_iteration && self.modes.get(&i) == Some(&Mode::Restore) {
            // No inner loop to skip (one step per iteration): the body ran.
            // From the recorded state before it (this worker, running as
            // recorded, visited i - 1), it computed the checkpoint's state:
            // restoring would only cost a read, so the iteration counts as
            // executed and is compared now and then (`sparse_check`).
            // Otherwise the state after it is put back from the checkpoint.
            let checkpoint = self.checkpoint(i)?;
            if self.cost_rule && self.plan.exact && i > 0 && self.modes.contains_key(&(i - 1)) {
                self.modes.insert(i, Mode::Execute);
                return Ok(if self.sparse_check(i) {
                    self.last_check = Some(i);
                    BlockEnd::Check { checkpoint }
                } else {
                    BlockEnd::Nothing
                });
            }
            return Ok(BlockEnd::Restore { checkpoint });
        }
        if let Some(planned) = self.plan.state_check(i) {
            // An executed one-step iteration is compared as sparsely as one
            // executed instead of restored, for the same reason.
            if at_iteration && !self.sparse_check(i) {
                return Ok(BlockEnd::Nothing);
            }
            self.last_check = Some(i);
            return Ok(BlockEnd::Check {
                checkpoint: planned.to_string(),
            });
        }
        Ok(self
            .instead
            .get(&i)
            .map_or(BlockEnd::Nothing, |checkpoint| BlockEnd::Check {
                checkpoint: checkpoint.clone(),
            }))
    }

    /// The state after iteration `i` differs from checkpoint `name` at `path`.
    pub fn state_differs(&self, i: u64, name: &str, path: &str, detail: &str) -> Error {
        self.diverged(
            format!("{} {i}: {path}", self.loop_name),
            format!(
                "after {} {i}, the state differs from the recorded checkpoint {name} at '{path}': {detail} \
                 (what changes it in this replay and not in the recording is not restored or not deterministic)",
                self.loop_name
            ),
        )
    }

    /// A value this replay logged differs from the recorded one.
    pub fn value_differs(&self, name: &str, at: &str, recorded: &str, replayed: &str) -> Error {
        self.diverged(
            format!("{name} at {at}"),
            format!("{name} at {at}: recorded {recorded}, replayed {replayed}"),
        )
    }

    /// Iteration `i` is over: the progress line for the driver (the worker protocol of `runs::replay`).
    pub fn iteration_end(&mut self, i: u64) -> String {
        if !std::mem::take(&mut self.inner_seen) && self.modes.get(&i) == Some(&Mode::Execute) {
            self.bodies_executed += 1;
        }
        self.phase = Phase::Between;
        format!("{i}\n")
    }

    /// The worker's last progress line; `run_secs`: its time from the
    /// outer loop's start to its end (the rest of its life is start-up).
    pub fn summary(&mut self, run_secs: f64) -> String {
        self.phase = Phase::Finished;
        let restore = self.restore_secs.iter().fold(0.0, |a, b| a + b);
        format!(
            "steps {} bodies {} restored {} restore_s {restore:.6} run_s {:.6}\n",
            self.steps_executed,
            self.bodies_executed,
            self.restored,
            run_secs.max(0.0)
        )
    }

    pub fn steps_executed(&self) -> u64 {
        self.steps_executed
    }

    pub fn restored_count(&self) -> u64 {
        self.restored
    }

    fn checkpoint(&self, i: u64) -> Result<String> {
        self.plan.checkpoints.get(&i).cloned().ok_or_else(|| {
            Error::internal(format!(
                "replay plan has no checkpoint for {} {i}",
                self.loop_name
            ))
        })
    }

    fn diverged(&self, at: String, detail: String) -> Error {
        Error::Diverged {
            what: "replay".into(),
            run: self.plan.run_id.clone(),
            at,
            detail,
        }
    }
}
