//! pyo3 binding: reads arguments, then releases the GIL for the work.
//! Torch and numpy specifics stay in Python (`hindsight/_store.py`), which
//! passes the callables this module needs (describe, make_array, ...).

mod audit;
mod buffer;
mod cli;
mod data;
mod describe;
mod errors;
mod fingerprint;
mod interrupt;
mod naming;
mod project;
mod runs;
mod session;
mod settings;
mod shards;
mod state_check;
mod steps;
mod tree;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hindsight_core::{self as core, Codec, Error, StoreOptions, WriterOptions};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use errors::IntoPy;
use hindsight_core::sync::lock;
use tree::{CacheEntry, CacheKey};

/// A checkpoint store and its background writer (see `hindsight.Store`).
#[pyclass(module = "hindsight._native", frozen)]
struct Store {
    /// The store, or a local replica in front of it (local-first mode).
    replica: Arc<core::Replica>,
    writer: Mutex<Option<Arc<core::Writer>>>,
    /// Unchanged-tensor cache: key path + identity -> the blob saved last time.
    cache: Mutex<HashMap<CacheKey, CacheEntry>>,
}

impl Store {
    fn writer(&self) -> PyResult<Arc<core::Writer>> {
        lock(&self.writer).clone().ok_or_else(|| {
            errors::to_py(Error::Closed {
                location: format!("store {}", self.replica.destination().location()),
                what: "the store was closed".into(),
            })
        })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // A writer thread may need the GIL (a device copy's gate), so its
        // threads are never joined while this thread holds it; nor from a
        // writer thread (Python's garbage collector can run there, inside a
        // gate), which could be waiting for itself.
        if let Some(w) = lock(&self.writer).take() {
            if core::checkpoint::writer::on_writer_thread() {
                std::thread::spawn(move || drop(w));
            } else {
                Python::attach(|py| py.detach(move || drop(w)));
            }
        }
    }
}

#[pyclass(module = "hindsight._native", frozen)]
struct SaveHandle {
    inner: core::SaveHandle,
    /// One-time set-up inside the save call (fresh staging memory).
    #[pyo3(get)]
    setup_seconds: f64,
}

fn stats_dict<'py>(py: Python<'py>, s: &core::SaveStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_staged", s.bytes_staged)?;
    d.set_item("bytes_reused", s.bytes_reused)?;
    d.set_item("chunks_written", s.chunks_written)?;
    d.set_item("bytes_written", s.bytes_written)?;
    d.set_item("chunks_deduplicated", s.chunks_deduplicated)?;
    d.set_item("seconds_to_durable", s.seconds_to_durable)?;
    d.set_item("setup_seconds", s.setup_seconds)?;
    Ok(d)
}

#[pymethods]
impl SaveHandle {
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// Block until durable; returns statistics, or None on timeout.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let h = &self.inner;
        let r = interrupt::wait_until(py, timeout, |slice| h.wait_timeout(Some(slice)))?;
        r.map(|s| stats_dict(py, &s)).transpose()
    }
}

#[pymethods]
impl Store {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, create=true, compression=None, zstd_level=None, chunk_size=None, staging_bytes=None, threads=None, local_first=None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        create: bool,
        compression: Option<&str>,
        zstd_level: Option<i32>,
        chunk_size: Option<i64>,
        staging_bytes: Option<i64>,
        threads: Option<i64>,
        local_first: Option<PathBuf>,
    ) -> PyResult<Self> {
        // Sizes arrive as Python ints of any sign: refuse bad ones by name
        // (not with an OverflowError from the conversion).
        let size = |arg: &str, v: Option<i64>| -> PyResult<Option<usize>> {
            v.map(|n| {
                usize::try_from(n).ok().filter(|&n| n > 0).ok_or_else(|| {
                    errors::to_py(Error::invalid(arg, format!("{n} is not a positive size")))
                })
            })
            .transpose()
        };
        let chunk_size = size("chunk_size", chunk_size)?;
        let staging_bytes = size("staging_bytes", staging_bytes)?;
        let threads = size("threads", threads)?;
        let options = if compression.is_some() || chunk_size.is_some() || zstd_level.is_some() {
            let mut o = StoreOptions::default();
            match compression {
                None | Some("none") => o.codec = Codec::Raw,
                Some("zstd") => o.codec = Codec::Zstd,
                Some(other) => {
                    return Err(errors::to_py(Error::invalid(
                        "compression",
                        format!("{other:?} is not one of None, 'none', 'zstd'"),
                    )))
                }
            }
            if let Some(l) = zstd_level {
                o.zstd_level = l;
            }
            if let Some(c) = chunk_size {
                o.chunk_size = c;
            }
            Some(o)
        } else {
            None
        };
        let mut wopts = WriterOptions::default();
        if let Some(b) = staging_bytes {
            wopts.staging_bytes = b;
        }
        if let Some(t) = threads {
            wopts.threads = t;
        }
        let location = path.to_string_lossy().into_owned();
        let (replica, writer) = interrupt::run(py, move |_| {
            let replica = core::Replica::open(&location, local_first.as_deref(), create, options)?;
            let writer = replica.start_writer(wopts)?;
            Ok::<_, Error>((Arc::new(replica), writer))
        })?;
        Ok(Store {
            replica,
            writer: Mutex::new(Some(Arc::new(writer))),
            cache: Default::default(),
        })
    }

    /// The destination (in local-first mode, not the local copy).
    #[getter]
    fn path(&self) -> String {
        self.replica.destination().location()
    }

    /// The local copy in local-first mode, else None.
    #[getter]
    fn local_first(&self) -> Option<String> {
        self.replica.local_location()
    }

    /// Checkpoints committed locally and not yet uploaded (0 unless local-first).
    fn uploads_pending(&self) -> PyResult<usize> {
        Ok(self.writer()?.uploader().map_or(0, |u| u.pending()))
    }

    #[getter]
    fn compression(&self) -> &'static str {
        match self.replica.primary().options().codec {
            Codec::Raw => "none",
            Codec::Zstd => "zstd",
        }
    }

    #[getter]
    fn chunk_size(&self) -> usize {
        self.replica.primary().options().chunk_size
    }

    /// CPU seconds this store's background threads have spent on saves so
    /// far (a running total; what checkpoints cost beside the caller's time).
    #[getter]
    fn background_cpu_seconds(&self) -> PyResult<f64> {
        Ok(self.writer()?.background_cpu_seconds())
    }

    #[getter]
    fn staging_bytes(&self) -> PyResult<usize> {
        Ok(self.writer()?.staging_limit())
    }

    fn staging_in_use(&self) -> PyResult<usize> {
        Ok(self.writer()?.staging_in_use())
    }

    /// Snapshot `state` and return at once; the write continues in the background.
    #[pyo3(signature = (name, state, describe, materialize, before_copy, device_fingerprints, meta=None, skip_unchanged=true, copy_threads=None, handle_out=None, part=false))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        name: String,
        state: &Bound<'_, PyAny>,
        describe: &Bound<'_, PyAny>,
        materialize: &Bound<'_, PyAny>,
        before_copy: &Bound<'_, PyAny>,
        device_fingerprints: &Bound<'_, PyAny>,
        meta: Option<BTreeMap<String, String>>,
        skip_unchanged: bool,
        copy_threads: Option<usize>,
        handle_out: Option<Bound<'_, PyList>>,
        part: bool,
    ) -> PyResult<Py<SaveHandle>> {
        // Copies and fingerprints are memory-bound: a few threads saturate it.
        let copy_threads = copy_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8))
        });
        let writer = self.writer()?;
        // Surface an earlier failure before doing any work; cached blobs may
        // refer to a save that failed, so forget them.
        if let Err(e) = writer.take_error() {
            lock(&self.cache).clear();
            return Err(errors::to_py(e));
        }
        core::checkpoint::format::validate_name(&name).py_err()?;
        // A rank's part of a multi-rank save (`hindsight.dist`) is named by
        // core; a checkpoint of its own may not take such a name.
        if core::checkpoint::shard::is_part(&name) != part {
            return Err(errors::to_py(if part {
                Error::internal(format!("'{name}' is not a part's name"))
            } else {
                core::checkpoint::shard::reserved(&name)
            }));
        }
        let mut cache = if skip_unchanged {
            std::mem::take(&mut *lock(&self.cache))
        } else {
            HashMap::new()
        };
        // Reuse only blobs whose chunks are still there (a gc after a remove,
        // or quarantine, may have taken them) and whose save did not fail:
        // confirmed under the store's shared lock, held until this save
        // commits, for the tensors the walk finds unchanged.
        let mut reuse = None;
        if !cache.is_empty() {
            reuse = Some(interrupt::run(py, |_| writer.reuse_check())?);
        }
        let mut walk = tree::SaveWalk::new(
            describe,
            materialize,
            device_fingerprints,
            &mut cache,
            skip_unchanged,
            reuse.as_mut(),
        );
        let root = walk.node(state, &mut Vec::new())?;
        walk.finish()?;
        let tree::SaveWalk {
            slots,
            sources,
            tracked,
            keepalive,
            lent,
            any_materialized,
            ..
        } = walk;
        let reuse_lock = reuse.map(core::ReuseCheck::into_lock);
        if any_materialized {
            before_copy.call0()?;
        }
        let result = interrupt::run(py, |intr| {
            // The save session is the engine's (core `checkpoint::save`).
            let walked = core::checkpoint::save::Walked {
                root,
                slots,
                sources: sources.iter().map(|s| s.as_slice()).collect(),
                lent,
            };
            core::checkpoint::save::run(
                &writer,
                &name,
                reuse_lock,
                walked,
                meta.unwrap_or_default(),
                copy_threads,
                &|| intr.check(),
            )
        });
        drop(keepalive);
        let core::checkpoint::save::Saved {
            handle,
            filled,
            setup_seconds,
        } = result?;
        if skip_unchanged {
            *lock(&self.cache) = tracked
                .into_iter()
                .filter_map(|t| t.into_entry(&filled))
                .collect();
        }
        let handle = Py::new(
            py,
            SaveHandle {
                inner: handle,
                setup_seconds,
            },
        )?;
        // Handed over before returning: a KeyboardInterrupt raised as the
        // call returns must not make the caller think the save failed.
        if let Some(out) = handle_out {
            out.append(&handle)?;
        }
        Ok(handle)
    }

    /// Compare a live state with checkpoint `name` (the core's
    /// `check_state`): hashes the live bytes along the checkpoint's chunks,
    /// reads only its manifest. `materialize` copies a device tensor to the
    /// host: (pointer, owner, None). `path`: the checkpoint's sub-tree the
    /// state is compared with (one rank's part of a multi-rank checkpoint).
    #[pyo3(signature = (name, state, describe, materialize, path=None))]
    fn check_state(
        &self,
        py: Python<'_>,
        name: String,
        state: &Bound<'_, PyAny>,
        describe: &Bound<'_, PyAny>,
        materialize: &Bound<'_, PyAny>,
        path: Option<Vec<String>>,
    ) -> PyResult<state_check::PyStateCheck> {
        let path = path.unwrap_or_default();
        let none = py.None().into_bound(py);
        let mut cache = HashMap::new();
        let mut walk = tree::SaveWalk::new(describe, materialize, &none, &mut cache, false, None);
        let live = walk.node(state, &mut Vec::new())?;
        // The device arrays' slots are filled here (their host copies).
        walk.finish()?;
        let tree::SaveWalk {
            slots,
            sources,
            keepalive,
            lent,
            ..
        } = walk;
        let result = interrupt::run(py, |_| {
            let mut lent = lent.iter();
            let mut bytes: Vec<&[u8]> = Vec::with_capacity(slots.len());
            for slot in &slots {
                match slot {
                    tree::Slot::Stage(src) => bytes.push(sources[*src].as_slice()),
                    tree::Slot::Lend => {
                        let buf = lent.next().ok_or_else(|| Error::Internal {
                            detail: "check_state: fewer lent buffers than slots".into(),
                        })?;
                        buf.ready().map_err(|detail| Error::Device {
                            checkpoint: name.clone(),
                            detail,
                        })?;
                        bytes.push(buf.bytes());
                    }
                    _ => {
                        return Err(Error::Internal {
                            detail: "check_state: a reused slot without a cache".into(),
                        })
                    }
                }
            }
            let recorded = self.replica.manifest(&name)?;
            let node = recorded.root.select(&path).ok_or_else(|| Error::NotFound {
                what: "checkpoint key",
                name: path.join("/"),
                location: name.clone(),
            })?;
            Ok(core::check_state(node, &live, &bytes))
        });
        drop(keepalive);
        Ok(result?.into())
    }

    /// Load a checkpoint (or the sub-tree at `path`) into Python objects.
    #[pyo3(signature = (name, make_array, unpickle, path=None, threads=None))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        name: String,
        make_array: &Bound<'py, PyAny>,
        unpickle: &Bound<'py, PyAny>,
        path: Option<Vec<String>>,
        threads: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let path = path.unwrap_or_default();
        let threads = threads.unwrap_or_else(core::checkpoint::replica::default_read_threads);
        let read = interrupt::run(py, |intr| {
            self.replica.read(&name, &path, threads, &|| intr.check())
        })?;
        Ok(built(py, read, &path, make_array, unpickle)?.tree)
    }

    /// [`Self::load`] without the arrays at the key paths `skip` (relative
    /// to `path`): None in their places, listed with their whole shapes for
    /// `read_regions` to read only the boxes the caller holds.
    fn load_leaving_out<'py>(
        &self,
        py: Python<'py>,
        name: String,
        make_array: &Bound<'py, PyAny>,
        unpickle: &Bound<'py, PyAny>,
        path: Vec<String>,
        skip: Vec<Vec<String>>,
    ) -> PyResult<shards::PartialTree> {
        let threads = core::checkpoint::replica::default_read_threads();
        let read = interrupt::run(py, |intr| {
            self.replica
                .read_leaving_out(&name, &path, &skip, threads, &|| intr.check())
        })?;
        let b = built(py, read, &path, make_array, unpickle)?;
        let left_out = b
            .left_out
            .into_iter()
            .map(|l| Py::new(py, shards::LeftOut::from_core(l)))
            .collect::<PyResult<_>>()?;
        Ok(shards::PartialTree {
            tree: b.tree.unbind(),
            left_out,
        })
    }

    /// Boxes of arrays of checkpoint `name`, whole or sharded: only the
    /// overlapping chunks are read, each verified, all on `threads` threads.
    #[pyo3(signature = (name, wanted, threads=None))]
    fn read_regions(
        &self,
        py: Python<'_>,
        name: String,
        wanted: Vec<PyRef<'_, shards::RegionRequest>>,
        threads: Option<usize>,
    ) -> PyResult<Vec<shards::Region>> {
        let threads = threads.unwrap_or_else(core::checkpoint::replica::default_read_threads);
        let wanted: Vec<core::checkpoint::parts::RegionRequest> =
            wanted.iter().map(|w| w.to_core()).collect();
        let got = interrupt::run(py, |intr| {
            self.replica
                .read_regions(&name, &wanted, threads, &|| intr.check())
        })?;
        got.into_iter()
            .map(|r| shards::Region::from_core(py, r))
            .collect()
    }

    /// Write the arrays of checkpoint `name` (or of the sub-tree at `path`)
    /// to one safetensors file (core `checkpoint::export`): the number of
    /// tensors and bytes, and the key paths of plain values left out.
    fn export_safetensors<'py>(
        &self,
        py: Python<'py>,
        name: String,
        path: Vec<String>,
        out: PathBuf,
    ) -> PyResult<Bound<'py, PyDict>> {
        let threads = core::checkpoint::replica::default_read_threads();
        let done = interrupt::run(py, |intr| {
            core::checkpoint::export::safetensors(
                &self.replica,
                &name,
                &path,
                &out,
                threads,
                &|| intr.check(),
            )
        })?;
        let d = PyDict::new(py);
        d.set_item("tensors", done.tensors)?;
        d.set_item("bytes", done.bytes)?;
        d.set_item("skipped", done.skipped)?;
        Ok(d)
    }

    /// Commit the parts `world` ranks saved of `name` in save attempt
    /// `attempt` as one checkpoint, waiting up to `timeout` seconds for
    /// them; returns its metadata.
    fn commit_parts(
        &self,
        py: Python<'_>,
        name: String,
        world: u64,
        attempt: String,
        timeout: f64,
    ) -> PyResult<BTreeMap<String, String>> {
        if let Ok(w) = self.writer() {
            interrupt::run(py, |_| w.flush())?;
        }
        let timeout = std::time::Duration::from_secs_f64(timeout.max(0.0));
        let m = interrupt::run(py, |intr| {
            self.replica
                .commit_parts(&name, world, &attempt, timeout, &|| intr.check())
        })?;
        Ok(m.meta)
    }

    /// Complete checkpoints; in local-first mode also those complete only locally.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        interrupt::run(py, |_| self.replica.list())
    }

    /// A checkpoint's metadata alone (`info` without its entries).
    fn meta(
        &self,
        py: Python<'_>,
        name: String,
    ) -> PyResult<std::collections::BTreeMap<String, String>> {
        let m = interrupt::run(py, |_| self.replica.manifest(&name))?;
        Ok(m.meta.clone())
    }

    fn info<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyDict>> {
        let (m, rows) = interrupt::run(py, |_| self.replica.describe(&name))?;
        let d = PyDict::new(py);
        d.set_item("name", &m.name)?;
        d.set_item("created_ms", m.created_ms)?;
        d.set_item("meta", m.meta.clone())?;
        d.set_item("nbytes", rows.iter().map(|r| r.2).sum::<u64>())?;
        let keys = PyList::empty(py);
        for (k, kind, n) in rows {
            keys.append((k, kind, n))?;
        }
        d.set_item("entries", keys)?;
        Ok(d)
    }

    /// Wait until all saves so far are durable. False on timeout.
    #[pyo3(signature = (timeout=None))]
    fn flush(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let writer = self.writer()?;
        let r = interrupt::wait_until(py, timeout, |slice| {
            Ok::<_, Error>(writer.flush_timeout(Some(slice))?.then_some(()))
        });
        if r.is_err() {
            lock(&self.cache).clear();
        }
        Ok(r?.is_some())
    }

    /// Remove a checkpoint (local-first: locally first, then at the destination,
    /// so a crash in between never leaves a local copy that would be uploaded again).
    /// A save of `name` still in flight finishes first (so it cannot
    /// reappear after the remove); then the checkpoint is removed.
    fn remove(&self, py: Python<'_>, name: String) -> PyResult<()> {
        let writer = lock(&self.writer).clone();
        interrupt::run(py, |_| {
            if let Some(w) = &writer {
                w.settle()?;
            }
            self.replica.remove(&name)
        })
    }

    /// Verify checkpoints (all by default); local-first checks each where it is.
    #[pyo3(signature = (names=None))]
    fn verify(&self, py: Python<'_>, names: Option<Vec<String>>) -> PyResult<(usize, Vec<String>)> {
        let names = names.unwrap_or_default();
        let (n, problems) = interrupt::run(py, |_| self.replica.verify(&names, |_| {}))?;
        Ok((
            n,
            problems.into_iter().map(|p| p.error.to_string()).collect(),
        ))
    }

    fn gc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = interrupt::run(py, |_| self.replica.gc())?;
        let d = PyDict::new(py);
        d.set_item("chunks_removed", r.chunks_removed)?;
        d.set_item("bytes_removed", r.bytes_removed)?;
        d.set_item("staging_files_removed", r.staging_files_removed)?;
        d.set_item("unreadable", r.unreadable)?;
        Ok(d)
    }

    /// Space used at the destination.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let u = interrupt::run(py, |_| self.replica.usage())?;
        let d = PyDict::new(py);
        d.set_item("checkpoints", u.checkpoints)?;
        d.set_item("logical_bytes", u.logical_bytes)?;
        d.set_item("unique_bytes", u.unique_bytes)?;
        d.set_item("stored_bytes", u.stored_bytes)?;
        d.set_item("chunks", u.chunks)?;
        d.set_item("unreferenced_chunks", u.unreferenced_chunks)?;
        d.set_item("unreadable", u.unreadable)?;
        Ok(d)
    }

    /// Flush, then stop the writer threads. Later saves raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(w) = lock(&self.writer).take() else {
            return Ok(());
        };
        lock(&self.cache).clear();
        let r = interrupt::wait_until(py, None, |slice| {
            Ok::<_, Error>(w.flush_timeout(Some(slice))?.then_some(()))
        });
        py.detach(move || drop(w));
        r.map(|_| ())
    }

    /// The checkpoints named by `prefix`, oldest first in resume order.
    fn checkpoints(&self, py: Python<'_>, prefix: String) -> PyResult<Vec<naming::PyCheckpointId>> {
        let ids = interrupt::run(py, |_| self.replica.checkpoints(&prefix))?;
        Ok(ids.into_iter().map(naming::PyCheckpointId).collect())
    }

    /// Apply a retention policy to the checkpoints of `prefix`; returns the
    /// names removed. Metrics for `keep_best` come from `metrics` (outer
    /// index -> value) or, with `monitor`, from each checkpoint's metadata.
    #[pyo3(signature = (prefix, keep_last=None, keep_best=None, best_mode="min", keep_every=None, metrics=None, monitor=None, keep_spread=None))]
    #[allow(clippy::too_many_arguments)]
    fn apply_retention(
        &self,
        py: Python<'_>,
        prefix: String,
        keep_last: Option<usize>,
        keep_best: Option<usize>,
        best_mode: &str,
        keep_every: Option<u64>,
        metrics: Option<HashMap<u64, f64>>,
        monitor: Option<String>,
        keep_spread: Option<usize>,
    ) -> PyResult<Vec<String>> {
        let mode: core::checkpoint::retention::BestMode = best_mode.parse().py_err()?;
        let policy = core::checkpoint::retention::Retention {
            keep_last,
            keep_best: keep_best.map(|k| (k, mode)),
            keep_every,
            keep_spread,
        };
        interrupt::run(py, |_| {
            let source = match (&metrics, &monitor) {
                (Some(m), _) => core::MetricSource::ByIndex(m),
                (None, Some(monitor)) => core::MetricSource::Meta { monitor },
                (None, None) => core::MetricSource::None,
            };
            self.replica.apply_retention(&prefix, &policy, source)
        })
    }

    /// Forget the unchanged-tensor cache (the next save copies everything).
    fn forget_unchanged(&self) {
        lock(&self.cache).clear();
    }
}

/// A read checkpoint as Python objects, with the arrays it left out.
struct Built<'py> {
    tree: Bound<'py, PyAny>,
    left_out: Vec<core::checkpoint::replica::LeftOut>,
}

fn built<'py>(
    py: Python<'py>,
    read: core::checkpoint::replica::ReadTree,
    path: &[String],
    make_array: &Bound<'py, PyAny>,
    unpickle: &Bound<'py, PyAny>,
) -> PyResult<Built<'py>> {
    let tree = tree::build(
        py,
        &read.node,
        &mut read.buffers.into_iter(),
        make_array,
        unpickle,
        &mut path.to_vec(),
    )?;
    Ok(Built {
        tree,
        left_out: read.left_out,
    })
}

/// How many checkpoints a recording keeps by default (spread over the run)
/// for an outer loop of `len` iterations (`None`: unknown); `None`: all
/// (`checkpoint::retention::Retention::default_for_loop`).
#[pyfunction]
#[pyo3(signature = (len))]
fn default_retention_spread(len: Option<u64>) -> Option<usize> {
    core::checkpoint::retention::Retention::default_for_loop(len).keep_spread
}

/// The multipliers of the device fingerprint (core `device_fp`): `2 x
/// DEVICE_FP_BLOCK_WORDS` little-endian int64, lane-major. The device side
/// uploads this table once per device, so both sides compute one function.
#[pyfunction]
fn device_fingerprint_table(py: Python<'_>) -> buffer::Buffer {
    py.detach(|| {
        let table = core::checkpoint::device_fp::multipliers();
        buffer::Buffer::new(table.iter().flat_map(|m| m.to_le_bytes()).collect())
    })
}

/// The device fingerprint of a C-contiguous buffer's bytes, computed here
/// (what a writer thread computes from a save's copy).
#[pyfunction]
fn device_fingerprint_of(py: Python<'_>, data: pyo3::buffer::PyBuffer<u8>) -> PyResult<[i64; 4]> {
    if !data.is_c_contiguous() {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "device_fingerprint_of: the buffer must be C-contiguous",
        ));
    }
    let (ptr, len) = (data.buf_ptr() as usize, data.len_bytes());
    // The buffer stays exported (held by `data`) while the GIL is released.
    Ok(py.detach(move || {
        // SAFETY: ptr/len describe the exported, contiguous buffer.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        core::device_fingerprint(bytes)
    }))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<Store>()?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<describe::ArrayView>()?;
    m.add_class::<describe::Pickled>()?;
    m.add_class::<state_check::PyStateCheck>()?;
    m.add_class::<state_check::PyDifference>()?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<naming::PyCheckpointId>()?;
    m.add_class::<naming::PyFitChoice>()?;
    m.add_class::<naming::PyResumeWalk>()?;
    session::register(m)?;
    m.add_function(wrap_pyfunction!(naming::choose_fit, m)?)?;
    cli::register(m)?;
    m.add_function(wrap_pyfunction!(audit::watch_opens, m)?)?;
    m.add_function(wrap_pyfunction!(device_fingerprint_table, m)?)?;
    m.add_function(wrap_pyfunction!(default_retention_spread, m)?)?;
    m.add_function(wrap_pyfunction!(device_fingerprint_of, m)?)?;
    m.add(
        "DEVICE_FP_BLOCK_WORDS",
        core::checkpoint::device_fp::BLOCK_WORDS,
    )?;
    m.add("STATE_ORIGIN_KEY", core::checkpoint::compare::ORIGIN)?;
    m.add_class::<data::PyJobSpec>()?;
    m.add_class::<data::DataUnit>()?;
    m.add_class::<data::DataClient>()?;
    m.add_class::<data::DataDispatcher>()?;
    m.add_class::<data::UnitWork>()?;
    m.add_class::<data::PyCheckpointPolicy>()?;
    m.add_function(wrap_pyfunction!(data::data_checkpoint_name, m)?)?;
    m.add_function(wrap_pyfunction!(data::data_latest_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(data::data_example_seed, m)?)?;
    m.add_function(wrap_pyfunction!(data::serve_data_worker, m)?)?;
    m.add_function(wrap_pyfunction!(data::run_data_dispatcher, m)?)?;
    m.add_function(wrap_pyfunction!(data::data_job_token, m)?)?;
    runs::register(m)?;
    fingerprint::register(m)?;
    steps::register(m)?;
    project::register(m)?;
    settings::register(m)?;
    shards::register(m)?;
    m.add("FORMAT_VERSION", core::checkpoint::format::FORMAT_VERSION)?;
    m.add(
        "TORCH_DTYPES",
        core::checkpoint::format::TORCH_DTYPES
            .iter()
            .map(|&(name, _)| name)
            .collect::<Vec<_>>(),
    )?;
    m.add(
        "DEFAULT_STAGING_BYTES",
        core::checkpoint::writer::default_staging_bytes(),
    )?;
    Ok(())
}
