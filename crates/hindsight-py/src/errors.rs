//! Engine errors become Python exceptions: one class per error kind, all
//! under `hindsight.HindsightError`, each also deriving from the builtin a
//! caller would naturally catch (`ValueError`, `OSError`, ...). The binding
//! creates the classes when the module loads (`hindsight.errors` re-exports
//! them), and the map from kind to class is an exhaustive match, so a new
//! kind in the engine does not compile until it has a class here. The
//! error's fields become attributes.

use hindsight_core::error::ErrorKind;
use hindsight_core::Error;
use hindsight_data::ErrorKind as DataKind;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// Every exception class: its name, its bases (ours by index into this
/// table, which comes first; else a builtin by name), its documentation.
enum Base {
    Ours(usize),
    Builtin(&'static str),
}

const HINDSIGHT: usize = 0;
const STORAGE: usize = 5;
const REPLAY: usize = 12;
const CANCELLED: usize = 14;
const DATA: usize = 18;

#[rustfmt::skip]
const CLASSES: &[(&str, &[Base], &str)] = &[
    ("HindsightError", &[Base::Builtin("Exception")], "Base class of every hindsight error. Errors from the engine carry what they are about as attributes (None where it does not apply): background, path, checkpoint, key_path, arg, run."),
    ("NotFoundError", &[Base::Ours(HINDSIGHT), Base::Builtin("LookupError")], "A store, checkpoint, run or key path that does not exist."),
    ("CorruptError", &[Base::Ours(HINDSIGHT)], "Stored bytes fail their checksum or do not parse. Nothing wrong is returned."),
    ("UnsupportedTypeError", &[Base::Ours(HINDSIGHT), Base::Builtin("TypeError")], "A value the format cannot hold; pass allow_pickle=True to pickle it."),
    ("InvalidArgumentError", &[Base::Ours(HINDSIGHT), Base::Builtin("ValueError")], "A bad name, option or argument."),
    ("StorageError", &[Base::Ours(HINDSIGHT), Base::Builtin("OSError")], "An I/O error from the storage."),
    ("StorageFullError", &[Base::Ours(STORAGE)], "The disk or quota is full. No partial checkpoint became visible."),
    ("StoragePermissionError", &[Base::Ours(STORAGE), Base::Builtin("PermissionError")], "Storage refused access: missing permission or credentials."),
    ("ConcurrentChangeError", &[Base::Ours(STORAGE)], "A conditional write lost a race: another process changed the object first."),
    ("LeaseLostError", &[Base::Ours(STORAGE)], "The lease protecting a save or gc on object storage was lost; nothing was committed under it."),
    ("WrongProcessError", &[Base::Ours(HINDSIGHT)], "A Store used in a process other than the one that opened it (e.g. a fork)."),
    ("DatabaseError", &[Base::Ours(HINDSIGHT)], "The run/log database failed (locked too long, unreadable, newer schema)."),
    ("ReplayError", &[Base::Ours(HINDSIGHT)], "A replay or resume cannot run as asked (script changed beyond logging, missing checkpoint, a loop that no longer matches, ...)."),
    ("DivergenceError", &[Base::Ours(REPLAY)], "A replay or a resume computed something other than the recording: a step consumed other data, a logged value differs, or the state at a checkpoint differs. Raised at the first difference, naming it; nothing computed after it is presented as a result."),
    ("CancelledError", &[Base::Ours(HINDSIGHT)], "The operation was interrupted or abandoned."),
    ("StoreClosedError", &[Base::Ours(CANCELLED)], "The store (or its writer) was closed."),
    ("AbandonedError", &[Base::Ours(CANCELLED)], "A save that never committed: an earlier step of it failed or was interrupted."),
    ("DeviceCopyError", &[Base::Ours(HINDSIGHT)], "The device-to-host copy of a save failed (e.g. a CUDA error); the save did not commit."),
    ("DataError", &[Base::Ours(HINDSIGHT)], "An error of the input service (hindsight.data); address and dataset name what it is about."),
    ("DataUnreachableError", &[Base::Ours(DATA), Base::Builtin("ConnectionError")], "Nothing answered at the dispatcher or worker address in time."),
    ("DataMismatchError", &[Base::Ours(DATA), Base::Builtin("ValueError")], "A job, protocol or code version that differs from the other side's; the message names the difference."),
    ("DataPipelineError", &[Base::Ours(DATA)], "The dataset factory or pipeline raised in a worker; the message holds its traceback."),
    ("NonDeterministicDataError", &[Base::Ours(DATA)], "A recomputed unit differs from its first computation: the pipeline is not deterministic."),
    ("NoDataWorkersError", &[Base::Ours(DATA)], "No live worker served the dataset within the wait."),
    ("DataServiceError", &[Base::Ours(DATA)], "A call inside the input service failed in a way no retry fixes."),
    ("InternalError", &[Base::Ours(HINDSIGHT)], "A broken invariant inside hindsight (a bug): reported, never papered over."),
];

/// The attributes every error carries (None where they do not apply).
const FIELDS: &[&str] = &["path", "checkpoint", "key_path", "arg", "run"];
const DATA_FIELDS: &[&str] = &["address", "dataset"];

static CREATED: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn create(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let builtins = py.import("builtins")?;
    let mut made: Vec<Py<PyType>> = Vec::with_capacity(CLASSES.len());
    for (i, (name, bases, doc)) in CLASSES.iter().enumerate() {
        let bases = bases
            .iter()
            .map(|b| match b {
                Base::Ours(j) => Ok(made[*j].bind(py).clone().into_any()),
                Base::Builtin(n) => builtins.getattr(*n),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let dict = PyDict::new(py);
        dict.set_item("__doc__", *doc)?;
        dict.set_item("__module__", "hindsight.errors")?;
        if i == HINDSIGHT {
            dict.set_item("background", false)?;
            for f in FIELDS {
                dict.set_item(*f, py.None())?;
            }
        }
        if i == DATA {
            for f in DATA_FIELDS {
                dict.set_item(*f, py.None())?;
            }
        }
        let cls = py
            .get_type::<PyType>()
            .call1((*name, PyTuple::new(py, bases)?, dict))?
            .cast_into::<PyType>()?;
        made.push(cls.unbind());
    }
    Ok(made)
}

fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CREATED.get_or_try_init(py, || create(py))
}

/// The classes into the module (`hindsight.errors` re-exports them).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for ((name, _, _), cls) in CLASSES.iter().zip(classes(m.py())?) {
        m.add(*name, cls.bind(m.py()))?;
    }
    Ok(())
}

fn index(name: &str) -> usize {
    CLASSES
        .iter()
        .position(|(n, _, _)| *n == name)
        .expect("every mapped class is in CLASSES")
}

fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotFound => "NotFoundError",
        ErrorKind::Corrupt => "CorruptError",
        ErrorKind::UnsupportedType => "UnsupportedTypeError",
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::StorageFull => "StorageFullError",
        ErrorKind::Io => "StorageError",
        ErrorKind::PermissionDenied => "StoragePermissionError",
        ErrorKind::Precondition => "ConcurrentChangeError",
        ErrorKind::LeaseLost => "LeaseLostError",
        ErrorKind::WrongProcess => "WrongProcessError",
        ErrorKind::Database => "DatabaseError",
        ErrorKind::Internal => "InternalError",
        ErrorKind::Interrupted => "CancelledError",
        ErrorKind::Closed => "StoreClosedError",
        ErrorKind::Abandoned => "AbandonedError",
        ErrorKind::Device => "DeviceCopyError",
        ErrorKind::Replay => "ReplayError",
        ErrorKind::Diverged => "DivergenceError",
    }
}

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    Ok(classes(py)?[index(name)].bind(py).clone())
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let err = PyErr::from_type(class(py, class_name(e.kind()))?, e.to_string());
    let value = err.value(py);
    value.setattr("background", matches!(e, Error::Background { .. }))?;
    value.setattr("path", e.path().map(|p| p.to_string_lossy().into_owned()))?;
    value.setattr("checkpoint", e.checkpoint())?;
    value.setattr("key_path", e.key_path())?;
    value.setattr("arg", e.arg())?;
    value.setattr("run", e.run())?;
    Ok(err)
}

pub(crate) fn to_py(e: Error) -> PyErr {
    Python::attach(|py| build(py, &e).unwrap_or_else(|failure| failure))
}

/// An engine error of either crate, as the Python exception it maps to.
pub(crate) trait ToPyErr {
    fn to_pyerr(self) -> PyErr;
}

impl ToPyErr for Error {
    fn to_pyerr(self) -> PyErr {
        to_py(self)
    }
}

impl ToPyErr for hindsight_data::Error {
    fn to_pyerr(self) -> PyErr {
        data_to_py(self)
    }
}

fn data_class_name(kind: DataKind) -> &'static str {
    match kind {
        DataKind::InvalidArgument => "InvalidArgumentError",
        DataKind::Corrupt => "CorruptError",
        DataKind::Unreachable => "DataUnreachableError",
        DataKind::Mismatch => "DataMismatchError",
        DataKind::Pipeline => "DataPipelineError",
        DataKind::NonDeterministic => "NonDeterministicDataError",
        DataKind::NoWorkers => "NoDataWorkersError",
        DataKind::Rpc => "DataServiceError",
        DataKind::Io => "StorageError",
        DataKind::Closed => "StoreClosedError",
    }
}

fn data_build(py: Python<'_>, e: &hindsight_data::Error) -> PyResult<PyErr> {
    let err = PyErr::from_type(class(py, data_class_name(e.kind()))?, e.to_string());
    let value = err.value(py);
    value.setattr("address", e.addr())?;
    value.setattr("dataset", e.dataset())?;
    Ok(err)
}

pub(crate) fn data_to_py(e: hindsight_data::Error) -> PyErr {
    Python::attach(|py| data_build(py, &e).unwrap_or_else(|failure| failure))
}

pub(crate) trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for hindsight_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
