//! The one wrapper for every long call: release the GIL for the work, and
//! turn Ctrl-C into KeyboardInterrupt by polling Python's signal state from
//! the calling thread while the work runs.

use std::sync::Mutex;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::errors::ToPyErr;

const POLL: Duration = Duration::from_millis(50);

pub(crate) struct Interrupt {
    caller: ThreadId,
    last: Mutex<Instant>,
    err: Mutex<Option<PyErr>>,
}

impl Interrupt {
    /// True once a signal handler raised (e.g. KeyboardInterrupt). Cheap:
    /// takes the GIL at most every 50 ms, and only on the calling thread
    /// (the only one Python delivers signals to).
    pub(crate) fn check(&self) -> bool {
        let mut err = self.err.lock().unwrap_or_else(|p| p.into_inner());
        if err.is_some() {
            return true;
        }
        if std::thread::current().id() != self.caller {
            return false;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() < POLL {
            return false;
        }
        *last = Instant::now();
        if let Err(e) = Python::attach(|py| py.check_signals()) {
            *err = Some(e);
            return true;
        }
        false
    }
}

/// Run `work` without the GIL. A signal raised meanwhile wins over the
/// work's own result; engine errors become Python exceptions.
pub(crate) fn run<T: Send, E: ToPyErr + Send>(
    py: Python<'_>,
    work: impl FnOnce(&Interrupt) -> Result<T, E> + Send,
) -> PyResult<T> {
    let intr = Interrupt {
        caller: std::thread::current().id(),
        last: Mutex::new(Instant::now()),
        err: Mutex::new(None),
    };
    let result = py.detach(|| work(&intr));
    if let Some(e) = intr.err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    result.map_err(ToPyErr::to_pyerr)
}

/// Wait for `step` to report completion, polling for signals in between.
pub(crate) fn wait_until<T: Send, E: ToPyErr + Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    mut step: impl FnMut(Duration) -> Result<Option<T>, E> + Send,
) -> PyResult<Option<T>> {
    // A timeout too large for a deadline (1e300, inf) is no deadline; NaN or
    // a negative one is "now".
    let deadline = timeout.and_then(|t| {
        let t = if t.is_nan() { 0.0 } else { t.max(0.0) };
        Duration::try_from_secs_f64(t)
            .ok()
            .and_then(|d| Instant::now().checked_add(d))
    });
    run(py, |intr| loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(POLL),
            None => POLL,
        };
        if let Some(v) = step(slice)? {
            return Ok::<_, E>(Some(v));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        if intr.check() {
            return Ok(None);
        }
    })
}
