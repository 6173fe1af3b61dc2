//! The `HINDSIGHT_*` variables (`hindsight_core::settings`): the table, and
//! a variable's value parsed by the engine's rule.

use hindsight_core::settings::{self as core_settings, Value};
use hindsight_core::Error;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

/// One environment variable: name, kind, default, what it does.
#[pyclass(module = "hindsight._native", name = "Setting", frozen)]
#[derive(Debug)]
pub(crate) struct PySetting {
    #[pyo3(get)]
    name: &'static str,
    /// "path", "location", "flag", "int", "float" or "text".
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    default: &'static str,
    #[pyo3(get)]
    doc: &'static str,
    /// Set by hindsight for the processes it starts.
    #[pyo3(get)]
    internal: bool,
}

#[pymethods]
impl PySetting {
    fn __repr__(&self) -> String {
        format!("Setting({}: {})", self.name, self.kind)
    }
}

/// Every variable, users' first.
#[pyfunction]
pub(crate) fn settings() -> Vec<PySetting> {
    core_settings::ALL
        .iter()
        .map(|s| PySetting {
            name: s.name,
            kind: s.kind.as_str(),
            default: s.default,
            doc: s.doc,
            internal: s.internal,
        })
        .collect()
}

/// `name`'s value in this process's environment: bool, int, float or str
/// by its kind, None when unset or empty. Raises InvalidArgumentError,
/// naming the variable, for a value that does not parse or an unknown name.
#[pyfunction]
pub(crate) fn setting_value(py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
    let s = core_settings::find(name).ok_or_else(|| {
        crate::errors::to_py(Error::invalid(
            "setting",
            format!("{name} is not a hindsight setting"),
        ))
    })?;
    match s.get().map_err(crate::errors::to_py)? {
        None => Ok(py.None()),
        Some(Value::Flag(b)) => b.into_py_any(py),
        Some(Value::Int(i)) => i.into_py_any(py),
        Some(Value::Bytes(b)) => b.into_py_any(py),
        Some(Value::Float(x)) => x.into_py_any(py),
        Some(Value::Text(t)) => t.into_py_any(py),
        Some(other) => Err(crate::errors::to_py(Error::invalid(
            "setting",
            format!("{name}: a value of kind {other:?} this binding does not convert"),
        ))),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySetting>()?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(setting_value, m)?)?;
    Ok(())
}
