//! The run session: the lifecycle of one recording or replaying process as
//! a state machine. The front ends (`hs.loop`, the Lightning callback)
//! translate what their loops do into events; the session answers each with
//! the action to take (visit, skip, restore a checkpoint, resume at a step,
//! save now, exit with a code, check the state against a checkpoint). Every
//! decision of the lifecycle has its owner here:
//!
//! - the resume point, and how each iteration is treated on the way to it;
//! - when to checkpoint (`every` or the adaptive policy, [`CheckpointSchedule`]);
//! - the preemption sequence (signal -> save at the next boundary -> exit code);
//! - retention, keep-best included, and when it is applied;
//! - the replay plan's execution ([`ReplaySession`]) and its proofs: each
//!   batch's fingerprint, each state check, the worker's progress lines.
//!
//! The front ends keep the plumbing: capturing and applying state, frames,
//! iterators. Nothing here touches a store or a database, so every decision
//! is unit-tested over loop shapes, signals at every boundary and plans.
//!
//! ```text
//!            outer_start
//!   Idle ───────────────► Between ◄──────────────────────────┐
//!                           │ iteration_start(i)             │
//!                           │   Skip ──► Between             │ iteration_end(i)
//!                           │   Stop ──► Ended               │   (save .end, exit on a signal)
//!                           ▼   Run/Rerun/Restore            │
//!                         Iteration(i) ──────────────────────┤
//!                           │ block_start(i)                 │
//!                           │   Restore ──► Iteration(i)     │
//!                           ▼   Run/ResumeSteps              │
//!                         Steps(i) ──step_boundary(i,j)──┐   │
//!                           │      (save .step-j, exit)  │   │
//!                           │◄───────────────────────────┘   │
//!                           │ block_end(i) (save, check)     │
//!                           └────────► Iteration(i) ─────────┘
//!   any ──outer_end──► Ended ──finish(status)──► Finished
//! ```

pub mod record;
pub mod replay;
#[cfg(test)]
mod tests;

pub use record::{BlockSave, Finish, IterationEnd, RecordSession, StepAction};
pub use replay::{BlockEnd, ReplaySession};

use crate::checkpoint::naming::{CheckpointId, Kind};
use crate::error::{Error, Result};

/// Where the session is in the loops (the diagram's states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Before the outer loop starts.
    Idle,
    /// Between two outer iterations.
    Between,
    /// In outer iteration `i`, outside its steps.
    Iteration(u64),
    /// In the training steps of outer iteration `i`.
    Steps(u64),
    /// The outer loop ended (ran out, or a replay's plan did).
    Ended,
    /// The run finished (completed, failed or interrupted).
    Finished,
}

/// What to do with an outer iteration about to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Visit {
    /// Run it.
    Run,
    /// Run it, but it does not start from the state its predecessor left
    /// (that one was skipped): what it logs before its steps would describe
    /// the wrong state, so those values are dropped until the steps restore
    /// or rebuild the state.
    RunStale,
    /// Run the first iteration from the RNG states the recording's first
    /// iteration began with (kept in every checkpoint as `start_rng`).
    RunFromStart,
    /// Resumed inside this iteration: run the code before its steps again
    /// from the RNG states and loop variables it began with (in the named
    /// checkpoint); what it logs there was logged already and is dropped.
    Rerun { checkpoint: String },
    /// Put the whole named checkpoint back (the iteration before this one
    /// ended in it), then run this one.
    Restore { checkpoint: String },
    /// Do not run it: its effect is in a checkpoint restored later.
    Skip,
    /// Leave the loop: nothing after this is needed.
    Stop,
}

impl Visit {
    /// Whether what is logged before the steps is dropped.
    pub fn stale(&self) -> bool {
        matches!(self, Visit::RunStale | Visit::Rerun { .. })
    }
}

/// What to do with an iteration's training steps about to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockStart {
    /// Run them from the first.
    Run,
    /// Do not run them: put the named checkpoint (the state after them) back.
    Restore { checkpoint: String },
    /// Put the named checkpoint back and go on at step `step` (the steps
    /// before it ran before the interruption).
    ResumeSteps { checkpoint: String, step: u64 },
}

/// A recording's resume point: the newest of its checkpoints that reads back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumePoint {
    pub name: String,
    pub index: u64,
    pub kind: Kind,
}

impl ResumePoint {
    /// `at_iteration_end`: the checkpoint was taken at the end of an outer
    /// iteration that has no inner loop, so it holds the whole iteration.
    pub fn new(name: &str, at_iteration_end: bool) -> Result<ResumePoint> {
        let id = CheckpointId::parse(name).ok_or_else(|| {
            Error::invalid(
                "resume checkpoint",
                format!("{name:?} is not a checkpoint name"),
            )
        })?;
        let kind = match id.kind {
            Kind::Block if at_iteration_end => Kind::End,
            k => k,
        };
        Ok(ResumePoint {
            name: name.to_string(),
            index: id.index,
            kind,
        })
    }

    /// The first iteration whose body runs again.
    fn first_to_run(&self) -> u64 {
        match self.kind {
            Kind::End => self.index + 1,
            _ => self.index,
        }
    }
}
