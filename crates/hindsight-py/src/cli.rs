//! The `hindsight` command line, parsed by the one clap tree
//! (`hindsight_cli::dispatch`): the commands the engine runs run here; the
//! Python package's commands come back as typed, frozen argument classes
//! (one per command, fields as clap parsed them), so Python parses nothing.

use std::path::Path;

use hindsight_cli::pycmds::{self, DataCommand, PythonCommand};
use hindsight_cli::Dispatch;
use pyo3::prelude::*;

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// An empty repeatable option is None (not given), as the engine's calls take it.
fn given(v: &[String]) -> Option<Vec<String>> {
    (!v.is_empty()).then(|| v.to_vec())
}

/// `hindsight replay`'s arguments (`hindsight_cli::pycmds::ReplayArgs`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct ReplayArgs {
    script: String,
    run: Option<Vec<String>>,
    runs: Option<Vec<String>>,
    since: Option<String>,
    jobs: u32,
    r#where: Option<String>,
    force: bool,
    allow_divergence: bool,
    fast: bool,
    recorded_ranks: bool,
    quiet: bool,
    launcher: String,
    sbatch: Option<Vec<String>>,
    home: Option<String>,
}

/// `hindsight plot` and `hindsight export` (`output` for plot,
/// `tensorboard` for export).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct SeriesArgs {
    command: &'static str,
    names: Vec<String>,
    run: Vec<String>,
    output: Option<String>,
    tensorboard: Option<String>,
    home: Option<String>,
}

/// `hindsight record`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct RecordArgs {
    explain: bool,
    command: Vec<String>,
}

/// `hindsight data dispatcher`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct DispatcherArgs {
    journal: String,
    port: u16,
    host: String,
    heartbeat_timeout: f64,
}

/// `hindsight data worker`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct WorkerArgs {
    dispatcher: String,
    dataset: String,
    args: String,
    collate: Option<String>,
    bind: String,
    advertise: Option<String>,
    parent_pid: Option<u32>,
    checkpoints: Option<String>,
    checkpoint_overhead: f64,
    shared_dir: Option<String>,
}

/// `hindsight data token`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Clone)]
pub(crate) struct TokenArgs {
    dataset: String,
    journal: Option<String>,
}

/// What `parse_cli` did: the exit code and output of a command run here
/// (or of its help or usage error), or a Python command's `args`.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct CliCall {
    code: i32,
    out: String,
    err: String,
    /// One of the argument classes above; None where the command ran here.
    args: Option<Py<PyAny>>,
    /// `--store` was given to a command that does not take it (replay: a
    /// run replays from the store it recorded).
    store_given: bool,
}

fn python_args(py: Python<'_>, call: pycmds::PythonCall) -> PyResult<Py<PyAny>> {
    let home = call.home.as_deref().map(path);
    let obj = match call.command {
        PythonCommand::Replay(a) => Py::new(
            py,
            ReplayArgs {
                run: given(&a.run),
                sbatch: given(&a.sbatch),
                script: a.script,
                runs: a.runs,
                since: a.since,
                jobs: a.jobs,
                r#where: a.where_,
                force: a.force,
                allow_divergence: a.allow_divergence,
                fast: a.fast,
                recorded_ranks: a.recorded_ranks,
                quiet: a.quiet,
                launcher: a.launcher,
                home,
            },
        )?
        .into_any(),
        PythonCommand::Plot(a) => Py::new(
            py,
            SeriesArgs {
                command: "plot",
                names: a.series.names,
                run: a.series.run,
                output: Some(path(&a.output)),
                tensorboard: None,
                home,
            },
        )?
        .into_any(),
        PythonCommand::Export(a) => Py::new(
            py,
            SeriesArgs {
                command: "export",
                names: a.series.names,
                run: a.series.run,
                output: None,
                tensorboard: Some(path(&a.tensorboard)),
                home,
            },
        )?
        .into_any(),
        PythonCommand::Record(a) => Py::new(
            py,
            RecordArgs {
                explain: a.explain,
                command: a.command,
            },
        )?
        .into_any(),
        PythonCommand::Data(DataCommand::Dispatcher(a)) => Py::new(
            py,
            DispatcherArgs {
                journal: path(&a.journal),
                port: a.port,
                host: a.host,
                heartbeat_timeout: a.heartbeat_timeout,
            },
        )?
        .into_any(),
        PythonCommand::Data(DataCommand::Worker(a)) => Py::new(
            py,
            WorkerArgs {
                dispatcher: a.dispatcher,
                dataset: a.dataset,
                args: a.args,
                collate: a.collate,
                bind: a.bind,
                advertise: a.advertise,
                parent_pid: a.parent_pid,
                checkpoints: a.checkpoints,
                checkpoint_overhead: a.checkpoint_overhead,
                shared_dir: a.shared_dir.as_deref().map(path),
            },
        )?
        .into_any(),
        PythonCommand::Data(DataCommand::Token(a)) => Py::new(
            py,
            TokenArgs {
                dataset: a.dataset,
                journal: a.journal.as_deref().map(path),
            },
        )?
        .into_any(),
    };
    Ok(obj)
}

/// Parse a `hindsight` command line (`args[0]` is the program name) by the
/// one grammar; run it here if the engine's, else return its arguments.
#[pyfunction]
fn parse_cli(py: Python<'_>, args: Vec<String>) -> PyResult<CliCall> {
    let (dispatch, out, err) = py.detach(move || {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let d = hindsight_cli::dispatch(args, &mut out, &mut err);
        (
            d,
            String::from_utf8_lossy(&out).into_owned(),
            String::from_utf8_lossy(&err).into_owned(),
        )
    });
    Ok(match dispatch {
        Dispatch::Done(code) => CliCall {
            code,
            out,
            err,
            args: None,
            store_given: false,
        },
        Dispatch::Python(call) => CliCall {
            code: 0,
            out,
            err,
            store_given: call.store_given,
            args: Some(python_args(py, *call)?),
        },
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_cli, m)?)?;
    m.add_class::<CliCall>()?;
    m.add_class::<ReplayArgs>()?;
    m.add_class::<SeriesArgs>()?;
    m.add_class::<RecordArgs>()?;
    m.add_class::<DispatcherArgs>()?;
    m.add_class::<WorkerArgs>()?;
    m.add_class::<TokenArgs>()
}
