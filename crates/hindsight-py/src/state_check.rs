//! `Store.check_state`'s result as typed objects (the rule is the core's
//! `checkpoint::compare`).

use hindsight_core as core;
use pyo3::prelude::*;

/// One difference between a checkpoint and the live state.
#[pyclass(
    module = "hindsight._native",
    name = "StateDifference",
    frozen,
    get_all,
    skip_from_py_object
)]
#[derive(Clone, Debug)]
pub(crate) struct PyDifference {
    /// Key path (`objects/model/fc.weight`).
    path: String,
    /// What differs.
    detail: String,
}

/// The outcome of comparing a live state with a checkpoint.
#[pyclass(
    module = "hindsight._native",
    name = "StateCheck",
    frozen,
    get_all,
    skip_from_py_object
)]
#[derive(Clone, Debug)]
pub(crate) struct PyStateCheck {
    /// The first difference that makes the live state another one, or None.
    first: Option<PyDifference>,
    /// Differences that are notes, not failures (clock readings).
    notes: Vec<PyDifference>,
}

impl From<core::Difference> for PyDifference {
    fn from(d: core::Difference) -> Self {
        PyDifference {
            path: d.path,
            detail: d.detail,
        }
    }
}

impl From<core::StateCheck> for PyStateCheck {
    fn from(c: core::StateCheck) -> Self {
        PyStateCheck {
            first: c.first.map(Into::into),
            notes: c.notes.into_iter().map(Into::into).collect(),
        }
    }
}
