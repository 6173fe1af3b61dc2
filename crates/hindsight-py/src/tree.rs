//! Python objects <-> engine tree. Plain values are handled here; arrays go
//! through the `describe` / `make_array` callables of the Python layer.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use hindsight_core::{self as core, Array, ArrayLib, Blob, Error, Fingerprint, Lent, Node};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use crate::buffer::Buffer;
use crate::describe::{ArrayView, Pickled};
use crate::errors::to_py;

pub(crate) use core::checkpoint::save::{Filled, Slot};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey {
    key_path: String,
    ptr: usize,
    nbytes: usize,
    dtype: String,
    shape: Vec<u64>,
    device: String,
}

/// Proof of what a tensor held when it was saved.
#[derive(Debug)]
pub(crate) enum Content {
    /// Host memory: the engine's full-content fingerprint.
    Host(Fingerprint),
    /// Device memory: the device fingerprint of the bytes the save copied
    /// to the host, summed by the writer's threads as they write them
    /// (incomplete until then: the tensor is not proven, so it is copied again).
    Device(DeviceFp),
}

/// The device fingerprint of a saved copy, summed in the background.
pub(crate) type DeviceFp = Arc<core::DeviceFpSum>;

/// How a tracked tensor's content will be proven at the next save.
#[derive(Debug)]
enum Proof {
    /// By the fingerprint staging computes (host memory).
    Host,
    /// By the device fingerprint of the copy (or of the proven old copy).
    Device(DeviceFp),
}

/// What the last save recorded about one tensor.
#[derive(Debug)]
pub(crate) struct CacheEntry {
    version: i64,
    content: Content,
    pub(crate) blob: Blob,
    /// Holding the tensor keeps its memory from being reused by another
    /// tensor, so a cache key cannot be matched by a recycled address.
    _keep: Py<PyAny>,
}

/// A tracked tensor of this save; its cache entry once the blob is known.
#[derive(Debug)]
pub(crate) struct Tracked {
    key: CacheKey,
    version: i64,
    proof: Proof,
    keep: Py<PyAny>,
    slot: usize,
}

/// A source of bytes kept alive by `SaveWalk::keepalive` for the whole save.
#[derive(Clone, Copy)]
pub(crate) struct Source {
    ptr: usize,
    len: usize,
}

impl Source {
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len describe memory of a Python object (tensor, array,
        // bytes) held in `keepalive` until the save call returns.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// The Python callable that blocks until a device copy is final (it waits
/// on the copy's CUDA event), called at most once, by the first writer
/// thread that needs the bytes.
#[derive(Debug)]
struct Gate {
    wait: Py<PyAny>,
    result: OnceLock<Result<(), String>>,
}

impl Gate {
    fn wait(&self) -> Result<(), String> {
        self.result
            .get_or_init(|| {
                Python::try_attach(|py| self.wait.call0(py).map(|_| ()).map_err(|e| e.to_string()))
                    .unwrap_or_else(|| Err("the Python interpreter is shutting down".into()))
            })
            .clone()
    }
}

/// Host memory the Python layer lends to a save: a pinned buffer a device
/// copy fills (one copy, device to host, never a second into staging).
#[derive(Debug)]
pub(crate) struct PyLent {
    ptr: usize,
    len: usize,
    /// Keeps the buffer's owner alive until the writer is done with it.
    _keep: Py<PyAny>,
    gate: Option<Arc<Gate>>,
    /// Where the writer sums the copy's device fingerprint.
    fingerprint: Option<DeviceFp>,
}

impl Lent for PyLent {
    fn len(&self) -> usize {
        self.len
    }
    fn ready(&self) -> Result<(), String> {
        self.gate.as_ref().map_or(Ok(()), |g| g.wait())
    }
    fn device_fp(&self) -> Option<&core::DeviceFpSum> {
        self.fingerprint.as_deref()
    }
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len describe memory owned by `_keep`, which the Python
        // layer does not reuse until this save's handle is done.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

pub(crate) struct SaveWalk<'a, 'w, 'py> {
    describe: &'a Bound<'py, PyAny>,
    materialize: &'a Bound<'py, PyAny>,
    device_fingerprints: &'a Bound<'py, PyAny>,
    old: &'a mut HashMap<CacheKey, CacheEntry>,
    skip: bool,
    /// Confirms that an old entry's blob may still be reused (None: no cache).
    reuse: Option<&'a mut core::ReuseCheck<'w>>,
    pub slots: Vec<Slot>,
    pub sources: Vec<Source>,
    pub tracked: Vec<Tracked>,
    pub keepalive: Vec<Py<PyAny>>,
    pub lent: Vec<Arc<dyn Lent>>,
    /// One gate per Python waiter (by identity): all tensors of a device share one.
    gates: HashMap<usize, Arc<Gate>>,
    /// Device arrays, in slot order: their proofs and copies wait until the
    /// walk is done ([`SaveWalk::finish`]).
    device: Vec<DeviceWork>,
    pub any_materialized: bool,
}

/// A device array's work, done after the walk: every "unchanged" proof
/// first, read back at once, then the copies of the rest. Interleaved, each
/// proof's read-back queued behind the copies already enqueued on the
/// device's one copy engine (1.4 ms per 64 MiB tensor on an H100, most of a
/// steady save's blocked time).
struct DeviceWork {
    slot: usize,
    keep: Py<PyAny>,
    nbytes: usize,
    /// The last save's blob and the fingerprint of its copy, to compare
    /// with the tensor's now (its version counter says unchanged).
    prove: Option<(Blob, core::DeviceFingerprint, DeviceFp)>,
    /// Its entry in `tracked`, whose proof follows the outcome.
    tracked: Option<usize>,
}

fn unsupported(path: &[String], type_name: String, hint: &str) -> PyErr {
    to_py(Error::UnsupportedType {
        key_path: path.join("/"),
        type_name,
        hint: hint.into(),
    })
}

impl<'a, 'w, 'py> SaveWalk<'a, 'w, 'py> {
    pub(crate) fn new(
        describe: &'a Bound<'py, PyAny>,
        materialize: &'a Bound<'py, PyAny>,
        device_fingerprints: &'a Bound<'py, PyAny>,
        old: &'a mut HashMap<CacheKey, CacheEntry>,
        skip: bool,
        reuse: Option<&'a mut core::ReuseCheck<'w>>,
    ) -> Self {
        SaveWalk {
            describe,
            materialize,
            device_fingerprints,
            old,
            skip,
            reuse,
            slots: Vec::new(),
            sources: Vec::new(),
            tracked: Vec::new(),
            keepalive: Vec::new(),
            lent: Vec::new(),
            gates: HashMap::new(),
            device: Vec::new(),
            any_materialized: false,
        }
    }

    /// Whether an unchanged tensor's old blob is still in the store.
    fn reusable(&mut self, blob: &Blob) -> PyResult<bool> {
        match self.reuse.as_deref_mut() {
            Some(check) => check.confirm(blob).map_err(to_py),
            None => Ok(false),
        }
    }

    fn source(&mut self, ptr: usize, len: usize, keep: Py<PyAny>) -> usize {
        self.sources.push(Source { ptr, len });
        self.keepalive.push(keep);
        self.sources.len() - 1
    }

    fn stage(&mut self, ptr: usize, len: usize, keep: Py<PyAny>) -> usize {
        let src = self.source(ptr, len, keep);
        self.slots.push(Slot::Stage(src));
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
            let mut w = SaveWalk::new(
                self.describe,
                self.materialize,
                self.device_fingerprints,
                &mut dummy,
                false,
                None,
            );
            return w.node(k, &mut path.to_vec());
        }
        Err(unsupported(
            path,
            format!("dict key of type {}", k.get_type().name()?),
            "dict keys must be str, int, float, bool, None or tuples of them",
        ))
    }

    pub(crate) fn node(
        &mut self,
        obj: &Bound<'py, PyAny>,
        path: &mut Vec<String>,
    ) -> PyResult<Node> {
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
            self.stage(bytes.as_ptr() as usize, bytes.len(), obj.clone().unbind());
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
        if let Ok(a) = d.cast::<ArrayView>() {
            let a = a.get();
            let node = self.array(a, path)?;
            return match (&a.global_shape, &a.offset, node) {
                (Some(shape), Some(offset), Node::Array(array)) => {
                    Ok(Node::Sharded(Box::new(core::checkpoint::format::Sharded {
                        shape: shape.clone(),
                        shards: vec![core::checkpoint::format::Shard {
                            offset: offset.clone(),
                            array: *array,
                        }],
                    })))
                }
                (None, None, node) => Ok(node),
                _ => Err(unsupported(
                    path,
                    "a piece of a sharded array".into(),
                    "describe() gave global_shape without offset or the reverse",
                )),
            };
        }
        if let Ok(p) = d.cast::<Pickled>() {
            let b = p.get().data.bind(obj.py());
            let bytes = b.as_bytes();
            self.stage(
                bytes.as_ptr() as usize,
                bytes.len(),
                b.clone().into_any().unbind(),
            );
            return Ok(Node::Pickle(Blob::default()));
        }
        if d.is(obj) {
            return Err(unsupported(
                path,
                "describe() answered the object itself".into(),
                "internal error",
            ));
        }
        // A plain value in its place (a numpy scalar as a Python one).
        self.node(&d, path)
    }

    fn array(&mut self, d: &ArrayView, path: &[String]) -> PyResult<Node> {
        let py = self.describe.py();
        let lib = match d.lib.as_str() {
            "torch" => ArrayLib::Torch,
            "numpy" => ArrayLib::Numpy,
            other => {
                return Err(to_py(internal(&format!(
                    "describe() named array library {other:?} at key '{}'",
                    path.join("/")
                ))))
            }
        };
        let (dtype, shape, ptr, nbytes) = (d.dtype.clone(), d.shape.clone(), d.ptr, d.nbytes);
        let keep = d.owner.bind(py).clone();
        let (device, host, version) = (d.device.clone(), d.host, d.version);
        let expected = core::checkpoint::format::itemsize(lib, &dtype)
            .map(|s| s * shape.iter().product::<u64>());
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
        // The engine's rule: which tensors are tracked, and which saved blob
        // is a candidate (core `checkpoint::save`).
        let version = match core::checkpoint::save::tracked_version(self.skip, nbytes, version) {
            Some(v) => v,
            None => {
                self.stage_array(ptr, nbytes, &keep, host)?;
                return Ok(node);
            }
        };
        let key = CacheKey {
            key_path: path.join("/"),
            ptr,
            nbytes,
            dtype,
            shape,
            device,
        };
        // The version counter only says "it changed" for sure; "unchanged"
        // is proven by a full-content fingerprint (host: below, without the
        // GIL; device: computed on the device now, compared with the sum the
        // writer made of the last copy).
        let old = match self.old.remove(&key) {
            Some(o)
                if core::checkpoint::save::candidate(o.version, version, || {
                    self.reusable(&o.blob)
                })? =>
            {
                Some(o)
            }
            _ => None,
        };
        let slot;
        let proof;
        if host {
            proof = Proof::Host;
            match old {
                Some(CacheEntry {
                    content: Content::Host(fingerprint),
                    blob,
                    ..
                }) => {
                    let source = self.source(ptr, nbytes, keep.clone().unbind());
                    self.slots.push(Slot::Verify {
                        source,
                        blob,
                        fingerprint,
                    });
                    slot = self.slots.len() - 1;
                }
                _ => slot = self.stage_array(ptr, nbytes, &keep, true)?,
            }
        } else {
            // Only a tensor whose counter says unchanged, with the proof of
            // its last copy in hand, is fingerprinted on the device (the
            // Python layer reads 4 integers back); a changed one is copied
            // and proven later from the copy, with no device work here.
            // Both after the walk: `finish`.
            let prove = match old {
                Some(CacheEntry {
                    content: Content::Device(fp),
                    blob,
                    ..
                }) => fp.get().map(|want| (blob, want, fp)),
                _ => None,
            };
            slot = self.defer(&keep, nbytes, prove, Some(self.tracked.len()));
            // Until `finish`: proven by the fingerprint of this save's copy.
            proof = Proof::Device(Arc::new(core::DeviceFpSum::new(nbytes)));
        }
        self.tracked.push(Tracked {
            key,
            version,
            proof,
            keep: keep.unbind(),
            slot,
        });
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
        Ok(self.defer(keep, nbytes, None, None))
    }

    /// A slot for a device array, filled by `finish`.
    fn defer(
        &mut self,
        keep: &Bound<'py, PyAny>,
        nbytes: usize,
        prove: Option<(Blob, core::DeviceFingerprint, DeviceFp)>,
        tracked: Option<usize>,
    ) -> usize {
        self.slots.push(Slot::Lend);
        self.device.push(DeviceWork {
            slot: self.slots.len() - 1,
            keep: keep.clone().unbind(),
            nbytes,
            prove,
            tracked,
        });
        self.slots.len() - 1
    }

    /// After the walk: the device arrays' proofs, all computed and read
    /// back in one call, then the copies of those not proven, in slot
    /// order (the order the engine takes the lent buffers in).
    pub(crate) fn finish(&mut self) -> PyResult<()> {
        let py = self.describe.py();
        let work = std::mem::take(&mut self.device);
        let asked: Vec<&Py<PyAny>> = work
            .iter()
            .filter(|w| w.prove.is_some())
            .map(|w| &w.keep)
            .collect();
        let mut now = if asked.is_empty() {
            Vec::new()
        } else {
            let got: Vec<core::DeviceFingerprint> = self
                .device_fingerprints
                .call1((PyList::new(py, asked)?,))?
                .extract()?;
            got
        }
        .into_iter();
        for w in work {
            let proven = match w.prove {
                Some((blob, want, fp)) => {
                    let now = now
                        .next()
                        .ok_or_else(|| to_py(internal("fewer device fingerprints than asked")))?;
                    (now == want).then_some((blob, fp))
                }
                None => None,
            };
            let fp = match proven {
                Some((blob, fp)) => {
                    self.slots[w.slot] = Slot::Reuse(blob);
                    fp
                }
                None => {
                    let fp = Arc::new(core::DeviceFpSum::new(w.nbytes));
                    self.lend_copy(w.keep.bind(py), w.nbytes, w.tracked.map(|_| fp.clone()))?;
                    fp
                }
            };
            if let Some(t) = w.tracked {
                self.tracked[t].proof = Proof::Device(fp);
            }
        }
        Ok(())
    }

    /// Device memory: the Python layer enqueues a copy into host memory it
    /// owns and lends it, with the waiter (or None) that says when the copy
    /// is final. `before_copy` then orders the device's streams.
    fn lend_copy(
        &mut self,
        keep: &Bound<'py, PyAny>,
        nbytes: usize,
        fingerprint: Option<DeviceFp>,
    ) -> PyResult<()> {
        let r = self.materialize.call1((keep,))?;
        let hptr: usize = r.get_item(0)?.extract()?;
        let owner = r.get_item(1)?.unbind();
        let waiter = r.get_item(2)?;
        self.any_materialized = true;
        let gate = if waiter.is_none() {
            None
        } else {
            let id = waiter.as_ptr() as usize;
            Some(
                self.gates
                    .entry(id)
                    .or_insert_with(|| {
                        Arc::new(Gate {
                            wait: waiter.unbind(),
                            result: OnceLock::new(),
                        })
                    })
                    .clone(),
            )
        };
        self.lent.push(Arc::new(PyLent {
            ptr: hptr,
            len: nbytes,
            _keep: owner,
            gate,
            fingerprint,
        }));
        Ok(())
    }
}

fn internal(what: &str) -> Error {
    Error::Internal {
        detail: format!("save: {what}"),
    }
}

impl Tracked {
    /// The cache entry for the next save, or None when nothing proves the content.
    pub(crate) fn into_entry(self, filled: &Filled) -> Option<(CacheKey, CacheEntry)> {
        let content = match self.proof {
            Proof::Device(fp) => Content::Device(fp),
            Proof::Host => Content::Host((*filled.fingerprints.get(self.slot)?)?),
        };
        let entry = CacheEntry {
            version: self.version,
            content,
            blob: filled.blobs.get(self.slot)?.clone(),
            _keep: self.keep,
        };
        Some((self.key, entry))
    }
}

/// Build Python objects from a tree and the buffers `Replica::read` returned.
pub(crate) fn build<'py>(
    py: Python<'py>,
    node: &Node,
    buffers: &mut std::vec::IntoIter<Vec<u8>>,
    make_array: &Bound<'py, PyAny>,
    unpickle: &Bound<'py, PyAny>,
    path: &mut Vec<String>,
) -> PyResult<Bound<'py, PyAny>> {
    // The reader returns one buffer per blob in tree order; fewer is a bug.
    let next = |buffers: &mut std::vec::IntoIter<Vec<u8>>| {
        buffers
            .next()
            .ok_or_else(|| to_py(internal("load: fewer buffers than blobs in the tree")))
    };
    Ok(match node {
        Node::None => py.None().into_bound(py),
        Node::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Node::Int(i) => i.into_pyobject(py)?.into_any(),
        Node::BigInt(s) => py.get_type::<PyInt>().call1((s.as_str(),))?,
        Node::Float(bits) => PyFloat::new(py, f64::from_bits(*bits)).into_any(),
        Node::Str(s) => PyString::new(py, s).into_any(),
        Node::Bytes(_) => PyBytes::new(py, &next(buffers)?).into_any(),
        Node::Pickle(_) => {
            let b = PyBytes::new(py, &next(buffers)?);
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
        // The reader assembles sharded arrays (core `shard::consolidate`).
        Node::Sharded(_) => {
            return Err(to_py(internal(&format!(
                "load: the sharded array at '{}' was not assembled",
                path.join("/")
            ))))
        }
        Node::Array(a) => {
            let lib = match a.lib {
                ArrayLib::Torch => "torch",
                ArrayLib::Numpy => "numpy",
            };
            let buf = Bound::new(py, Buffer::new(next(buffers)?))?;
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
