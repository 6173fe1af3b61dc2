//! hindsight input service (seed 002): every example exactly once per epoch,
//! in a reproducible order, across worker failures.
//!
//! - [`order`]: job identity, the stateless epoch permutation, batches,
//!   splits and rank slices, per-example random seeds.
//! - [`journal`]: the dispatcher's append-only, checksummed journal.
//! - [`shared`]: same-host payload handoff through shared memory.
//! - [`recovery`]: worker checkpoints of split read state, and when they pay.

pub mod auth;
pub mod client;
pub mod dispatcher;
pub mod error;
pub mod journal;
pub mod order;
pub mod proto;
pub mod recovery;
pub mod shared;
pub mod tls;
pub mod worker;

pub use error::{Error, ErrorKind, Result};
pub use tls::Tls;

/// What to say when a server of the input service listens where other
/// machines reach it without TLS: every call must carry the service token,
/// but calls travel unencrypted, so the token and the data can be read on
/// the way. Loopback (the default) and TLS say nothing.
pub fn exposure_note(what: &str, addr: &std::net::SocketAddr, tls: bool) -> Option<String> {
    (!addr.ip().is_loopback() && !tls).then(|| {
        format!(
            "{what}: listening on {addr}, which other machines can reach; calls must carry the service \
             token but travel unencrypted: use it only on a network you trust, or give certificates \
             (HINDSIGHT_DATA_TLS_CA, _CERT, _KEY) to serve over TLS (the default, 127.0.0.1, serves this \
             machine alone)"
        )
    })
}

/// A runtime for one service part. Four threads: a journal fsync or the
/// user's pipeline may hold one, heartbeats and probes must still run.
pub(crate) fn runtime(what: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .thread_name(format!("hindsight-data-{what}"))
        .enable_all()
        .build()
        .map_err(|e| Error::Io {
            what: format!("start the {what} runtime"),
            source: e,
        })
}

/// A service part (dispatcher or worker) with its own runtime, for callers
/// that are not async (the Python binding, command-line tools).
#[derive(Debug)]
pub struct Running<H> {
    rt: Option<tokio::runtime::Runtime>,
    handle: Option<H>,
    pid: u32,
}

impl<H> Running<H> {
    pub(crate) fn new(
        what: &str,
        start: impl std::future::Future<Output = Result<H>>,
    ) -> Result<Self> {
        let rt = runtime(what)?;
        let handle = rt.block_on(start)?;
        Ok(Running {
            rt: Some(rt),
            handle: Some(handle),
            pid: std::process::id(),
        })
    }

    pub fn handle(&self) -> Option<&H> {
        self.handle.as_ref()
    }

    /// Stop serving. In a forked child the parent's threads are not
    /// there: the runtime is leaked rather than touched.
    pub fn stop(&mut self) {
        let handle = self.handle.take();
        if std::process::id() != self.pid {
            std::mem::forget(handle);
            if let Some(rt) = self.rt.take() {
                std::mem::forget(rt);
            }
            return;
        }
        drop(handle);
        if let Some(rt) = self.rt.take() {
            // Wait (briefly) for the tasks to be dropped: the dispatcher's
            // journal lock goes with them, so a restart can follow at once.
            rt.shutdown_timeout(std::time::Duration::from_secs(2));
        }
    }
}

impl<H> Drop for Running<H> {
    fn drop(&mut self) {
        self.stop();
    }
}
