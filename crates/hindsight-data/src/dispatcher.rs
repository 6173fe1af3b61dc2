//! The dispatcher: which worker computes which split, under which attempt.
//!
//! It is never on the data path: clients stream units straight from
//! workers, so a dispatcher restart only delays new assignments. Every
//! decision is written to the journal before it is answered (write-ahead),
//! and the state is rebuilt from the journal by the same [`State::apply`]
//! that the live path uses, so a restarted dispatcher hands out exactly the
//! attempts it would have, and never reuses an attempt number.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use crate::auth::{self, Check, Token};
use crate::error::{Error, Result};
use crate::journal::Journal;
use crate::proto::{self, check_protocol, journal_record::Event, Key};
use crate::tls::Tls;

/// Digests per journal record of a compacted journal (~30 bytes each).
const DIGESTS_PER_RECORD: usize = 50_000;

/// Large enough for any reply or report (units never pass here).
pub(crate) const MAX_CONTROL_MESSAGE: usize = 256 << 20;

/// How the dispatcher detects failures.
#[derive(Debug, Clone)]
pub struct DispatcherOptions {
    pub journal_dir: PathBuf,
    /// A worker silent for this long is declared dead.
    pub heartbeat_timeout: Duration,
    /// How long a probe of a worker reported by a client may take.
    pub probe_timeout: Duration,
    /// The service's token; None: [`Token::for_dispatcher`] (the
    /// environment, else the journal's token file).
    pub token: Option<Token>,
    /// TLS; None: from the environment ([`Tls::from_env`]).
    pub tls: Option<Tls>,
    /// Bounds on what callers can make it hold (each refused beyond, by
    /// name): live workers, distinct jobs, ranks of a job. Dead workers are
    /// forgotten beyond [`DEAD_WORKERS_KEPT`].
    pub max_workers: usize,
    pub max_jobs: usize,
    pub max_ranks: u32,
}

/// Dead workers kept for `Status` (the oldest are forgotten first: an
/// unknown id is treated as a dead one everywhere).
pub const DEAD_WORKERS_KEPT: usize = 256;

impl DispatcherOptions {
    pub fn new(journal_dir: impl Into<PathBuf>) -> Self {
        DispatcherOptions {
            journal_dir: journal_dir.into(),
            heartbeat_timeout: Duration::from_millis(1000),
            probe_timeout: Duration::from_millis(300),
            token: None,
            tls: None,
            max_workers: 4096,
            max_jobs: 256,
            max_ranks: 1 << 16,
        }
    }
}

#[derive(Debug)]
struct WorkerEntry {
    address: String,
    dataset: String,
    dataset_args: String,
    code_version: String,
    alive: bool,
    last_seen: Instant,
}

impl WorkerEntry {
    /// Builds the job's examples: same factory, arguments and code.
    fn serves(&self, job: &proto::JobSpec) -> bool {
        self.dataset == job.dataset
            && self.dataset_args == job.dataset_args
            && self.code_version == job.code_version
    }
}

#[derive(Debug)]
struct SplitEntry {
    latest: proto::Assignment,
    finished: bool,
}

/// The dispatcher's state: a pure function of the journal's records.
#[derive(Debug, Default)]
struct State {
    jobs: HashMap<String, proto::JobSpec>,
    workers: BTreeMap<String, WorkerEntry>,
    splits: HashMap<Key, SplitEntry>,
    cursors: HashMap<(String, u32), (u64, u64)>,
    /// Digest of every unit delivered, per (job, epoch, rank).
    digests: HashMap<(String, u64, u32), BTreeMap<u64, Vec<u8>>>,
    assignments: u64,
    reassignments: u64,
    records: u64,
}

impl State {
    /// Keep at most `keep` dead workers, the most recently seen.
    fn forget_dead(&mut self, keep: usize) {
        let mut dead: Vec<(Instant, String)> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.alive)
            .map(|(id, w)| (w.last_seen, id.clone()))
            .collect();
        if dead.len() <= keep {
            return;
        }
        dead.sort();
        for (_, id) in &dead[..dead.len() - keep] {
            self.workers.remove(id);
        }
    }

    /// The one place a record changes the state: replay and live path.
    fn apply(&mut self, event: &Event, now: Instant) {
        self.records += 1;
        match event {
            Event::Job(spec) => {
                let id = crate::order::JobSpec::from(spec).job_id();
                self.jobs.insert(id, spec.clone());
            }
            Event::Worker(w) => {
                self.workers.insert(
                    w.worker_id.clone(),
                    WorkerEntry {
                        address: w.address.clone(),
                        dataset: w.dataset.clone(),
                        dataset_args: w.dataset_args.clone(),
                        code_version: w.code_version.clone(),
                        alive: true,
                        last_seen: now,
                    },
                );
            }
            Event::WorkerDead(id) => {
                if let Some(w) = self.workers.get_mut(id) {
                    w.alive = false;
                }
            }
            Event::Assigned(a) => {
                let Some(key) = a.key.as_ref().map(proto::SplitKey::key) else {
                    return;
                };
                self.assignments += 1;
                if a.attempt > 1 {
                    self.reassignments += 1;
                }
                self.splits.insert(
                    key,
                    SplitEntry {
                        latest: a.clone(),
                        finished: false,
                    },
                );
            }
            Event::Finished(k) => {
                if let Some(s) = self.splits.get_mut(&k.key()) {
                    s.finished = true;
                }
            }
            Event::Digests(p) => self.add_digests(p),
            Event::Cursor(p) => {
                self.add_digests(p);
                let slot = (p.job_id.clone(), p.rank);
                let previous = self.cursors.insert(slot, (p.epoch, p.cursor_batch));
                // Splits two epochs back can no longer be asked for: forget
                // them, so the state (and a compacted journal) stays bounded.
                if previous.is_none_or(|(e, _)| e < p.epoch) && p.epoch >= 2 {
                    let (job, rank, keep) = (&p.job_id, p.rank, p.epoch - 1);
                    self.splits
                        .retain(|k, _| !(&k.0 == job && k.2 == rank && k.1 < keep));
                    self.digests
                        .retain(|k, _| !(&k.0 == job && k.2 == rank && k.1 < keep));
                }
            }
        }
    }

    fn add_digests(&mut self, p: &proto::ProgressRequest) {
        if p.digests.is_empty() {
            return;
        }
        let known = self
            .digests
            .entry((p.job_id.clone(), p.epoch, p.rank))
            .or_default();
        for d in &p.digests {
            known.entry(d.batch).or_insert_with(|| d.digest.clone());
        }
    }

    /// Records that rebuild this state: what a compacted journal holds.
    fn snapshot(&self) -> Vec<Event> {
        let mut out: Vec<Event> = self.jobs.values().cloned().map(Event::Job).collect();
        for (id, w) in &self.workers {
            if w.alive {
                out.push(Event::Worker(proto::RegisterWorkerRequest {
                    protocol: proto::PROTOCOL,
                    worker_id: id.clone(),
                    address: w.address.clone(),
                    dataset: w.dataset.clone(),
                    code_version: w.code_version.clone(),
                    dataset_args: w.dataset_args.clone(),
                }));
            }
        }
        let mut splits: Vec<_> = self.splits.iter().collect();
        splits.sort_by(|a, b| a.0.cmp(b.0));
        for (_, s) in splits {
            // A split whose worker is gone keeps its latest attempt (as an
            // assignment to the dead id), so the next attempt stays fenced.
            out.push(Event::Assigned(s.latest.clone()));
            if s.finished {
                if let Some(k) = s.latest.key.clone() {
                    out.push(Event::Finished(k));
                }
            }
        }
        let mut digests: Vec<_> = self.digests.iter().collect();
        digests.sort_by(|a, b| a.0.cmp(b.0));
        for ((job, epoch, rank), known) in digests {
            // In chunks: one record stays far below the journal's limit.
            let all: Vec<_> = known.iter().collect();
            for chunk in all.chunks(DIGESTS_PER_RECORD) {
                out.push(Event::Digests(proto::ProgressRequest {
                    protocol: proto::PROTOCOL,
                    job_id: job.clone(),
                    epoch: *epoch,
                    rank: *rank,
                    digests: chunk
                        .iter()
                        .map(|(b, d)| proto::UnitDigest {
                            batch: **b,
                            digest: (*d).clone(),
                        })
                        .collect(),
                    ..Default::default()
                }));
            }
        }
        for ((job, rank), (epoch, batch)) in &self.cursors {
            out.push(Event::Cursor(proto::ProgressRequest {
                protocol: proto::PROTOCOL,
                job_id: job.clone(),
                epoch: *epoch,
                rank: *rank,
                cursor_batch: *batch,
                ..Default::default()
            }));
        }
        out
    }

    fn live(&self, id: &str) -> bool {
        self.workers.get(id).is_some_and(|w| w.alive)
    }

    /// The live worker for `job`'s dataset with the fewest unfinished
    /// splits; `avoid` only if nobody else is left.
    fn pick_worker(
        &self,
        job: &proto::JobSpec,
        avoid: Option<&str>,
        planned: &HashMap<String, usize>,
    ) -> Option<(String, String)> {
        let mut load: HashMap<&str, usize> = HashMap::new();
        for s in self.splits.values().filter(|s| !s.finished) {
            *load.entry(s.latest.worker_id.as_str()).or_default() += 1;
        }
        for (id, n) in planned {
            *load.entry(id.as_str()).or_default() += n;
        }
        let candidates = self
            .workers
            .iter()
            .filter(|(_, w)| w.alive && w.serves(job));
        let best = |avoiding: bool| {
            candidates
                .clone()
                .filter(|(id, _)| !avoiding || Some(id.as_str()) != avoid)
                .min_by_key(|(id, _)| (load.get(id.as_str()).copied().unwrap_or(0), *id))
                .map(|(id, w)| (id.clone(), w.address.clone()))
        };
        best(true).or_else(|| best(false))
    }
}

/// Journal records of `events`, in order.
fn encode(events: &[Event]) -> Vec<Vec<u8>> {
    events
        .iter()
        .map(|e| {
            proto::JournalRecord {
                event: Some(e.clone()),
            }
            .encode_to_vec()
        })
        .collect()
}

struct Shared {
    state: State,
    journal: Journal,
    /// After a failed compaction: the record count to try again at.
    compact_after: u64,
}

struct Inner {
    shared: Mutex<Shared>,
    /// Heartbeats that arrived while `shared` was busy.
    beats: Mutex<HashMap<String, Instant>>,
    opts: DispatcherOptions,
    seq: std::sync::atomic::AtomicU64,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Journal, then apply: what a client was told survives any crash.
    fn commit(shared: &mut Shared, events: Vec<Event>) -> std::result::Result<(), Status> {
        if events.is_empty() {
            return Ok(());
        }
        let encoded = encode(&events);
        let refs: Vec<&[u8]> = encoded.iter().map(Vec::as_slice).collect();
        shared
            .journal
            .append(&refs)
            .map_err(|e| Status::internal(format!("dispatcher journal: {e}")))?;
        let now = Instant::now();
        for e in &events {
            shared.state.apply(e, now);
        }
        Ok(())
    }

    fn new_worker_id(&self) -> String {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let h = blake3::hash(format!("{}:{nanos}:{n}", std::process::id()).as_bytes());
        format!("w-{}", &h.to_hex()[..12])
    }

    /// A new attempt of `key` on a live worker (journaled before returned).
    fn reassign(
        shared: &mut Shared,
        key: &proto::SplitKey,
        from_batch: u64,
        avoid: Option<&str>,
    ) -> std::result::Result<proto::Assignment, Status> {
        let a = Self::plan(shared, key, from_batch, avoid, &HashMap::new())?;
        Self::commit(shared, vec![Event::Assigned(a.clone())])?;
        Ok(a)
    }

    /// The next attempt of `key`, not yet journaled; `planned` counts the
    /// splits already given to each worker in the same batch.
    fn plan(
        shared: &Shared,
        key: &proto::SplitKey,
        from_batch: u64,
        avoid: Option<&str>,
        planned: &HashMap<String, usize>,
    ) -> std::result::Result<proto::Assignment, Status> {
        let Some(job) = shared.state.jobs.get(&key.job_id) else {
            return Err(Status::not_found(format!(
                "job {} is not attached at this dispatcher (attach first)",
                key.job_id
            )));
        };
        let Some((worker_id, worker_addr)) = shared.state.pick_worker(job, avoid, planned) else {
            // Workers that serve the dataset from other code, or built it
            // with other arguments, will never do: refuse at once, naming
            // the difference, instead of waiting for a matching one.
            let others: Vec<&WorkerEntry> = shared
                .state
                .workers
                .values()
                .filter(|w| w.alive && w.dataset == job.dataset && !w.serves(job))
                .collect();
            let versions: Vec<&str> = others
                .iter()
                .filter(|w| w.code_version != job.code_version)
                .map(|w| w.code_version.as_str())
                .collect();
            if !versions.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "code version mismatch: the job wants dataset {} at code version {}, the live \
                     workers run version(s) {}; start the workers from the same code as the trainer",
                    job.dataset,
                    job.code_version,
                    versions.join(", ")
                )));
            }
            if let Some(w) = others.first() {
                return Err(Status::failed_precondition(format!(
                    "dataset arguments mismatch: the job wants dataset {} with arguments {}, the live \
                     workers build it with {}; start the workers with the trainer's dataset_args",
                    job.dataset, job.dataset_args, w.dataset_args
                )));
            }
            return Err(Status::unavailable(format!(
                "no live worker serves dataset {} (code version {})",
                job.dataset, job.code_version
            )));
        };
        let attempt = shared
            .state
            .splits
            .get(&key.key())
            .map_or(0, |s| s.latest.attempt)
            + 1;
        let a = proto::Assignment {
            key: Some(key.clone()),
            worker_id,
            worker_addr,
            attempt,
            from_batch,
        };
        Ok(a)
    }

    /// Declare workers dead whose heartbeats stopped.
    fn expire(&self) {
        let mut shared = self.lock();
        let beats: Vec<(String, Instant)> = {
            let mut side = self.beats.lock().unwrap_or_else(|p| p.into_inner());
            side.drain().collect()
        };
        for (id, at) in beats {
            if let Some(w) = shared.state.workers.get_mut(&id) {
                w.last_seen = w.last_seen.max(at);
            }
        }
        let timeout = self.opts.heartbeat_timeout;
        let dead: Vec<Event> = shared
            .state
            .workers
            .iter()
            .filter(|(_, w)| w.alive && w.last_seen.elapsed() > timeout)
            .map(|(id, _)| Event::WorkerDead(id.clone()))
            .collect();
        if let Err(e) = Self::commit(&mut shared, dead) {
            eprintln!("hindsight data dispatcher: {}", e.message());
        }
        shared.state.forget_dead(DEAD_WORKERS_KEPT);
    }

    fn grace(&self) {
        let now = Instant::now();
        for w in self.lock().state.workers.values_mut() {
            w.last_seen = now;
        }
    }

    /// Keep the journal proportional to the state, not to history.
    fn maybe_compact(&self) {
        let mut shared = self.lock();
        let due = 4 * (shared.state.splits.len() as u64 + 64) + 100_000;
        if shared.state.records < due.max(shared.compact_after) {
            return;
        }
        let snapshot = shared.state.snapshot();
        let encoded = encode(&snapshot);
        let refs: Vec<&[u8]> = encoded.iter().map(Vec::as_slice).collect();
        match shared.journal.compact(&refs) {
            Ok(()) => shared.state.records = snapshot.len() as u64,
            Err(e) => {
                // Not again before the journal grew by another tenth.
                shared.compact_after = shared.state.records + shared.state.records / 10;
                eprintln!("hindsight data dispatcher: compaction failed: {e}");
            }
        }
    }
}

/// The dispatcher's gRPC service.
#[derive(Clone)]
pub struct DispatcherService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DispatcherService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatcherService")
            .field("journal", &self.inner.opts.journal_dir)
            .finish()
    }
}

/// What recovery found in the journal.
#[derive(Debug, Clone)]
pub struct Recovered {
    pub records: usize,
    pub truncated_bytes: u64,
    pub jobs: usize,
    pub workers: usize,
    pub seconds: f64,
}

impl DispatcherService {
    /// Rebuild the state from the journal (truncating a torn tail; a
    /// corrupt record before the tail is an error naming its offset).
    pub fn open(opts: DispatcherOptions) -> Result<(Self, Recovered)> {
        let started = Instant::now();
        let (journal, records, recovery) = Journal::open(&opts.journal_dir)?;
        let mut state = State::default();
        let now = Instant::now();
        for (i, bytes) in records.iter().enumerate() {
            let rec = proto::JournalRecord::decode(bytes.as_slice()).map_err(|e| {
                Error::Journal(crate::journal::JournalError::Corrupt {
                    path: journal.path().to_path_buf(),
                    offset: 0,
                    reason: format!("record {i} passed its checksum but does not decode: {e}"),
                })
            })?;
            if let Some(event) = rec.event {
                state.apply(&event, now);
            }
        }
        // Workers known from the journal get one heartbeat timeout to
        // check in (their `last_seen` is now) before they are declared dead.
        let recovered = Recovered {
            records: recovery.records,
            truncated_bytes: recovery.truncated_bytes,
            jobs: state.jobs.len(),
            workers: state.workers.values().filter(|w| w.alive).count(),
            seconds: started.elapsed().as_secs_f64(),
        };
        let service = DispatcherService {
            inner: Arc::new(Inner {
                shared: Mutex::new(Shared {
                    state,
                    journal,
                    compact_after: 0,
                }),
                beats: Mutex::new(HashMap::new()),
                opts,
                seq: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        Ok((service, recovered))
    }

    async fn probe(&self, address: &str, worker_id: &str) -> bool {
        let timeout = self.inner.opts.probe_timeout;
        let call = async {
            let token = self.inner.opts.token.as_ref()?;
            let tls = self.inner.opts.tls.clone().unwrap_or_default();
            let mut c = crate::worker::connect(address, timeout, token, &tls)
                .await
                .ok()?;
            c.probe(proto::ProbeRequest {
                worker_id: worker_id.to_string(),
            })
            .await
            .ok()
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(Some(reply)) => reply.get_ref().worker_id == worker_id,
            _ => false,
        }
    }
}

/// Whether a caller of `scope` may act on job `job_id`: the service may on
/// any (an unknown one is the handler's to refuse), a job token only on a
/// known job over its dataset.
fn job_allowed(
    scope: &Option<auth::Scope>,
    shared: &Shared,
    job_id: &str,
) -> std::result::Result<(), Status> {
    let dataset = shared
        .state
        .jobs
        .get(job_id)
        .map(|spec| spec.dataset.as_str());
    match scope {
        Some(auth::Scope::Service) => Ok(()),
        Some(s) if dataset.is_some() && s.allows(dataset) => Ok(()),
        _ => Err(auth::refused()),
    }
}

#[tonic::async_trait]
impl proto::dispatcher_server::Dispatcher for DispatcherService {
    async fn register_worker(
        &self,
        request: Request<proto::RegisterWorkerRequest>,
    ) -> std::result::Result<Response<proto::RegisterWorkerReply>, Status> {
        auth::allow(&request, None)?;
        let mut req = request.into_inner();
        check_protocol(req.protocol, "worker")?;
        let mut shared = self.inner.lock();
        let known = shared.state.workers.get(&req.worker_id);
        let same = known.is_some_and(|w| {
            w.alive
                && w.address == req.address
                && w.dataset == req.dataset
                && w.dataset_args == req.dataset_args
                && w.code_version == req.code_version
        });
        if same {
            if let Some(w) = shared.state.workers.get_mut(&req.worker_id) {
                w.last_seen = Instant::now();
            }
        } else {
            let live = shared.state.workers.values().filter(|w| w.alive).count();
            if live >= self.inner.opts.max_workers {
                return Err(Status::resource_exhausted(format!(
                    "this dispatcher serves at most {} live workers",
                    self.inner.opts.max_workers
                )));
            }
            // Unknown, dead or changed: a new identity, so that anything the
            // old one still sends is fenced off.
            req.worker_id = self.inner.new_worker_id();
            Inner::commit(&mut shared, vec![Event::Worker(req.clone())])?;
        }
        Ok(Response::new(proto::RegisterWorkerReply {
            worker_id: req.worker_id,
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<proto::HeartbeatRequest>,
    ) -> std::result::Result<Response<proto::HeartbeatReply>, Status> {
        auth::allow(&request, None)?;
        let req = request.into_inner();
        check_protocol(req.protocol, "worker")?;
        // Never wait behind a journal fsync: a busy state lock must not
        // turn live workers into dead ones. The beat is noted on the side
        // and merged before the next expiry check.
        let known = match self.inner.shared.try_lock() {
            Ok(mut shared) => match shared.state.workers.get_mut(&req.worker_id) {
                Some(w) if w.alive => {
                    w.last_seen = Instant::now();
                    true
                }
                _ => false,
            },
            Err(_) => {
                let mut side = self.inner.beats.lock().unwrap_or_else(|p| p.into_inner());
                side.insert(req.worker_id, Instant::now());
                true
            }
        };
        Ok(Response::new(proto::HeartbeatReply { known }))
    }

    async fn attach(
        &self,
        request: Request<proto::AttachRequest>,
    ) -> std::result::Result<Response<proto::AttachReply>, Status> {
        let dataset = request.get_ref().spec.as_ref().map(|s| s.dataset.clone());
        auth::allow(&request, dataset.as_deref())?;
        let scope = auth::scope(&request);
        let req = request.into_inner();
        check_protocol(req.protocol, "client")?;
        let Some(spec) = req.spec else {
            return Err(Status::invalid_argument("attach without a job spec"));
        };
        let ours = crate::order::JobSpec::from(&spec);
        ours.validate()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if req.world == 0 || req.rank >= req.world {
            return Err(Status::invalid_argument(format!(
                "rank {} is not below the world size {}",
                req.rank, req.world
            )));
        }
        let job_id = ours.job_id();
        let mut shared = self.inner.lock();
        if !req.expect_job_id.is_empty() && req.expect_job_id != job_id {
            // Another dataset's job is not this caller's to see.
            let visible = shared
                .state
                .jobs
                .get(&req.expect_job_id)
                .filter(|j| scope.as_ref().is_some_and(|s| s.allows(Some(&j.dataset))));
            let detail = match visible {
                Some(theirs) => crate::order::JobSpec::from(theirs)
                    .differences(&ours)
                    .join("; "),
                None => format!("job {} is not known here", req.expect_job_id),
            };
            return Err(Status::failed_precondition(format!(
                "the input job differs from the one this training state was recorded with: {detail}"
            )));
        }
        if req.world == 0 || req.world > self.inner.opts.max_ranks || req.rank >= req.world {
            return Err(Status::invalid_argument(format!(
                "rank {} of {} ranks: give 0 <= rank < world <= {}",
                req.rank, req.world, self.inner.opts.max_ranks
            )));
        }
        if !shared.state.jobs.contains_key(&job_id) {
            if shared.state.jobs.len() >= self.inner.opts.max_jobs {
                return Err(Status::resource_exhausted(format!(
                    "this dispatcher holds {} jobs, its most: start another (with its own journal) for more",
                    shared.state.jobs.len()
                )));
            }
            Inner::commit(&mut shared, vec![Event::Job(spec.clone())])?;
        }
        let (cursor_epoch, cursor_batch) = shared
            .state
            .cursors
            .get(&(job_id.clone(), req.rank))
            .copied()
            .unwrap_or((0, 0));
        let live_workers = shared
            .state
            .workers
            .values()
            .filter(|w| w.alive && w.serves(&spec))
            .count() as u32;
        Ok(Response::new(proto::AttachReply {
            job_id,
            cursor_epoch,
            cursor_batch,
            live_workers,
        }))
    }

    async fn assign(
        &self,
        request: Request<proto::AssignRequest>,
    ) -> std::result::Result<Response<proto::AssignReply>, Status> {
        let scope = auth::scope(&request);
        let req = request.into_inner();
        check_protocol(req.protocol, "client")?;
        if req.from_batch.len() != req.splits.len() {
            return Err(Status::invalid_argument("one from_batch per split"));
        }
        let mut shared = self.inner.lock();
        for key in &req.splits {
            job_allowed(&scope, &shared, &key.job_id)?;
        }
        let mut out = Vec::with_capacity(req.splits.len());
        // New assignments of one request go to the journal in one write
        // (one fsync for a whole window, not one per split).
        let mut events = Vec::new();
        let mut planned: HashMap<String, usize> = HashMap::new();
        for (key, from) in req.splits.iter().zip(&req.from_batch) {
            let current = shared.state.splits.get(&key.key()).and_then(|s| {
                (!s.finished && shared.state.live(&s.latest.worker_id)).then(|| s.latest.clone())
            });
            let a = match current {
                Some(mut a) => {
                    a.from_batch = *from;
                    a
                }
                None => {
                    let a = Inner::plan(&shared, key, *from, None, &planned)?;
                    *planned.entry(a.worker_id.clone()).or_default() += 1;
                    events.push(Event::Assigned(a.clone()));
                    a
                }
            };
            out.push(a);
        }
        Inner::commit(&mut shared, events)?;
        Ok(Response::new(proto::AssignReply { assignments: out }))
    }

    async fn report_failure(
        &self,
        request: Request<proto::ReportFailureRequest>,
    ) -> std::result::Result<Response<proto::AssignReply>, Status> {
        let scope = auth::scope(&request);
        let req = request.into_inner();
        check_protocol(req.protocol, "client")?;
        let Some(failed) = req.failed else {
            return Err(Status::invalid_argument("report without an assignment"));
        };
        let Some(key) = failed.key.clone() else {
            return Err(Status::invalid_argument("assignment without a split"));
        };
        {
            let shared = self.inner.lock();
            job_allowed(&scope, &shared, &key.job_id)?;
            if let Some(s) = shared.state.splits.get(&key.key()) {
                if s.latest.attempt > failed.attempt && shared.state.live(&s.latest.worker_id) {
                    let mut a = s.latest.clone();
                    a.from_batch = req.from_batch;
                    return Ok(Response::new(proto::AssignReply {
                        assignments: vec![a],
                    }));
                }
            }
        }
        // The express path: confirm the client's report at once with a
        // probe instead of waiting for heartbeats to time out.
        let alive = self.probe(&failed.worker_addr, &failed.worker_id).await;
        let mut shared = self.inner.lock();
        if !alive && shared.state.live(&failed.worker_id) {
            Inner::commit(
                &mut shared,
                vec![Event::WorkerDead(failed.worker_id.clone())],
            )?;
        }
        let latest = shared
            .state
            .splits
            .get(&key.key())
            .map(|s| s.latest.clone());
        let a = match latest {
            // Someone else already moved it on.
            Some(mut a) if a.attempt > failed.attempt && shared.state.live(&a.worker_id) => {
                a.from_batch = req.from_batch;
                a
            }
            // A stall on a live worker: keep waiting for it.
            Some(mut a) if alive && !req.broken && a.attempt == failed.attempt => {
                a.from_batch = req.from_batch;
                a
            }
            _ => Inner::reassign(
                &mut shared,
                &key,
                req.from_batch,
                Some(failed.worker_id.as_str()),
            )?,
        };
        Ok(Response::new(proto::AssignReply {
            assignments: vec![a],
        }))
    }

    async fn progress(
        &self,
        request: Request<proto::ProgressRequest>,
    ) -> std::result::Result<Response<proto::AssignReply>, Status> {
        let scope = auth::scope(&request);
        let req = request.into_inner();
        check_protocol(req.protocol, "client")?;
        let mut events = Vec::new();
        let mut shared = self.inner.lock();
        job_allowed(&scope, &shared, &req.job_id)?;
        // Only an attached job's ranks leave state behind.
        if !shared.state.jobs.contains_key(&req.job_id) {
            return Err(Status::not_found(format!(
                "job {} is not attached at this dispatcher (attach first)",
                req.job_id
            )));
        }
        if req.rank >= self.inner.opts.max_ranks {
            return Err(Status::invalid_argument(format!(
                "rank {} is beyond this dispatcher's {} ranks",
                req.rank, self.inner.opts.max_ranks
            )));
        }
        for split in &req.finished_splits {
            let key = proto::SplitKey {
                job_id: req.job_id.clone(),
                epoch: req.epoch,
                rank: req.rank,
                split: *split,
            };
            if shared
                .state
                .splits
                .get(&key.key())
                .is_some_and(|s| !s.finished)
            {
                events.push(Event::Finished(key));
            }
        }
        let slot = (req.job_id.clone(), req.rank);
        if !req.digests.is_empty()
            || shared.state.cursors.get(&slot) != Some(&(req.epoch, req.cursor_batch))
        {
            events.push(Event::Cursor(proto::ProgressRequest {
                finished_splits: vec![],
                window: vec![],
                ..req.clone()
            }));
        }
        Inner::commit(&mut shared, events)?;
        let assignments = req
            .window
            .iter()
            .filter_map(|split| {
                let key = (req.job_id.clone(), req.epoch, req.rank, *split);
                shared.state.splits.get(&key).map(|s| s.latest.clone())
            })
            .collect();
        Ok(Response::new(proto::AssignReply { assignments }))
    }

    async fn digests(
        &self,
        request: Request<proto::DigestsRequest>,
    ) -> std::result::Result<Response<proto::DigestsReply>, Status> {
        let scope = auth::scope(&request);
        let req = request.into_inner();
        let shared = self.inner.lock();
        job_allowed(&scope, &shared, &req.job_id)?;
        let digests = shared
            .state
            .digests
            .get(&(req.job_id, req.epoch, req.rank))
            .map(|known| {
                known
                    .iter()
                    .map(|(b, d)| proto::UnitDigest {
                        batch: *b,
                        digest: d.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Response::new(proto::DigestsReply { digests }))
    }

    async fn status(
        &self,
        request: Request<proto::StatusRequest>,
    ) -> std::result::Result<Response<proto::StatusReply>, Status> {
        auth::allow(&request, None)?;
        let shared = self.inner.lock();
        let mut assigned: HashMap<&str, u32> = HashMap::new();
        for s in shared.state.splits.values().filter(|s| !s.finished) {
            *assigned.entry(s.latest.worker_id.as_str()).or_default() += 1;
        }
        let workers = shared
            .state
            .workers
            .iter()
            .map(|(id, w)| proto::WorkerStatus {
                worker_id: id.clone(),
                address: w.address.clone(),
                alive: w.alive,
                since_heartbeat_s: w.last_seen.elapsed().as_secs_f64(),
                assigned: assigned.get(id.as_str()).copied().unwrap_or(0),
            })
            .collect();
        Ok(Response::new(proto::StatusReply {
            workers,
            assignments: shared.state.assignments,
            reassignments: shared.state.reassignments,
            journal_records: shared.state.records,
        }))
    }
}

impl DispatcherHandle {
    /// Where workers and trainers find the token: the line a dispatcher
    /// process prints (on stderr) before its address.
    pub fn token_line(&self) -> String {
        match &self.token_file {
            Some(path) => format!(
                "hindsight data dispatcher: every call needs its token: give workers and trainers \
                 {}={}",
                hindsight_core::settings::DATA_TOKEN_FILE.name,
                path.display()
            ),
            None => format!(
                "hindsight data dispatcher: every call needs its token: the one in {} or {}",
                hindsight_core::settings::DATA_TOKEN.name,
                hindsight_core::settings::DATA_TOKEN_FILE.name
            ),
        }
    }

    /// The line a dispatcher process prints once it listens.
    pub fn listening_line(&self) -> String {
        let r = &self.recovered;
        format!(
            "hindsight data dispatcher listening on {} (journal: {} records, {} torn bytes \
             truncated, {} jobs, {} workers, replayed in {:.3} s)",
            self.addr, r.records, r.truncated_bytes, r.jobs, r.workers, r.seconds
        )
    }
}

/// A dispatcher serving on a loopback or public address.
#[derive(Debug)]
pub struct DispatcherHandle {
    pub addr: SocketAddr,
    pub recovered: Recovered,
    /// What every call must carry, and the file it is kept in (none where
    /// it came from the environment or the caller).
    pub token: Token,
    pub token_file: Option<PathBuf>,
    /// Whether it serves over TLS.
    pub tls: bool,
    shutdown: Option<oneshot::Sender<()>>,
    /// The server and the failure monitor; both hold the journal.
    tasks: Vec<JoinHandle<()>>,
}

impl DispatcherHandle {
    /// Stop serving (connections are dropped, as a crash would). The
    /// journal's lock goes once the runtime has dropped the aborted tasks.
    pub fn stop(mut self) {
        self.shutdown.take();
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for DispatcherHandle {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

/// Open the journal, bind `bind` ("127.0.0.1:0" picks a port) and serve on
/// the current tokio runtime.
pub async fn spawn(bind: &str, mut opts: DispatcherOptions) -> Result<DispatcherHandle> {
    let (token, token_file) = match opts.token.clone() {
        Some(t) => (t, None),
        None => {
            std::fs::create_dir_all(&opts.journal_dir).map_err(|e| Error::Io {
                what: format!(
                    "create the journal directory {}",
                    opts.journal_dir.display()
                ),
                source: e,
            })?;
            Token::for_dispatcher(&opts.journal_dir)?
        }
    };
    opts.token = Some(token.clone());
    let tls = Tls::resolve(opts.tls.take())?;
    opts.tls = Some(tls.clone());
    let server = tls.server(tonic::transport::Server::builder(), "dispatcher")?;
    let (service, recovered) = DispatcherService::open(opts)?;
    let listener = TcpListener::bind(bind).await.map_err(|e| Error::Io {
        what: format!("bind the dispatcher to {bind}"),
        source: e,
    })?;
    let addr = listener.local_addr().map_err(|e| Error::Io {
        what: format!("address of {bind}"),
        source: e,
    })?;
    let (tx, rx) = oneshot::channel::<()>();
    let inner = service.inner.clone();
    let monitor = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Instant::now();
        loop {
            tick.tick().await;
            // A monitor that was itself starved (a long fsync, an
            // overloaded host) cannot tell silent workers from unheard ones:
            // give everyone a fresh timeout instead of declaring deaths.
            if last.elapsed() > Duration::from_millis(500) {
                inner.grace();
            } else {
                inner.expire();
            }
            inner.maybe_compact();
            last = Instant::now();
        }
    });
    let check = Check::new(&token);
    let join = tokio::spawn(async move {
        let served = server
            .tcp_nodelay(true)
            .add_service(InterceptedService::new(
                proto::dispatcher_server::DispatcherServer::new(service)
                    .max_decoding_message_size(MAX_CONTROL_MESSAGE)
                    .max_encoding_message_size(MAX_CONTROL_MESSAGE),
                check,
            ))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = served {
            eprintln!("hindsight data dispatcher: {e}");
        }
    });
    Ok(DispatcherHandle {
        addr,
        recovered,
        token,
        token_file,
        tls: tls.on(),
        shutdown: Some(tx),
        tasks: vec![join, monitor],
    })
}

/// A dispatcher on its own runtime (see [`crate::Running`]).
pub fn start(bind: &str, opts: DispatcherOptions) -> Result<crate::Running<DispatcherHandle>> {
    crate::Running::new("dispatcher", spawn(bind, opts))
}
