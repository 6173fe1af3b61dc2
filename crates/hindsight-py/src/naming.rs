//! `hindsight._native.CheckpointId`: the engine's checkpoint naming rule,
//! typed, for the training API and the Lightning callback.

use std::collections::BTreeMap;

use hindsight_core::checkpoint::{naming, walk};
use hindsight_core::{CheckpointId as Id, CheckpointKind as Kind, Error};
use pyo3::prelude::*;

use crate::errors::to_py;

#[pyclass(
    module = "hindsight._native",
    name = "CheckpointId",
    frozen,
    eq,
    ord,
    hash,
    skip_from_py_object
)]
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PyCheckpointId(pub Id);

fn kind_of(kind: &str, step: Option<u64>) -> PyResult<Kind> {
    match (kind, step) {
        ("block", None) => Ok(Kind::Block),
        ("end", None) => Ok(Kind::End),
        ("step", Some(s)) => Ok(Kind::Step(s)),
        _ => Err(to_py(Error::invalid(
            "checkpoint kind",
            format!("{kind:?} with step={step:?}: use 'block', 'end', or 'step' with a step"),
        ))),
    }
}

#[pymethods]
impl PyCheckpointId {
    #[new]
    #[pyo3(signature = (prefix, loop_name, index, kind="block", step=None))]
    fn new(
        prefix: &str,
        loop_name: &str,
        index: u64,
        kind: &str,
        step: Option<u64>,
    ) -> PyResult<Self> {
        Id::new(prefix, loop_name, index, kind_of(kind, step)?)
            .map(PyCheckpointId)
            .map_err(to_py)
    }

    /// The id a checkpoint name encodes, or None for other names.
    #[staticmethod]
    fn parse(name: &str) -> Option<Self> {
        Id::parse(name).map(PyCheckpointId)
    }

    #[getter]
    fn name(&self) -> String {
        self.0.name()
    }

    #[getter]
    fn prefix(&self) -> &str {
        &self.0.prefix
    }

    #[getter]
    fn loop_name(&self) -> &str {
        &self.0.loop_name
    }

    #[getter]
    fn index(&self) -> u64 {
        self.0.index
    }

    /// "block" (after the iteration's training steps), "step" (inside it) or "end" (after it).
    #[getter]
    fn kind(&self) -> &'static str {
        match self.0.kind {
            Kind::Block => "block",
            Kind::End => "end",
            Kind::Step(_) => "step",
        }
    }

    #[getter]
    fn step(&self) -> Option<u64> {
        match self.0.kind {
            Kind::Step(s) => Some(s),
            _ => None,
        }
    }

    /// Metadata describing the id, to store in the checkpoint's manifest.
    fn meta(&self) -> BTreeMap<String, String> {
        self.0.meta()
    }

    fn __repr__(&self) -> String {
        format!("CheckpointId({:?})", self.0.name())
    }
}

/// Which Lightning fit a `Trainer.fit` continues (`naming::choose_fit`).
#[pyclass(
    module = "hindsight._native",
    name = "FitChoice",
    frozen,
    skip_from_py_object
)]
#[derive(Clone, Debug)]
pub(crate) struct PyFitChoice(naming::FitChoice);

#[pymethods]
impl PyFitChoice {
    /// The checkpoint to resume from, or None: start a fresh fit.
    #[getter]
    fn resume(&self) -> Option<PyCheckpointId> {
        self.0.resume.clone().map(PyCheckpointId)
    }

    /// The newest checkpoint with trainer state of the newest fit, finished or not.
    #[getter]
    fn latest(&self) -> Option<PyCheckpointId> {
        self.0.latest.clone().map(PyCheckpointId)
    }

    /// The prefix a fit started afresh writes its checkpoints under.
    #[getter]
    fn fresh_prefix(&self) -> &str {
        &self.0.fresh_prefix
    }

    fn __repr__(&self) -> String {
        format!(
            "FitChoice(resume={:?}, fresh_prefix={:?})",
            self.0.resume.as_ref().map(Id::name),
            self.0.fresh_prefix
        )
    }
}

/// The fit to continue among checkpoint `names` of fits under prefix `base`.
#[pyfunction]
pub(crate) fn choose_fit(names: Vec<String>, base: &str) -> PyFitChoice {
    PyFitChoice(naming::choose_fit(&names, base))
}

/// The resume walk (`checkpoint::walk`): the checkpoints a continuing
/// process tries, newest first, one at a time.
#[pyclass(module = "hindsight._native", name = "ResumeWalk", skip_from_py_object)]
pub(crate) struct PyResumeWalk(walk::ResumeWalk);

#[pymethods]
impl PyResumeWalk {
    /// The checkpoints of run `run_id`.
    #[staticmethod]
    fn run(names: Vec<String>, run_id: &str) -> Self {
        Self(walk::ResumeWalk::run(&names, run_id))
    }

    /// The checkpoints of loop `loop_name` of the newest unfinished fit under `base`.
    #[staticmethod]
    fn fit(names: Vec<String>, base: &str, loop_name: &str) -> Self {
        Self(walk::ResumeWalk::fit(&names, base, loop_name))
    }

    /// An order another process chose (rank 0's).
    #[staticmethod]
    fn given(order: Vec<String>) -> Self {
        Self(walk::ResumeWalk::given(order))
    }

    /// Every candidate, newest first.
    #[getter]
    fn order(&self) -> Vec<String> {
        self.0.order().to_vec()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self) -> Option<String> {
        self.0.next()
    }

    /// The warning for candidate `name`, which did not read back (`why`).
    #[staticmethod]
    fn damaged(name: &str, why: &str) -> String {
        walk::ResumeWalk::damaged(name, why)
    }
}
