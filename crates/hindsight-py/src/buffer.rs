//! A Rust-owned byte buffer exposed through the buffer protocol, so loaded
//! tensors wrap the bytes read from disk without another copy.

use std::ffi::{c_int, c_void};

use hindsight_data::shared::Payload;
use pyo3::ffi;
use pyo3::prelude::*;

#[pyclass(module = "hindsight._native", frozen)]
#[derive(Debug)]
pub struct Buffer {
    /// Owned and unique, so handing out a writable pointer is sound.
    data: Payload,
    ptr: *mut u8,
}

// SAFETY: the buffer owns its allocation; Python serializes access through
// the buffer protocol like for bytearray.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn new(data: Vec<u8>) -> Self {
        Self::from_payload(Payload::from(data))
    }

    pub fn from_payload(mut data: Payload) -> Self {
        let ptr = data.as_mut_ptr();
        Buffer { data, ptr }
    }
}

#[pymethods]
impl Buffer {
    /// # Safety
    /// Called by CPython with a valid `view`.
    unsafe fn __getbuffer__(
        slf: PyRef<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        // Writable: torch.frombuffer warns on read-only buffers, and the
        // tensor built on it is the caller's to modify.
        // SAFETY: view is valid per the protocol; ptr/len describe our allocation,
        // which lives as long as the exporter object FillInfo keeps a reference to.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                slf.ptr as *mut c_void,
                slf.data.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython; nothing to release.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.data.len()
    }
}
