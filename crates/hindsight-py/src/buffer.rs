//! A Rust-owned byte buffer exposed through the buffer protocol, so loaded
//! tensors wrap the bytes read from disk without another copy.

use std::ffi::{c_int, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

#[pyclass(module = "hindsight._native", frozen)]
#[derive(Debug)]
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its allocation; Python serializes access through
// the buffer protocol like for bytearray.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn new(data: Vec<u8>) -> Self {
        let b = data.into_boxed_slice();
        let len = b.len();
        Buffer {
            ptr: Box::into_raw(b) as *mut u8,
            len,
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from Box::into_raw of a boxed slice of this length.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.len,
            )))
        };
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
                slf.len as ffi::Py_ssize_t,
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
        self.len
    }
}
