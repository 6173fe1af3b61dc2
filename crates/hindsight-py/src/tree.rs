//! Python objects <-> engine tree. Plain values are handled here; arrays go
//! through the `describe` / `make_array` callables of the Python layer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use hindsight_core::{self as core, Array, ArrayLib, Blob, Error, Node};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use crate::buffer::Buffer;
use crate::errors::to_py;

/// Below this size a tensor is always copied: cheaper than proving it unchanged.
const MIN_TRACKED_BYTES: usize = 64 << 10;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    key_path: String,
    ptr: usize,
    nbytes: usize,
    dtype: String,
    shape: Vec<u64>,
    device: String,
}

/// What the last save recorded about one tensor.
#[derive(Debug)]
pub struct CacheEntry {
    version: i64,
    fingerprint: Option<[u8; 32]>,
    blob: Blob,
    /// Holding the tensor keeps its memory from being reused by another
    /// tensor, so (address, version) cannot be fooled by recycling.
    _keep: Py<PyAny>,
}

#[derive(Debug)]
pub struct PartialEntry {
    version: i64,
    fingerprint: Option<[u8; 32]>,
    keep: Py<PyAny>,
}

impl PartialEntry {
    pub fn with_blob(self, blob: Blob) -> CacheEntry {
        CacheEntry {
            version: self.version,
            fingerprint: self.fingerprint,
            blob,
            _keep: self.keep,
        }
    }
}

/// A source of bytes kept alive by `SaveWalk::keepalive` for the whole save.
pub struct Source {
    ptr: usize,
    len: usize,
}

impl Source {
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len describe memory of a Python object (tensor, array,
        // bytes) held in `keepalive` until the save call returns.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

pub enum Slot {
    Stage(usize),
    Reuse(Blob),
}

pub struct SaveWalk<'a, 'py> {
    describe: &'a Bound<'py, PyAny>,
    materialize: &'a Bound<'py, PyAny>,
    old: &'a mut HashMap<CacheKey, CacheEntry>,
    skip: bool,
    pub slots: Vec<Slot>,
    pub sources: Vec<Source>,
    /// (key, entry, slot index): the cache after this save.
    pub new_cache: Vec<(CacheKey, PartialEntry, usize)>,
    pub keepalive: Vec<Py<PyAny>>,
    pub any_materialized: bool,
}

/// Sampled fingerprint: catches writes that bypass the version counter
/// (`param.data.add_(...)`), which change nearly every element.
fn fingerprint(src: &[u8]) -> [u8; 32] {
    const WINDOWS: usize = 64;
    const WIDTH: usize = 64;
    let mut h = blake3::Hasher::new();
    let step = (src.len() - WIDTH) / (WINDOWS - 1);
    for i in 0..WINDOWS {
        let off = i * step;
        h.update(&src[off..off + WIDTH]);
    }
    *h.finalize().as_bytes()
}

fn unsupported(path: &[String], type_name: String, hint: &str) -> PyErr {
    to_py(Error::UnsupportedType {
        key_path: path.join("/"),
        type_name,
        hint: hint.into(),
    })
}

impl<'a, 'py> SaveWalk<'a, 'py> {
    pub fn new(
        describe: &'a Bound<'py, PyAny>,
        materialize: &'a Bound<'py, PyAny>,
        old: &'a mut HashMap<CacheKey, CacheEntry>,
        skip: bool,
    ) -> Self {
        SaveWalk {
            describe,
            materialize,
            old,
            skip,
            slots: Vec::new(),
            sources: Vec::new(),
            new_cache: Vec::new(),
            keepalive: Vec::new(),
            any_materialized: false,
        }
    }

    fn stage(&mut self, ptr: usize, len: usize, keep: Py<PyAny>) -> usize {
        self.sources.push(Source { ptr, len });
        self.keepalive.push(keep);
        self.slots.push(Slot::Stage(self.sources.len() - 1));
        self.slots.len() - 1
    }

    fn key(&self, k: &Bound<'py, PyAny>, path: &[String]) -> PyResult<Node> {
        if let Ok(t) = k.cast::<PyTuple>() {
            return Ok(Node::Tuple(
                t.iter()
                    .map(|e| self.key(&e, path))
                    .collect::<PyResult<_>>()?,
            ));
        }
        if k.is_none()
            || k.is_instance_of::<PyBool>()
            || k.is_instance_of::<PyInt>()
            || k.is_instance_of::<PyFloat>()
            || k.is_instance_of::<PyString>()
        {
            let mut dummy = HashMap::new();
            let mut w = SaveWalk::new(self.describe, self.materialize, &mut dummy, false);
            return w.node(k, &mut path.to_vec());
        }
        Err(unsupported(
            path,
            format!("dict key of type {}", k.get_type().name()?),
            "dict keys must be str, int, float, bool, None or tuples of them",
        ))
    }

    pub fn node(&mut self, obj: &Bound<'py, PyAny>, path: &mut Vec<String>) -> PyResult<Node> {
        if obj.is_none() {
            return Ok(Node::None);
        }
        if let Ok(b) = obj.cast::<PyBool>() {
            return Ok(Node::Bool(b.is_true()));
        }
        if obj.is_instance_of::<PyInt>() {
            return Ok(match obj.extract::<i64>() {
                Ok(i) => Node::Int(i),
                Err(_) => Node::BigInt(obj.str()?.to_string()),
            });
        }
        if let Ok(f) = obj.cast::<PyFloat>() {
            return Ok(Node::Float(f.value().to_bits()));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return Ok(Node::Str(s.to_str()?.to_string()));
        }
        if let Ok(b) = obj.cast::<PyBytes>() {
            let bytes = b.as_bytes();
            let idx = self.stage(bytes.as_ptr() as usize, bytes.len(), obj.clone().unbind());
            let _ = idx;
            return Ok(Node::Bytes(Blob::default()));
        }
        if let Ok(b) = obj.cast::<PyByteArray>() {
            // Snapshot now: a bytearray may change after save returns.
            let copy = PyBytes::new(obj.py(), &b.to_vec());
            return self.node(copy.as_any(), path);
        }
        if let Ok(d) = obj.cast::<PyDict>() {
            let mut items = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                let key = self.key(&k, path)?;
                path.push(key.key_label());
                let val = self.node(&v, path)?;
                path.pop();
                items.push((key, val));
            }
            return Ok(Node::Dict(items));
        }
        if let Ok(l) = obj.cast::<PyList>() {
            let mut items = Vec::with_capacity(l.len());
            for (i, v) in l.iter().enumerate() {
                path.push(i.to_string());
                items.push(self.node(&v, path)?);
                path.pop();
            }
            return Ok(Node::List(items));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            let mut items = Vec::with_capacity(t.len());
            for (i, v) in t.iter().enumerate() {
                path.push(i.to_string());
                items.push(self.node(&v, path)?);
                path.pop();
            }
            return Ok(Node::Tuple(items));
        }
        // Anything else: ask the Python layer (torch, numpy, opt-in pickle).
        let d = self.describe.call1((obj, path.join("/")))?;
        let kind: String = d.get_item(0)?.extract()?;
        match kind.as_str() {
            "array" => self.array(&d, path),
            "pickle" => {
                let b = d.get_item(1)?;
                let bytes = b.cast::<PyBytes>()?.as_bytes();
                self.stage(bytes.as_ptr() as usize, bytes.len(), b.clone().unbind());
                Ok(Node::Pickle(Blob::default()))
            }
            "value" => self.node(&d.get_item(1)?, path),
            other => Err(unsupported(
                path,
                format!("describe() answered {other:?}"),
                "internal error",
            )),
        }
    }

    /// ("array", lib, dtype, shape, ptr, nbytes, keep, device, host, version)
    fn array(&mut self, d: &Bound<'py, PyAny>, path: &[String]) -> PyResult<Node> {
        let lib = match d.get_item(1)?.extract::<String>()?.as_str() {
            "torch" => ArrayLib::Torch,
            _ => ArrayLib::Numpy,
        };
        let dtype: String = d.get_item(2)?.extract()?;
        let shape: Vec<u64> = d.get_item(3)?.extract()?;
        let ptr: usize = d.get_item(4)?.extract()?;
        let nbytes: usize = d.get_item(5)?.extract()?;
        let keep = d.get_item(6)?;
        let device: String = d.get_item(7)?.extract()?;
        let host: bool = d.get_item(8)?.extract()?;
        let version: Option<i64> = d.get_item(9)?.extract()?;
        let expected =
            core::format::itemsize(lib, &dtype).map(|s| s * shape.iter().product::<u64>());
        if expected != Some(nbytes as u64) {
            return Err(unsupported(
                path,
                format!("array of dtype {dtype}"),
                "dtype not supported by the format",
            ));
        }
        let node = Node::Array(Box::new(Array {
            lib,
            dtype: dtype.clone(),
            shape: shape.clone(),
            byte_order: "little".into(),
            device: Some(device.clone()),
            data: Blob::default(),
        }));
        let tracked = self.skip && version.is_some() && nbytes >= MIN_TRACKED_BYTES;
        let key = CacheKey {
            key_path: path.join("/"),
            ptr,
            nbytes,
            dtype,
            shape,
            device,
        };
        let fp = |ptr: usize| host.then(|| fingerprint(Source { ptr, len: nbytes }.as_slice()));
        if tracked {
            let version = version.unwrap_or_default();
            let fingerprint = fp(ptr);
            if let Some(old) = self.old.remove(&key) {
                if old.version == version && old.fingerprint == fingerprint {
                    self.slots.push(Slot::Reuse(old.blob));
                    let e = PartialEntry {
                        version,
                        fingerprint,
                        keep: keep.clone().unbind(),
                    };
                    self.new_cache.push((key, e, self.slots.len() - 1));
                    return Ok(node);
                }
            }
            let slot = self.stage_array(ptr, nbytes, &keep, host)?;
            let e = PartialEntry {
                version,
                fingerprint,
                keep: keep.unbind(),
            };
            self.new_cache.push((key, e, slot));
        } else {
            self.stage_array(ptr, nbytes, &keep, host)?;
        }
        Ok(node)
    }

    fn stage_array(
        &mut self,
        ptr: usize,
        nbytes: usize,
        keep: &Bound<'py, PyAny>,
        host: bool,
    ) -> PyResult<usize> {
        if host {
            return Ok(self.stage(ptr, nbytes, keep.clone().unbind()));
        }
        // Device memory: the Python layer starts an async copy into a pinned
        // host buffer; `before_copy` waits for all of them.
        let r = self.materialize.call1((keep,))?;
        let hptr: usize = r.get_item(0)?.extract()?;
        self.any_materialized = true;
        Ok(self.stage(hptr, nbytes, r.get_item(1)?.unbind()))
    }
}

/// Put the staged / reused blobs into the tree (same order as the walk) and
/// return the final blob of every slot.
pub fn fill_blobs(root: &mut Node, slots: Vec<Slot>, staged: Vec<Blob>) -> Vec<Blob> {
    let mut out = Vec::with_capacity(slots.len());
    let mut it = slots.into_iter();
    root.for_each_blob_mut(&mut |b| {
        let blob = match it.next() {
            Some(Slot::Stage(i)) => staged.get(i).cloned().unwrap_or_default(),
            Some(Slot::Reuse(blob)) => blob,
            None => Blob::default(),
        };
        *b = blob.clone();
        out.push(blob);
    });
    out
}

/// Read every blob under `node`, verifying each chunk, on `threads` threads.
pub fn read_blobs(
    store: &core::Store,
    checkpoint: &str,
    node: &Node,
    base: &[String],
    threads: usize,
    cancel: &(dyn Fn() -> bool + Sync),
) -> core::Result<Vec<Vec<u8>>> {
    let mut blobs: Vec<(String, Blob)> = Vec::new();
    node.for_each_blob(&mut base.to_vec(), &mut |p, b| {
        blobs.push((p.join("/"), b.clone()))
    });
    let mut buffers: Vec<Vec<u8>> = blobs
        .iter()
        .map(|(_, b)| core::mem::zeroed(b.nbytes as usize))
        .collect();
    let mut work = Vec::new();
    for ((key, blob), buf) in blobs.iter().zip(buffers.iter_mut()) {
        let mut rest: &mut [u8] = buf;
        for c in &blob.chunks {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len as usize);
            work.push((head, c.id, key.as_str()));
            rest = tail;
        }
    }
    let total = work.len();
    let queue = Mutex::new(work.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let done = AtomicUsize::new(0);
    let run = || loop {
        if failed.lock().map(|f| f.is_some()).unwrap_or(true) {
            return;
        }
        if cancel() {
            let _ = failed.lock().map(|mut f| {
                f.get_or_insert(Error::Cancelled("load interrupted".into()))
                    .to_string()
            });
            return;
        }
        let item = queue.lock().ok().and_then(|mut q| q.next());
        let Some((dest, id, key)) = item else { return };
        if let Err(e) = store.read_chunk_into(&id, dest) {
            if let Ok(mut f) = failed.lock() {
                f.get_or_insert(e.in_checkpoint(checkpoint, key));
            }
            return;
        }
        done.fetch_add(1, Ordering::Relaxed);
    };
    let threads = threads.clamp(1, 16).min(total.max(1));
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(buffers)
}

/// Build Python objects from a tree and the buffers `read_blobs` returned.
pub fn build<'py>(
    py: Python<'py>,
    node: &Node,
    buffers: &mut std::vec::IntoIter<Vec<u8>>,
    make_array: &Bound<'py, PyAny>,
    unpickle: &Bound<'py, PyAny>,
    path: &mut Vec<String>,
) -> PyResult<Bound<'py, PyAny>> {
    let next = |buffers: &mut std::vec::IntoIter<Vec<u8>>| buffers.next().unwrap_or_default();
    Ok(match node {
        Node::None => py.None().into_bound(py),
        Node::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Node::Int(i) => i.into_pyobject(py)?.into_any(),
        Node::BigInt(s) => py.get_type::<PyInt>().call1((s.as_str(),))?,
        Node::Float(bits) => PyFloat::new(py, f64::from_bits(*bits)).into_any(),
        Node::Str(s) => PyString::new(py, s).into_any(),
        Node::Bytes(_) => PyBytes::new(py, &next(buffers)).into_any(),
        Node::Pickle(_) => {
            let b = PyBytes::new(py, &next(buffers));
            unpickle.call1((b, path.join("/")))?
        }
        Node::List(items) => {
            let l = PyList::empty(py);
            for (i, n) in items.iter().enumerate() {
                path.push(i.to_string());
                l.append(build(py, n, buffers, make_array, unpickle, path)?)?;
                path.pop();
            }
            l.into_any()
        }
        Node::Tuple(items) => {
            let mut v = Vec::with_capacity(items.len());
            for (i, n) in items.iter().enumerate() {
                path.push(i.to_string());
                v.push(build(py, n, buffers, make_array, unpickle, path)?);
                path.pop();
            }
            PyTuple::new(py, v)?.into_any()
        }
        Node::Dict(items) => {
            let d = PyDict::new(py);
            for (k, v) in items {
                let key = build(py, k, buffers, make_array, unpickle, path)?;
                path.push(k.key_label());
                let val = build(py, v, buffers, make_array, unpickle, path)?;
                path.pop();
                d.set_item(key, val)?;
            }
            d.into_any()
        }
        Node::Array(a) => {
            let lib = match a.lib {
                ArrayLib::Torch => "torch",
                ArrayLib::Numpy => "numpy",
            };
            let buf = Bound::new(py, Buffer::new(next(buffers)))?;
            let shape = PyTuple::new(py, a.shape.iter())?;
            make_array.call1((
                lib,
                a.dtype.as_str(),
                shape,
                buf,
                a.device.as_deref(),
                path.join("/"),
            ))?
        }
    })
}
