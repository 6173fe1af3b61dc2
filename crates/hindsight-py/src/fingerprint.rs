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
use std::sync::Mutex;

use crate::interrupt;

/// Nesting below this is described by its type only.
const MAX_DEPTH: usize = 8;
/// A scalar's description is cut at this many characters.
const MAX_TEXT: usize = 4096;
/// Below this many bytes hashing is quicker than releasing the GIL.
const DETACH_BYTES: usize = 256 << 10;
/// An object's attributes are walked when it has at most this many.
const MAX_FIELDS: usize = 64;

/// A part hashed from where it lies, not copied into the framed buffer.
enum Large {
    /// A CPU tensor's memory, read in place (`_owner` keeps it alive).
    Raw {
        ptr: usize,
        len: usize,
        _owner: Py<PyAny>,
    },
    Buffer(PyBuffer<u8>),
}

impl Large {
    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the tensor is held by `_owner` and was contiguous
            // over `len` bytes from `ptr` when read.
            Large::Raw { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(*ptr as *const u8, *len)
            },
            // SAFETY: checked C-contiguous when taken; the buffer stays
            // exported while it lives.
            Large::Buffer(b) => unsafe {
                std::slice::from_raw_parts(b.buf_ptr() as *const u8, b.len_bytes())
            },
        }
    }
}

/// A walk's parts in order: every description framed into one buffer as
/// it is found (no string per part), and the tensors' bytes where they
/// lie, each with the length of `framed` when it came. The fingerprint
/// hashes the framed stream of all of them (`BatchDigest`), which is the
/// same however it is cut into calls.
#[derive(Default)]
struct Parts {
    framed: Vec<u8>,
    large: Vec<(usize, Large)>,
    large_bytes: usize,
    /// Where the description being written starts (`begin_text`).
    open: usize,
}

impl Parts {
    fn text(&mut self, t: &str) {
        BatchDigest::frame(&mut self.framed, t.as_bytes());
    }

    /// A description written by `write` straight into the buffer, framed.
    fn text_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        self.begin_text(&[]);
        write(&mut self.framed);
        self.end_text();
    }

    /// Start a description with `pieces`; the caller appends the rest to
    /// `framed`, then ends it (or drops it).
    fn begin_text(&mut self, pieces: &[&str]) {
        self.open = self.framed.len();
        self.framed.extend_from_slice(&[0; 8]);
        for p in pieces {
            self.framed.extend_from_slice(p.as_bytes());
        }
    }

    /// The description begun last is complete: its length goes before it.
    fn end_text(&mut self) {
        let at = self.open;
        let n = (self.framed.len() - at - 8) as u64;
        self.framed[at..at + 8].copy_from_slice(&n.to_le_bytes());
    }

    fn drop_text(&mut self) {
        self.framed.truncate(self.open);
    }

    fn large(&mut self, part: Large) {
        self.large_bytes += part.bytes().len();
        self.large.push((self.framed.len(), part));
    }

    fn hash(&self) -> String {
        let mut d = BatchDigest::new();
        let mut from = 0;
        for (at, part) in &self.large {
            d.framed(&self.framed[from..*at]);
            d.part(part.bytes());
            from = *at;
        }
        d.framed(&self.framed[from..]);
        d.finish()
    }

    fn clear(&mut self) {
        self.framed.clear();
        self.large.clear();
        self.large_bytes = 0;
    }
}

thread_local! {
    /// The framed buffer kept between steps: a step's descriptions are
    /// written into memory already there.
    static SPARE: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
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
    /// Each dtype met (torch's dtypes are singletons): its text and element
    /// size, so that a tensor costs neither `str(dtype)` nor `element_size()`.
    dtypes: Mutex<Vec<(Py<PyAny>, String, usize)>>,
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
            dtypes: Mutex::new(Vec::new()),
        }
    }

    /// The fingerprint of `batch`, as 32 hex digits.
    pub(crate) fn digest(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<String> {
        let mut parts = Parts {
            framed: SPARE.take(),
            ..Parts::default()
        };
        parts.framed.clear();
        let out = self
            .walk(batch, &mut parts, 0)
            .and_then(|()| digest_parts(py, &parts));
        // Tensors are let go here, with the GIL; the buffer is kept.
        parts.clear();
        SPARE.set(parts.framed);
        out
    }
}

/// The fingerprint of `parts`, hashed with the GIL released where they
/// are large. Their owners (`Py`, exported buffers) stay with the caller,
/// alive and dropped with the GIL.
fn digest_parts(py: Python<'_>, parts: &Parts) -> PyResult<String> {
    if parts.framed.len() + parts.large_bytes < DETACH_BYTES {
        return Ok(parts.hash());
    }
    interrupt::run(py, |_| Ok::<_, hindsight_core::Error>(parts.hash()))
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
    let mut out = Parts::default();
    for p in parts {
        match p {
            DigestPart::Text(t) => out.text(&t),
            DigestPart::Bytes(b) if b.is_c_contiguous() => out.large(Large::Buffer(b)),
            DigestPart::Bytes(_) => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "batch_digest: buffers must be C-contiguous",
                ))
            }
        }
    }
    digest_parts(py, &out)
}

impl BatchPrinter {
    fn walk(&self, x: &Bound<'_, PyAny>, parts: &mut Parts, depth: usize) -> PyResult<()> {
        let py = x.py();
        let ty = x.get_type();
        if self.plain_tensors.iter().any(|t| ty.is(t.bind(py))) && self.read_in_place(x, parts)? {
            return Ok(());
        }
        if x.is_exact_instance_of::<PyInt>() {
            // A sampler's indices: Python's repr of an int is its digits.
            if let Ok(v) = x.extract::<i64>() {
                parts.text_with(|b| {
                    b.extend_from_slice(b"int ");
                    push_int(b, v.unsigned_abs(), v < 0);
                });
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
            parts.text(cut(&text));
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
            parts.text(&ty.qualname()?.to_string_lossy());
        } else if x.is_instance_of::<PyList>() || x.is_instance_of::<PyTuple>() {
            let name = ty.qualname()?;
            let n = x.len()?;
            parts.text_with(|b| {
                b.extend_from_slice(name.to_string_lossy().as_bytes());
                b.push(b' ');
                push_int(b, n as u64, false);
            });
            for v in x.try_iter()? {
                self.walk(&v?, parts, depth + 1)?;
            }
        } else if let Ok(m) = x.cast::<PyMapping>() {
            parts.text(&format!("{} {}", ty.qualname()?, m.len()?));
            for kv in x.call_method0(intern!(py, "items"))?.try_iter()? {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = kv?.extract()?;
                parts.text(&k.str()?.to_string_lossy());
                self.walk(&v, parts, depth + 1)?;
            }
        } else {
            // Another object (a framework's batch class): its attributes,
            // if plain, else only its type.
            parts.text(&ty.qualname()?.to_string_lossy());
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
    fn read_in_place(&self, t: &Bound<'_, PyAny>, parts: &mut Parts) -> PyResult<bool> {
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
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let item = {
            let mut known = self.dtypes.lock().unwrap_or_else(|e| e.into_inner());
            match known.iter().find(|(d, ..)| d.bind(py).is(&dtype)) {
                Some((_, name, size)) => {
                    parts.begin_text(&["tensor ", name, " "]);
                    *size
                }
                None => {
                    let size = t.call_method0(intern!(py, "element_size"))?.extract()?;
                    let name = dtype.str()?.to_string_lossy().into_owned();
                    parts.begin_text(&["tensor ", &name, " "]);
                    known.push((dtype.unbind(), name, size));
                    size
                }
            }
        };
        // The shape as Python's repr of a tuple: `()`, `(8,)`, `(8, 32)`.
        let shape = t.getattr(intern!(py, "shape"))?;
        let shape = shape.cast::<PyTuple>()?;
        let mut len = item;
        parts.framed.push(b'(');
        for (k, d) in shape.iter().enumerate() {
            let d: usize = d.extract()?;
            len = len.saturating_mul(d);
            if k > 0 {
                parts.framed.extend_from_slice(b", ");
            }
            push_int(&mut parts.framed, d as u64, false);
        }
        if shape.len() == 1 {
            parts.framed.push(b',');
        }
        parts.framed.push(b')');
        if len > self.full_bytes {
            parts.drop_text();
            return Ok(false);
        }
        parts.end_text();
        if len > 0 {
            let ptr: usize = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
            parts.large(Large::Raw {
                ptr,
                len,
                _owner: t.clone().unbind(),
            });
        }
        Ok(true)
    }

    fn leaf(&self, x: &Bound<'_, PyAny>, parts: &mut Parts) -> PyResult<()> {
        let out = self.leaf.bind(x.py()).call1((x,))?;
        for p in out.try_iter()? {
            let p = p?;
            if let Ok(s) = p.cast::<PyString>() {
                parts.text(&s.to_string_lossy());
                continue;
            }
            let b = PyBuffer::<u8>::get(&p)?;
            if !b.is_c_contiguous() {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "batch fingerprint: a leaf's buffers must be C-contiguous",
                ));
            }
            parts.large(Large::Buffer(b));
        }
        Ok(())
    }
}

/// A number in decimal, as Python's repr writes an int.
fn push_int(out: &mut Vec<u8>, magnitude: u64, negative: bool) {
    let mut digits = [0u8; 20];
    let mut n = magnitude;
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if negative {
        out.push(b'-');
    }
    out.extend_from_slice(&digits[at..]);
}

/// The first `MAX_TEXT` characters (Python's `text[:4096]`).
fn cut(text: &str) -> &str {
    match text.char_indices().nth(MAX_TEXT) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(batch_digest, m)?)?;
    m.add_class::<BatchPrinter>()
}
