//! The batch fingerprint's walk (`runs::db::BatchDigest`), native: one call
//! per step instead of a Python recursion over the batch.
//!
//! The walk emits the same parts as it always has (recordings made before
//! it stay comparable): a description per node, and the bytes of every
//! tensor or array. Containers, scalars and plain objects are walked here;
//! a CPU tensor that is contiguous and small enough to hash whole is read
//! in place. Everything else tensor- or array-like (numpy arrays, device,
//! sparse or sampled tensors, tensor subclasses) goes to the `leaf`
//! callable Python gives, which knows torch and numpy and returns its parts.

use hindsight_core::runs::db::BatchDigest;
use pyo3::buffer::PyBuffer;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};

use crate::interrupt;

/// Nesting below this is described by its type only.
const MAX_DEPTH: usize = 8;
/// A scalar's description is cut at this many characters.
const MAX_TEXT: usize = 4096;
/// Below this many bytes hashing is quicker than releasing the GIL.
const DETACH_BYTES: usize = 256 << 10;
/// An object's attributes are walked when it has at most this many.
const MAX_FIELDS: usize = 64;
/// Small parts are gathered up to this many bytes before they are hashed.
const SMALL_BYTES: usize = 4096;

enum Part {
    Text(String),
    /// An int, described as `int {v}` (a sampler's index: a batch has
    /// dozens, so no string is made for each).
    Int(i64),
    /// A CPU tensor's memory, read in place (`_owner` keeps it alive).
    Raw {
        ptr: usize,
        len: usize,
        _owner: Py<PyAny>,
    },
    Buffer(PyBuffer<u8>),
}

impl Part {
    fn len(&self) -> usize {
        match self {
            Part::Text(t) => t.len(),
            Part::Int(_) => 24,
            Part::Raw { len, .. } => *len,
            Part::Buffer(b) => b.len_bytes(),
        }
    }
}

/// Fingerprints what one training step consumed (`hindsight._run.batches`).
#[pyclass(module = "hindsight._native", frozen)]
pub(crate) struct BatchPrinter {
    /// Exact types read in place when CPU, strided and contiguous.
    plain_tensors: Vec<Py<PyAny>>,
    /// Types handed to `leaf` (torch.Tensor, numpy.ndarray, as loaded).
    leaf_types: Vec<Py<PyAny>>,
    strided: Option<Py<PyAny>>,
    /// A tensor above this is sampled (by `leaf`), not hashed whole.
    full_bytes: usize,
    leaf: Py<PyAny>,
}

#[pymethods]
impl BatchPrinter {
    #[new]
    #[pyo3(signature = (plain_tensors, leaf_types, strided, full_bytes, leaf))]
    fn new(
        plain_tensors: Vec<Py<PyAny>>,
        leaf_types: Vec<Py<PyAny>>,
        strided: Option<Py<PyAny>>,
        full_bytes: usize,
        leaf: Py<PyAny>,
    ) -> Self {
        Self {
            plain_tensors,
            leaf_types,
            strided,
            full_bytes,
            leaf,
        }
    }

    /// The fingerprint of `batch`, as 32 hex digits.
    fn digest(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<String> {
        let mut parts = Vec::new();
        self.walk(batch, &mut parts, 0)?;
        digest_parts(py, &parts)
    }

    /// The fingerprints of a step's batch and of the sampler's indices it
    /// was drawn by: one call a step.
    fn digest_with_order(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, PyAny>,
        order: &Bound<'_, PyAny>,
    ) -> PyResult<StepPrints> {
        Ok(StepPrints {
            batch: self.digest(py, batch)?,
            order: self.digest(py, order)?,
        })
    }
}

/// A step's two fingerprints (`BatchPrinter.digest_with_order`).
#[pyclass(module = "hindsight._native", frozen, get_all, skip_from_py_object)]
pub(crate) struct StepPrints {
    batch: String,
    order: String,
}

/// The fingerprint over `parts` in order (`BatchDigest`), hashed with the
/// GIL released where they are large. Their owners (`Py`, exported
/// buffers) stay with the caller, alive and dropped with the GIL.
fn digest_parts(py: Python<'_>, parts: &[Part]) -> PyResult<String> {
    let hash = || {
        let mut d = BatchDigest::new();
        // Small parts are framed into one buffer and hashed in one go (the
        // same fingerprint): a sampler's 64 indices are 64 parts.
        let mut small = Vec::with_capacity(SMALL_BYTES);
        for p in parts {
            let large = match p {
                Part::Text(t) => {
                    BatchDigest::frame(&mut small, t.as_bytes());
                    None
                }
                Part::Int(v) => {
                    let mut text = [0u8; 24];
                    let n = int_text(*v, &mut text);
                    BatchDigest::frame(&mut small, &text[..n]);
                    None
                }
                // SAFETY: the tensor is held by `_owner` and was contiguous
                // over `len` bytes from `ptr` when read.
                Part::Raw { ptr, len, .. } => {
                    Some(unsafe { std::slice::from_raw_parts(*ptr as *const u8, *len) })
                }
                // SAFETY: checked C-contiguous when taken; the buffer stays
                // exported while `parts` lives.
                Part::Buffer(b) => Some(unsafe {
                    std::slice::from_raw_parts(b.buf_ptr() as *const u8, b.len_bytes())
                }),
            };
            if large.is_some() || small.len() >= SMALL_BYTES {
                d.framed(&small);
                small.clear();
            }
            if let Some(bytes) = large {
                d.part(bytes);
            }
        }
        d.framed(&small);
        d.finish()
    };
    if parts.iter().map(Part::len).sum::<usize>() < DETACH_BYTES {
        return Ok(hash());
    }
    interrupt::run(py, |_| Ok::<_, hindsight_core::Error>(hash()))
}

/// A part of an explicit fingerprint: a description or a buffer's bytes.
#[derive(FromPyObject)]
enum DigestPart {
    Text(String),
    Bytes(PyBuffer<u8>),
}

/// The fingerprint of explicit parts, in order: what `BatchPrinter.digest`
/// hashes for a batch, spelled out (the format's reference in tests).
#[pyfunction]
fn batch_digest(py: Python<'_>, parts: Vec<DigestPart>) -> PyResult<String> {
    let parts = parts
        .into_iter()
        .map(|p| match p {
            DigestPart::Text(t) => Ok(Part::Text(t)),
            DigestPart::Bytes(b) if b.is_c_contiguous() => Ok(Part::Buffer(b)),
            DigestPart::Bytes(_) => Err(pyo3::exceptions::PyValueError::new_err(
                "batch_digest: buffers must be C-contiguous",
            )),
        })
        .collect::<PyResult<Vec<_>>>()?;
    digest_parts(py, &parts)
}

impl BatchPrinter {
    fn walk(&self, x: &Bound<'_, PyAny>, parts: &mut Vec<Part>, depth: usize) -> PyResult<()> {
        let py = x.py();
        let ty = x.get_type();
        if self.plain_tensors.iter().any(|t| ty.is(t.bind(py))) && self.read_in_place(x, parts)? {
            return Ok(());
        }
        if x.is_exact_instance_of::<PyInt>() {
            // A sampler's indices: Python's repr of an int is its digits.
            if let Ok(v) = x.extract::<i64>() {
                parts.push(Part::Int(v));
                return Ok(());
            }
        }
        // Scalars before the leaf types: no type is both, and an
        // isinstance check against torch.Tensor is the dearer one.
        if x.is_none()
            || x.is_instance_of::<PyBool>()
            || x.is_instance_of::<PyInt>()
            || x.is_instance_of::<PyFloat>()
            || x.is_instance_of::<PyString>()
            || x.is_instance_of::<PyBytes>()
        {
            let text = format!("{} {}", ty.name()?, x.repr()?);
            parts.push(Part::Text(cut(text)));
            return Ok(());
        }
        let plain_container = x.is_exact_instance_of::<PyList>()
            || x.is_exact_instance_of::<PyTuple>()
            || x.is_exact_instance_of::<PyDict>();
        if !plain_container {
            for t in &self.leaf_types {
                if x.is_instance(t.bind(py))? {
                    return self.leaf(x, parts);
                }
            }
        }
        if depth >= MAX_DEPTH {
            parts.push(Part::Text(ty.qualname()?.to_string()));
        } else if x.is_instance_of::<PyList>() || x.is_instance_of::<PyTuple>() {
            parts.push(Part::Text(format!("{} {}", ty.qualname()?, x.len()?)));
            for v in x.try_iter()? {
                self.walk(&v?, parts, depth + 1)?;
            }
        } else if let Ok(m) = x.cast::<PyMapping>() {
            parts.push(Part::Text(format!("{} {}", ty.qualname()?, m.len()?)));
            for kv in x.call_method0(intern!(py, "items"))?.try_iter()? {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = kv?.extract()?;
                parts.push(Part::Text(k.str()?.to_string()));
                self.walk(&v, parts, depth + 1)?;
            }
        } else {
            // Another object (a framework's batch class): its attributes,
            // if plain, else only its type.
            parts.push(Part::Text(ty.qualname()?.to_string()));
            if let Some(fields) = x.getattr_opt(intern!(py, "__dict__"))? {
                if let Ok(d) = fields.cast::<PyDict>() {
                    if d.len() <= MAX_FIELDS {
                        self.walk(&fields, parts, depth + 1)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A plain CPU tensor's description and bytes, read in place; false
    /// (nothing pushed) where `leaf` must do it.
    fn read_in_place(&self, t: &Bound<'_, PyAny>, parts: &mut Vec<Part>) -> PyResult<bool> {
        let py = t.py();
        let Some(strided) = &self.strided else {
            return Ok(false);
        };
        if !t.getattr(intern!(py, "layout"))?.is(strided.bind(py))
            || !t.getattr(intern!(py, "is_cpu"))?.is_truthy()?
            || !t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?
        {
            return Ok(false);
        }
        let shape: Vec<usize> = t.getattr(intern!(py, "shape"))?.extract()?;
        let len = shape.iter().product::<usize>()
            * t.call_method0(intern!(py, "element_size"))?
                .extract::<usize>()?;
        if len > self.full_bytes {
            return Ok(false);
        }
        let dtype = t.getattr(intern!(py, "dtype"))?.str()?.to_string();
        parts.push(Part::Text(format!("tensor {dtype} {}", tuple_repr(&shape))));
        if len > 0 {
            let ptr: usize = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
            parts.push(Part::Raw {
                ptr,
                len,
                _owner: t.clone().unbind(),
            });
        }
        Ok(true)
    }

    fn leaf(&self, x: &Bound<'_, PyAny>, parts: &mut Vec<Part>) -> PyResult<()> {
        let out = self.leaf.bind(x.py()).call1((x,))?;
        for p in out.try_iter()? {
            let p = p?;
            if let Ok(s) = p.cast::<PyString>() {
                parts.push(Part::Text(s.to_string()));
                continue;
            }
            let b = PyBuffer::<u8>::get(&p)?;
            if !b.is_c_contiguous() {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "batch fingerprint: a leaf's buffers must be C-contiguous",
                ));
            }
            parts.push(Part::Buffer(b));
        }
        Ok(())
    }
}

/// `int {v}` written into `out`; its length.
fn int_text(v: i64, out: &mut [u8; 24]) -> usize {
    use std::io::Write as _;
    let mut w = &mut out[..];
    write!(w, "int {v}").expect("24 bytes hold `int ` and any i64");
    24 - w.len()
}

/// Python's repr of a tuple of ints: `()`, `(8,)`, `(8, 32)`.
fn tuple_repr(shape: &[usize]) -> String {
    match shape {
        [] => "()".into(),
        [n] => format!("({n},)"),
        _ => {
            let inner: Vec<String> = shape.iter().map(usize::to_string).collect();
            format!("({})", inner.join(", "))
        }
    }
}

/// The first `MAX_TEXT` characters (Python's `text[:4096]`).
fn cut(text: String) -> String {
    match text.char_indices().nth(MAX_TEXT) {
        Some((at, _)) => text[..at].to_string(),
        None => text,
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(batch_digest, m)?)?;
    m.add_class::<StepPrints>()?;
    m.add_class::<BatchPrinter>()
}
