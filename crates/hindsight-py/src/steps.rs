//! `hs.loop`'s inner loop, iterated natively: a training step runs no
//! Python frame of hindsight's on the common path.
//!
//! Between steps the data loading evicts hindsight's code and data from the
//! caches, so every Python frame and attribute lookup on this path costs
//! several times what it does in a tight loop (measured in the zoo's
//! siamese loop: 5 to 7 us a hook cold, 1 to 2 us hot). Here one native
//! call does what the hooks did per step: the stack's step index, the
//! step's log de-duplication reset, the batch fingerprint (recorded, or
//! checked against the recording), the supervisor's heartbeat, and the
//! session's step boundary. Python is called back only for what is rare:
//! a boundary action (a save, a signal's exit), a divergence, and the
//! cases kept in Python (a boundary under several ranks meets the other
//! ranks there, in `RecordRun._step_boundary`).

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyIterator, PyList};

use crate::fingerprint::BatchPrinter;
use crate::session::{RecordSession, ReplaySession};
use hindsight_core::ErrorKind;

/// What a step's batch is fingerprinted for.
enum Prints {
    /// Recorded into the run's `batch_rows`, as (rank, kind, i, j, digest),
    /// with the sampler's index batch (`tap.last`) where a tap is given.
    Record { rank: u64, tap: Option<Py<PyAny>> },
    /// Checked against the recording; a difference goes to `run._diverged`.
    Replay(Py<ReplaySession>),
}

/// The printer for the frameworks imported now: a step may be the first
/// to import torch or numpy (a generator's lazy import), and a printer
/// made before knows neither, so the modules are looked at every step
/// (two dict lookups) and `make()` asked again when they changed.
struct Printers {
    modules: Py<PyDict>,
    make: Py<PyAny>,
    current: Option<((bool, bool), Py<BatchPrinter>)>,
}

impl Printers {
    fn get<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, BatchPrinter>> {
        let modules = self.modules.bind(py);
        let loaded = (
            modules.contains(intern!(py, "torch"))?,
            modules.contains(intern!(py, "numpy"))?,
        );
        match &self.current {
            Some((was, p)) if *was == loaded => Ok(p.bind(py).clone()),
            _ => {
                let p = self.make.bind(py).call0()?.cast_into::<BatchPrinter>()?;
                self.current = Some((loaded, p.clone().unbind()));
                Ok(p)
            }
        }
    }
}

/// What ends a step.
enum Boundary {
    /// Nothing (a replay).
    Nothing,
    /// The recording's session, decided here (one rank).
    Session(Py<RecordSession>),
    /// The run's own `_step_boundary(i, j)` (several ranks meet there).
    Run,
}

/// At most one byte a second to `hindsight run`'s supervisor: the loop is alive.
struct Beat {
    fd: i32,
    next: f64,
}

fn clock(id: libc::clockid_t) -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec to write.
    unsafe { libc::clock_gettime(id, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// `time.thread_time()`: what the training thread spends on hindsight.
fn own_clock() -> f64 {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// `time.monotonic()`: the session's clock.
fn monotonic() -> f64 {
    clock(libc::CLOCK_MONOTONIC)
}

/// The steps of one block (`Run._block`), as the iterator the training loop
/// consumes: each `next` first ends the step before (its boundary), then
/// starts the next one. A step ended by an exception or a `break` has no
/// boundary, as before.
#[pyclass(module = "hindsight._native")]
pub(crate) struct StepLoop {
    it: Py<PyIterator>,
    i: u64,
    next: u64,
    /// The `hs.loop` stack's entry for this loop: [name, step].
    entry: Py<PyList>,
    /// The step's values logged so far (`Values.reps_inner`), cleared per step.
    reps: Py<PyDict>,
    run: Py<PyAny>,
    prints: Prints,
    printers: Printers,
    boundary: Boundary,
    /// The step whose boundary the next `next` runs.
    pending: Option<u64>,
    beat: Option<Beat>,
    /// Training-thread CPU spent here, not yet added to `run.own_seconds`.
    own: f64,
}

#[pymethods]
impl StepLoop {
    /// `prints`: "record" (into `run.batch_rows` as `rank`'s, with the
    /// sampler's index batches where `tap`) or "replay" (checked by
    /// `session`, a `ReplaySession`); `boundary`: "none", "session" (a
    /// `RecordSession`'s, decided here) or "run" (`run._step_boundary`);
    /// `beat_fd`: the supervisor's pipe.
    #[new]
    #[pyo3(signature = (it, *, i, start, entry, reps, run, printer, session, prints, boundary, rank=0, tap=None, beat_fd=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        it: &Bound<'_, PyAny>,
        i: u64,
        start: u64,
        entry: Bound<'_, PyList>,
        reps: Bound<'_, PyDict>,
        run: Bound<'_, PyAny>,
        printer: Bound<'_, PyAny>,
        session: Bound<'_, PyAny>,
        prints: &str,
        boundary: &str,
        rank: u64,
        tap: Option<Bound<'_, PyAny>>,
        beat_fd: Option<i32>,
    ) -> PyResult<Self> {
        let py = it.py();
        let bad = |what: &str, value: &str, allowed: &str| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "StepLoop: {what} must be {allowed}, not {value:?}"
            ))
        };
        let prints = match prints {
            "record" => Prints::Record {
                rank,
                tap: tap.map(Bound::unbind),
            },
            "replay" => Prints::Replay(session.cast::<ReplaySession>()?.clone().unbind()),
            other => return Err(bad("prints", other, "'record' or 'replay'")),
        };
        let boundary = match boundary {
            "none" => Boundary::Nothing,
            "session" => Boundary::Session(session.cast::<RecordSession>()?.clone().unbind()),
            "run" => Boundary::Run,
            other => return Err(bad("boundary", other, "'none', 'session' or 'run'")),
        };
        let modules = py
            .import(intern!(py, "sys"))?
            .getattr(intern!(py, "modules"))?
            .cast_into::<PyDict>()?;
        Ok(Self {
            it: PyIterator::from_object(it)?.unbind(),
            i,
            next: start,
            entry: entry.unbind(),
            reps: reps.unbind(),
            run: run.unbind(),
            prints,
            printers: Printers {
                modules: modules.unbind(),
                make: printer.unbind(),
                current: None,
            },
            boundary,
            pending: None,
            beat: beat_fd.map(|fd| Beat { fd, next: 0.0 }),
            own: 0.0,
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if let Some(j) = self.pending.take() {
            self.step_boundary(py, j)?;
        }
        let x = match self.it.bind(py).clone().next() {
            None => {
                self.close(py)?;
                return Ok(None);
            }
            Some(x) => x?,
        };
        let j = self.next;
        self.next += 1;
        self.entry.bind(py).set_item(1, j)?;
        self.reps.bind(py).clear();
        self.step_starts(py, j, &x)?;
        self.heartbeat(py)?;
        self.pending = Some(j);
        Ok(Some(x.unbind()))
    }

    /// Adds the CPU spent here to `run.own_seconds` (the recording's
    /// account of itself); the block calls it when the steps end.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.own > 0.0 {
            let run = self.run.bind(py);
            let name = intern!(py, "own_seconds");
            let total: f64 = run.getattr(name)?.extract()?;
            run.setattr(name, total + self.own)?;
            self.own = 0.0;
        }
        Ok(())
    }
}

impl StepLoop {
    fn step_starts(&mut self, py: Python<'_>, j: u64, x: &Bound<'_, PyAny>) -> PyResult<()> {
        let run = self.run.bind(py);
        match &self.prints {
            Prints::Record { rank, tap } => {
                let t0 = own_clock();
                let rank = *rank;
                let tap = tap.as_ref().map(|t| t.clone_ref(py));
                let printer = self.printers.get(py)?;
                let printer = printer.get();
                let rows = run
                    .getattr(intern!(py, "batch_rows"))?
                    .cast_into::<PyList>()?;
                let batch = printer.digest(py, x)?;
                rows.append((rank, intern!(py, "batch"), self.i, j, batch))?;
                if let Some(tap) = tap {
                    let order = printer.digest(py, &tap.bind(py).getattr(intern!(py, "last"))?)?;
                    rows.append((rank, intern!(py, "order"), self.i, j, order))?;
                }
                self.own += own_clock() - t0;
            }
            Prints::Replay(session) => {
                let session = session.clone_ref(py);
                let printer = self.printers.get(py)?;
                let digest = printer.get().digest(py, x)?;
                let checked = session
                    .bind(py)
                    .borrow_mut()
                    .step_checked(self.i, j, &digest);
                if let Err(e) = checked {
                    if e.kind() != ErrorKind::Diverged {
                        return Err(crate::errors::to_py(e));
                    }
                    let err = crate::errors::to_py(e);
                    run.call_method1(intern!(py, "_diverged"), (err.value(py),))?;
                }
            }
        }
        Ok(())
    }

    fn step_boundary(&mut self, py: Python<'_>, j: u64) -> PyResult<()> {
        let session = match &self.boundary {
            Boundary::Nothing => return Ok(()),
            Boundary::Run => {
                let run = self.run.bind(py);
                run.call_method1(intern!(py, "_step_boundary"), (self.i, j))?;
                return Ok(());
            }
            Boundary::Session(s) => s.clone_ref(py),
        };
        // `RecordRun._sync` for one rank: a signal the handler noted, and
        // whether any object is checkpointed.
        let t0 = own_clock();
        let run = self.run.bind(py).clone();
        let signum: Option<i32> = run
            .getattr(intern!(py, "signals"))?
            .getattr(intern!(py, "received"))?
            .extract()?;
        let any = run.getattr(intern!(py, "objects"))?.is_truthy()?;
        let act = {
            let mut s = session.bind(py).borrow_mut();
            if let Some(signum) = signum {
                s.signal(signum);
            }
            s.set_objects(any);
            s.step_boundary(self.i, j, monotonic())
        };
        let out = match act {
            Ok(Some(act)) => {
                // The run's account must be current for what it does now.
                self.close(py)?;
                run.call_method1(intern!(py, "_between_steps"), (self.i, j, act))
                    .map(drop)
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        self.own += own_clock() - t0;
        out
    }

    fn heartbeat(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some(beat) = self.beat.as_mut() else {
            return Ok(());
        };
        let now = monotonic();
        if now < beat.next {
            return Ok(());
        }
        beat.next = now + 1.0;
        // SAFETY: one byte from a live buffer to a descriptor the run opened.
        let n = unsafe { libc::write(beat.fd, b".".as_ptr().cast(), 1) };
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // The supervisor is gone; training goes on.
            self.beat = None;
            self.run
                .bind(py)
                .setattr(intern!(py, "_beat_fd"), py.None())?;
        }
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepLoop>()?;
    Ok(())
}
