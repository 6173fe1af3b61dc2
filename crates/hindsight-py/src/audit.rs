//! The recording's watch on files opened for writing, as a C-level audit
//! hook (PEP 578).
//!
//! A hook added with `sys.addaudithook` is a Python call for every audit
//! event the process raises, and most are not `open`: an optimizer's step
//! raises `builtins.id` once per parameter group and state lookup (minGPT:
//! 145 an iteration), each 87 ns through a Python hook against 29 ns for
//! the bare `id()`. This hook compares the event's name in C and calls the
//! Python watcher for `open` alone.
//!
//! `PySys_AddAuditHook` is not in the limited API, so it is declared here:
//! every CPython since 3.8 exports it, and the extension resolves it from
//! the interpreter that loads it, as it does every other `Py*` symbol.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

type Hook = unsafe extern "C" fn(*const c_char, *mut ffi::PyObject, *mut c_void) -> c_int;

unsafe extern "C" {
    fn PySys_AddAuditHook(hook: Hook, user_data: *mut c_void) -> c_int;
}

/// The Python function called as `watcher(args)` for each `open` event. A
/// hook cannot be removed, so there is one per process, set once.
static WATCHER: OnceLock<Py<PyAny>> = OnceLock::new();

unsafe extern "C" fn hook(event: *const c_char, args: *mut ffi::PyObject, _: *mut c_void) -> c_int {
    // SAFETY: CPython passes a NUL-terminated event name.
    if unsafe { CStr::from_ptr(event) }.to_bytes() != b"open" || args.is_null() {
        return 0;
    }
    let Some(watcher) = WATCHER.get() else {
        return 0;
    };
    // SAFETY: audit hooks run with the calling thread attached (it holds
    // the GIL), and `args` is a borrowed reference to the event's tuple.
    let py = unsafe { Python::assume_attached() };
    let args = unsafe { Bound::from_borrowed_ptr(py, args) };
    let Ok(args) = args.cast_into::<PyTuple>() else {
        return 0;
    };
    match watcher.bind(py).call1(args) {
        Ok(_) => 0,
        Err(e) => {
            // The open is refused with the watcher's exception (a replay
            // worker's write the mirror cannot redirect).
            e.restore(py);
            -1
        }
    }
}

/// Call `watcher(path, mode, flags)` for every `open` audit event of the
/// process from now on. Once per process: a second call is refused.
#[pyfunction]
pub(crate) fn watch_opens(py: Python<'_>, watcher: Py<PyAny>) -> PyResult<()> {
    if WATCHER.set(watcher).is_err() {
        return Err(PyRuntimeError::new_err(
            "watch_opens: this process already has its open watcher (an audit hook cannot be removed)",
        ));
    }
    // SAFETY: `hook` is a valid audit hook for the life of the process;
    // adding one after start-up is allowed (it raises `sys.addaudithook`).
    let rc = unsafe { PySys_AddAuditHook(hook, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(PyErr::take(py).unwrap_or_else(|| {
            PyRuntimeError::new_err("watch_opens: the interpreter refused the audit hook")
        }));
    }
    Ok(())
}
