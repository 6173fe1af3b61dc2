//! Where a project's things are (`hindsight_core::runs::project`), for the Python
//! layer: the same rule the CLI uses, from one place.

use std::path::PathBuf;

use hindsight_core::runs::{project, ranks};
use hindsight_core::{Error, Location, Store};
use pyo3::prelude::*;

use crate::interrupt;

/// A project home and the files in it.
#[pyclass(module = "hindsight._native", name = "ProjectPaths", frozen)]
#[derive(Debug)]
pub(crate) struct ProjectPaths {
    #[pyo3(get)]
    home: PathBuf,
    /// The run database (`<home>/logs.db`).
    #[pyo3(get)]
    db: PathBuf,
    /// The default checkpoint store (`<home>/store`).
    #[pyo3(get)]
    store: PathBuf,
}

impl ProjectPaths {
    fn of(home: PathBuf) -> Self {
        ProjectPaths {
            db: project::db_path(&home),
            store: project::store_path(&home),
            home,
        }
    }
}

/// The project of a program started in `start`: `$HINDSIGHT_HOME`, else
/// `.hindsight` at the enclosing git work tree, else in `start`. An explicit
/// `home` wins over both.
#[pyfunction]
#[pyo3(signature = (start, home=None))]
pub(crate) fn project_paths(start: PathBuf, home: Option<PathBuf>) -> ProjectPaths {
    ProjectPaths::of(home.unwrap_or_else(|| project::project_home(&start)))
}

/// Names of the complete checkpoints at `location` (a directory or
/// `s3://...`); empty when no store is there. Opens no writer and creates nothing.
#[pyfunction]
pub(crate) fn checkpoint_names(py: Python<'_>, location: String) -> PyResult<Vec<String>> {
    interrupt::run(py, move |_| match Store::open_url(&location, false, None) {
        Ok(store) => store.list(),
        Err(Error::NotFound { .. }) => Ok(Vec::new()),
        Err(e) => Err(e),
    })
}

/// The metadata of checkpoint `name` at `location` (its manifest, verified;
/// no entry is read). Opens no writer and creates nothing.
#[pyfunction]
pub(crate) fn checkpoint_meta(
    py: Python<'_>,
    location: String,
    name: String,
) -> PyResult<std::collections::BTreeMap<String, String>> {
    interrupt::run(py, move |_| {
        let store = Store::open_url(&location, false, None)?;
        Ok::<_, Error>(store.manifest(&name)?.meta)
    })
}

/// A store location as the engine reads it: `s3://bucket/prefix` without a
/// trailing slash, or an absolute directory. `what` names the argument in
/// the error; `local` requires a directory.
#[pyfunction]
#[pyo3(signature = (location, what, local=false))]
pub(crate) fn store_location(location: &str, what: &str, local: bool) -> PyResult<String> {
    let parsed = if local {
        Location::parse_local(location, what).map(Location::Local)
    } else {
        Location::parse(location, what)
    };
    Ok(parsed.map_err(crate::errors::to_py)?.to_string())
}

/// Which store a run writes to, and through which local directory (core
/// `runs::store_choice`: the one rule every front end asks).
#[pyclass(module = "hindsight._native", name = "StoreChoice", frozen)]
#[derive(Debug)]
pub(crate) struct PyStoreChoice {
    #[pyo3(get)]
    location: String,
    #[pyo3(get)]
    local_first: Option<String>,
    /// The store asked for that a resumed run does not take.
    #[pyo3(get)]
    declined: Option<String>,
}

/// The store of a run in project `home`: the `recorded` one (resumed,
/// replayed), else `explicit` (given in code), else `$HINDSIGHT_STORE`,
/// else `<home>/store`; `local_first` (code), else `$HINDSIGHT_LOCAL_FIRST`.
#[pyfunction]
#[pyo3(signature = (home, recorded=None, explicit=None, local_first=None, replay=false))]
pub(crate) fn choose_store(
    home: PathBuf,
    recorded: Option<&str>,
    explicit: Option<&str>,
    local_first: Option<&str>,
    replay: bool,
) -> PyResult<PyStoreChoice> {
    use hindsight_core::runs::store_choice::{self, StoreAsk};
    use hindsight_core::settings::{LOCAL_FIRST, STORE};

    let ask = StoreAsk {
        recorded,
        explicit,
        local_first,
        replay,
    };
    let c = store_choice::choose_store(ask, &home, STORE.raw(), LOCAL_FIRST.raw())
        .map_err(crate::errors::to_py)?;
    Ok(PyStoreChoice {
        location: c.location,
        local_first: c.local_first,
        declined: c.declined,
    })
}

/// The exit code that tells a batch system "checkpointed, reschedule me":
/// `explicit`, else HTCondor's CheckpointExitCode, else
/// `$HINDSIGHT_EXIT_CODE`, else 85 (the engine's one rule).
#[pyfunction]
#[pyo3(signature = (explicit=None))]
pub(crate) fn checkpoint_exit_code(explicit: Option<i32>) -> PyResult<i32> {
    hindsight_core::runs::preempt::exit_code(explicit).map_err(crate::errors::to_py)
}

/// This process's place in a multi-process launch (core `runs::ranks::World`).
#[pyclass(module = "hindsight._native", name = "World", frozen)]
#[derive(Debug)]
pub(crate) struct World {
    #[pyo3(get)]
    rank: u64,
    #[pyo3(get)]
    size: u64,
    /// The launcher's variables it was read from, for messages.
    #[pyo3(get)]
    source: &'static str,
    /// "torchrun" or "srun", which a recording notes for its replay.
    #[pyo3(get)]
    launcher: &'static str,
    /// Whether this rank owns the job's run (rank 0).
    #[pyo3(get)]
    leads: bool,
}

/// The launch this process is part of (`torchrun`, `srun`), or `None`; a
/// bad launcher variable is an error naming it.
#[pyfunction]
pub(crate) fn launch_world() -> PyResult<Option<World>> {
    let world = ranks::World::from_env().map_err(crate::errors::to_py)?;
    Ok(world.map(|w| World {
        leads: w.leads(),
        rank: w.rank,
        size: w.size,
        source: w.source,
        launcher: w.launcher,
    }))
}

/// How a launch of `now` ranks resumes from `checkpoint`, saved by `saved`
/// ranks (`None`: one process): "same", "reshard" or "skip"; another size
/// not opted into (`reshard`) is refused (core `runs::ranks::resume_fit`).
#[pyfunction]
#[pyo3(signature = (checkpoint, saved, now, reshard))]
pub(crate) fn resume_fit(
    checkpoint: &str,
    saved: Option<u64>,
    now: u64,
    reshard: bool,
) -> PyResult<&'static str> {
    let fit = ranks::resume_fit(checkpoint, saved, now, reshard).map_err(crate::errors::to_py)?;
    Ok(match fit {
        ranks::WorldFit::Same => "same",
        ranks::WorldFit::Reshard => "reshard",
        ranks::WorldFit::Skip => "skip",
        other => {
            return Err(crate::errors::to_py(
                hindsight_core::error::Error::Internal {
                    detail: format!("resume_fit: {other:?} has no name here"),
                },
            ))
        }
    })
}

/// Refuse a replay worker of `run_id` launched on `now` ranks when the run
/// was recorded on another number (core `runs::ranks`).
#[pyfunction]
#[pyo3(signature = (run_id, versions_json, now, restores_only))]
pub(crate) fn check_replay_world(
    run_id: &str,
    versions_json: &str,
    now: u64,
    restores_only: bool,
) -> PyResult<&'static str> {
    match ranks::check_replay_world(run_id, versions_json, now, restores_only) {
        Ok(ranks::ReplayWorld::Recorded) => Ok("recorded"),
        Ok(ranks::ReplayWorld::OneProcess) => Ok("one_process"),
        Err(e) => Err(crate::errors::to_py(e)),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProjectPaths>()?;
    m.add_function(wrap_pyfunction!(project_paths, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_names, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_meta, m)?)?;
    m.add_function(wrap_pyfunction!(store_location, m)?)?;
    m.add_class::<PyStoreChoice>()?;
    m.add_function(wrap_pyfunction!(choose_store, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_exit_code, m)?)?;
    m.add_class::<World>()?;
    m.add_function(wrap_pyfunction!(launch_world, m)?)?;
    m.add_function(wrap_pyfunction!(resume_fit, m)?)?;
    m.add_function(wrap_pyfunction!(check_replay_world, m)?)?;
    Ok(())
}
