//! The background writer. A save copies the caller's bytes into staging
//! blocks (bounded by a byte budget) and returns; worker threads hash,
//! encode and write the chunks, then the save's manifest is committed.
//!
//! A caller may instead *lend* bytes it owns (pinned host memory that a
//! device copy is still filling): they are not copied again, and the worker
//! threads wait until the lender says they are final ([`Lent`]).
//!
//! Saves commit in the order they were made. Errors are kept until someone
//! looks: the save's handle, the next save, `flush`, or the owner at exit.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::device_fp::DeviceFpSum;
use crate::checkpoint::fingerprint::{self, Fingerprint, SegmentHasher, COPY_STEP};
use crate::checkpoint::format::{
    self, Blob, ChunkId, ChunkRef, Manifest, Node, Pending, StagedChunks, FORMAT_VERSION,
};
use crate::checkpoint::storage::LockGuard;
use crate::checkpoint::store::Store;
use crate::checkpoint::upload::Uploader;
use crate::error::{Error, Result};
use crate::sync::lock;

#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// Most bytes of staged (copied, not yet written) data held at once.
    pub staging_bytes: usize,
    /// Threads that hash, encode and write chunks.
    pub threads: usize,
    /// Nice increment of those threads (0 keeps the caller's priority).
    pub nice: i32,
}

impl Default for WriterOptions {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 8);
        WriterOptions {
            staging_bytes: default_staging_bytes(),
            threads,
            nice: 10,
        }
    }
}

/// A quarter of physical memory, between 256 MiB and 16 GiB.
pub fn default_staging_bytes() -> usize {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let total = if pages > 0 && page > 0 {
        pages as u64 * page as u64
    } else {
        4 << 30
    };
    (total / 4).clamp(256 << 20, 16 << 30) as usize
}

/// Staging memory: a byte budget plus a pool of reusable chunk-sized blocks,
/// so steady-state saves copy into memory that is already mapped.
#[derive(Debug)]
struct Budget {
    limit: usize,
    block: usize,
    state: Mutex<BudgetState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct BudgetState {
    used: usize,
    /// The most staging ever in use: memory beyond it is new to the process.
    peak: usize,
    pool: Vec<Vec<u8>>,
}

impl Budget {
    /// A buffer of `len` bytes; waits while the budget is spent.
    /// One request larger than the whole budget is let through alone.
    /// `(buffer, first_use)`: `first_use` when staging grew beyond the most
    /// it ever held, i.e. memory this process meets for the first time
    /// (one-time set-up); a reallocated small buffer of a later save is not.
    fn acquire(&self, len: usize) -> (Vec<u8>, bool) {
        let mut st = lock(&self.state);
        while st.used > 0 && st.used + len > self.limit {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.used += len;
        let first_use = st.used > st.peak;
        st.peak = st.peak.max(st.used);
        if len == self.block {
            if let Some(mut b) = st.pool.pop() {
                drop(st);
                b.truncate(len);
                return (b, false);
            }
        }
        drop(st);
        // Zeroed, not uninitialized: handing out `&mut [u8]` over uninitialized
        // memory is undefined behaviour. Large fresh blocks are usually zero
        // pages from mmap, and steady-state saves reuse pooled blocks, so the
        // zeroing is rarely paid.
        (crate::staging::zeroed(len), first_use)
    }

    fn release(&self, buf: Vec<u8>) {
        let mut st = lock(&self.state);
        st.used -= buf.len();
        // Keep full blocks for reuse while pool + in use stays within the budget.
        if buf.len() == self.block && (st.pool.len() + 1) * self.block + st.used <= self.limit {
            st.pool.push(buf);
        }
        drop(st);
        self.cv.notify_all();
    }

    fn used(&self) -> usize {
        lock(&self.state).used
    }
}

/// What one save did, available from its handle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SaveStats {
    /// Bytes copied into staging by the save call.
    pub bytes_staged: u64,
    /// Bytes of arrays the caller marked unchanged (not copied at all).
    pub bytes_reused: u64,
    pub chunks_written: u64,
    /// Encoded bytes written to storage (new chunks and manifest).
    pub bytes_written: u64,
    /// Staged chunks that were already in the store.
    pub chunks_deduplicated: u64,
    /// Seconds from the save call to durable commit.
    pub seconds_to_durable: f64,
    /// Seconds of one-time set-up inside the save call (fresh staging
    /// memory faulted in): part of the first saves, not of the steady cost.
    pub setup_seconds: f64,
}

#[derive(Debug, Default)]
struct HandleState {
    result: Mutex<Option<Result<SaveStats, Arc<Error>>>>,
    cv: Condvar,
}

/// Tracks one save until it is durable.
#[derive(Debug, Clone)]
pub struct SaveHandle {
    name: String,
    job_id: u64,
    state: Arc<HandleState>,
    shared: Arc<Shared>,
}

impl SaveHandle {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn is_done(&self) -> bool {
        lock(&self.state.result).is_some()
    }

    /// Wait up to `timeout` (forever if None). Ok(None) means still running.
    /// A failure is reported here and no longer at the next save or flush.
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> Result<Option<SaveStats>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut r = lock(&self.state.result);
        loop {
            if let Some(res) = r.as_ref() {
                return match res {
                    Ok(stats) => Ok(Some(stats.clone())),
                    Err(e) => {
                        lock(&self.shared.errors).retain(|(id, _, _)| *id != self.job_id);
                        Err(Error::Background {
                            checkpoint: self.name.clone(),
                            source: e.clone(),
                        })
                    }
                };
            }
            match deadline {
                None => r = self.state.cv.wait(r).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(None);
                    }
                    r = self
                        .state
                        .cv
                        .wait_timeout(r, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    pub fn wait(&self) -> Result<SaveStats> {
        self.wait_timeout(None)?
            .ok_or_else(|| Error::internal("a wait without timeout ended early"))
    }
}

/// Bytes a caller lends to a save instead of having them copied into
/// staging. The writer reads them only after `ready` returned `Ok`, and
/// drops its reference once they are written; the lender must keep them
/// unchanged until then (e.g. by reusing them only after the save's handle
/// is done).
pub trait Lent: Send + Sync + std::fmt::Debug {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Block until the bytes are final; an error fails the save. Called by
    /// every writer thread that reads these bytes, so it must be cheap after
    /// the first call.
    fn ready(&self) -> std::result::Result<(), String>;
    /// The bytes; valid once `ready` returned `Ok`.
    fn bytes(&self) -> &[u8];
    /// Where the writer sums these bytes' device fingerprint as it writes
    /// them (a device tensor's copy: the proof a later save compares with).
    fn device_fp(&self) -> Option<&DeviceFpSum> {
        None
    }
}

#[derive(Debug)]
enum Data {
    /// Staging memory of the budget.
    Owned(Vec<u8>),
    /// A range of lent bytes.
    Lent(Arc<dyn Lent>, Range<usize>),
}

#[derive(Debug)]
struct Staged {
    /// The slot of this chunk's ref.
    index: usize,
    data: Data,
    /// A pack: the small blobs it holds, each with a slot of its own.
    slices: Vec<Slice>,
}

/// One small blob inside a pack chunk.
#[derive(Debug, Clone, Copy)]
struct Slice {
    slot: usize,
    at: usize,
    len: usize,
}

/// Set by commit: the tree, metadata, the number of ref slots and of
/// staged chunks (a pack is one chunk with a slot per blob it holds).
#[derive(Debug)]
struct Sealed {
    root: Node,
    meta: BTreeMap<String, String>,
    slots: usize,
    items: usize,
}

#[derive(Debug, Default)]
struct JobState {
    staged: VecDeque<Staged>,
    sealed: Option<Sealed>,
    aborted: bool,
}

#[derive(Debug)]
struct Job {
    id: u64,
    name: String,
    created_ms: u64,
    started: Instant,
    stats: Mutex<SaveStats>,
    chunks: Arc<StagedChunks>,
    state: Mutex<JobState>,
    cv: Condvar,
    handle: Arc<HandleState>,
    /// The store's shared lock, taken by the caller before it decided which
    /// chunks to reuse ([`SaveBuilder::hold_lock`]); kept until the commit.
    held: Mutex<Option<Box<dyn LockGuard>>>,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Arc<Job>>,
    /// Jobs taken by the dispatcher and not yet finished.
    running: usize,
    closed: bool,
}

#[derive(Debug)]
struct Shared {
    store: Arc<Store>,
    budget: Budget,
    queue: Mutex<Queue>,
    queue_cv: Condvar,
    /// Failures not yet reported to anyone: (job id, error).
    errors: Mutex<Vec<(u64, String, Arc<Error>)>>,
    next_id: AtomicU64,
    /// Only one save is built at a time (see `Writer::begin`).
    building: Mutex<()>,
    /// Local-first mode: committed checkpoints are handed to it for upload.
    uploader: Option<Arc<Uploader>>,
    /// CPU nanoseconds the background threads spent on saves: part of what
    /// a checkpoint costs the machine (the adaptive policy prices it).
    cpu_ns: AtomicU64,
}

/// A chunk's refs by slot (its own, and one per blob a pack holds), and
/// the bytes written (0: deduplicated).
type Done = Result<(Vec<(usize, ChunkRef)>, u64)>;
type Task = (Staged, Arc<Job>, mpsc::Sender<Done>);
// The workers share one multi-consumer queue (crossbeam-channel), not a
// receiver behind a mutex.
type TaskTx = crossbeam_channel::Sender<Task>;
type TaskRx = crossbeam_channel::Receiver<Task>;

/// Owns the background threads of one store.
#[derive(Debug)]
pub struct Writer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    task_tx: Option<TaskTx>,
    owner_pid: u32,
}

impl Writer {
    pub fn new(store: Arc<Store>, options: WriterOptions) -> Result<Writer> {
        Writer::build(store, options, None)
    }

    /// A writer whose saves commit to the uploader's local store and are then
    /// uploaded to its destination; `flush` waits for both.
    pub fn local_first(uploader: Arc<Uploader>, options: WriterOptions) -> Result<Writer> {
        Writer::build(uploader.local().clone(), options, Some(uploader))
    }

    fn build(
        store: Arc<Store>,
        options: WriterOptions,
        uploader: Option<Arc<Uploader>>,
    ) -> Result<Writer> {
        if options.threads == 0 {
            return Err(Error::invalid("threads", "must be at least 1"));
        }
        let block = store.options().chunk_size;
        let shared = Arc::new(Shared {
            store,
            budget: Budget {
                limit: options.staging_bytes.max(1),
                block,
                state: Default::default(),
                cv: Condvar::new(),
            },
            queue: Default::default(),
            queue_cv: Condvar::new(),
            errors: Default::default(),
            next_id: AtomicU64::new(1),
            building: Mutex::new(()),
            uploader,
            cpu_ns: AtomicU64::new(0),
        });
        let (task_tx, task_rx) = crossbeam_channel::unbounded::<Task>();
        let mut threads = Vec::new();
        let nice = options.nice;
        for i in 0..options.threads {
            let rx = task_rx.clone();
            let sh = shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("hindsight-io-{i}"))
                .spawn(move || worker_loop(&sh, &rx, nice))
                .map_err(|e| Error::io("<thread>", e))?;
            threads.push(t);
        }
        let sh = shared.clone();
        let tx = task_tx.clone();
        let t = std::thread::Builder::new()
            .name("hindsight-commit".into())
            .spawn(move || dispatcher_loop(&sh, &tx))
            .map_err(|e| Error::io("<thread>", e))?;
        threads.push(t);
        Ok(Writer {
            shared,
            threads,
            task_tx: Some(task_tx),
            owner_pid: std::process::id(),
        })
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.shared.store
    }

    pub fn uploader(&self) -> Option<&Arc<Uploader>> {
        self.shared.uploader.as_ref()
    }

    fn check_process(&self) -> Result<()> {
        let current = std::process::id();
        if current != self.owner_pid {
            return Err(Error::WrongProcess {
                path: self.shared.store.location().into(),
                owner: self.owner_pid,
                current,
            });
        }
        Ok(())
    }

    /// Report (and forget) the unreported background failures, the first in full.
    pub fn take_error(&self) -> Result<()> {
        let all: Vec<_> = lock(&self.shared.errors).drain(..).collect();
        let Some((_, name, first)) = all.first() else {
            return match &self.shared.uploader {
                Some(u) => u.take_error(),
                None => Ok(()),
            };
        };
        let more = if all.len() > 1 {
            format!(" (and {} later saves failed too)", all.len() - 1)
        } else {
            String::new()
        };
        Err(Error::Background {
            checkpoint: format!("{name}{more}"),
            source: first.clone(),
        })
    }

    /// Start a save. Fails first with any unreported background failure.
    pub fn begin(&self, name: &str) -> Result<SaveBuilder<'_>> {
        self.begin_with(name, None)
    }

    /// [`Writer::begin`] for a save that reuses blobs a [`ReuseCheck`]
    /// confirmed ([`ReuseCheck::into_lock`]): `lock` becomes the save's own store lock,
    /// held until it commits (it is in the job before the job is queued, so
    /// the save never asks for a second one that a waiting gc could refuse).
    pub fn begin_with(&self, name: &str, reuse: Option<ReuseLock>) -> Result<SaveBuilder<'_>> {
        self.check_process()?;
        format::validate_name(name)?;
        self.take_error()?;
        // Concurrent builders could each hold budget the other needs while the
        // commit thread waits on the older one: build one save at a time.
        let guard = lock(&self.shared.building);
        let job = Arc::new(Job {
            id: self.shared.next_id.fetch_add(1, Ordering::Relaxed),
            name: name.to_string(),
            created_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            started: Instant::now(),
            stats: Default::default(),
            chunks: Default::default(),
            state: Default::default(),
            cv: Condvar::new(),
            handle: Default::default(),
            held: Mutex::new(reuse.map(|l| l.0)),
        });
        {
            let mut q = lock(&self.shared.queue);
            if q.closed {
                return Err(Error::Closed {
                    location: format!("store {}", self.shared.store.location()),
                    what: format!("cannot save '{name}'"),
                });
            }
            q.jobs.push_back(job.clone());
        }
        self.shared.queue_cv.notify_all();
        Ok(SaveBuilder {
            writer: self,
            job,
            next_index: 0,
            next_item: 0,
            committed: false,
            _guard: guard,
        })
    }

    /// Wait until every save made so far is durable; report unreported failures.
    pub fn flush_timeout(&self, timeout: Option<Duration>) -> Result<bool> {
        self.check_process()?;
        let deadline = timeout.map(|t| Instant::now() + t);
        if !self.wait_idle(deadline) {
            return Ok(false);
        }
        if let Some(u) = &self.shared.uploader {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if !u.flush_timeout(left)? {
                return Ok(false);
            }
        }
        self.take_error()?;
        Ok(true)
    }

    /// Wait until no save is queued or running; a failure stays unreported
    /// (for the save's handle or the next call). `remove` calls this so that
    /// a save in flight of the removed name cannot commit after it.
    pub fn settle(&self) -> Result<()> {
        self.check_process()?;
        self.wait_idle(None);
        Ok(())
    }

    fn wait_idle(&self, deadline: Option<Instant>) -> bool {
        let mut q = lock(&self.shared.queue);
        while !q.jobs.is_empty() || q.running > 0 {
            q = match deadline {
                None => self
                    .shared
                    .queue_cv
                    .wait(q)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    self.shared
                        .queue_cv
                        .wait_timeout(q, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        true
    }

    pub fn flush(&self) -> Result<()> {
        self.flush_timeout(None).map(|_| ())
    }

    /// Bytes of staging memory currently holding unwritten data.
    pub fn staging_in_use(&self) -> usize {
        self.shared.budget.used()
    }

    pub fn staging_limit(&self) -> usize {
        self.shared.budget.limit
    }

    /// CPU seconds the background threads have spent on saves so far
    /// (hashing, compressing, writing, committing), a running total.
    pub fn background_cpu_seconds(&self) -> f64 {
        self.shared.cpu_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }
}

/// CPU time of the calling thread, in nanoseconds (0 where unavailable).
fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec owned by this frame.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    if rc != 0 {
        return 0;
    }
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// Adds the calling thread's CPU time from now until it is dropped.
struct CpuMeter<'a> {
    total: &'a AtomicU64,
    start: u64,
}

impl<'a> CpuMeter<'a> {
    fn start(total: &'a AtomicU64) -> Self {
        CpuMeter {
            total,
            start: thread_cpu_ns(),
        }
    }
}

impl Drop for CpuMeter<'_> {
    fn drop(&mut self) {
        let spent = thread_cpu_ns().saturating_sub(self.start);
        self.total.fetch_add(spent, Ordering::Relaxed);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if std::process::id() != self.owner_pid {
            // A forked child has no writer threads; touching the queue could
            // deadlock on a lock held at fork time. Leak instead.
            let shared = self.shared.clone();
            std::mem::forget(shared);
            std::mem::forget(std::mem::take(&mut self.threads));
            std::mem::forget(self.task_tx.take());
            return;
        }
        lock(&self.shared.queue).closed = true;
        self.shared.queue_cv.notify_all();
        // The dispatcher drains the queue, then exits; then the workers see the channel close.
        if let Some(t) = self.threads.pop() {
            let _ = t.join();
        }
        self.task_tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Sources up to this size are packed together into chunks of up to the
/// store's chunk size ([`SaveBuilder::stage_packs`]).
fn pack_limit(block: usize) -> usize {
    (256 << 10).min(block / 4)
}

/// Builds one save: stage bytes, then commit the tree that refers to them.
/// Dropping it without commit abandons the save (nothing becomes visible).
#[derive(Debug)]
pub struct SaveBuilder<'w> {
    writer: &'w Writer,
    job: Arc<Job>,
    next_index: usize,
    /// Chunks staged so far (a pack is one chunk and several slots).
    next_item: usize,
    committed: bool,
    _guard: MutexGuard<'w, ()>,
}

/// A staged source: its pending blob and the fingerprint of the bytes copied.
#[derive(Debug)]
pub struct StagedBlob {
    pub blob: Blob,
    pub fingerprint: Fingerprint,
}

/// The store's shared lock, taken to decide which earlier blobs a save may
/// reuse and held by that save until it commits ([`Writer::reuse_check`],
/// [`Writer::begin_with`]).
#[derive(Debug)]
pub struct ReuseLock(Box<dyn LockGuard>);

/// Decides, blob by blob, which blobs of earlier saves of this writer a new
/// save may reuse instead of copying: not from a save that failed, and
/// every chunk still in the store. Asked only for the blobs a save would
/// reuse (tensors proven unchanged), not for every blob the last save
/// wrote: that checked every chunk (two `lstat`s each, ~2.3 us here: ~5 ms
/// for a save of 8 GiB in 4 MiB chunks) of tensors that had changed
/// anyway, with the training thread waiting. Holds the store's shared
/// lock; hand it to the save ([`into_lock`](Self::into_lock),
/// [`Writer::begin_with`]) so gc (in any process) cannot delete the
/// confirmed chunks before the save commits. A blob whose chunks are gone
/// (gc after a remove, quarantine after damage) is copied again instead of
/// failing the save.
pub struct ReuseCheck<'w> {
    writer: &'w Writer,
    lock: ReuseLock,
    present: std::collections::HashMap<ChunkId, bool>,
}

impl std::fmt::Debug for ReuseCheck<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReuseCheck")
            .field("chunks_checked", &self.present.len())
            .finish_non_exhaustive()
    }
}

impl Writer {
    /// Take the store's shared lock to confirm reusable blobs under it.
    pub fn reuse_check(&self) -> Result<ReuseCheck<'_>> {
        let guard = self.shared.store.storage().lock_shared()?;
        Ok(ReuseCheck {
            writer: self,
            lock: ReuseLock(guard),
            present: Default::default(),
        })
    }
}

impl ReuseCheck<'_> {
    /// Whether `blob` (from an earlier save of this writer) may be reused.
    pub fn confirm(&mut self, blob: &Blob) -> Result<bool> {
        if blob.from_failed_save() {
            return Ok(false);
        }
        let storage = self.writer.shared.store.storage();
        // Chunks still unknown belong to a save in flight, which holds the
        // lock until it commits, and this save commits after it.
        let mut all = true;
        for c in blob.known_chunks().unwrap_or_default() {
            let here = match self.present.get(&c.id) {
                Some(&h) => h,
                None => {
                    let h = storage.has_chunk(&c.id)?;
                    self.present.insert(c.id, h);
                    h
                }
            };
            all &= here;
        }
        Ok(all)
    }

    /// The lock the confirmations hold, for the save that reuses them.
    pub fn into_lock(self) -> ReuseLock {
        self.lock
    }
}

impl SaveBuilder<'_> {
    /// One-time set-up seconds spent staging so far ([`SaveStats::setup_seconds`]).
    pub fn setup_seconds(&self) -> f64 {
        lock(&self.job.stats).setup_seconds
    }

    /// Copy each source into staging and return one pending blob per source,
    /// with the [`Fingerprint`] of the bytes copied (computed during the copy).
    /// Copies run on up to `copy_threads` threads; returns once every byte is
    /// copied, so the caller may then change its buffers.
    pub fn stage_many(
        &mut self,
        sources: &[&[u8]],
        copy_threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<Vec<StagedBlob>> {
        let block = self.writer.shared.store.options().chunk_size;
        let start = self.next_index;
        let items_before = self.next_item;
        // Plan: (source, offset, len, index) for every chunk of a large
        // source; the small ones are packed afterwards.
        let mut plan = Vec::new();
        let mut small = Vec::new();
        let mut blobs = Vec::with_capacity(sources.len());
        for (s, src) in sources.iter().enumerate() {
            let first = self.next_index;
            if !src.is_empty() && src.len() <= pack_limit(block) {
                small.push(s);
            }
            let mut off = 0;
            while off < src.len() && small.last() != Some(&s) {
                let len = block.min(src.len() - off);
                plan.push((s, off, len, self.next_index));
                self.next_index += 1;
                off += len;
            }
            blobs.push(Blob {
                nbytes: src.len() as u64,
                chunks: Vec::new(),
                pending: Some(Pending {
                    chunks: self.job.chunks.clone(),
                    range: first..self.next_index,
                }),
            });
        }
        let total: u64 = sources.iter().map(|s| s.len() as u64).sum();
        let segment_hashes: Vec<OnceLock<u128>> = plan.iter().map(|_| OnceLock::new()).collect();
        let next = AtomicU64::new(0);
        let setup_ns = AtomicU64::new(0);
        let shared = &self.writer.shared;
        let job = &self.job;
        let run = || -> Result<()> {
            loop {
                if cancel() {
                    return Err(Error::interrupted("save (while copying)"));
                }
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&(s, off, len, index)) = plan.get(i) else {
                    return Ok(());
                };
                let (mut data, first_use) = shared.budget.acquire(len);
                if first_use {
                    // One-time set-up, timed apart from the copy: the
                    // adaptive policy prices checkpoints at steady state.
                    let t = Instant::now();
                    crate::staging::prefault(&mut data);
                    setup_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                // Copy and fingerprint in cache-sized steps: the hash reads
                // bytes the copy just wrote, not main memory again.
                let mut hasher = SegmentHasher::default();
                for (to, from) in data
                    .chunks_mut(COPY_STEP)
                    .zip(sources[s][off..off + len].chunks(COPY_STEP))
                {
                    to.copy_from_slice(from);
                    hasher.update(to);
                }
                let _ = segment_hashes[i].set(hasher.finish());
                lock(&job.state).staged.push_back(Staged {
                    index,
                    data: Data::Owned(data),
                    slices: Vec::new(),
                });
                job.cv.notify_one();
            }
        };
        let threads = copy_threads.clamp(1, 16).min(plan.len().max(1));
        let result = if threads == 1 || total < (16 << 20) {
            run()
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = (0..threads - 1).map(|_| sc.spawn(run)).collect();
                let mut r = run();
                for h in hs {
                    let r2 = h
                        .join()
                        .unwrap_or_else(|_| Err(Error::internal("a copy thread panicked")));
                    r = r.and(r2);
                }
                r
            })
        };
        // Summed over the copy threads, which fault in parallel: the share
        // of the caller's wait is the sum over the threads that ran.
        let ran = if threads == 1 || total < (16 << 20) {
            1
        } else {
            threads
        };
        lock(&job.stats).setup_seconds += setup_ns.into_inner() as f64 * 1e-9 / ran as f64;
        if let Err(e) = result {
            // Cancelled part way: copy threads check before taking an index and
            // stage every index they take, so exactly plan[..taken] was staged.
            // The commit thread must wait for those chunks only, not the planned
            // ones (it would wait forever, and every later save and flush with it).
            let taken = (next.load(Ordering::Relaxed) as usize).min(plan.len());
            self.next_index = start + taken;
            self.next_item = items_before + taken;
            let staged: u64 = plan[..taken].iter().map(|p| p.2 as u64).sum();
            lock(&job.stats).bytes_staged += staged;
            return Err(e);
        }
        self.next_item += plan.len();
        let mut per_source: Vec<Vec<u128>> = vec![Vec::new(); sources.len()];
        for (p, h) in plan.iter().zip(segment_hashes) {
            let h = h
                .into_inner()
                .ok_or_else(|| Error::internal("a staged segment was not fingerprinted"))?;
            per_source[p.0].push(h);
        }
        let packed = self.stage_packs(sources, &small, block, cancel)?;
        for (s, slot, h) in packed {
            per_source[s].push(h);
            if let Some(p) = blobs[s].pending.as_mut() {
                p.range = slot..slot + 1;
            }
        }
        lock(&self.job.stats).bytes_staged += total;
        Ok(blobs
            .into_iter()
            .zip(per_source)
            .map(|(blob, hashes)| {
                let fingerprint = fingerprint::fold(hashes, blob.nbytes);
                StagedBlob { blob, fingerprint }
            })
            .collect())
    }

    /// Copy the small sources into pack chunks of up to `block` bytes: one
    /// chunk file for many small tensors (a checkpoint of a small model had
    /// ~90 chunk files, and creating them was most of its writer's CPU).
    /// Returns (source, slot of its ref, segment fingerprint) for each.
    fn stage_packs(
        &mut self,
        sources: &[&[u8]],
        small: &[usize],
        block: usize,
        cancel: Cancel<'_>,
    ) -> Result<Vec<(usize, usize, u128)>> {
        let mut out = Vec::with_capacity(small.len());
        let mut rest = small;
        while !rest.is_empty() {
            if cancel() {
                return Err(Error::interrupted("save (while copying)"));
            }
            let mut size = 0;
            let mut n = 0;
            while n < rest.len() && (n == 0 || size + sources[rest[n]].len() <= block) {
                size += sources[rest[n]].len();
                n += 1;
            }
            let (group, tail) = rest.split_at(n);
            rest = tail;
            let shared = &self.writer.shared;
            let (mut data, first_use) = shared.budget.acquire(size);
            if first_use {
                let t = Instant::now();
                crate::staging::prefault(&mut data);
                lock(&self.job.stats).setup_seconds += t.elapsed().as_secs_f64();
            }
            let index = self.next_index;
            self.next_index += 1;
            let mut slices = Vec::with_capacity(group.len());
            let mut at = 0;
            for &s in group {
                let src = sources[s];
                let mut hasher = SegmentHasher::default();
                for (to, from) in data[at..at + src.len()]
                    .chunks_mut(COPY_STEP)
                    .zip(src.chunks(COPY_STEP))
                {
                    to.copy_from_slice(from);
                    hasher.update(to);
                }
                slices.push(Slice {
                    slot: self.next_index,
                    at,
                    len: src.len(),
                });
                out.push((s, self.next_index, hasher.finish()));
                self.next_index += 1;
                at += src.len();
            }
            lock(&self.job.state).staged.push_back(Staged {
                index,
                data: Data::Owned(data),
                slices,
            });
            self.next_item += 1;
            self.job.cv.notify_one();
        }
        Ok(out)
    }

    /// Add lent buffers to the save, one pending blob each, without copying
    /// them ([`Lent`]). Their chunks are written once the save is committed
    /// and each buffer is ready.
    pub fn lend(&mut self, buffers: Vec<Arc<dyn Lent>>) -> Vec<Blob> {
        let block = self.writer.shared.store.options().chunk_size;
        let mut blobs = Vec::with_capacity(buffers.len());
        let mut total = 0u64;
        let mut st = lock(&self.job.state);
        for buf in buffers {
            let len = buf.len();
            let first = self.next_index;
            let mut off = 0;
            while off < len {
                let n = block.min(len - off);
                st.staged.push_back(Staged {
                    index: self.next_index,
                    data: Data::Lent(buf.clone(), off..off + n),
                    slices: Vec::new(),
                });
                self.next_index += 1;
                self.next_item += 1;
                off += n;
            }
            total += len as u64;
            blobs.push(Blob {
                nbytes: len as u64,
                chunks: Vec::new(),
                pending: Some(Pending {
                    chunks: self.job.chunks.clone(),
                    range: first..self.next_index,
                }),
            });
        }
        drop(st);
        lock(&self.job.stats).bytes_staged += total;
        self.job.cv.notify_all();
        blobs
    }

    pub fn stage(&mut self, source: &[u8]) -> Result<Blob> {
        let mut v = self.stage_many(&[source], 1, &|| false)?;
        Ok(v.remove(0).blob)
    }

    /// The segment size fingerprints of this store use (its chunk size).
    pub fn fingerprint_segment(&self) -> usize {
        self.writer.shared.store.options().chunk_size
    }

    /// Record bytes the caller reuses from an earlier save (for statistics).
    pub fn note_reused(&mut self, bytes: u64) {
        lock(&self.job.stats).bytes_reused += bytes;
    }

    /// Seal the save: it commits in the background once its chunks are durable.
    pub fn commit(mut self, root: Node, meta: BTreeMap<String, String>) -> SaveHandle {
        lock(&self.job.state).sealed = Some(Sealed {
            root,
            meta,
            slots: self.next_index,
            items: self.next_item,
        });
        self.job.cv.notify_all();
        self.committed = true;
        SaveHandle {
            name: self.job.name.clone(),
            job_id: self.job.id,
            state: self.job.handle.clone(),
            shared: self.writer.shared.clone(),
        }
    }
}

impl Drop for SaveBuilder<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let mut st = lock(&self.job.state);
            st.aborted = true;
            st.sealed = Some(Sealed {
                root: Node::None,
                meta: BTreeMap::new(),
                slots: self.next_index,
                items: self.next_item,
            });
            drop(st);
            self.job.cv.notify_all();
        }
    }
}

thread_local! {
    static ON_WRITER_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a writer thread of some store: one must
/// not join writer threads from there (e.g. dropping a store while a lent
/// buffer's `ready` runs foreign code on it).
pub fn on_writer_thread() -> bool {
    ON_WRITER_THREAD.with(|c| c.get())
}

fn worker_loop(shared: &Shared, rx: &TaskRx, nice: i32) {
    ON_WRITER_THREAD.with(|c| c.set(true));
    if nice != 0 {
        // Background work yields to the training threads. On Linux a thread id
        // given to setpriority changes that thread only. Best effort.
        // SAFETY: plain syscalls on this thread's own id.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        }
    }
    loop {
        let task = rx.recv();
        let Ok((staged, job, done)) = task else {
            return;
        };
        let meter = CpuMeter::start(&shared.cpu_ns);
        let aborted = lock(&job.state).aborted;
        let r = if aborted {
            Err(Error::Abandoned {
                checkpoint: job.name.clone(),
            })
        } else {
            let bytes = match &staged.data {
                Data::Owned(v) => Ok(v.as_slice()),
                Data::Lent(buf, range) => buf
                    .ready()
                    .map(|()| &buf.bytes()[range.clone()])
                    .map_err(|detail| Error::Device {
                        checkpoint: job.name.clone(),
                        detail,
                    }),
            };
            bytes.and_then(|b| {
                let id = ChunkId::of(b);
                let written = shared.store.put_chunk(b, &id)?;
                if let Data::Lent(buf, range) = &staged.data {
                    if let Some(sum) = buf.device_fp() {
                        sum.add(range.start, b);
                    }
                }
                let mut refs = vec![(staged.index, ChunkRef::whole(id, b.len() as u64))];
                for s in &staged.slices {
                    let own = ChunkId::of(&b[s.at..s.at + s.len]);
                    refs.push((
                        s.slot,
                        ChunkRef::packed(id, b.len() as u64, s.at as u64, s.len as u64, own),
                    ));
                }
                Ok((refs, written))
            })
        };
        if let Data::Owned(v) = staged.data {
            shared.budget.release(v);
        }
        drop(meter);
        let _ = done.send(r);
    }
}

fn dispatcher_loop(shared: &Shared, tasks: &TaskTx) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    q.running += 1;
                    break j;
                }
                if q.closed {
                    return;
                }
                q = shared.queue_cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let result = {
            let _meter = CpuMeter::start(&shared.cpu_ns);
            run_job(shared, &job, tasks)
        };
        if result.is_err() {
            job.chunks.failed.store(true, Ordering::Release);
        }
        // Released here if the job never reached `run_job`'s own use of it.
        drop(lock(&job.held).take());
        let aborted = lock(&job.state).aborted;
        match (&result, &shared.uploader) {
            (Err(e), _) if !aborted => {
                lock(&shared.errors).push((job.id, job.name.clone(), e.clone()));
            }
            // Queued before `running` drops, so a flush never sees a gap.
            (Ok(_), Some(u)) => u.enqueue(&job.name),
            _ => {}
        }
        *lock(&job.handle.result) = Some(result);
        job.handle.cv.notify_all();
        lock(&shared.queue).running -= 1;
        shared.queue_cv.notify_all();
    }
}

fn run_job(shared: &Shared, job: &Arc<Job>, tasks: &TaskTx) -> Result<SaveStats, Arc<Error>> {
    let storage = shared.store.storage().clone();
    // Held until commit so gc (in any process) cannot delete chunks this save
    // wrote or reuses. Taken before any chunk is written; a save that reuses
    // blobs brings the lock they were checked under.
    let held = lock(&job.held).take();
    let lock_guard = match held {
        Some(g) => Ok(g),
        None => storage.lock_shared(),
    };
    let (done_tx, done_rx) = mpsc::channel();
    let mut sent = 0usize;
    let Sealed {
        root,
        meta,
        slots: n,
        ..
    } = loop {
        let mut st = lock(&job.state);
        // Leave the CPU to the copy while the caller is blocked in `save`:
        // start hashing and writing once the save is sealed, or earlier only
        // when staging memory runs short (a state larger than the budget).
        let go = st.sealed.is_some() || shared.budget.used() * 2 > shared.budget.limit;
        if let Some(s) = go.then(|| st.staged.pop_front()).flatten() {
            drop(st);
            if tasks.send((s, job.clone(), done_tx.clone())).is_err() {
                return Err(Arc::new(Error::internal("the writer threads stopped")));
            }
            sent += 1;
            continue;
        }
        if let Some(items) = st.sealed.as_ref().map(|s| s.items) {
            if sent >= items {
                if let Some(sealed) = st.sealed.take() {
                    break sealed;
                }
            }
        }
        drop(job.cv.wait(st).unwrap_or_else(|p| p.into_inner()));
    };
    drop(done_tx);
    let mut refs: Vec<Option<ChunkRef>> = vec![None; n];
    let mut first_err: Option<Error> = None;
    let mut stats = lock(&job.stats).clone();
    for r in done_rx.iter() {
        match r {
            Ok((chunk_refs, written)) => {
                if written > 0 {
                    stats.chunks_written += 1;
                    stats.bytes_written += written;
                } else {
                    stats.chunks_deduplicated += 1;
                }
                for (index, c) in chunk_refs {
                    if let Some(slot) = refs.get_mut(index) {
                        *slot = Some(c);
                    }
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if lock(&job.state).aborted {
        return Err(Arc::new(Error::Abandoned {
            checkpoint: job.name.clone(),
        }));
    }
    let _lock = lock_guard.map_err(Arc::new)?;
    if let Some(e) = first_err {
        return Err(Arc::new(e));
    }
    let own: Vec<ChunkRef> = refs
        .into_iter()
        .map(|r| r.ok_or_else(|| Error::internal("a staged chunk has no result")))
        .collect::<Result<_>>()
        .map_err(Arc::new)?;
    let own_ids: HashSet<ChunkId> = own.iter().map(|c| c.id).collect();
    let _ = job.chunks.refs.set(own);

    // Resolve pending blobs; chunks from earlier saves must still exist.
    let mut root = root;
    let mut problem: Option<Error> = None;
    let mut foreign: Vec<ChunkId> = Vec::new();
    root.for_each_blob_mut(&mut |b| {
        if let Some(p) = b.pending.take() {
            match p.chunks.refs.get() {
                Some(all) if p.range.end <= all.len() => b.chunks = all[p.range.clone()].to_vec(),
                _ => {
                    problem.get_or_insert(Error::invalid(
                        "save",
                        format!("checkpoint '{}' reuses data of an earlier save that failed; save again", job.name),
                    ));
                }
            }
        }
        foreign.extend(b.chunks.iter().map(|c| c.id).filter(|id| !own_ids.contains(id)));
    });
    if let Some(e) = problem {
        return Err(Arc::new(e));
    }
    foreign.sort();
    foreign.dedup();
    for id in &foreign {
        if !storage.has_chunk(id).map_err(Arc::new)? {
            return Err(Arc::new(Error::corrupt(
                storage.chunk_path(id),
                format!("checkpoint '{}' reuses a chunk that is no longer in the store (removed by gc?); save again", job.name),
            )));
        }
    }
    storage.sync().map_err(Arc::new)?;
    let manifest = Manifest {
        format: FORMAT_VERSION,
        name: job.name.clone(),
        created_ms: job.created_ms,
        meta,
        root,
    };
    manifest
        .refuse_superseded(storage.committed(&job.name).map_err(Arc::new)?.as_ref())
        .map_err(Arc::new)?;
    let bytes = manifest.encode().map_err(Arc::new)?;
    storage.put_manifest(&job.name, &bytes).map_err(Arc::new)?;
    stats.bytes_written += bytes.len() as u64;
    stats.seconds_to_durable = job.started.elapsed().as_secs_f64();
    Ok(stats)
}
