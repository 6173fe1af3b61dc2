//! Deleting a recorded run: its checkpoints (in the store it wrote to), then
//! its rows (logs and iterations go with it). Checkpoints first: a crash in
//! between leaves a run without checkpoints (replay recomputes), never
//! checkpoints that no run names.

use std::path::Path;

use crate::checkpoint::naming;
use crate::checkpoint::store::Store;
use crate::error::{Error, Result};
use crate::runs::db::{LogDb, RunStatus};
use crate::runs::lease::{self, Holder};
use crate::runs::resume::{alive, Here};

/// What [`remove_run`] deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Checkpoint names removed (their space returns with gc).
    pub checkpoints: Vec<String>,
    /// The store they were in (None: the run's store does not exist).
    pub store: Option<String>,
}

/// `what` (run `run_id`, or one of its checkpoints) cannot be removed while
/// a process holds the run ([`lease`]): a replay reading it, or, for the
/// whole run, a recording (one of its older checkpoints may go: the
/// recording's resume walks past a missing one).
pub fn refuse_if_held(home: &Path, run_id: &str, what: &str, whole_run: bool) -> Result<()> {
    let why = match lease::holder(home, run_id)? {
        None => return Ok(()),
        Some(Holder::Recording(_)) if !whole_run => return Ok(()),
        Some(Holder::Replays) => {
            "it is being replayed (hindsight replay); remove it once that ends".to_string()
        }
        Some(Holder::Recording(who)) => format!("a recording holds it ({who}); stop it first"),
    };
    Err(Error::invalid(format!("rm of {what}"), why))
}

/// Delete run `run_id`: its checkpoints from the run's store (`default_store`
/// when it recorded none) and its database rows. A run still running here,
/// or held by a replay or a recording of this home, is refused.
pub fn remove_run(db: &LogDb, home: &Path, run_id: &str, default_store: &str) -> Result<Removed> {
    let run = db.run(run_id)?;
    refuse_if_held(home, run_id, &format!("run {run_id}"), true)?;
    if run.status == RunStatus::Running && run.host == Here::current().host && alive(run.pid) {
        return Err(Error::invalid(
            "run",
            format!(
                "run {run_id} is still running (pid {}); stop it first",
                run.pid
            ),
        ));
    }
    let location = run
        .store
        .clone()
        .unwrap_or_else(|| default_store.to_string());
    let mut removed = Removed::default();
    match Store::open_url(&location, false, None) {
        Ok(store) => {
            for id in naming::with_prefix(&store.list()?, run_id) {
                let name = id.name();
                match store.remove(&name) {
                    Ok(()) | Err(Error::NotFound { .. }) => removed.checkpoints.push(name),
                    Err(e) => return Err(e),
                }
            }
            removed.store = Some(store.location());
        }
        Err(Error::NotFound { .. }) => {}
        Err(e) => return Err(e),
    }
    db.delete_run(run_id)?;
    Ok(removed)
}
