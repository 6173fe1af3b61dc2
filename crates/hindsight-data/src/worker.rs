//! A worker: computes the units of the splits it is assigned and streams
//! them to the client that asked. The user's preprocessing is behind
//! [`Pipeline`] (the Python binding implements it); everything else (which
//! indices, which seeds, digests, fencing, heartbeats) is decided here.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Endpoint;
use tonic::{Request, Response, Status};

use crate::auth::{self, Authed, Bearer, Check, Token};
use crate::error::{Error, Result};
use crate::order::{example_seed, EpochOrder, JobSpec};
use crate::proto::{self, check_protocol};
use crate::shared::SharedDir;
use crate::tls::Tls;

/// What the worker asks the user's pipeline for: one rank's slice of one
/// global batch.
#[derive(Debug)]
pub struct UnitRequest<'a> {
    pub spec: &'a JobSpec,
    pub job_id: &'a str,
    pub epoch: u64,
    pub batch: u64,
    /// The split the unit belongs to and its batches (worker checkpoints
    /// are taken at unit boundaries inside it).
    pub split: u64,
    pub split_batches: std::ops::Range<u64>,
    /// Dataset indices, in delivery order.
    pub indices: &'a [u64],
    /// The seed of every random draw for the example at the same position.
    pub seeds: &'a [u64],
    /// Sharded datasets: where each record is read (empty otherwise).
    pub shards: &'a [u64],
    pub offsets: &'a [u64],
}

/// A produced payload: dropped on the producing thread, after it is sent
/// or written.
pub type Produced = Box<dyn AsRef<[u8]> + Send>;

/// The user's code raised: the text (a traceback) goes to the client.
#[derive(Debug, Clone)]
pub struct PipelineFailure {
    pub detail: String,
}

/// The preprocessing a worker runs.
pub trait Pipeline: Send + Sync + 'static {
    /// "module:factory", as in the job spec.
    fn dataset(&self) -> &str;
    /// Canonical JSON of the arguments the factory was called with, as in
    /// the job spec (`"{}"` for none).
    fn dataset_args(&self) -> &str;
    /// A digest of the dataset's code; jobs of another version are refused.
    fn code_version(&self) -> &str;
    /// The payload of one unit. Must depend only on the request. Any owner
    /// of bytes will do (the Python binding lends the encoder's buffer, so a
    /// shared-memory handoff copies the batch once).
    fn produce(&self, req: &UnitRequest<'_>) -> std::result::Result<Produced, PipelineFailure>;
}

/// The 16-byte content digest carried by every unit: xxh3-128, which
/// catches damage and nondeterminism (nothing here is adversarial) at
/// memory speed; blake3 cost the trainer ~1.5 ms per 5 MiB batch.
pub fn digest(payload: &[u8]) -> Vec<u8> {
    twox_hash::XxHash3_128::oneshot(payload)
        .to_le_bytes()
        .to_vec()
}

/// What one rank's slice of a global batch holds.
#[derive(Debug, Clone, Default)]
pub struct UnitIndices {
    pub indices: Vec<u64>,
    pub seeds: Vec<u64>,
    /// Sharded datasets only: the shard and offset of each record.
    pub shards: Vec<u64>,
    pub offsets: Vec<u64>,
}

/// The indices, seeds (and shard offsets) of one rank's slice of a global batch.
pub fn unit_indices(
    spec: &JobSpec,
    order: &EpochOrder,
    epoch: u64,
    batch: u64,
    rank: u32,
    world: u32,
) -> Result<UnitIndices> {
    let mut out = UnitIndices::default();
    for p in spec.rank_positions(batch, rank, world)? {
        let index = order.index(p);
        out.indices.push(index);
        out.seeds.push(example_seed(spec.seed, epoch, index));
        if let Some(at) = order.shard_offset(p) {
            out.shards.push(at.shard);
            out.offsets.push(at.offset);
        }
    }
    Ok(out)
}

pub(crate) async fn connect(
    addr: &str,
    timeout: Duration,
    token: &Token,
    tls: &Tls,
) -> std::result::Result<proto::worker_client::WorkerClient<Authed>, tonic::transport::Error> {
    let channel = endpoint(addr, timeout, tls)?.connect().await?;
    Ok(
        proto::worker_client::WorkerClient::with_interceptor(channel, Bearer::new(token))
            .max_decoding_message_size(MAX_MESSAGE),
    )
}

/// Units are whole batches: allow large messages (the default is 4 MiB).
pub(crate) const MAX_MESSAGE: usize = 1 << 30;

pub(crate) fn endpoint(
    addr: &str,
    timeout: Duration,
    tls: &Tls,
) -> std::result::Result<Endpoint, tonic::transport::Error> {
    tls.client(
        Endpoint::from_shared(tls.uri(addr))?
            .connect_timeout(timeout)
            .tcp_nodelay(true),
    )
}

/// How a worker finds and talks to its dispatcher.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub dispatcher: String,
    /// Where to listen; port 0 picks one.
    pub bind: String,
    /// The address clients should use, if not the bound one.
    pub advertise: Option<String>,
    pub heartbeat: Duration,
    /// How long the first registration may keep failing before giving up.
    pub startup_timeout: Duration,
    /// Hand large payloads over through this shared-memory directory
    /// (workers started by a local loader, on the client's host).
    pub shared_dir: Option<std::path::PathBuf>,
    /// The service's token; None: from the environment ([`Token::required`]).
    pub token: Option<Token>,
    /// TLS; None: from the environment ([`Tls::from_env`]).
    pub tls: Option<Tls>,
}

impl WorkerOptions {
    pub fn new(dispatcher: impl Into<String>) -> Self {
        WorkerOptions {
            dispatcher: dispatcher.into(),
            bind: "127.0.0.1:0".into(),
            advertise: None,
            heartbeat: Duration::from_millis(200),
            startup_timeout: Duration::from_secs(10),
            shared_dir: None,
            token: None,
            tls: None,
        }
    }
}

struct WorkerService {
    pipeline: Arc<dyn Pipeline>,
    /// The id the dispatcher knows this worker by; requests for another id
    /// were meant for an earlier identity (fenced).
    id: watch::Receiver<String>,
    /// One unit at a time: the pipeline is the user's single interpreter.
    compute: Arc<Mutex<()>>,
    active: Arc<std::sync::atomic::AtomicU32>,
    shared: Option<Arc<SharedDir>>,
}

#[tonic::async_trait]
impl proto::worker_server::Worker for WorkerService {
    type ProduceStream = ReceiverStream<std::result::Result<proto::Unit, Status>>;

    async fn produce(
        &self,
        request: Request<proto::ProduceRequest>,
    ) -> std::result::Result<Response<Self::ProduceStream>, Status> {
        // A job token reads its own dataset's units only, and learns
        // nothing of what this worker serves otherwise.
        let dataset = request.get_ref().spec.as_ref().map(|s| s.dataset.clone());
        auth::allow(&request, dataset.as_deref())?;
        let req = request.into_inner();
        check_protocol(req.protocol, "client")?;
        let (Some(spec), Some(a)) = (req.spec, req.assignment) else {
            return Err(Status::invalid_argument(
                "produce needs a spec and an assignment",
            ));
        };
        let Some(key) = a.key.clone() else {
            return Err(Status::invalid_argument("assignment without a split"));
        };
        let spec = JobSpec::from(&spec);
        if spec.dataset != self.pipeline.dataset()
            || spec.code_version != self.pipeline.code_version()
            || spec.dataset_args != self.pipeline.dataset_args()
        {
            return Err(Status::failed_precondition(format!(
                "this worker serves dataset {} with arguments {} at code version {}, the job wants {} with {} at {}",
                self.pipeline.dataset(),
                self.pipeline.dataset_args(),
                self.pipeline.code_version(),
                spec.dataset,
                spec.dataset_args,
                spec.code_version
            )));
        }
        if spec.job_id() != key.job_id {
            return Err(Status::invalid_argument(
                "the spec does not hash to the job id",
            ));
        }
        if *self.id.borrow() != a.worker_id {
            return Err(Status::unavailable(format!(
                "fenced: this worker is now {}, the assignment names {}",
                *self.id.borrow(),
                a.worker_id
            )));
        }
        let batches = spec.split_batches(key.split);
        if a.from_batch < batches.start || a.from_batch > batches.end {
            return Err(Status::invalid_argument(format!(
                "batch {} is not in split {}",
                a.from_batch, key.split
            )));
        }
        // Reject a bad rank before streaming.
        spec.rank_positions(batches.start, key.rank, req.world)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (tx, rx) = mpsc::channel(2);
        let pipeline = self.pipeline.clone();
        let compute = self.compute.clone();
        let active = self.active.clone();
        let shared = self.shared.clone();
        active.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::task::spawn_blocking(move || {
            let order = spec.order(key.epoch);
            for batch in a.from_batch..batches.end {
                if tx.is_closed() {
                    break;
                }
                let unit = (|| {
                    let u = unit_indices(&spec, &order, key.epoch, batch, key.rank, req.world)
                        .map_err(|e| Status::invalid_argument(e.to_string()))?;
                    let payload = {
                        let _one = compute.lock().unwrap_or_else(|p| p.into_inner());
                        pipeline.produce(&UnitRequest {
                            spec: &spec,
                            job_id: &key.job_id,
                            epoch: key.epoch,
                            batch,
                            split: key.split,
                            split_batches: batches.clone(),
                            indices: &u.indices,
                            seeds: &u.seeds,
                            shards: &u.shards,
                            offsets: &u.offsets,
                        })
                    }
                    // Aborted is reserved for the user's code failing: the
                    // client does not retry it elsewhere.
                    .map_err(|f| Status::aborted(f.detail))?;
                    let bytes = (*payload).as_ref();
                    let digest = digest(bytes);
                    let (inline, shared) = match shared.as_ref().and_then(|d| d.put(bytes)) {
                        Some(name) => (Bytes::new(), name),
                        None => (Bytes::copy_from_slice(bytes), String::new()),
                    };
                    drop(payload);
                    let payload = inline;
                    Ok(proto::Unit {
                        epoch: key.epoch,
                        batch,
                        attempt: a.attempt,
                        digest,
                        payload,
                        indices: u.indices,
                        shared,
                    })
                })();
                let failed = unit.is_err();
                if let Err(unsent) = tx.blocking_send(unit) {
                    // The stream is gone: nobody will take its file.
                    if let (Ok(u), Some(d)) = (unsent.0, shared.as_ref()) {
                        d.remove(&u.shared);
                    }
                    break;
                }
                if failed {
                    break;
                }
            }
            active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn probe(
        &self,
        request: Request<proto::ProbeRequest>,
    ) -> std::result::Result<Response<proto::ProbeReply>, Status> {
        auth::allow(&request, None)?;
        Ok(Response::new(proto::ProbeReply {
            worker_id: self.id.borrow().clone(),
        }))
    }
}

/// A running worker.
#[derive(Debug)]
pub struct WorkerHandle {
    pub addr: SocketAddr,
    /// Whether it serves over TLS.
    pub tls: bool,
    id: watch::Receiver<String>,
    shutdown: Option<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl WorkerHandle {
    /// The id the dispatcher currently knows this worker by.
    pub fn worker_id(&self) -> String {
        self.id.borrow().clone()
    }

    /// Stop serving at once (clients see their streams break).
    pub fn stop(mut self) {
        self.shutdown.take();
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

async fn register(
    opts: &WorkerOptions,
    bearer: &Bearer,
    pipeline: &dyn Pipeline,
    address: &str,
    previous: &str,
) -> std::result::Result<String, Status> {
    let tls = opts.tls.clone().unwrap_or_default();
    let channel = endpoint(&opts.dispatcher, Duration::from_secs(2), &tls)
        .map_err(|e| Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut d =
        proto::dispatcher_client::DispatcherClient::with_interceptor(channel, bearer.clone());
    let call = d.register_worker(proto::RegisterWorkerRequest {
        protocol: proto::PROTOCOL,
        worker_id: previous.to_string(),
        address: address.to_string(),
        dataset: pipeline.dataset().to_string(),
        code_version: pipeline.code_version().to_string(),
        dataset_args: pipeline.dataset_args().to_string(),
    });
    // A dispatcher that accepts but never answers (stopped, hung) must not
    // hang the worker's start or its heartbeat loop.
    let reply = tokio::time::timeout(Duration::from_secs(2), call)
        .await
        .map_err(|_| Status::unavailable("the dispatcher did not answer the registration"))??;
    Ok(reply.into_inner().worker_id)
}

/// Bind, register with the dispatcher and serve on the current runtime.
/// Fails fast (naming the address) if the dispatcher cannot be reached
/// within `startup_timeout` or refuses this worker.
pub async fn spawn(pipeline: Arc<dyn Pipeline>, mut opts: WorkerOptions) -> Result<WorkerHandle> {
    let token = Token::required(opts.token.clone(), "worker")?;
    let tls = Tls::resolve(opts.tls.take())?;
    opts.tls = Some(tls.clone());
    let serves_tls = tls.on();
    let server = tls.server(tonic::transport::Server::builder(), "worker")?;
    let bearer = Bearer::new(&token);
    let listener = TcpListener::bind(&opts.bind).await.map_err(|e| Error::Io {
        what: format!("bind the worker to {}", opts.bind),
        source: e,
    })?;
    let addr = listener.local_addr().map_err(|e| Error::Io {
        what: format!("address of {}", opts.bind),
        source: e,
    })?;
    // "host" or "host:0" means: this host name, the port actually bound.
    let advertised = match opts.advertise.as_deref() {
        None => addr.to_string(),
        Some(a) => match a.rsplit_once(':') {
            Some((host, "0")) => format!("{host}:{}", addr.port()),
            Some(_) => a.to_string(),
            None => format!("{a}:{}", addr.port()),
        },
    };
    let deadline = Instant::now() + opts.startup_timeout;
    let first = loop {
        match register(&opts, &bearer, pipeline.as_ref(), &advertised, "").await {
            Ok(id) => break id,
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) if s.code() == tonic::Code::Unavailable => {
                return Err(Error::Unreachable {
                    role: "dispatcher",
                    addr: opts.dispatcher.clone(),
                    detail: s.message().to_string(),
                })
            }
            Err(s) if s.code() == tonic::Code::Unauthenticated => {
                return Err(Error::Token(format!(
                    "the dispatcher at {} refused this worker: {}",
                    opts.dispatcher,
                    s.message()
                )))
            }
            Err(s) => return Err(Error::rpc("register the worker", &s)),
        }
    };
    let (id_tx, id_rx) = watch::channel(first);
    let active = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = WorkerService {
        pipeline: pipeline.clone(),
        id: id_rx.clone(),
        compute: Arc::new(Mutex::new(())),
        active: active.clone(),
        shared: opts.shared_dir.clone().map(|d| Arc::new(SharedDir::new(d))),
    };
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let served = server
            .tcp_nodelay(true)
            .add_service(InterceptedService::new(
                proto::worker_server::WorkerServer::new(service)
                    .max_encoding_message_size(MAX_MESSAGE),
                Check::new(&token),
            ))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = served {
            eprintln!("hindsight data worker: {e}");
        }
    });
    // Heartbeats run on their own task, never behind the user's code, so a
    // worker busy in a slow transform is not mistaken for a dead one. A
    // dispatcher that is down is retried forever: streams keep flowing.
    let heartbeat = tokio::spawn(async move {
        let mut tick = tokio::time::interval(opts.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut client: Option<proto::dispatcher_client::DispatcherClient<Authed>> = None;
        loop {
            tick.tick().await;
            if client.is_none() {
                client = endpoint(&opts.dispatcher, opts.heartbeat * 2, &tls)
                    .ok()
                    .map(|e| e.connect_lazy())
                    .map(|c| {
                        proto::dispatcher_client::DispatcherClient::with_interceptor(
                            c,
                            bearer.clone(),
                        )
                    });
            }
            let Some(c) = client.as_mut() else { continue };
            let id = id_tx.borrow().clone();
            let beat = c.heartbeat(proto::HeartbeatRequest {
                protocol: proto::PROTOCOL,
                worker_id: id.clone(),
                active_streams: active.load(std::sync::atomic::Ordering::Relaxed),
            });
            match tokio::time::timeout(opts.heartbeat * 2, beat).await {
                Ok(Ok(r)) if r.get_ref().known => {}
                Ok(Ok(_)) => {
                    // Declared dead (e.g. after a SIGSTOP): come back under a
                    // new identity; the old one's assignments stay fenced.
                    if let Ok(new) =
                        register(&opts, &bearer, pipeline.as_ref(), &advertised, "").await
                    {
                        let _ = id_tx.send(new);
                    }
                }
                _ => client = None,
            }
        }
    });
    Ok(WorkerHandle {
        addr,
        tls: serves_tls,
        id: id_rx,
        shutdown: Some(tx),
        tasks: vec![server, heartbeat],
    })
}

/// A worker on its own runtime (see [`crate::Running`]).
pub fn start(
    pipeline: Arc<dyn Pipeline>,
    opts: WorkerOptions,
) -> Result<crate::Running<WorkerHandle>> {
    crate::Running::new("worker", spawn(pipeline, opts))
}
