//! Engine errors become Python exceptions: one class per kind, all under
//! `hindsight.HindsightError` (classes live in `hindsight/errors.py` so they
//! can also derive from the matching builtin, e.g. `ValueError`).

use hindsight_core::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

fn class_name(e: &Error) -> &'static str {
    match e.root() {
        Error::NotFound { .. } => "NotFoundError",
        Error::Corrupt { .. } => "CorruptError",
        Error::UnsupportedType { .. } => "UnsupportedTypeError",
        Error::InvalidArgument { .. } => "InvalidArgumentError",
        Error::StorageFull { .. } => "StorageFullError",
        Error::Io { .. } => "StorageError",
        Error::WrongProcess { .. } => "WrongProcessError",
        Error::Cancelled(_) => "CancelledError",
        Error::Database { .. } => "DatabaseError",
        _ => "HindsightError",
    }
}

pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let cls = py
            .import("hindsight.errors")
            .and_then(|m| m.getattr(class_name(&e)))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        let background = matches!(e, Error::Background { .. });
        match cls {
            Ok(cls) => {
                let err = PyErr::from_type(cls, e.to_string());
                if background {
                    // Let callers tell a deferred failure from an immediate one.
                    let _ = err.value(py).setattr("background", true);
                }
                err
            }
            Err(_) => PyRuntimeError::new_err(e.to_string()),
        }
    })
}

pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for hindsight_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
