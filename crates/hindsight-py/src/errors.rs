//! Engine errors become Python exceptions: one class per error kind, all
//! under `hindsight.HindsightError`. The classes live in `hindsight/errors.py`
//! (so they can also derive from the matching builtin, e.g. `ValueError`);
//! they are looked up once per process, and the map from kind to class is an
//! exhaustive match, so a new kind in the engine does not compile until it
//! has a class here. The error's fields become attributes.

use hindsight_core::error::ErrorKind;
use hindsight_core::Error;
use hindsight_data::ErrorKind as DataKind;
use std::sync::Mutex;

use hindsight_core::sync::lock;
use pyo3::prelude::*;
use pyo3::types::PyType;

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

/// The exception class of each kind, looked up in `hindsight.errors` the
/// first time that kind is raised and kept for the life of the process.
static CLASSES: Mutex<Vec<(ErrorKind, Py<PyType>)>> = Mutex::new(Vec::new());

fn class(py: Python<'_>, kind: ErrorKind) -> PyResult<Bound<'_, PyType>> {
    let mut known = lock(&CLASSES);
    if let Some((_, c)) = known.iter().find(|(k, _)| *k == kind) {
        return Ok(c.bind(py).clone());
    }
    let cls = py
        .import("hindsight.errors")?
        .getattr(class_name(kind))?
        .cast_into::<PyType>()?;
    known.push((kind, cls.clone().unbind()));
    Ok(cls)
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let err = PyErr::from_type(class(py, e.kind())?, e.to_string());
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
    // Only a broken installation (no hindsight.errors) fails here; say so.
    Python::attach(|py| build(py, &e).unwrap_or_else(|import_failure| import_failure))
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
    let cls = py
        .import("hindsight.errors")?
        .getattr(data_class_name(e.kind()))?
        .cast_into::<PyType>()?;
    let err = PyErr::from_type(cls, e.to_string());
    let value = err.value(py);
    value.setattr("address", e.addr())?;
    value.setattr("dataset", e.dataset())?;
    Ok(err)
}

pub(crate) fn data_to_py(e: hindsight_data::Error) -> PyErr {
    Python::attach(|py| data_build(py, &e).unwrap_or_else(|import_failure| import_failure))
}

pub(crate) trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for hindsight_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
