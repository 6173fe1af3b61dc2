//! What the Python layer answers when the tree walk meets an object it does
//! not know (`describe(obj, key)`): typed, not a positional tuple.
//! - [`ArrayView`]: a tensor's or array's bytes, where they are and how to
//!   prove them unchanged;
//! - [`Pickled`]: an object the caller allowed to pickle, as its bytes;
//! - any other object: a plain value stored in its place (a numpy scalar
//!   as the equivalent Python scalar).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A tensor or array as a save reads it.
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Debug)]
pub(crate) struct ArrayView {
    /// "torch" or "numpy".
    pub(crate) lib: String,
    /// torch: the name after `torch.`; numpy: `dtype.str`.
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
    /// Address of the first byte (contiguous, little-endian).
    pub(crate) ptr: usize,
    pub(crate) nbytes: usize,
    /// What keeps the memory alive while the save reads it.
    pub(crate) owner: Py<PyAny>,
    /// "cpu", "cuda:0", ...
    pub(crate) device: String,
    /// The bytes are in host memory (else a device copy is made).
    pub(crate) host: bool,
    /// torch's version counter (None: numpy, no counter).
    pub(crate) version: Option<i64>,
    /// A piece of a sharded array (a DTensor's local shard): the whole
    /// array's shape and where this piece starts in it.
    pub(crate) global_shape: Option<Vec<u64>>,
    pub(crate) offset: Option<Vec<u64>>,
}

#[pymethods]
impl ArrayView {
    #[new]
    #[pyo3(signature = (*, lib, dtype, shape, ptr, nbytes, owner, device, host, version=None, global_shape=None, offset=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        lib: String,
        dtype: String,
        shape: Vec<u64>,
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        device: String,
        host: bool,
        version: Option<i64>,
        global_shape: Option<Vec<u64>>,
        offset: Option<Vec<u64>>,
    ) -> PyResult<Self> {
        // The writer reads `nbytes` from `ptr`: memory that is not there
        // (a tensor subclass without storage of its own) must never get in.
        if ptr == 0 && nbytes > 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "ArrayView of {nbytes} bytes at a null address ({lib} {dtype} on {device})"
            )));
        }
        Ok(ArrayView {
            lib,
            dtype,
            shape,
            ptr,
            nbytes,
            owner,
            device,
            host,
            version,
            global_shape,
            offset,
        })
    }
}

/// An object stored as pickled bytes (only where the caller allowed it).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
#[derive(Debug)]
pub(crate) struct Pickled {
    pub(crate) data: Py<PyBytes>,
}

#[pymethods]
impl Pickled {
    #[new]
    fn new(data: Py<PyBytes>) -> Self {
        Pickled { data }
    }
}
