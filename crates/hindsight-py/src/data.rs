//! The input service (`hindsight.data`) for Python: argument conversion and
//! GIL handling only; every rule lives in `hindsight-data`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::buffer::Buffer;
use hindsight_data::auth::Token;
use hindsight_data::client::{Client, ClientOptions, Next};
use hindsight_data::dispatcher::{self, DispatcherHandle, DispatcherOptions};
use hindsight_data::order::{self, JobSpec};
use hindsight_data::recovery;
use hindsight_data::worker::{
    self, Pipeline, PipelineFailure, Produced, UnitRequest, WorkerOptions,
};
use hindsight_data::{Error as DataError, Running};

use crate::errors::data_to_py;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::ToPyErr;
use crate::interrupt;
use hindsight_core::sync::lock;

/// What makes two attachments the same input job (see `hindsight.data`).
#[pyclass(
    module = "hindsight._native",
    name = "JobSpec",
    frozen,
    get_all,
    skip_from_py_object
)]
#[derive(Clone)]
pub(crate) struct PyJobSpec {
    dataset: String,
    dataset_args: String,
    code_version: String,
    seed: u64,
    length: u64,
    global_batch: u64,
    split_batches: u64,
    drop_last: bool,
    shuffle: bool,
    /// Record counts of a sharded dataset's shards (empty: map-style).
    shards: Vec<u64>,
}

impl PyJobSpec {
    fn core(&self) -> JobSpec {
        JobSpec {
            dataset: self.dataset.clone(),
            dataset_args: self.dataset_args.clone(),
            code_version: self.code_version.clone(),
            seed: self.seed,
            length: self.length,
            global_batch: self.global_batch,
            split_batches: self.split_batches,
            drop_last: self.drop_last,
            shuffle: self.shuffle,
            shards: self.shards.clone(),
        }
    }
}

#[pymethods]
impl PyJobSpec {
    #[new]
    #[pyo3(signature = (*, dataset, dataset_args, code_version, seed, length, global_batch, split_batches, drop_last, shuffle, shards=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        dataset: String,
        dataset_args: String,
        code_version: String,
        seed: u64,
        length: u64,
        global_batch: u64,
        split_batches: u64,
        drop_last: bool,
        shuffle: bool,
        shards: Vec<u64>,
    ) -> PyResult<Self> {
        let s = PyJobSpec {
            dataset,
            dataset_args,
            code_version,
            seed,
            length,
            global_batch,
            split_batches,
            drop_last,
            shuffle,
            shards,
        };
        s.core()
            .validate()
            .map_err(|e| DataError::from(e).to_pyerr())?;
        Ok(s)
    }

    fn job_id(&self) -> String {
        self.core().job_id()
    }

    /// One "field: ours != theirs" per differing field.
    fn differences(&self, other: &PyJobSpec) -> Vec<String> {
        self.core().differences(&other.core())
    }

    fn batches_per_epoch(&self) -> u64 {
        self.core().batches_per_epoch()
    }

    /// The dataset indices rank `rank` of `world` gets in global batch
    /// `batch` of `epoch` (what a worker computes; for audits and tests).
    fn batch_indices(&self, epoch: u64, batch: u64, rank: u32, world: u32) -> PyResult<Vec<u64>> {
        let spec = self.core();
        worker::unit_indices(&spec, &spec.order(epoch), epoch, batch, rank, world)
            .map(|u| u.indices)
            .map_err(ToPyErr::to_pyerr)
    }

    fn __repr__(&self) -> String {
        format!(
            "JobSpec(dataset={:?}, length={}, global_batch={}, split_batches={}, seed={}, shuffle={}, drop_last={})",
            self.dataset,
            self.length,
            self.global_batch,
            self.split_batches,
            self.seed,
            self.shuffle,
            self.drop_last
        )
    }
}

/// The seed of every random draw made for example `index` in `epoch`.
#[pyfunction]
pub(crate) fn data_example_seed(seed: u64, epoch: u64, index: u64) -> u64 {
    order::example_seed(seed, epoch, index)
}

/// One delivered unit: this rank's slice of one global batch.
#[pyclass(module = "hindsight._native", name = "DataUnit", frozen, get_all)]
pub(crate) struct DataUnit {
    epoch: u64,
    batch: u64,
    indices: Vec<u64>,
    digest: Py<PyBytes>,
    /// Writable, so tensors can be views of it without a copy.
    payload: Py<Buffer>,
}

/// A training process's connection to an input job.
#[pyclass(module = "hindsight._native", frozen)]
pub(crate) struct DataClient {
    client: Mutex<Client>,
}

#[pymethods]
impl DataClient {
    #[new]
    #[pyo3(signature = (dispatcher, spec, *, rank=0, world=1, expect_job_id=None, window_splits=4, stall_timeout=0.5, unit_deadline=None, no_worker_wait=60.0, connect_timeout=3.0, warn_nondeterministic=false, shared_dir=None, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dispatcher: String,
        spec: &PyJobSpec,
        rank: u32,
        world: u32,
        expect_job_id: Option<String>,
        window_splits: usize,
        stall_timeout: f64,
        unit_deadline: Option<f64>,
        no_worker_wait: f64,
        connect_timeout: f64,
        warn_nondeterministic: bool,
        shared_dir: Option<PathBuf>,
        token: Option<String>,
    ) -> PyResult<Self> {
        let opts = ClientOptions {
            window_splits,
            stall_timeout: seconds(stall_timeout, "stall_timeout")?,
            unit_deadline: unit_deadline
                .map(|d| seconds(d, "unit_deadline"))
                .transpose()?,
            no_worker_wait: seconds(no_worker_wait, "no_worker_wait")?,
            connect_timeout: seconds(connect_timeout, "connect_timeout")?,
            warn_nondeterministic,
            shared_dir,
            token: given_token(token)?,
            ..ClientOptions::default()
        };
        let spec = spec.core();
        let client = interrupt::run(py, |_| {
            Client::connect(
                &dispatcher,
                spec,
                rank,
                world,
                expect_job_id.as_deref(),
                opts,
            )
        })?;
        Ok(DataClient {
            client: Mutex::new(client),
        })
    }

    #[getter]
    fn job_id(&self) -> String {
        lock(&self.client).job_id().to_string()
    }

    fn start_epoch(&self, epoch: u64, from_batch: u64) -> PyResult<()> {
        lock(&self.client)
            .start_epoch(epoch, from_batch)
            .map_err(ToPyErr::to_pyerr)
    }

    /// Stop the epoch in flight; its workers stop computing for it.
    fn stop_epoch(&self) {
        lock(&self.client).stop_epoch();
    }

    /// The next unit, or None at the end of the epoch. Ctrl-C interrupts.
    fn next(&self, py: Python<'_>) -> PyResult<Option<DataUnit>> {
        let got =
            interrupt::wait_until(py, None, |slice| match lock(&self.client).next(slice)? {
                Next::Unit(d) => Ok::<_, DataError>(Some(Some(d))),
                Next::End => Ok(Some(None)),
                Next::Pending => Ok(None),
            })?;
        let Some(Some(d)) = got else {
            return Ok(None);
        };
        Ok(Some(DataUnit {
            epoch: d.epoch,
            batch: d.batch,
            indices: d.indices,
            digest: PyBytes::new(py, &d.digest).unbind(),
            payload: Py::new(py, Buffer::from_payload(d.payload))?,
        }))
    }

    /// Counters: delivered, duplicates_dropped, stale_dropped, failovers, ...
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = lock(&self.client);
        let s = c.stats();
        let d = PyDict::new(py);
        d.set_item("delivered", s.delivered.load(Relaxed))?;
        d.set_item("duplicates_dropped", s.duplicates_dropped.load(Relaxed))?;
        d.set_item("stale_dropped", s.stale_dropped.load(Relaxed))?;
        d.set_item("failovers", s.failovers.load(Relaxed))?;
        d.set_item("stalls_reported", s.stalls_reported.load(Relaxed))?;
        d.set_item("units_after_failover", s.units_after_failover.load(Relaxed))?;
        d.set_item("nondeterministic", s.nondeterministic.load(Relaxed))?;
        d.set_item(
            "last_failover_seconds",
            s.last_failover_us.load(Relaxed) as f64 / 1e6,
        )?;
        Ok(d)
    }

    fn close(&self) {
        lock(&self.client).close();
    }
}

fn seconds(v: f64, arg: &str) -> PyResult<Duration> {
    // At most a year: past it is a typo (and no deadline can be computed).
    const MAX: f64 = 365.0 * 24.0 * 3600.0;
    if !(0.0..=MAX).contains(&v) {
        return Err(crate::errors::to_py(hindsight_core::Error::invalid(
            arg,
            format!("{v}: give a number of seconds from 0 to {MAX} (a year)"),
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A token given as an argument (None: the core reads the environment).
fn given_token(token: Option<String>) -> PyResult<Option<Token>> {
    token
        .map(|t| Token::parse(&t, "the token argument"))
        .transpose()
        .map_err(|e| e.to_pyerr())
}

/// A dispatcher inside this process (what `Loader(workers="local:N")`
/// runs); `hindsight data dispatcher` runs the same in its own process.
#[pyclass(module = "hindsight._native", frozen)]
pub(crate) struct DataDispatcher {
    running: Mutex<Running<DispatcherHandle>>,
    address: String,
    token: Token,
}

#[pymethods]
impl DataDispatcher {
    #[new]
    #[pyo3(signature = (journal_dir, *, bind="127.0.0.1:0", heartbeat_timeout=1.0))]
    fn new(
        py: Python<'_>,
        journal_dir: std::path::PathBuf,
        bind: &str,
        heartbeat_timeout: f64,
    ) -> PyResult<Self> {
        let mut opts = DispatcherOptions::new(journal_dir);
        opts.heartbeat_timeout = seconds(heartbeat_timeout, "heartbeat_timeout")?;
        let running = interrupt::run(py, |_| dispatcher::start(bind, opts))?;
        let (address, token) = match running.handle() {
            Some(h) => (h.addr.to_string(), h.token.clone()),
            None => {
                return Err(
                    DataError::Closed("the dispatcher stopped as it started".into()).to_pyerr(),
                )
            }
        };
        Ok(DataDispatcher {
            running: Mutex::new(running),
            address,
            token,
        })
    }

    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The token its workers and clients must give (for the processes this one starts).
    #[getter]
    fn token(&self) -> &str {
        self.token.reveal()
    }

    fn stop(&self) {
        lock(&self.running).stop();
    }
}

/// What a worker's pipeline is asked for: one rank's slice of one global
/// batch, and where it sits in its split.
#[pyclass(module = "hindsight._native", name = "UnitWork", frozen, get_all)]
pub(crate) struct UnitWork {
    job_id: String,
    epoch: u64,
    batch: u64,
    split: u64,
    /// The split's batches: [split_start, split_end).
    split_start: u64,
    split_end: u64,
    /// Dataset indices (positions in the sharded order), in delivery order.
    indices: Vec<u64>,
    /// The seed of every random draw for the example at the same position.
    seeds: Vec<u64>,
    /// Sharded datasets: where each record is read (empty otherwise).
    shards: Vec<u64>,
    offsets: Vec<u64>,
}

/// Worker checkpoints: when one pays, from what this worker measured
/// (the rule is `hindsight_data::recovery`).
#[pyclass(module = "hindsight._native", name = "CheckpointPolicy")]
pub(crate) struct PyCheckpointPolicy(recovery::CheckpointPolicy);

#[pymethods]
impl PyCheckpointPolicy {
    #[new]
    #[pyo3(signature = (max_overhead=0.05))]
    fn new(max_overhead: f64) -> Self {
        PyCheckpointPolicy(recovery::CheckpointPolicy::new(max_overhead))
    }
    fn observe_read(&mut self, n: u64, secs: f64) {
        self.0.observe_read(n, secs);
    }
    fn observe_unit(&mut self, secs: f64) {
        self.0.observe_unit(secs);
    }
    fn observe_checkpoint(&mut self, records: u64, secs: f64) {
        self.0.observe_checkpoint(records, secs);
    }
    /// "checkpoint", "wait" or "never".
    fn decide(&mut self, read: u64, kept: u64, since: u64) -> &'static str {
        match self.0.decide(read, kept, since) {
            recovery::Decision::Checkpoint => "checkpoint",
            recovery::Decision::Wait => "wait",
            recovery::Decision::Never => "never",
        }
    }
    #[getter]
    fn read_s_per_record(&self) -> Option<f64> {
        self.0.read_s_per_record()
    }
    #[getter]
    fn stall_s_per_record(&self) -> Option<f64> {
        self.0.stall_s_per_record()
    }
    #[getter]
    fn gave_up(&self) -> bool {
        self.0.gave_up()
    }
}

/// The store name of a worker checkpoint of `split`, taken before `batch`.
#[pyfunction]
pub(crate) fn data_checkpoint_name(job_id: &str, epoch: u64, split: u64, batch: u64) -> String {
    recovery::checkpoint_name(job_id, epoch, split, batch)
}

/// The checkpoint a worker starting `split` at `batch` restores, if any.
#[pyfunction]
pub(crate) fn data_latest_checkpoint(
    names: Vec<String>,
    job_id: &str,
    epoch: u64,
    split: u64,
    batch: u64,
) -> Option<String> {
    recovery::latest_checkpoint(
        names.iter().map(String::as_str),
        job_id,
        epoch,
        split,
        batch,
    )
    .map(|(n, _)| n.to_string())
}

/// The encoder's buffer, lent to the worker without a copy. Only the
/// worker reads it, and the encoder keeps no reference to it.
struct Encoded(PyBuffer<u8>);

impl AsRef<[u8]> for Encoded {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a C-contiguous buffer of len_bytes bytes, kept exported
        // (so neither freed nor resized) while the PyBuffer lives.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
}

/// The user's preprocessing, called with the GIL for each unit.
struct PyPipeline {
    dataset: String,
    dataset_args: String,
    code_version: String,
    produce: Py<PyAny>,
}

impl Pipeline for PyPipeline {
    fn dataset(&self) -> &str {
        &self.dataset
    }
    fn dataset_args(&self) -> &str {
        &self.dataset_args
    }
    fn code_version(&self) -> &str {
        &self.code_version
    }
    fn produce(&self, req: &UnitRequest<'_>) -> Result<Produced, PipelineFailure> {
        Python::attach(|py| {
            let work = UnitWork {
                job_id: req.job_id.to_string(),
                epoch: req.epoch,
                batch: req.batch,
                split: req.split,
                split_start: req.split_batches.start,
                split_end: req.split_batches.end,
                indices: req.indices.to_vec(),
                seeds: req.seeds.to_vec(),
                shards: req.shards.to_vec(),
                offsets: req.offsets.to_vec(),
            };
            let out = self.produce.call1(py, (work,)).and_then(|v| {
                let buf = PyBuffer::<u8>::get(v.bind(py))?;
                if buf.is_c_contiguous() {
                    Ok(Box::new(Encoded(buf)) as Produced)
                } else {
                    Ok(Box::new(buf.to_vec(py)?) as Produced)
                }
            });
            out.map_err(|e| PipelineFailure {
                detail: traceback(py, &e),
            })
        })
    }
}

fn traceback(py: Python<'_>, e: &PyErr) -> String {
    let formatted = py.import("traceback").and_then(|tb| {
        tb.getattr("format_exception")?
            .call1((e.get_type(py), e.value(py), e.traceback(py)))?
            .extract::<Vec<String>>()
    });
    match formatted {
        Ok(lines) => lines.concat(),
        Err(_) => e.to_string(),
    }
}

/// Serve as a worker until interrupted: register at `dispatcher`, compute
/// the units clients ask for with `produce(epoch, batch, indices, seeds)`.
/// `ready(address, worker_id)` is called once serving. With `parent_pid`
/// (local workers), it also stops when that process is gone, so a trainer
/// killed with SIGKILL leaves no workers behind.
#[pyfunction]
#[pyo3(signature = (dispatcher, dataset, dataset_args, code_version, produce, *, bind="127.0.0.1:0", advertise=None, ready=None, parent_pid=None, shared_dir=None, token=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_data_worker(
    py: Python<'_>,
    dispatcher: String,
    dataset: String,
    dataset_args: String,
    code_version: String,
    produce: Py<PyAny>,
    bind: &str,
    advertise: Option<String>,
    ready: Option<Py<PyAny>>,
    parent_pid: Option<u32>,
    shared_dir: Option<PathBuf>,
    token: Option<String>,
) -> PyResult<()> {
    let pipeline = Arc::new(PyPipeline {
        dataset,
        dataset_args,
        code_version,
        produce,
    });
    let mut opts = WorkerOptions::new(dispatcher);
    opts.bind = bind.to_string();
    opts.advertise = advertise;
    opts.shared_dir = shared_dir;
    opts.token = given_token(token)?;
    let mut running = interrupt::run(py, |_| worker::start(pipeline, opts))?;
    if let Some(note) = running
        .handle()
        .and_then(|h| hindsight_data::exposure_note("hindsight data worker", &h.addr, h.tls))
    {
        eprintln!("{note}");
    }
    if let (Some(ready), Some(h)) = (ready, running.handle()) {
        ready.call1(py, (h.addr.to_string(), h.worker_id()))?;
    }
    // Serve until a signal handler raises (Ctrl-C, or SIGTERM turned into
    // an exception by the caller).
    let result = interrupt::wait_until(py, None, |_slice| {
        std::thread::sleep(Duration::from_millis(50));
        let orphaned = parent_pid.is_some_and(|p| std::os::unix::process::parent_id() != p);
        Ok::<Option<()>, DataError>(orphaned.then_some(()))
    });
    running.stop();
    result.map(|_| ())
}

/// The job token for trainers of jobs over `dataset` (`hindsight data
/// token`), derived from the service's token (`auth::Token::of_service`).
#[pyfunction]
#[pyo3(signature = (dataset, journal_dir=None))]
pub(crate) fn data_job_token(
    dataset: &str,
    journal_dir: Option<std::path::PathBuf>,
) -> PyResult<String> {
    let service =
        hindsight_data::auth::Token::of_service(journal_dir.as_deref()).map_err(data_to_py)?;
    let job = service.for_dataset(dataset).map_err(data_to_py)?;
    Ok(job.reveal().to_string())
}

/// Run a dispatcher in this process until interrupted (`hindsight data
/// dispatcher`); prints its address and what its journal held.
#[pyfunction]
#[pyo3(signature = (journal_dir, *, bind="127.0.0.1:50051", heartbeat_timeout=1.0))]
pub(crate) fn run_data_dispatcher(
    py: Python<'_>,
    journal_dir: std::path::PathBuf,
    bind: &str,
    heartbeat_timeout: f64,
) -> PyResult<()> {
    let mut opts = DispatcherOptions::new(journal_dir);
    opts.heartbeat_timeout = seconds(heartbeat_timeout, "heartbeat_timeout")?;
    let mut running = interrupt::run(py, |_| dispatcher::start(bind, opts))?;
    if let Some(h) = running.handle() {
        // Before the address: whoever reads that line has seen the warning.
        if let Some(note) =
            hindsight_data::exposure_note("hindsight data dispatcher", &h.addr, h.tls)
        {
            eprintln!("{note}");
        }
        eprintln!("{}", h.token_line());
        println!("{}", h.listening_line());
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let result = interrupt::wait_until(py, None, |_slice| {
        std::thread::sleep(Duration::from_millis(50));
        Ok::<Option<()>, DataError>(None)
    });
    running.stop();
    result.map(|_| ())
}
