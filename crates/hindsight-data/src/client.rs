//! The client inside the training process: delivers one rank's units of an
//! epoch in order, each exactly once, whatever happens to the workers.
//!
//! It keeps a window of splits in flight, one stream per split straight
//! from the worker the dispatcher assigned. The cursor only moves forward,
//! by one batch at a time: a unit is delivered only when it is the next one,
//! duplicates (a recomputed unit, a zombie's late output) are dropped after
//! their digest is compared with the first copy, and a failed split is
//! resumed by its next attempt at the client's own position in it, so
//! nothing consumed is recomputed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::auth::{Authed, Bearer, Token};
use tonic::{Code, Status};

use crate::error::{Error, Result};
use crate::order::JobSpec;
use crate::proto;
use crate::shared::{self, Payload};
use crate::tls::Tls;
use crate::worker::{digest, endpoint, MAX_MESSAGE};

/// Tuning of one client; the defaults suit a trainer on one host.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Splits in flight at once (at least 1).
    pub window_splits: usize,
    /// Units buffered per split beyond the one being delivered.
    pub units_per_split: usize,
    /// Stop opening splits while this many payload bytes are buffered.
    pub max_buffer_bytes: usize,
    /// A split with nothing new for this long is reported as stalled (the
    /// dispatcher then probes its worker).
    pub stall_timeout: Duration,
    /// A split whose worker, alive and answering, has not delivered its next
    /// unit for this long is taken from it and given to another (a dataset
    /// item that never returns). None: 20 times the slowest unit so far, at
    /// least [`UNIT_DEADLINE_FLOOR`].
    pub unit_deadline: Option<Duration>,
    /// How long to wait for some live worker (or for the dispatcher)
    /// before giving up.
    pub no_worker_wait: Duration,
    pub connect_timeout: Duration,
    pub progress_every: Duration,
    /// Warn instead of failing when a recomputed unit differs.
    pub warn_nondeterministic: bool,
    /// The shared-memory directory same-host workers hand payloads over
    /// through (see [`crate::shared`]); None: payloads only travel inline.
    pub shared_dir: Option<std::path::PathBuf>,
    /// The service's token; None: from the environment ([`Token::required`]).
    pub token: Option<Token>,
    /// TLS; None: from the environment ([`Tls::from_env`]).
    pub tls: Option<Tls>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            window_splits: 4,
            units_per_split: 4,
            max_buffer_bytes: 512 << 20,
            stall_timeout: Duration::from_millis(500),
            unit_deadline: None,
            no_worker_wait: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(3),
            progress_every: Duration::from_millis(250),
            warn_nondeterministic: false,
            shared_dir: None,
            token: None,
            tls: None,
        }
    }
}

/// One delivered unit: this rank's slice of a global batch.
#[derive(Debug)]
pub struct Delivered {
    pub epoch: u64,
    pub batch: u64,
    pub indices: Vec<u64>,
    pub digest: Vec<u8>,
    /// Owned and writable: the receive buffer itself or a shared-memory
    /// mapping (no copy after the transport's).
    pub payload: Payload,
}

/// Counters a user (and the chaos tests) can read.
#[derive(Debug, Default)]
pub struct ClientStats {
    pub delivered: AtomicU64,
    pub duplicates_dropped: AtomicU64,
    pub stale_dropped: AtomicU64,
    pub failovers: AtomicU64,
    pub stalls_reported: AtomicU64,
    pub units_after_failover: AtomicU64,
    pub nondeterministic: AtomicU64,
    /// Seconds from a failure being noticed to the first unit of the
    /// replacement (the last one), in microseconds.
    pub last_failover_us: AtomicU64,
}

type Item = Result<Option<Delivered>>;

/// Broken streams of one split, without a unit in between, before the
/// epoch fails (each on a different worker when there is one).
const MAX_FAILURES: u32 = 3;

/// The least time a worker gets for one unit when the deadline is derived
/// from measured unit times (the first unit also builds the dataset).
pub const UNIT_DEADLINE_FLOOR: Duration = Duration::from_secs(60);

/// Digests carried by one progress report.
const DIGESTS_PER_REPORT: usize = 20_000;

/// The detail of a report that repeats one the dispatcher could not answer.
const RETRY: &str = "retry";

/// A training process's connection to one input job.
#[derive(Debug)]
pub struct Client {
    rt: Option<Runtime>,
    pid: u32,
    ctx: Arc<Ctx>,
    rx: Option<mpsc::Receiver<Item>>,
    task: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Ctx {
    dispatcher: proto::dispatcher_client::DispatcherClient<Authed>,
    /// What every call to a worker carries.
    bearer: Bearer,
    dispatcher_addr: String,
    spec: JobSpec,
    wire_spec: proto::JobSpec,
    job_id: String,
    rank: u32,
    world: u32,
    opts: ClientOptions,
    stats: Arc<ClientStats>,
}

impl Client {
    /// Attach to the job `spec` at `dispatcher` as `rank` of `world`.
    /// `expect_job_id` (from a training checkpoint) refuses a changed job,
    /// naming what changed.
    pub fn connect(
        dispatcher: &str,
        spec: JobSpec,
        rank: u32,
        world: u32,
        expect_job_id: Option<&str>,
        mut opts: ClientOptions,
    ) -> Result<Client> {
        spec.validate()?;
        let bearer = Bearer::new(&Token::required(opts.token.clone(), "trainer")?);
        let tls = Tls::resolve(opts.tls.take())?;
        opts.tls = Some(tls.clone());
        let rt = crate::runtime("client")?;
        let wire_spec = proto::JobSpec::from(&spec);
        let unreachable = |detail: String| Error::Unreachable {
            role: "dispatcher",
            addr: dispatcher.to_string(),
            detail,
        };
        let channel = rt.block_on(async {
            let ep = endpoint(dispatcher, opts.connect_timeout, &tls)
                .map_err(|e| unreachable(format!("bad address: {e}")))?;
            tokio::time::timeout(opts.connect_timeout, ep.connect())
                .await
                .map_err(|_| unreachable(format!("no answer in {:?}", opts.connect_timeout)))?
                .map_err(|e| unreachable(format!("{} ({})", source_chain(&e), tls_hint(&tls))))
        })?;
        let mut d =
            proto::dispatcher_client::DispatcherClient::with_interceptor(channel, bearer.clone())
                .max_decoding_message_size(crate::dispatcher::MAX_CONTROL_MESSAGE)
                .max_encoding_message_size(crate::dispatcher::MAX_CONTROL_MESSAGE);
        let attach = proto::AttachRequest {
            protocol: proto::PROTOCOL,
            spec: Some(wire_spec.clone()),
            rank,
            world,
            expect_job_id: expect_job_id.unwrap_or_default().to_string(),
        };
        let reply = rt
            .block_on(async { tokio::time::timeout(opts.connect_timeout, d.attach(attach)).await })
            .map_err(|_| unreachable("attach got no answer".into()))?
            .map_err(|s| match s.code() {
                Code::FailedPrecondition => Error::Mismatch {
                    what: "input job",
                    detail: s.message().to_string(),
                },
                Code::Unavailable => unreachable(s.message().to_string()),
                Code::Unauthenticated | Code::PermissionDenied => Error::Token(format!(
                    "the dispatcher at {dispatcher} refused the call: {}",
                    s.message()
                )),
                // The connection broke under the call: most often one side
                // speaks TLS and the other does not.
                _ if std::error::Error::source(&s).is_some() => {
                    unreachable(format!("{} ({})", source_chain(&s), tls_hint(&tls)))
                }
                _ => Error::rpc("attach", &s),
            })?
            .into_inner();
        let ctx = Ctx {
            dispatcher: d,
            bearer,
            dispatcher_addr: dispatcher.to_string(),
            job_id: reply.job_id,
            spec,
            wire_spec,
            rank,
            world,
            opts,
            stats: Arc::new(ClientStats::default()),
        };
        Ok(Client {
            rt: Some(rt),
            pid: std::process::id(),
            ctx: Arc::new(ctx),
            rx: None,
            task: None,
        })
    }

    pub fn job_id(&self) -> &str {
        &self.ctx.job_id
    }

    pub fn spec(&self) -> &JobSpec {
        &self.ctx.spec
    }

    pub fn stats(&self) -> &ClientStats {
        &self.ctx.stats
    }

    fn runtime(&self) -> Result<&Runtime> {
        if std::process::id() != self.pid {
            return Err(Error::Closed(
                "this input client belongs to the process that created it; a forked child \
                 (e.g. a DataLoader worker) must create its own"
                    .into(),
            ));
        }
        self.rt
            .as_ref()
            .ok_or_else(|| Error::Closed("the input client is closed".into()))
    }

    /// Start delivering `epoch` at global batch `from_batch` (0, or the
    /// position a training checkpoint recorded). Drops any epoch in flight.
    pub fn start_epoch(&mut self, epoch: u64, from_batch: u64) -> Result<()> {
        let rt = self.runtime()?.handle().clone();
        if let Some(t) = self.task.take() {
            t.abort();
        }
        let end = self.ctx.spec.batches_per_epoch();
        if from_batch > end {
            return Err(Error::Mismatch {
                what: "resume position",
                detail: format!("batch {from_batch} is past the epoch's {end} batches"),
            });
        }
        let (tx, rx) = mpsc::channel(1);
        let ctx = self.ctx.clone();
        self.task = Some(rt.spawn(async move {
            let mut run = EpochRun::new(ctx, epoch, from_batch);
            run.load_digests().await;
            if let Err(e) = run.run(&tx).await {
                let _ = tx.send(Err(e)).await;
            }
        }));
        self.rx = Some(rx);
        Ok(())
    }

    /// The next unit, `Ok(None)` at the end of the epoch, or `Err(Closed)`
    /// ... after `timeout` with nothing: `Ok(Some(Next::Pending))`.
    pub fn next(&mut self, timeout: Duration) -> Result<Next> {
        let rt = self.runtime()?.handle().clone();
        let Some(rx) = self.rx.as_mut() else {
            return Err(Error::Closed("no epoch started (call start_epoch)".into()));
        };
        match rt.block_on(async { tokio::time::timeout(timeout, rx.recv()).await }) {
            Err(_) => Ok(Next::Pending),
            Ok(None) => Err(Error::Closed("the epoch's delivery stopped".into())),
            Ok(Some(Err(e))) => {
                self.rx = None;
                Err(e)
            }
            Ok(Some(Ok(None))) => {
                self.rx = None;
                Ok(Next::End)
            }
            Ok(Some(Ok(Some(d)))) => Ok(Next::Unit(d)),
        }
    }

    /// Stop the epoch in flight (the reader left it early): its streams end
    /// and workers stop computing for it.
    pub fn stop_epoch(&mut self) {
        if std::process::id() != self.pid {
            return;
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.rx = None;
    }

    /// Stop streaming and release the runtime's threads.
    pub fn close(&mut self) {
        if std::process::id() != self.pid {
            // Never touch the parent's threads from a forked child.
            if let Some(rt) = self.rt.take() {
                std::mem::forget(rt);
            }
            return;
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
        self.rx = None;
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// What [`Client::next`] found.
#[derive(Debug)]
pub enum Next {
    Unit(Delivered),
    End,
    /// Nothing yet within the timeout (the caller checks for Ctrl-C).
    Pending,
}

/// What to check when a connection fails, given how this process dials.
fn tls_hint(tls: &Tls) -> &'static str {
    if tls.on() {
        "over TLS: the service's certificate must be signed by HINDSIGHT_DATA_TLS_CA and name the \
         address dialled"
    } else {
        "in plain text: a service that serves TLS needs HINDSIGHT_DATA_TLS_CA here"
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

enum Event {
    Unit {
        split: u64,
        attempt: u64,
        unit: proto::Unit,
    },
    StreamEnd {
        split: u64,
        attempt: u64,
        status: Option<Status>,
    },
    Assigned(std::result::Result<Vec<proto::Assignment>, Status>),
    Replaced {
        split: u64,
        failed_attempt: u64,
        result: std::result::Result<proto::Assignment, Status>,
    },
    /// A progress report's answer (None: it failed; `reported` goes again).
    Current {
        list: Option<Vec<proto::Assignment>>,
        reported: (Vec<u64>, Vec<proto::UnitDigest>),
    },
}

/// A checked unit waiting for the cursor, with its payload mapped if it
/// came through shared memory.
struct Received {
    unit: proto::Unit,
    mapped: Option<MmapMut>,
}

impl Received {
    fn payload(&self) -> &[u8] {
        self.mapped.as_deref().unwrap_or(&self.unit.payload)
    }
}

struct SplitRun {
    a: proto::Assignment,
    /// The next batch expected from the stream.
    next: u64,
    end: u64,
    buf: VecDeque<Received>,
    /// Units the stream may hand over before the buffer drains.
    room: Arc<Semaphore>,
    stream: Option<JoinHandle<()>>,
    last_activity: Instant,
    /// Since when the split has been waiting for its next unit from the
    /// current stream (a stall answered "keep waiting" does not reset it).
    waiting_since: Instant,
    reporting: bool,
    retry_at: Option<Instant>,
    failing_since: Option<Instant>,
    /// Broken streams since the split last delivered a unit: a failure
    /// that follows the split from worker to worker (a unit too large, an
    /// example that crashes every worker) ends the epoch instead of looping.
    failures: u32,
    last_failure: String,
}

/// Dropped when its task ends or is aborted (a new epoch, an abandoned
/// iteration, `close`): the streams go with it.
impl Drop for EpochRun {
    fn drop(&mut self) {
        self.stop();
    }
}

struct EpochRun {
    ctx: Arc<Ctx>,
    epoch: u64,
    cursor: u64,
    end: u64,
    splits: BTreeMap<u64, SplitRun>,
    /// Digest of every unit received this epoch: a later copy of the same
    /// batch must match it.
    digests: HashMap<u64, Vec<u8>>,
    /// Delivered since the last progress report (the dispatcher journals them).
    unreported: Vec<proto::UnitDigest>,
    finished: Vec<u64>,
    events_tx: mpsc::Sender<Event>,
    events: mpsc::Receiver<Event>,
    /// An Assign call is in flight.
    assigning: bool,
    /// After a failed Assign: not before this instant.
    assign_retry_at: Option<Instant>,
    assign_failing_since: Option<Instant>,
    progress_in_flight: bool,
    last_progress: Instant,
    channels: HashMap<String, Channel>,
    buffered_bytes: usize,
    failure_noticed: HashMap<u64, Instant>,
    /// The longest a unit took to arrive so far (from the dataset's code to
    /// this client), for the derived unit deadline.
    slowest_unit: Duration,
}

impl EpochRun {
    fn new(ctx: Arc<Ctx>, epoch: u64, from_batch: u64) -> Self {
        let end = ctx.spec.batches_per_epoch();
        let (events_tx, events) = mpsc::channel(256);
        EpochRun {
            ctx,
            epoch,
            cursor: from_batch,
            end,
            splits: BTreeMap::new(),
            digests: HashMap::new(),
            unreported: Vec::new(),
            finished: Vec::new(),
            events_tx,
            events,
            assigning: false,
            assign_retry_at: None,
            assign_failing_since: None,
            progress_in_flight: false,
            last_progress: Instant::now(),
            channels: HashMap::new(),
            buffered_bytes: 0,
            failure_noticed: HashMap::new(),
            slowest_unit: Duration::ZERO,
        }
    }

    /// Digests of units an earlier reader of this epoch was given (before a
    /// trainer restart): the units delivered now must match them. Skipped if
    /// the dispatcher cannot say.
    async fn load_digests(&mut self) {
        let mut d = self.ctx.dispatcher.clone();
        let req = proto::DigestsRequest {
            job_id: self.ctx.job_id.clone(),
            epoch: self.epoch,
            rank: self.ctx.rank,
        };
        if let Ok(Ok(r)) = tokio::time::timeout(self.ctx.opts.connect_timeout, d.digests(req)).await
        {
            for u in r.into_inner().digests {
                self.digests.insert(u.batch, u.digest);
            }
        }
    }

    /// End every stream of this epoch: closing a split's semaphore wakes
    /// a stream task waiting for room, and aborting it drops the gRPC call,
    /// so the worker stops producing for it.
    fn stop(&mut self) {
        for run in self.splits.values_mut() {
            run.room.close();
            if let Some(s) = run.stream.take() {
                s.abort();
            }
        }
    }

    fn key(&self, split: u64) -> proto::SplitKey {
        proto::SplitKey {
            job_id: self.ctx.job_id.clone(),
            epoch: self.epoch,
            rank: self.ctx.rank,
            split,
        }
    }

    async fn run(&mut self, tx: &mpsc::Sender<Item>) -> Result<()> {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.cursor >= self.end {
                self.report_progress(true).await;
                let _ = tx.send(Ok(None)).await;
                return Ok(());
            }
            self.fill_window();
            let split = self.ctx.spec.split_of(self.cursor);
            let ready = self
                .splits
                .get(&split)
                .and_then(|r| r.buf.front())
                .is_some_and(|r| r.unit.batch == self.cursor);
            tokio::select! {
                biased;
                permit = tx.reserve(), if ready => {
                    let Ok(permit) = permit else { return Ok(()) };
                    permit.send(Ok(Some(self.take_next(split))));
                }
                ev = self.events.recv() => {
                    if let Some(ev) = ev {
                        self.handle(ev)?;
                    }
                }
                _ = tick.tick() => self.on_tick()?,
            }
        }
    }

    /// Hand over the unit at the cursor and move the cursor by one.
    fn take_next(&mut self, split: u64) -> Delivered {
        let mut done = false;
        let unit = {
            let Some(run) = self.splits.get_mut(&split) else {
                unreachable!("take_next is only called for a ready split")
            };
            let Some(unit) = run.buf.pop_front() else {
                unreachable!("take_next is only called for a ready split")
            };
            run.room.add_permits(1);
            if run.buf.is_empty() && run.next >= run.end {
                done = true;
            }
            if run.buf.is_empty() {
                // The stall clock starts when the split has nothing to give,
                // not when it last received (its buffer may have been full).
                run.last_activity = Instant::now();
                run.waiting_since = Instant::now();
            }
            unit
        };
        self.buffered_bytes = self.buffered_bytes.saturating_sub(unit.payload().len());
        let Received { unit, mapped } = unit;
        let payload = match mapped {
            Some(m) => Payload::Mapped(m),
            // Converted this late, the transport has likely moved on from
            // the buffer, so it is taken over without a copy.
            None => Payload::from_bytes(unit.payload),
        };
        if done {
            if let Some(mut run) = self.splits.remove(&split) {
                if let Some(s) = run.stream.take() {
                    s.abort();
                }
            }
            self.finished.push(split);
        }
        self.cursor += 1;
        self.ctx.stats.delivered.fetch_add(1, Ordering::Relaxed);
        self.unreported.push(proto::UnitDigest {
            batch: unit.batch,
            digest: unit.digest.clone(),
        });
        Delivered {
            epoch: self.epoch,
            batch: unit.batch,
            indices: unit.indices,
            digest: unit.digest,
            payload,
        }
    }

    /// Ask for assignments of the splits the window now covers.
    fn fill_window(&mut self) {
        if self.assigning || self.assign_retry_at.is_some_and(|t| t > Instant::now()) {
            return;
        }
        if self.buffered_bytes > self.ctx.opts.max_buffer_bytes {
            return;
        }
        let first = self.ctx.spec.split_of(self.cursor);
        let last = (first + self.ctx.opts.window_splits.max(1) as u64)
            .min(self.ctx.spec.splits_per_epoch());
        let need: Vec<u64> = (first..last)
            .filter(|s| !self.splits.contains_key(s))
            .collect();
        if need.is_empty() {
            return;
        }
        let from: Vec<u64> = need
            .iter()
            .map(|&s| self.ctx.spec.split_batches(s).start.max(self.cursor))
            .collect();
        let req = proto::AssignRequest {
            protocol: proto::PROTOCOL,
            splits: need.iter().map(|&s| self.key(s)).collect(),
            from_batch: from,
            world: self.ctx.world,
        };
        let mut d = self.ctx.dispatcher.clone();
        let events = self.events_tx.clone();
        let timeout = self.ctx.opts.connect_timeout;
        self.assigning = true;
        self.assign_retry_at = None;
        tokio::spawn(async move {
            let result = match tokio::time::timeout(timeout, d.assign(req)).await {
                Ok(r) => r.map(|r| r.into_inner().assignments),
                Err(_) => Err(Status::unavailable("the dispatcher did not answer")),
            };
            let _ = events.send(Event::Assigned(result)).await;
        });
    }

    fn channel(&mut self, addr: &str) -> Result<Channel> {
        if let Some(c) = self.channels.get(addr) {
            return Ok(c.clone());
        }
        let tls = self.ctx.opts.tls.clone().unwrap_or_default();
        let ep = endpoint(addr, self.ctx.opts.connect_timeout, &tls).map_err(|e| {
            Error::Unreachable {
                role: "worker",
                addr: addr.to_string(),
                detail: e.to_string(),
            }
        })?;
        // Batches are megabytes: large HTTP/2 frames and windows cut the
        // per-frame work and window updates of the receive path.
        let c = ep
            .max_frame_size(1 << 20)
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(32 << 20)
            .connect_lazy();
        self.channels.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Start streaming `split` from its assignment, at the run's `next`.
    fn open_stream(&mut self, split: u64) -> Result<()> {
        let Some(addr) = self.splits.get(&split).map(|r| r.a.worker_addr.clone()) else {
            return Ok(());
        };
        let channel = self.channel(&addr)?;
        let Some(run) = self.splits.get_mut(&split) else {
            return Ok(());
        };
        if let Some(old) = run.stream.take() {
            old.abort();
        }
        // Whatever the old stream left in the buffer stays: it was checked.
        let room = Arc::new(Semaphore::new(self.ctx.opts.units_per_split.max(1)));
        let held = run.buf.len().min(self.ctx.opts.units_per_split.max(1));
        if held > 0 {
            room.forget_permits(held);
        }
        run.room = room.clone();
        run.last_activity = Instant::now();
        run.waiting_since = Instant::now();
        run.reporting = false;
        let mut a = run.a.clone();
        a.from_batch = run.next;
        let attempt = a.attempt;
        let req = proto::ProduceRequest {
            protocol: proto::PROTOCOL,
            spec: Some(self.ctx.wire_spec.clone()),
            assignment: Some(a),
            world: self.ctx.world,
        };
        let events = self.events_tx.clone();
        let bearer = self.ctx.bearer.clone();
        run.stream = Some(tokio::spawn(async move {
            let mut client = proto::worker_client::WorkerClient::with_interceptor(channel, bearer)
                .max_decoding_message_size(MAX_MESSAGE);
            let status = match client.produce(req).await {
                Err(s) => Some(s),
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        let Ok(permit) = room.clone().acquire_owned().await else {
                            break None;
                        };
                        match stream.message().await {
                            Ok(Some(unit)) => {
                                permit.forget();
                                let ev = Event::Unit {
                                    split,
                                    attempt,
                                    unit,
                                };
                                if events.send(ev).await.is_err() {
                                    break None;
                                }
                            }
                            Ok(None) => break None,
                            Err(s) => break Some(s),
                        }
                    }
                }
            };
            let _ = events
                .send(Event::StreamEnd {
                    split,
                    attempt,
                    status,
                })
                .await;
        }));
        Ok(())
    }

    fn handle(&mut self, ev: Event) -> Result<()> {
        match ev {
            Event::Assigned(Ok(list)) => {
                self.assigning = false;
                self.assign_failing_since = None;
                for a in list {
                    let Some(split) = a.key.as_ref().map(|k| k.split) else {
                        continue;
                    };
                    if self.splits.contains_key(&split)
                        || split < self.ctx.spec.split_of(self.cursor)
                    {
                        continue;
                    }
                    let range = self.ctx.spec.split_batches(split);
                    let next = a.from_batch.max(range.start);
                    self.splits.insert(
                        split,
                        SplitRun {
                            a,
                            next,
                            end: range.end,
                            buf: VecDeque::new(),
                            room: Arc::new(Semaphore::new(0)),
                            stream: None,
                            last_activity: Instant::now(),
                            waiting_since: Instant::now(),
                            reporting: false,
                            retry_at: None,
                            failing_since: None,
                            failures: 0,
                            last_failure: String::new(),
                        },
                    );
                    self.open_stream(split)?;
                }
            }
            Event::Assigned(Err(status)) => {
                let since = *self.assign_failing_since.get_or_insert_with(Instant::now);
                self.fatal_or_wait(&status, since)?;
                // Retry after a short pause.
                self.assigning = false;
                self.assign_retry_at = Some(Instant::now() + Duration::from_millis(200));
            }
            Event::Unit {
                split,
                attempt,
                unit,
            } => self.on_unit(split, attempt, unit)?,
            Event::StreamEnd {
                split,
                attempt,
                status,
            } => {
                let Some(run) = self.splits.get_mut(&split) else {
                    return Ok(());
                };
                if run.a.attempt != attempt {
                    return Ok(());
                }
                run.stream = None;
                match status {
                    None if run.next >= run.end => {}
                    None => self.report(split, true, "the stream ended early".into())?,
                    Some(s) => match s.code() {
                        Code::OutOfRange | Code::ResourceExhausted | Code::Unimplemented => {
                            return Err(Error::Rpc {
                                op: "stream units",
                                detail: format!(
                                    "{:?}: {} (a unit larger than the 1 GiB message limit? \
                                     lower batch_size)",
                                    s.code(),
                                    s.message()
                                ),
                            })
                        }
                        Code::Aborted => {
                            return Err(Error::Pipeline {
                                dataset: self.ctx.spec.dataset.clone(),
                                detail: s.message().to_string(),
                            })
                        }
                        Code::FailedPrecondition | Code::InvalidArgument => {
                            return Err(Error::Mismatch {
                                what: "worker",
                                detail: s.message().to_string(),
                            })
                        }
                        _ => {
                            let detail = format!("{:?}: {}", s.code(), s.message());
                            self.report(split, true, detail)?
                        }
                    },
                }
            }
            Event::Replaced {
                split,
                failed_attempt,
                result,
            } => {
                let Some(run) = self.splits.get_mut(&split) else {
                    return Ok(());
                };
                if run.a.attempt != failed_attempt {
                    return Ok(());
                }
                run.reporting = false;
                match result {
                    Ok(a) if a.attempt > run.a.attempt => {
                        run.a = a;
                        run.failing_since = None;
                        self.open_stream(split)?;
                    }
                    Ok(_) => {
                        // The worker is alive, only slow: keep its stream.
                        run.failing_since = None;
                        run.last_activity = Instant::now();
                        if run.stream.is_none() {
                            self.open_stream(split)?;
                        }
                    }
                    Err(status) => {
                        let since = *run.failing_since.get_or_insert_with(Instant::now);
                        run.retry_at = Some(Instant::now() + Duration::from_millis(200));
                        self.fatal_or_wait(&status, since)?;
                    }
                }
            }
            Event::Current { list, reported } => {
                self.progress_in_flight = false;
                let Some(list) = list else {
                    self.finished.extend(reported.0);
                    self.unreported.extend(reported.1);
                    return Ok(());
                };
                for a in list {
                    let Some(split) = a.key.as_ref().map(|k| k.split) else {
                        continue;
                    };
                    let Some(run) = self.splits.get_mut(&split) else {
                        continue;
                    };
                    // The dispatcher moved it on (its worker stopped
                    // heartbeating): follow without waiting for a stall.
                    if a.attempt > run.a.attempt && !run.reporting {
                        self.ctx.stats.failovers.fetch_add(1, Ordering::Relaxed);
                        self.failure_noticed
                            .entry(split)
                            .or_insert_with(Instant::now);
                        run.a = a;
                        self.open_stream(split)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn on_unit(&mut self, split: u64, attempt: u64, unit: proto::Unit) -> Result<()> {
        let stats = self.ctx.stats.clone();
        // Mapped (and unlinked) first, so a dropped unit leaves no file.
        let mapped = (!unit.shared.is_empty()).then(|| match &self.ctx.opts.shared_dir {
            Some(dir) => shared::take(dir, &unit.shared).map_err(|e| e.to_string()),
            None => Err("this client has no shared-memory directory".to_string()),
        });
        let Some(run) = self.splits.get_mut(&split) else {
            stats.stale_dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        if run.a.attempt != attempt || unit.attempt != attempt || unit.epoch != self.epoch {
            // A fenced attempt (a zombie worker's late output). Its permit
            // belonged to the old stream's semaphore: none goes back.
            stats.stale_dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let mapped = match mapped.transpose() {
            Ok(m) => m,
            Err(detail) => {
                run.room.add_permits(1);
                let detail = format!(
                    "unit {}: shared-memory payload {}: {detail}",
                    unit.batch, unit.shared
                );
                return self.report(split, true, detail);
            }
        };
        if digest(mapped.as_deref().unwrap_or(&unit.payload)) != unit.digest {
            // Damaged in transit or by the worker: never deliver it.
            run.room.add_permits(1);
            return self.report(
                split,
                true,
                format!("unit {} failed its digest", unit.batch),
            );
        }
        if unit.batch < run.next {
            run.room.add_permits(1);
            stats.duplicates_dropped.fetch_add(1, Ordering::Relaxed);
            return self.check_same(unit.batch, &unit.digest);
        }
        if unit.batch > run.next {
            run.room.add_permits(1);
            let detail = format!("unit {} skipped {}", unit.batch, run.next);
            return self.report(split, true, detail);
        }
        self.check_same(unit.batch, &unit.digest)?;
        let Some(run) = self.splits.get_mut(&split) else {
            return Ok(());
        };
        if attempt > 1 {
            stats.units_after_failover.fetch_add(1, Ordering::Relaxed);
        }
        run.failures = 0;
        if let Some(t) = self.failure_noticed.remove(&split) {
            stats
                .last_failover_us
                .store(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        run.next += 1;
        let took = run.waiting_since.elapsed();
        self.slowest_unit = self.slowest_unit.max(took);
        run.last_activity = Instant::now();
        run.waiting_since = Instant::now();
        let unit = Received { unit, mapped };
        self.buffered_bytes += unit.payload().len();
        self.digests
            .insert(unit.unit.batch, unit.unit.digest.clone());
        run.buf.push_back(unit);
        Ok(())
    }

    /// A second copy of a unit must equal the first.
    fn check_same(&mut self, batch: u64, got: &[u8]) -> Result<()> {
        let Some(first) = self.digests.get(&batch) else {
            return Ok(());
        };
        if first.as_slice() == got {
            return Ok(());
        }
        self.ctx
            .stats
            .nondeterministic
            .fetch_add(1, Ordering::Relaxed);
        let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let err = Error::NonDeterministic {
            epoch: self.epoch,
            batch,
            first: hex(first),
            second: hex(got),
        };
        if self.ctx.opts.warn_nondeterministic {
            eprintln!("hindsight: warning: {err}");
            return Ok(());
        }
        Err(err)
    }

    /// Tell the dispatcher; it probes the worker and answers with the
    /// assignment to follow.
    fn report(&mut self, split: u64, broken: bool, detail: String) -> Result<()> {
        // What the failing unit holds, for the error that ends the epoch.
        let unit = match self.splits.get(&split) {
            Some(run) if broken && detail != RETRY && run.failures >= MAX_FAILURES => {
                format!("batch {}, {}", run.next, self.examples_of(run.next))
            }
            _ => String::new(),
        };
        let Some(run) = self.splits.get_mut(&split) else {
            return Ok(());
        };
        if run.reporting {
            return Ok(());
        }
        if broken && detail != RETRY {
            run.failures += 1;
            run.last_failure.clone_from(&detail);
            if run.failures > MAX_FAILURES {
                return Err(Error::Rpc {
                    op: "stream units",
                    detail: format!(
                        "split {split} of epoch {} failed {} times in a row without \
                         delivering a unit, on every worker it was given to (the unit: {unit}); \
                         last: {detail}",
                        self.epoch, run.failures
                    ),
                });
            }
        }
        run.reporting = true;
        run.retry_at = None;
        if broken {
            self.ctx.stats.failovers.fetch_add(1, Ordering::Relaxed);
            self.failure_noticed
                .entry(split)
                .or_insert_with(Instant::now);
            if let Some(s) = run.stream.take() {
                s.abort();
            }
        } else {
            self.ctx
                .stats
                .stalls_reported
                .fetch_add(1, Ordering::Relaxed);
            self.failure_noticed
                .entry(split)
                .or_insert_with(Instant::now);
        }
        let req = proto::ReportFailureRequest {
            protocol: proto::PROTOCOL,
            failed: Some(run.a.clone()),
            from_batch: run.next,
            broken,
            detail,
            world: self.ctx.world,
        };
        let failed_attempt = run.a.attempt;
        let mut d = self.ctx.dispatcher.clone();
        let events = self.events_tx.clone();
        let timeout = self.ctx.opts.connect_timeout;
        tokio::spawn(async move {
            let result = match tokio::time::timeout(timeout, d.report_failure(req)).await {
                Ok(Ok(r)) => r
                    .into_inner()
                    .assignments
                    .into_iter()
                    .next()
                    .ok_or_else(|| Status::internal("empty reassignment")),
                Ok(Err(s)) => Err(s),
                Err(_) => Err(Status::unavailable("the dispatcher did not answer")),
            };
            let _ = events
                .send(Event::Replaced {
                    split,
                    failed_attempt,
                    result,
                })
                .await;
        });
        Ok(())
    }

    /// Unavailable (no live worker yet, dispatcher restarting) is waited
    /// out up to `no_worker_wait`; anything else ends the epoch.
    fn fatal_or_wait(&self, status: &Status, since: Instant) -> Result<()> {
        match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
                if since.elapsed() < self.ctx.opts.no_worker_wait =>
            {
                Ok(())
            }
            // The connection dropped under the call (a dispatcher killed and
            // restarting): tonic says Internal for the HTTP/2 layer's error,
            // but the call never reached a dispatcher that could refuse it.
            Code::Internal
                if connection_dropped(status) && since.elapsed() < self.ctx.opts.no_worker_wait =>
            {
                Ok(())
            }
            Code::Unavailable if status.message().starts_with("no live worker") => {
                Err(Error::NoWorkers {
                    dataset: self.ctx.spec.dataset.clone(),
                    waited_s: since.elapsed().as_secs_f64(),
                })
            }
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => {
                Err(Error::Unreachable {
                    role: "dispatcher",
                    addr: self.ctx.dispatcher_addr.clone(),
                    detail: status.message().to_string(),
                })
            }
            Code::FailedPrecondition | Code::InvalidArgument | Code::NotFound => {
                Err(Error::Mismatch {
                    what: "input job",
                    detail: status.message().to_string(),
                })
            }
            _ => Err(Error::rpc("dispatcher call", status)),
        }
    }

    fn on_tick(&mut self) -> Result<()> {
        let now = Instant::now();
        let stall = self.ctx.opts.stall_timeout;
        let mut stalled = Vec::new();
        let mut retry = Vec::new();
        let mut overdue = Vec::new();
        let deadline = self.unit_deadline();
        for (split, run) in &self.splits {
            if run.reporting {
                continue;
            }
            if run.retry_at.is_some_and(|t| t <= now) {
                retry.push(*split);
            } else if run.retry_at.is_none()
                && run.next < run.end
                && run.buf.is_empty()
                && run.stream.is_some()
                && run.waiting_since.elapsed() > deadline
            {
                overdue.push((*split, run.next, run.waiting_since.elapsed()));
            } else if run.retry_at.is_none()
                && run.next < run.end
                && run.buf.is_empty()
                && run.last_activity.elapsed() > stall
            {
                stalled.push(*split);
            }
        }
        for split in retry {
            let broken = self.splits.get(&split).is_some_and(|r| r.stream.is_none());
            self.report(split, broken, RETRY.into())?;
        }
        for split in stalled {
            self.report(split, false, "no unit within the stall timeout".into())?;
        }
        for (split, batch, waited) in overdue {
            let detail = format!(
                "its worker, still answering, delivered no unit for {:.1} s (the unit deadline: \
                 {:.1} s; the slowest unit so far took {:.1} s): it may be stuck computing the \
                 examples of batch {batch} of epoch {}: {}",
                waited.as_secs_f64(),
                deadline.as_secs_f64(),
                self.slowest_unit.as_secs_f64(),
                self.epoch,
                self.examples_of(batch)
            );
            self.report(split, true, detail)?;
        }
        if !self.progress_in_flight && self.last_progress.elapsed() >= self.ctx.opts.progress_every
        {
            self.spawn_progress();
        }
        Ok(())
    }

    /// How long a live worker may take for one unit before its split is
    /// given to another.
    fn unit_deadline(&self) -> Duration {
        self.ctx
            .opts
            .unit_deadline
            .unwrap_or_else(|| UNIT_DEADLINE_FLOOR.max(self.slowest_unit * 20))
    }

    /// The dataset indices of this rank's unit of `batch`, for messages.
    fn examples_of(&self, batch: u64) -> String {
        let order = self.ctx.spec.order(self.epoch);
        match crate::worker::unit_indices(
            &self.ctx.spec,
            &order,
            self.epoch,
            batch,
            self.ctx.rank,
            self.ctx.world,
        ) {
            Ok(u) if u.indices.len() <= 16 => format!("dataset indices {:?}", u.indices),
            Ok(u) => format!(
                "dataset indices {:?} ... ({} in all)",
                &u.indices[..16],
                u.indices.len()
            ),
            Err(e) => format!("(its indices: {e})"),
        }
    }

    fn progress_request(&mut self) -> proto::ProgressRequest {
        proto::ProgressRequest {
            protocol: proto::PROTOCOL,
            job_id: self.ctx.job_id.clone(),
            epoch: self.epoch,
            rank: self.ctx.rank,
            cursor_batch: self.cursor,
            finished_splits: std::mem::take(&mut self.finished),
            window: self.splits.keys().copied().collect(),
            // Bounded: after a long dispatcher outage the backlog goes in
            // several reports.
            digests: {
                let n = self.unreported.len().min(DIGESTS_PER_REPORT);
                self.unreported.drain(..n).collect()
            },
        }
    }

    fn spawn_progress(&mut self) {
        self.progress_in_flight = true;
        self.last_progress = Instant::now();
        let req = self.progress_request();
        let reported = (req.finished_splits.clone(), req.digests.clone());
        let mut d = self.ctx.dispatcher.clone();
        let events = self.events_tx.clone();
        let timeout = self.ctx.opts.connect_timeout;
        tokio::spawn(async move {
            // The dispatcher may be down: streams keep flowing, and the
            // finished splits are reported again with the next cursor.
            let list = match tokio::time::timeout(timeout, d.progress(req)).await {
                Ok(Ok(r)) => Some(r.into_inner().assignments),
                _ => None,
            };
            let _ = events.send(Event::Current { list, reported }).await;
        });
    }

    /// The last report of an epoch, awaited briefly.
    async fn report_progress(&mut self, _final: bool) {
        let req = self.progress_request();
        let mut d = self.ctx.dispatcher.clone();
        let _ = tokio::time::timeout(Duration::from_millis(500), d.progress(req)).await;
    }
}

/// A call that failed because its HTTP/2 connection went away (tonic's
/// status for an `h2` error), not because the server answered it.
fn connection_dropped(status: &Status) -> bool {
    status.message().starts_with("h2 protocol error")
}
