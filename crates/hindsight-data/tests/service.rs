//! The input service end to end on loopback gRPC: a dispatcher, workers and
//! a client in this process, a synthetic pipeline whose payload encodes each
//! example's index and random seed, and failures injected while an epoch
//! streams. (Killing real worker processes is tested from Python.)

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hindsight_data::auth::Token;
use hindsight_data::client::{Client, ClientOptions, Next};
use hindsight_data::dispatcher::{self, DispatcherOptions};
use hindsight_data::order::{example_seed, JobSpec};
use hindsight_data::shared::Payload;
use hindsight_data::worker::{
    self, Pipeline, PipelineFailure, Produced, UnitRequest, WorkerOptions,
};
use hindsight_data::Error;

struct Synthetic {
    delay: Duration,
    /// Payloads are padded to at least this many bytes (a fixed pattern).
    pad: usize,
    /// Nonzero: every unit computed after the first `n` gets another byte.
    drift_after: u64,
    made: AtomicU64,
}

impl Synthetic {
    fn new(delay_ms: u64) -> Arc<Self> {
        Arc::new(Synthetic {
            delay: Duration::from_millis(delay_ms),
            pad: 0,
            drift_after: 0,
            made: AtomicU64::new(0),
        })
    }
}

impl Pipeline for Synthetic {
    fn dataset(&self) -> &str {
        "synthetic:make"
    }
    fn dataset_args(&self) -> &str {
        "{}"
    }
    fn code_version(&self) -> &str {
        "v1"
    }
    fn produce(&self, req: &UnitRequest<'_>) -> Result<Produced, PipelineFailure> {
        std::thread::sleep(self.delay);
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(req.indices.len() * 16);
        for (i, s) in req.indices.iter().zip(req.seeds) {
            out.extend_from_slice(&i.to_le_bytes());
            out.extend_from_slice(&s.to_le_bytes());
        }
        if self.drift_after > 0 && n >= self.drift_after {
            out.push(1);
        }
        pad(&mut out, self.pad);
        Ok(Box::new(out))
    }
}

fn pad(out: &mut Vec<u8>, to: usize) {
    while out.len() < to {
        out.push((out.len() % 251) as u8);
    }
}

fn spec(len: u64) -> JobSpec {
    JobSpec {
        dataset: "synthetic:make".into(),
        dataset_args: "{}".into(),
        code_version: "v1".into(),
        seed: 7,
        length: len,
        global_batch: 8,
        split_batches: 3,
        drop_last: false,
        shuffle: true,
        shards: vec![],
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A runtime, a journal directory and a dispatcher on loopback (keep the
/// directory and the handle alive for the test).
fn cluster() -> (
    tokio::runtime::Runtime,
    tempfile::TempDir,
    dispatcher::DispatcherHandle,
    String,
) {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let d = rt
        .block_on(dispatcher::spawn("127.0.0.1:0", fast_options(dir.path())))
        .unwrap();
    let addr = d.addr.to_string();
    (rt, dir, d, addr)
}

/// The token every part of a test's service shares.
fn token() -> Token {
    Token::parse("test-token-0123456789abcdef", "the test").unwrap()
}

fn fast_options(dir: &std::path::Path) -> DispatcherOptions {
    let mut o = DispatcherOptions::new(dir);
    o.heartbeat_timeout = Duration::from_millis(600);
    o.token = Some(token());
    o
}

fn worker_options(dispatcher: impl Into<String>) -> WorkerOptions {
    WorkerOptions {
        token: Some(token()),
        ..WorkerOptions::new(dispatcher)
    }
}

fn client_options() -> ClientOptions {
    ClientOptions {
        stall_timeout: Duration::from_millis(300),
        no_worker_wait: Duration::from_secs(20),
        token: Some(token()),
        ..ClientOptions::default()
    }
}

/// A delivered unit: (batch, dataset indices, payload).
type Unit = (u64, Vec<u64>, Vec<u8>);

/// Read a whole epoch; `during(batch)` runs after each delivered unit.
fn read_epoch(
    client: &mut Client,
    epoch: u64,
    mut during: impl FnMut(u64),
) -> Result<Vec<Unit>, Error> {
    client.start_epoch(epoch, 0)?;
    let mut out = Vec::new();
    loop {
        match client.next(Duration::from_secs(30))? {
            Next::Unit(d) => {
                during(d.batch);
                out.push((d.batch, d.indices, d.payload.to_vec()));
            }
            Next::End => return Ok(out),
            Next::Pending => panic!("no unit within 30 s"),
        }
    }
}

/// What an epoch must deliver: the permutation, batch by batch.
fn expected(spec: &JobSpec, epoch: u64) -> Vec<Unit> {
    let perm = spec.permutation(epoch);
    (0..spec.batches_per_epoch())
        .map(|b| {
            let idx: Vec<u64> = spec.batch_positions(b).map(|p| perm.index(p)).collect();
            let mut payload = Vec::new();
            for i in &idx {
                payload.extend_from_slice(&i.to_le_bytes());
                payload.extend_from_slice(&example_seed(spec.seed, epoch, *i).to_le_bytes());
            }
            (b, idx, payload)
        })
        .collect()
}

#[test]
fn an_epoch_is_the_permutation_exactly_once_whatever_the_worker_count() {
    let (rt, _dir, _d, addr) = cluster();
    let mut workers = Vec::new();
    for n in [1usize, 3] {
        while workers.len() < n {
            let w = rt
                .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
                .unwrap();
            workers.push(w);
        }
        let s = spec(203);
        let mut c = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
        for epoch in 0..2 {
            let got = read_epoch(&mut c, epoch, |_| {}).unwrap();
            assert_eq!(got, expected(&s, epoch), "{n} workers, epoch {epoch}");
            let mut seen: Vec<u64> = got.iter().flat_map(|g| g.1.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..203).collect::<Vec<_>>());
        }
    }
}

#[test]
fn workers_added_mid_epoch_take_work_and_change_nothing_delivered() {
    let (rt, _dir, _d, addr) = cluster();
    let first = Synthetic::new(4);
    let mut workers = vec![rt
        .block_on(worker::spawn(first.clone(), worker_options(&addr)))
        .unwrap()];
    let added: Vec<_> = (0..2).map(|_| Synthetic::new(4)).collect();
    let s = spec(400);
    let mut c = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
    let got = read_epoch(&mut c, 0, |batch| {
        if batch == 5 {
            for p in &added {
                let w = rt.block_on(worker::spawn(p.clone(), worker_options(&addr)));
                workers.push(w.unwrap());
            }
        }
    })
    .unwrap();
    assert_eq!(got, expected(&s, 0));
    for p in &added {
        assert!(
            p.made.load(Ordering::Relaxed) > 0,
            "an added worker got no split"
        );
    }
}

#[test]
fn same_host_workers_hand_units_over_through_shared_memory_and_leave_no_file() {
    let (rt, _dir, _d, addr) = cluster();
    let shm = tempfile::tempdir().unwrap();
    let size = hindsight_data::shared::MIN_SHARED + 5;
    let _workers: Vec<_> = (0..2)
        .map(|_| {
            let mut o = worker_options(&addr);
            o.shared_dir = Some(shm.path().to_path_buf());
            let p = Arc::new(Synthetic {
                pad: size,
                ..Arc::into_inner(Synthetic::new(0)).unwrap()
            });
            rt.block_on(worker::spawn(p, o)).unwrap()
        })
        .collect();
    let s = spec(60);
    let opts = ClientOptions {
        shared_dir: Some(shm.path().to_path_buf()),
        ..client_options()
    };
    let mut c = Client::connect(&addr, s.clone(), 0, 1, None, opts).unwrap();
    c.start_epoch(0, 0).unwrap();
    let want = expected(&s, 0);
    for w in &want {
        let Next::Unit(d) = c.next(Duration::from_secs(30)).unwrap() else {
            panic!("epoch ended early or stalled")
        };
        assert!(
            matches!(d.payload, Payload::Mapped(_)),
            "unit {} came inline",
            d.batch
        );
        let mut body = w.2.clone();
        pad(&mut body, size);
        assert_eq!(
            (d.batch, &d.indices, &d.payload[..]),
            (w.0, &w.1, &body[..])
        );
    }
    assert!(matches!(
        c.next(Duration::from_secs(30)).unwrap(),
        Next::End
    ));
    drop(c);
    let left: Vec<_> = std::fs::read_dir(shm.path()).unwrap().collect();
    assert!(
        left.is_empty(),
        "files left in the shared-memory directory: {left:?}"
    );
}

#[test]
fn ranks_read_disjoint_slices_that_make_up_the_global_batches() {
    let (rt, _dir, _d, addr) = cluster();
    let _w = rt
        .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
        .unwrap();
    let s = spec(100);
    let all = expected(&s, 1);
    let mut per_rank = Vec::new();
    for rank in 0..3 {
        let mut c = Client::connect(&addr, s.clone(), rank, 3, None, client_options()).unwrap();
        per_rank.push(read_epoch(&mut c, 1, |_| {}).unwrap());
    }
    for (b, idx, _) in &all {
        let joined: Vec<u64> = (0..3)
            .flat_map(|r| per_rank[r][*b as usize].1.clone())
            .collect();
        assert_eq!(&joined, idx, "batch {b}");
    }
}

#[test]
fn a_worker_stopped_mid_epoch_loses_and_repeats_nothing() {
    let (rt, _dir, _d, addr) = cluster();
    let mut workers: Vec<_> = (0..3)
        .map(|_| {
            rt.block_on(worker::spawn(Synthetic::new(3), worker_options(&addr)))
                .unwrap()
        })
        .collect();
    let s = spec(400);
    let mut c = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
    let mut victims = vec![10u64, 30];
    let got = read_epoch(&mut c, 0, |batch| {
        if victims.first() == Some(&batch) {
            victims.remove(0);
            workers.remove(0).stop();
        }
    })
    .unwrap();
    assert_eq!(got, expected(&s, 0));
    assert!(c.stats().failovers.load(Ordering::Relaxed) >= 1);
}

#[test]
fn a_restarted_dispatcher_resumes_from_its_journal_and_streams_never_stop() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let d = rt
        .block_on(dispatcher::spawn("127.0.0.1:0", fast_options(dir.path())))
        .unwrap();
    let addr = d.addr;
    let _workers: Vec<_> = (0..2)
        .map(|_| {
            rt.block_on(worker::spawn(
                Synthetic::new(2),
                worker_options(addr.to_string()),
            ))
            .unwrap()
        })
        .collect();
    let s = spec(300);
    let mut c =
        Client::connect(&addr.to_string(), s.clone(), 0, 1, None, client_options()).unwrap();
    let mut d = Some(d);
    let got = read_epoch(&mut c, 0, |batch| {
        if batch == 5 {
            // Crash: connections drop; restart on the same port from the
            // journal a moment later.
            d.take().unwrap().stop();
            std::thread::sleep(Duration::from_millis(200));
            let again = rt
                .block_on(dispatcher::spawn(
                    &addr.to_string(),
                    fast_options(dir.path()),
                ))
                .unwrap();
            assert!(again.recovered.records > 0);
            assert_eq!(again.recovered.jobs, 1);
            d = Some(again);
        }
    })
    .unwrap();
    assert_eq!(got, expected(&s, 0));
}

#[test]
fn a_reread_epoch_whose_units_differ_from_the_first_delivery_is_a_named_error() {
    let (rt, _dir, _d, addr) = cluster();
    // Deterministic for the first epoch's 8 units, then every unit differs.
    let drifting = Arc::new(Synthetic {
        delay: Duration::from_millis(1),
        drift_after: 8,
        ..Arc::into_inner(Synthetic::new(0)).unwrap()
    });
    let _w = rt
        .block_on(worker::spawn(drifting, worker_options(&addr)))
        .unwrap();
    let s = spec(64);
    let mut c = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
    assert_eq!(read_epoch(&mut c, 0, |_| {}).unwrap(), expected(&s, 0));
    // Let the last progress report (with the digests) land.
    std::thread::sleep(Duration::from_millis(700));
    // A trainer resumed from a checkpoint re-reads the epoch, in a new
    // client: the dispatcher's journaled digests catch the drift.
    let mut again = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
    let err = read_epoch(&mut again, 0, |_| {}).unwrap_err();
    assert!(
        matches!(err, Error::NonDeterministic { epoch: 0, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("not deterministic"), "{err}");
}

#[test]
fn an_epoch_left_early_stops_its_workers_computing() {
    let (rt, _dir, _d, addr) = cluster();
    let pipeline = Synthetic::new(5);
    let _w = rt
        .block_on(worker::spawn(pipeline.clone(), worker_options(&addr)))
        .unwrap();
    let mut c = Client::connect(&addr, spec(2000), 0, 1, None, client_options()).unwrap();
    c.start_epoch(0, 0).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            c.next(Duration::from_secs(10)).unwrap(),
            Next::Unit(_)
        ));
    }
    c.stop_epoch();
    std::thread::sleep(Duration::from_millis(300));
    let settled = pipeline.made.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(600));
    // At most the unit in hand when the stream was dropped.
    assert!(
        pipeline.made.load(Ordering::Relaxed) <= settled + 1,
        "the worker kept computing for an abandoned epoch"
    );
    assert!(
        settled < 100,
        "{settled} units made for 3 read: buffers are not bounded"
    );
}

#[test]
fn attaching_a_changed_job_names_the_difference() {
    let (_rt, _dir, _d, addr) = cluster();
    let s = spec(64);
    let c = Client::connect(&addr, s.clone(), 0, 1, None, client_options()).unwrap();
    let old_id = c.job_id().to_string();
    let mut changed = s.clone();
    changed.global_batch = 16;
    let err = Client::connect(&addr, changed, 0, 1, Some(&old_id), client_options()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("global_batch"), "{text}");
    assert!(matches!(err, Error::Mismatch { .. }), "{err:?}");
}

#[test]
fn workers_running_other_code_are_refused_at_once_naming_both_versions() {
    let (rt, _dir, _d, addr) = cluster();
    let _w = rt
        .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
        .unwrap();
    let newer = JobSpec {
        code_version: "v2".into(),
        ..spec(40)
    };
    let mut c = Client::connect(&addr, newer, 0, 1, None, client_options()).unwrap();
    let started = std::time::Instant::now();
    let err = read_epoch(&mut c, 0, |_| {}).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        started.elapsed()
    );
    assert!(matches!(err, Error::Mismatch { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("v1") && text.contains("v2"), "{text}");
}

#[test]
fn an_unreachable_dispatcher_fails_fast_naming_the_address() {
    // A port nobody listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let err = Client::connect(&addr, spec(10), 0, 1, None, client_options()).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(matches!(err, Error::Unreachable { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr), "{err}");
}

mod random_failures {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // Each case starts real servers on loopback: keep the count small
        // (HINDSIGHT_FUZZ_CASES raises it).
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("HINDSIGHT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(6)
        ))]

        /// Whatever the geometry, window and failure schedule, the reorder
        /// and dedup logic delivers exactly the permutation, batch by batch.
        #[test]
        fn delivery_is_exact_under_random_geometry_and_failures(
            len in 1u64..300,
            global_batch in 1u64..17,
            split_batches in 1u64..5,
            drop_last in any::<bool>(),
            window in 1usize..6,
            workers in 1usize..4,
            kills in proptest::collection::vec(0u64..40, 0..3),
        ) {
            let (rt, _dir, _d, addr) = cluster();
            let mut live: Vec<_> = (0..workers + kills.len())
                .map(|_| {
                    rt.block_on(worker::spawn(Synthetic::new(1), worker_options(&addr)))
                        .unwrap()
                })
                .collect();
            let s = JobSpec { global_batch, split_batches, drop_last, ..spec(len) };
            let opts = ClientOptions { window_splits: window, ..client_options() };
            let mut c = Client::connect(&addr, s.clone(), 0, 1, None, opts).unwrap();
            let got = read_epoch(&mut c, 1, |batch| {
                if kills.contains(&batch) && live.len() > 1 {
                    live.remove(0).stop();
                }
            })
            .unwrap();
            prop_assert_eq!(got, expected(&s, 1));
        }
    }
}

/// Computes like [`Synthetic`], but never returns (until released) a unit
/// holding `hang_on` (or any unit, with `None`).
struct Hangs {
    inner: Arc<Synthetic>,
    hang_on: Option<u64>,
    release: Arc<std::sync::atomic::AtomicBool>,
    hung: AtomicU64,
}

impl Pipeline for Hangs {
    fn dataset(&self) -> &str {
        self.inner.dataset()
    }
    fn dataset_args(&self) -> &str {
        self.inner.dataset_args()
    }
    fn code_version(&self) -> &str {
        self.inner.code_version()
    }
    fn produce(&self, req: &UnitRequest<'_>) -> Result<Produced, PipelineFailure> {
        if self.hang_on.is_none_or(|k| req.indices.contains(&k)) {
            self.hung.fetch_add(1, Ordering::Relaxed);
            while !self.release.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.inner.produce(req)
    }
}

fn hangs(hang_on: Option<u64>, release: &Arc<std::sync::atomic::AtomicBool>) -> Arc<Hangs> {
    Arc::new(Hangs {
        inner: Synthetic::new(0),
        hang_on,
        release: release.clone(),
        hung: AtomicU64::new(0),
    })
}

/// Issue 22: a dataset item whose code never returns stalled the loader
/// forever (its worker still answers). Past the unit deadline the split goes
/// to another worker; the epoch is still exactly the permutation.
#[test]
fn a_worker_stuck_in_a_unit_loses_its_split_past_the_unit_deadline() {
    let (rt, _dir, _d, addr) = cluster();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stuck = hangs(None, &release);
    let _a = rt
        .block_on(worker::spawn(stuck.clone(), worker_options(&addr)))
        .unwrap();
    let _b = rt
        .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
        .unwrap();
    let s = spec(120);
    let opts = ClientOptions {
        unit_deadline: Some(Duration::from_millis(800)),
        ..client_options()
    };
    let mut c = Client::connect(&addr, s.clone(), 0, 1, None, opts).unwrap();
    let got = read_epoch(&mut c, 0, |_| {});
    release.store(true, Ordering::Relaxed);
    assert_eq!(got.unwrap(), expected(&s, 0));
    assert!(
        stuck.hung.load(Ordering::Relaxed) > 0,
        "the stuck worker got no split"
    );
    assert!(c.stats().failovers.load(Ordering::Relaxed) > 0);
}

/// ... and an example that hangs every worker ends the epoch with an error
/// naming its dataset index, instead of moving from worker to worker.
#[test]
fn an_example_that_hangs_every_worker_is_named() {
    let (rt, _dir, _d, addr) = cluster();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = spec(64);
    let bad = s.permutation(0).index(20); // in batch 2
    let _workers: Vec<_> = (0..2)
        .map(|_| {
            rt.block_on(worker::spawn(
                hangs(Some(bad), &release),
                worker_options(&addr),
            ))
            .unwrap()
        })
        .collect();
    let opts = ClientOptions {
        unit_deadline: Some(Duration::from_millis(500)),
        ..client_options()
    };
    let mut c = Client::connect(&addr, s, 0, 1, None, opts).unwrap();
    let e = read_epoch(&mut c, 0, |_| {}).unwrap_err();
    release.store(true, Ordering::Relaxed);
    let msg = e.to_string();
    assert!(msg.contains("unit deadline"), "{msg}");
    assert!(
        msg.contains(&format!("{bad}")) && msg.contains("batch 2 of epoch 0"),
        "{msg}"
    );
}

#[test]
fn a_caller_without_the_token_learns_nothing_reads_nothing_and_cannot_register() {
    use hindsight_data::proto::{
        self, dispatcher_client::DispatcherClient, worker_client::WorkerClient,
    };
    let (rt, _dir, _d, addr) = cluster();
    let w = rt
        .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
        .unwrap();
    let mut c = Client::connect(&addr, spec(40), 0, 1, None, client_options()).unwrap();
    let job = c.job_id().to_string();
    assert_eq!(
        read_epoch(&mut c, 0, |_| {}).unwrap().len(),
        5,
        "the token holder reads"
    );
    // A trainer with another token is refused, told where the token comes from.
    let wrong = Token::parse("another-token-0123456789abcdef", "the test").unwrap();
    let err = Client::connect(
        &addr,
        spec(40),
        0,
        1,
        None,
        ClientOptions {
            token: Some(wrong),
            ..client_options()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.kind(),
        hindsight_data::ErrorKind::InvalidArgument,
        "{err}"
    );
    assert!(err.to_string().contains("HINDSIGHT_DATA_TOKEN"), "{err}");
    // Raw calls without a token, to every RPC that told or gave something.
    let worker_addr = format!("http://{}", w.addr);
    let refusals = rt.block_on(async {
        let mut d = DispatcherClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let mut wc = WorkerClient::connect(worker_addr).await.unwrap();
        vec![
            d.status(proto::StatusRequest {}).await.map(|_| ()),
            d.register_worker(proto::RegisterWorkerRequest {
                protocol: proto::PROTOCOL,
                address: "127.0.0.1:9".into(),
                dataset: "synthetic:make".into(),
                code_version: "v1".into(),
                dataset_args: "{}".into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
            d.attach(proto::AttachRequest {
                protocol: proto::PROTOCOL,
                spec: Some(proto::JobSpec::from(&spec(40))),
                world: 1,
                ..Default::default()
            })
            .await
            .map(|_| ()),
            wc.probe(proto::ProbeRequest {
                worker_id: w.worker_id(),
            })
            .await
            .map(|_| ()),
            wc.produce(proto::ProduceRequest {
                protocol: proto::PROTOCOL,
                spec: Some(proto::JobSpec::from(&spec(40))),
                world: 1,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        ]
    });
    for r in refusals {
        let s = r.unwrap_err();
        assert_eq!(s.code(), tonic::Code::Unauthenticated, "{s:?}");
        // Nothing about the service: no job, dataset, worker or address.
        for secret in [
            job.as_str(),
            "synthetic",
            &w.worker_id(),
            &w.addr.to_string(),
            "test-token",
        ] {
            assert!(!s.message().contains(secret), "{s:?} names {secret}");
        }
    }
    // The refused registration left no worker behind.
    let status = rt.block_on(async {
        token_holder(&addr)
            .await
            .status(proto::StatusRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    assert_eq!(status.workers.len(), 1, "{status:?}");
    assert_eq!(status.workers[0].address, w.addr.to_string());
}

/// Issue 42, item 2: one service feeding several jobs. A trainer given a job
/// token (derived from the service's for one dataset) reads its job's
/// epoch exactly, and can do nothing else: not attach a job over another
/// dataset, nor report progress or read digests of one, nor register a
/// worker, list the service or probe a worker, nor read another dataset's
/// units from a worker.
#[test]
fn a_job_token_reads_its_own_datasets_job_and_nothing_else() {
    use hindsight_data::proto::{self, worker_client::WorkerClient};
    let (rt, _dir, _d, addr) = cluster();
    let w = rt
        .block_on(worker::spawn(Synthetic::new(0), worker_options(&addr)))
        .unwrap();
    let job_token = token().for_dataset("synthetic:make").unwrap();
    let mut c = Client::connect(
        &addr,
        spec(40),
        0,
        1,
        None,
        ClientOptions {
            token: Some(job_token.clone()),
            ..client_options()
        },
    )
    .unwrap();
    assert_eq!(
        read_epoch(&mut c, 0, |_| {}).unwrap(),
        expected(&spec(40), 0)
    );
    // Another dataset's job, attached by its own trainer (service token here).
    let other = JobSpec {
        dataset: "other:make".into(),
        ..spec(40)
    };
    let theirs = Client::connect(&addr, other.clone(), 0, 1, None, client_options()).unwrap();
    let err = Client::connect(
        &addr,
        other.clone(),
        0,
        1,
        None,
        ClientOptions {
            token: Some(job_token.clone()),
            ..client_options()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("not good for that call"), "{err}");
    let channel = |a: String| async move {
        tonic::transport::Endpoint::from_shared(a)
            .unwrap()
            .connect()
            .await
            .unwrap()
    };
    let bearer = hindsight_data::auth::Bearer::new(&job_token);
    let refusals = rt.block_on(async {
        let mut d = proto::dispatcher_client::DispatcherClient::with_interceptor(
            channel(format!("http://{addr}")).await,
            bearer.clone(),
        );
        let mut wc = WorkerClient::with_interceptor(
            channel(format!("http://{}", w.addr)).await,
            bearer.clone(),
        );
        vec![
            d.status(proto::StatusRequest {}).await.map(|_| ()),
            d.register_worker(proto::RegisterWorkerRequest {
                protocol: proto::PROTOCOL,
                address: "127.0.0.1:9".into(),
                dataset: "synthetic:make".into(),
                code_version: "v1".into(),
                dataset_args: "{}".into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
            d.progress(proto::ProgressRequest {
                protocol: proto::PROTOCOL,
                job_id: theirs.job_id().to_string(),
                cursor_batch: 3,
                ..Default::default()
            })
            .await
            .map(|_| ()),
            d.digests(proto::DigestsRequest {
                job_id: theirs.job_id().to_string(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
            d.assign(proto::AssignRequest {
                protocol: proto::PROTOCOL,
                splits: vec![proto::SplitKey {
                    job_id: theirs.job_id().to_string(),
                    ..Default::default()
                }],
                from_batch: vec![0],
                world: 1,
            })
            .await
            .map(|_| ()),
            wc.probe(proto::ProbeRequest {
                worker_id: w.worker_id(),
            })
            .await
            .map(|_| ()),
            wc.produce(proto::ProduceRequest {
                protocol: proto::PROTOCOL,
                spec: Some(proto::JobSpec::from(&other)),
                world: 1,
                ..Default::default()
            })
            .await
            .map(|_| ()),
        ]
    });
    for r in refusals {
        let s = r.unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
        for secret in [
            "other:make",
            &w.worker_id(),
            &w.addr.to_string(),
            "test-token",
        ] {
            assert!(!s.message().contains(secret), "{s:?} names {secret}");
        }
    }
    // The service's own view: still one worker, and the other job's trainer
    // was not moved by the refused progress.
    let status = rt.block_on(async {
        token_holder(&addr)
            .await
            .status(proto::StatusRequest {})
            .await
            .unwrap()
            .into_inner()
    });
    assert_eq!(status.workers.len(), 1, "{status:?}");
    drop(theirs);
}

/// A raw gRPC client of the dispatcher at `addr` that gives the test token.
async fn token_holder(
    addr: &str,
) -> hindsight_data::proto::dispatcher_client::DispatcherClient<hindsight_data::auth::Authed> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    hindsight_data::proto::dispatcher_client::DispatcherClient::with_interceptor(
        channel,
        hindsight_data::auth::Bearer::new(&token()),
    )
}

/// Issue 42, item 2: what callers can make a dispatcher hold is bounded,
/// even with the token: live workers, distinct jobs, and progress only for
/// an attached job (it used to journal state for any job id). A flood of
/// registrations beyond the bound is refused without growing the journal.
#[test]
fn a_flood_of_registrations_jobs_and_progress_is_refused_beyond_the_bounds() {
    use hindsight_data::proto;
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = fast_options(dir.path());
    opts.max_workers = 8;
    opts.max_jobs = 2;
    let opts_timeout = opts.heartbeat_timeout;
    let d = rt.block_on(dispatcher::spawn("127.0.0.1:0", opts)).unwrap();
    let addr = d.addr.to_string();
    let journal = dir.path().join(hindsight_data::journal::FILE_NAME);
    rt.block_on(async {
        let mut c = token_holder(&addr).await;
        let register = |i: usize| proto::RegisterWorkerRequest {
            protocol: proto::PROTOCOL,
            address: format!("127.0.0.1:{}", 10_000 + i),
            dataset: "synthetic:make".into(),
            code_version: "v1".into(),
            dataset_args: "{}".into(),
            ..Default::default()
        };
        for i in 0..8 {
            c.register_worker(register(i)).await.unwrap();
        }
        let live_since = std::time::Instant::now();
        let size = std::fs::metadata(&journal).unwrap().len();
        // Up to 3000 more, while the 8 are surely live (they send no
        // heartbeats, so they expire after the timeout; a slow machine
        // floods for less, never past half of it).
        let mut refused = 0;
        for i in 8..3008 {
            if live_since.elapsed() > opts_timeout / 2 {
                break;
            }
            let s = c.register_worker(register(i)).await.unwrap_err();
            assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
            refused += 1;
        }
        assert!(refused >= 100, "only {refused} registrations in the flood");
        assert_eq!(
            std::fs::metadata(&journal).unwrap().len(),
            size,
            "refusals journal nothing"
        );
        // Progress of a job never attached leaves nothing behind.
        let s = c
            .progress(proto::ProgressRequest {
                protocol: proto::PROTOCOL,
                job_id: "no-such-job".into(),
                cursor_batch: 3,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(s.code(), tonic::Code::NotFound, "{s:?}");
        assert_eq!(std::fs::metadata(&journal).unwrap().len(), size);
        // Two jobs fit, a third is refused; a rank outside its world too.
        let attach = |len: u64, rank: u32, world: u32| proto::AttachRequest {
            protocol: proto::PROTOCOL,
            spec: Some(proto::JobSpec::from(&spec(len))),
            rank,
            world,
            ..Default::default()
        };
        c.attach(attach(40, 0, 1)).await.unwrap();
        c.attach(attach(48, 0, 1)).await.unwrap();
        let s = c.attach(attach(56, 0, 1)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
        let s = c.attach(attach(40, 5, 2)).await.unwrap_err();
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        // Once the silent workers are declared dead, there is room again.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        c.register_worker(register(9999)).await.unwrap();
    });
}

/// PEM files of a test authority and a certificate it signed for 127.0.0.1,
/// written to `dir`: (ca, cert, key).
fn certificates(
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

const TLS_NAMES: (&str, &str, &str) = ("CA", "CERT", "KEY");

#[test]
fn with_certificates_the_service_serves_over_tls_and_a_plain_text_caller_gets_nothing() {
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificates(dir.path());
    let server_tls =
        hindsight_data::Tls::from_files(Some(&ca), Some(&cert), Some(&key), TLS_NAMES).unwrap();
    let client_tls = hindsight_data::Tls::from_files(Some(&ca), None, None, TLS_NAMES).unwrap();
    let journal = dir.path().join("journal");
    let mut opts = fast_options(&journal);
    opts.tls = Some(server_tls.clone());
    let d = rt.block_on(dispatcher::spawn("127.0.0.1:0", opts)).unwrap();
    assert!(d.tls);
    let addr = d.addr.to_string();
    let mut wopts = worker_options(addr.clone());
    wopts.tls = Some(server_tls);
    let w = rt
        .block_on(worker::spawn(Synthetic::new(0), wopts))
        .unwrap();
    assert!(w.tls);
    // A trainer that trusts the authority reads the whole epoch, exactly.
    let spec = spec(40);
    let copts = ClientOptions {
        tls: Some(client_tls),
        ..client_options()
    };
    let mut c = Client::connect(&addr, spec.clone(), 0, 1, None, copts).unwrap();
    assert_eq!(read_epoch(&mut c, 0, |_| {}).unwrap(), expected(&spec, 0));
    c.close();
    // One that speaks plain text (even with the token) reaches nothing.
    let plain = ClientOptions {
        tls: Some(hindsight_data::Tls::off()),
        connect_timeout: Duration::from_secs(1),
        ..client_options()
    };
    let e = Client::connect(&addr, spec.clone(), 0, 1, None, plain).unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("HINDSIGHT_DATA_TLS_CA"), "{e}");
    // Nor does one that trusts another authority.
    let other = tempfile::tempdir().unwrap();
    let (other_ca, _, _) = certificates(other.path());
    let stranger = ClientOptions {
        tls: Some(hindsight_data::Tls::from_files(Some(&other_ca), None, None, TLS_NAMES).unwrap()),
        connect_timeout: Duration::from_secs(1),
        ..client_options()
    };
    let e = Client::connect(&addr, spec, 0, 1, None, stranger).unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains("HINDSIGHT_DATA_TLS_CA"), "{e}");
    drop(w);
    drop(d);
}

#[test]
fn half_given_tls_is_refused_naming_the_missing_setting() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificates(dir.path());
    let msg = |r: Result<hindsight_data::Tls, Error>| r.unwrap_err().to_string();
    let e = msg(hindsight_data::Tls::from_files(
        Some(&ca),
        Some(&cert),
        None,
        TLS_NAMES,
    ));
    assert!(e.contains("CERT is set but KEY is not"), "{e}");
    let e = msg(hindsight_data::Tls::from_files(
        None,
        Some(&cert),
        Some(&key),
        TLS_NAMES,
    ));
    assert!(e.contains("CA is not"), "{e}");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = msg(hindsight_data::Tls::from_files(
        Some(&junk),
        None,
        None,
        TLS_NAMES,
    ));
    assert!(e.contains("junk.pem") && e.contains("not PEM"), "{e}");
    // A server that is told to use TLS but has no certificate does not
    // start in plain text.
    let rt = runtime();
    let mut opts = fast_options(&dir.path().join("journal"));
    opts.tls = Some(hindsight_data::Tls::from_files(Some(&ca), None, None, TLS_NAMES).unwrap());
    let e = rt
        .block_on(dispatcher::spawn("127.0.0.1:0", opts))
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no certificate"), "{e}");
}
