//! Checkpoints on object storage (cargo feature `s3`): one implementation over
//! `Arc<dyn ObjectStore>`, the backend chosen by the URL's scheme in
//! [`connect`] (S3 and S3-compatible servers, Azure Blob Storage, XRootD). Everything below the
//! connection (layout, atomic commit, leases, listing, errors) is generic.
//!
//! Layout under `SCHEME://BUCKET/PREFIX` (the same names as a local store):
//! ```text
//! PREFIX/HINDSIGHT.json        store options
//! PREFIX/chunks/ab/cdef...     content-addressed chunks
//! PREFIX/manifests/NAME.hsm    committed checkpoints
//! PREFIX/locks/gc              held by a running gc (lease)
//! PREFIX/locks/writer-ID       one per save in progress (lease)
//! ```
//!
//! **Atomic commit.** A PUT of one object is atomic on S3: readers see the old
//! object or the complete new one, never part of it, and the object is durable
//! when the PUT returns. Every chunk and manifest is written with a single PUT
//! (a chunk is at most 1 GiB, well under S3's 5 GiB single-PUT limit), so
//! [`Storage::sync`] has nothing to do. The commit protocol of the writer is
//! unchanged: all chunks first, then the manifest PUT. A save interrupted at any
//! instant therefore has no manifest and is never listed; the chunks it did
//! upload are unreferenced and the next gc removes them.
//!
//! **gc coordination with leases.** S3 has no `flock`, so the shared/exclusive
//! lock is built from small *lease* objects under `PREFIX/locks/`:
//!
//! * A save (shared lock) PUTs `locks/writer-ID`, then checks `locks/gc`. If a
//!   fresh gc lease exists it deletes its own lease and waits (with backoff) until
//!   the gc is done; otherwise it holds the lock until its guard is dropped,
//!   which deletes the lease.
//! * gc (exclusive lock) creates `locks/gc` with a conditional PUT
//!   (`If-None-Match: *`, so only one gc wins), then waits until no fresh
//!   `locks/writer-*` lease exists. Both sides write their own lease before
//!   reading the other's, and S3 is strongly consistent, so at least one of
//!   them sees the other: a save never runs while gc deletes chunks.
//! * A lease is *fresh* while its object was written less than the lease timeout
//!   ago ([`DEFAULT_LEASE_TIMEOUT`], 10 minutes), measured on the server's clock
//!   (`Last-Modified`, corrected for the local clock's offset). Holders renew
//!   their lease every tenth of the timeout from a background task, so only the
//!   lease of a crashed (or frozen) process goes stale. gc deletes stale writer
//!   leases before deleting any chunk and reports them as staging leftovers; a
//!   stale gc lease is replaced by the next gc.
//! * A writer renews its lease once more, conditionally (`If-Match` on the ETag it
//!   last wrote), right before its manifest PUT. If a gc took it for dead and
//!   deleted the lease meanwhile (its new chunks may be gone), the save fails
//!   instead of committing a checkpoint with missing chunks.
//!
//! Consequences: after a crash (SIGKILL, lost node) a gc waits up to the lease
//! timeout for that writer's lease to go stale; saves wait while a gc runs. The
//! bucket must support conditional PUT (`If-None-Match` / `If-Match`): AWS S3,
//! MinIO, Cloudflare R2, moto and most current implementations do.
//!
//! Connection settings come from the standard AWS environment variables
//! (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_SESSION_TOKEN`, `AWS_REGION` / `AWS_DEFAULT_REGION`, ...); plain HTTP is
//! allowed when the endpoint is an `http://` URL.

use std::fmt;
use std::future::Future;
use std::io::{self, Cursor, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{
    ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion,
};

use crate::checkpoint::format::ChunkId;
use crate::checkpoint::layout;
use crate::checkpoint::location::{ObjectUrl, Scheme};
use crate::checkpoint::storage::{LockGuard, Storage, CONFIG_FILE};
use crate::error::{Error, Result};
use crate::sync::lock;
use object_store::azure::MicrosoftAzureBuilder;

/// A lease not renewed for this long belongs to a dead process.
pub const DEFAULT_LEASE_TIMEOUT: Duration = Duration::from_secs(600);

const GC_LEASE: &str = "gc";
const WRITER_PREFIX: &str = "writer-";
const CLOCK_PREFIX: &str = "clock-";

/// A store's objects in one bucket (or container), under one prefix.
#[derive(Debug)]
pub struct ObjectStorage {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` only while dropping.
    rt: Option<tokio::runtime::Runtime>,
    store: Arc<dyn ObjectStore>,
    /// `SCHEME://BUCKET`: object keys are named under it in messages.
    root: String,
    base: Key,
    url: String,
    lease_timeout: Duration,
    owner_pid: u32,
    /// Server clock minus local clock (ms), measured on first use.
    skew_ms: Mutex<Option<i64>>,
    /// Writer leases held through this instance, re-validated before every manifest PUT.
    leases: Mutex<Vec<Arc<Lease>>>,
    /// The gc lease held through this instance, checked before every chunk delete.
    gc_lease: Mutex<Option<Arc<Lease>>>,
    /// Stale writer leases removed since the last `clean_staging`.
    reaped: AtomicU64,
    /// A new store's chunk size (see [`Storage::preferred_chunk_size`]).
    chunk_size: Option<usize>,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStorage")
            .field("url", &self.url)
            .field("lease_timeout", &self.lease_timeout)
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            if std::process::id() == self.owner_pid {
                rt.shutdown_background();
            } else {
                // A forked child has none of the runtime's threads; joining them would hang.
                std::mem::forget(rt);
            }
        }
    }
}

/// One lease object and what its holder last wrote there.
#[derive(Debug)]
struct Lease {
    key: Key,
    kind: &'static str,
    /// ETag of our last write; `None` once released. Held across a renewal so
    /// renewals and the release never interleave.
    etag: tokio::sync::Mutex<Option<String>>,
    /// Set when a renewal found the lease deleted or replaced.
    lost: AtomicBool,
    renewals: AtomicU64,
    /// Wall-clock time (ms) of our last successful write of the lease.
    renewed_ms: AtomicI64,
}

impl Lease {
    fn body(&self) -> PutPayload {
        let body = serde_json::json!({
            "kind": self.kind,
            "host": hostname(),
            "pid": std::process::id(),
            "renewed_ms": now_ms(),
            "renewal": self.renewals.fetch_add(1, Ordering::Relaxed),
        });
        PutPayload::from(body.to_string())
    }

    /// Rewrite the lease if it is still the one we wrote last (If-Match).
    /// Ok(false): it was deleted or replaced, so it is lost.
    async fn renew(
        &self,
        store: &dyn ObjectStore,
    ) -> std::result::Result<bool, object_store::Error> {
        let mut etag = self.etag.lock().await;
        if etag.is_none() || self.lost.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let mode = PutMode::Update(UpdateVersion {
            e_tag: etag.clone(),
            version: None,
        });
        match store.put_opts(&self.key, self.body(), mode.into()).await {
            Ok(r) => {
                *etag = r.e_tag;
                self.renewed_ms.store(now_ms(), Ordering::Relaxed);
                Ok(true)
            }
            Err(
                object_store::Error::Precondition { .. } | object_store::Error::NotFound { .. },
            ) => {
                self.lost.store(true, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A name no other process (on any host) picks: hash of host, pid, time, counter.
fn unique_id() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let seed = format!(
        "{}/{}/{nanos}/{}",
        hostname(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let h = blake3::hash(seed.as_bytes()).to_hex();
    format!("{}-{}", std::process::id(), &h[..12])
}

/// Sleeps 50 ms, doubling up to 1 s.
struct Backoff(Duration);
impl Backoff {
    fn new() -> Self {
        Backoff(Duration::from_millis(50))
    }
    fn sleep(&mut self) {
        std::thread::sleep(self.0);
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
    }
}

/// The backend for `url`'s scheme: the one place a scheme becomes a client.
/// Makes no request: a wrong endpoint or credentials show up at the first
/// operation.
pub fn connect(url: &ObjectUrl) -> Result<Arc<dyn ObjectStore>> {
    let refused = |e: object_store::Error| {
        Error::invalid(
            "store URL",
            format!("{url}: cannot configure {} access: {e}", url.scheme.name()),
        )
    };
    match url.scheme {
        Scheme::S3 => {
            // Settings from the standard AWS environment variables; plain
            // HTTP when the endpoint is an http:// URL (a server on loopback).
            let mut builder = AmazonS3Builder::from_env().with_bucket_name(&url.bucket);
            let endpoint = ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
                .iter()
                .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
            if endpoint.is_some_and(|e| e.starts_with("http://")) {
                builder = builder.with_allow_http(true);
            }
            Ok(Arc::new(builder.build().map_err(refused)?))
        }
        Scheme::Azure => {
            // Settings from the standard AZURE_STORAGE_* variables
            // (AZURE_STORAGE_USE_EMULATOR=true: Azurite, at
            // AZURITE_BLOB_STORAGE_URL or 127.0.0.1:10000, over plain HTTP).
            let builder = MicrosoftAzureBuilder::from_env().with_container_name(&url.bucket);
            let emulator = std::env::var("AZURE_STORAGE_USE_EMULATOR")
                .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true"));
            Ok(Arc::new(
                builder.with_allow_http(emulator).build().map_err(refused)?,
            ))
        }
        // The XRootD client's tools, with the user's own security settings
        // (X509_USER_PROXY, BEARER_TOKEN, XrdSecSSSKT, ...).
        Scheme::Xrootd => Ok(Arc::new(crate::checkpoint::xrootd::Xrootd::new(
            &url.bucket,
        ))),
    }
}

impl ObjectStorage {
    /// Connect to `SCHEME://bucket/prefix` (see [`connect`]).
    pub fn open(url: &str) -> Result<ObjectStorage> {
        ObjectStorage::open_parsed(&ObjectUrl::parse(url, "store URL")?)
    }

    /// [`ObjectStorage::open`] of a URL parsed by `Location`.
    pub fn open_parsed(url: &ObjectUrl) -> Result<ObjectStorage> {
        let store = connect(url)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hindsight-objects")
            .enable_all()
            .build()
            .map_err(|e| Error::io("<object store runtime>", e))?;
        Ok(ObjectStorage {
            inner: Arc::new(Inner {
                rt: Some(rt),
                store,
                root: url.root(),
                base: Key::from(url.prefix.as_str()),
                url: url.to_string(),
                lease_timeout: DEFAULT_LEASE_TIMEOUT,
                owner_pid: std::process::id(),
                skew_ms: Mutex::new(None),
                leases: Mutex::new(Vec::new()),
                gc_lease: Mutex::new(None),
                reaped: AtomicU64::new(0),
                // Each XRootD object is a few client processes (about 20 ms
                // each): 32 MiB chunks keep that under a tenth of the
                // transfer (docs/xrootd.md).
                chunk_size: match url.scheme {
                    Scheme::Xrootd => Some(crate::checkpoint::xrootd::CHUNK_SIZE),
                    _ => None,
                },
            }),
        })
    }

    /// Change the lease timeout (tests; at least 3 s, as `Last-Modified` has a
    /// resolution of one second). Every process sharing a store must use the
    /// same timeout, or a gc may take a live save for dead.
    pub fn with_lease_timeout(mut self, timeout: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.lease_timeout = timeout.max(Duration::from_secs(3));
        }
        self
    }

    pub fn url(&self) -> &str {
        &self.inner.url
    }
}

impl Inner {
    fn block_on<F: Future>(&self, f: F) -> Result<F::Output> {
        let current = std::process::id();
        match &self.rt {
            Some(rt) if current == self.owner_pid => Ok(rt.block_on(f)),
            _ => Err(Error::WrongProcess {
                path: self.url.clone().into(),
                owner: self.owner_pid,
                current,
            }),
        }
    }

    fn key(&self, parts: &[&str]) -> Key {
        let mut k = self.base.clone();
        k.extend(parts.iter().copied());
        k
    }

    fn chunk_key(&self, id: &ChunkId) -> Key {
        let (fan, file) = layout::chunk_parts(id);
        self.key(&[layout::CHUNKS, &fan, &file])
    }

    fn manifest_key(&self, name: &str) -> Key {
        self.key(&[layout::MANIFESTS, &layout::manifest_file(name)])
    }

    /// The object's URL, for messages.
    fn url_of(&self, key: &Key) -> PathBuf {
        PathBuf::from(format!("{}/{key}", self.root))
    }

    fn err(&self, key: &Key, e: object_store::Error) -> Error {
        let path = self.url_of(key);
        match e {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => Error::PermissionDenied {
                path,
                source: io::Error::new(io::ErrorKind::PermissionDenied, e),
            },
            object_store::Error::Precondition { .. } => Error::Precondition {
                path,
                source: io::Error::other(e),
            },
            object_store::Error::NotFound { .. } => Error::Io {
                path,
                source: io::Error::new(io::ErrorKind::NotFound, e),
            },
            _ => Error::Io {
                path,
                source: io::Error::other(e),
            },
        }
    }

    fn head(&self, key: &Key) -> Result<Option<ObjectMeta>> {
        match self.block_on(self.store.head(key))? {
            Ok(m) => Ok(Some(m)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(key, e)),
        }
    }

    /// GET a whole object; Ok(None) when it does not exist.
    fn get(&self, key: &Key) -> Result<Option<Bytes>> {
        let r = self.block_on(async {
            match self.store.get(key).await {
                Ok(r) => r.bytes().await,
                Err(e) => Err(e),
            }
        })?;
        match r {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err(key, e)),
        }
    }

    fn put(&self, key: &Key, payload: PutPayload) -> Result<()> {
        self.block_on(self.store.put(key, payload))?
            .map(|_| ())
            .map_err(|e| self.err(key, e))
    }

    fn delete(&self, key: &Key) -> Result<()> {
        match self.block_on(self.store.delete(key))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(key, e)),
        }
    }

    fn list(&self, dir: &Key) -> Result<Vec<ObjectMeta>> {
        self.block_on(self.store.list(Some(dir)).try_collect::<Vec<_>>())?
            .map_err(|e| self.err(dir, e))
    }

    /// The server's clock now (ms since the epoch), from the local clock and
    /// the offset measured once by writing a probe object.
    fn server_now_ms(&self) -> Result<i64> {
        let mut skew = lock(&self.skew_ms);
        if skew.is_none() {
            let key = self.key(&["locks", &format!("{CLOCK_PREFIX}{}", unique_id())]);
            let before = now_ms();
            self.put(&key, PutPayload::from_static(b"clock probe"))?;
            let meta = self.head(&key)?;
            let after = now_ms();
            let _ = self.delete(&key);
            let meta = meta.ok_or_else(|| {
                self.err(
                    &key,
                    object_store::Error::Generic {
                        store: "object store",
                        source:
                            "a just-written object is missing (is the store strongly consistent?)"
                                .into(),
                    },
                )
            })?;
            // Last-Modified is truncated to whole seconds: add half a second.
            *skew = Some(meta.last_modified.timestamp_millis() + 500 - (before + after) / 2);
        }
        Ok(now_ms() + skew.unwrap_or(0))
    }

    fn is_stale(&self, meta: &ObjectMeta, server_now: i64) -> bool {
        server_now - meta.last_modified.timestamp_millis() > self.lease_timeout.as_millis() as i64
    }

    /// Renew every this often: a tenth of the timeout.
    fn renew_every(&self) -> Duration {
        self.lease_timeout / 10
    }

    /// The gc lease, if one exists and is fresh.
    fn fresh_gc_lease(&self) -> Result<Option<ObjectMeta>> {
        let Some(meta) = self.head(&self.key(&["locks", GC_LEASE]))? else {
            return Ok(None);
        };
        let now = self.server_now_ms()?;
        Ok((!self.is_stale(&meta, now)).then_some(meta))
    }

    /// Create a lease object (PutMode::Create when `exclusive`). Ok(None): it exists.
    fn write_lease(
        &self,
        key: Key,
        kind: &'static str,
        exclusive: bool,
    ) -> Result<Option<Arc<Lease>>> {
        let lease = Arc::new(Lease {
            key,
            kind,
            etag: tokio::sync::Mutex::new(None),
            lost: AtomicBool::new(false),
            renewals: AtomicU64::new(0),
            renewed_ms: AtomicI64::new(now_ms()),
        });
        let mode = if exclusive {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let opts = PutOptions::from(mode);
        match self.block_on(self.store.put_opts(&lease.key, lease.body(), opts))? {
            Ok(r) => {
                *lease.etag.blocking_lock() = r.e_tag;
                Ok(Some(lease))
            }
            Err(object_store::Error::AlreadyExists { .. }) => Ok(None),
            Err(e @ object_store::Error::NotImplemented { .. }) => Err(Error::invalid(
                "store URL",
                format!(
                    "{}: the gc lock needs conditional PUT (If-None-Match), which this S3 configuration lacks: {e}",
                    self.url
                ),
            )),
            Err(e) => Err(self.err(&lease.key, e)),
        }
    }

    /// Turn a written lease into a guard that renews it in the background.
    fn hold(self: &Arc<Self>, lease: Arc<Lease>, writer: bool) -> Result<Box<dyn LockGuard>> {
        let store = self.store.clone();
        let every = self.renew_every();
        let l = lease.clone();
        let rt = self.rt.as_ref().ok_or_else(|| Error::Closed {
            location: format!("store {}", self.url),
            what: "cannot take a lease".into(),
        })?;
        let heartbeat = rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                // Transient errors: try again next time (the timeout leaves room).
                if let Ok(false) = l.renew(store.as_ref()).await {
                    return;
                }
            }
        });
        if writer {
            lock(&self.leases).push(lease.clone());
        } else {
            *lock(&self.gc_lease) = Some(lease.clone());
        }
        Ok(Box::new(LeaseGuard {
            inner: self.clone(),
            lease,
            heartbeat: Some(heartbeat),
            writer,
        }))
    }

    /// Delete stale writer leases; Ok(number of fresh ones).
    fn reap_writer_leases(&self) -> Result<usize> {
        let dir = self.key(&["locks"]);
        let metas = self.list(&dir)?;
        let now = self.server_now_ms()?;
        let mut fresh = 0;
        for m in metas {
            let name = m.location.filename().unwrap_or_default();
            let stale = self.is_stale(&m, now);
            if name.starts_with(WRITER_PREFIX) {
                if stale {
                    self.delete(&m.location)?;
                    self.reaped.fetch_add(1, Ordering::Relaxed);
                } else {
                    fresh += 1;
                }
            } else if name.starts_with(CLOCK_PREFIX) && stale {
                // A clock probe of a process killed while measuring.
                self.delete(&m.location)?;
            }
        }
        Ok(fresh)
    }

    /// Fails when `lease` may have looked stale to other processes: no
    /// successful renewal for half the timeout (renewals run every tenth), which
    /// only happens when this process was paused (SIGSTOP, suspend) or cut off.
    fn check_current(&self, lease: &Lease) -> Result<()> {
        let age = now_ms() - lease.renewed_ms.load(Ordering::Relaxed);
        let limit = self.lease_timeout.as_millis() as i64 / 2;
        if lease.lost.load(Ordering::Relaxed) || age > limit {
            return Err(self.lease_error(lease, age));
        }
        Ok(())
    }

    fn lease_error(&self, lease: &Lease, age_ms: i64) -> Error {
        let what = if lease.kind == "gc" {
            "this gc's lease went stale or was replaced, so saves may have started: gc stopped; run it again"
        } else {
            "this save's lease went stale or was removed by a gc that took the save for dead; \
             chunks it wrote may be gone, so nothing was committed: save again"
        };
        Error::LeaseLost {
            path: self.url_of(&lease.key),
            detail: format!(
                "{what} (last renewed {} s ago; leases expire after {} s)",
                age_ms / 1000,
                self.lease_timeout.as_secs()
            ),
        }
    }

    /// Before a manifest PUT: every writer lease held here must still be ours
    /// and never have looked stale; renewing it (If-Match) proves the first.
    fn check_leases(&self) -> Result<()> {
        let leases: Vec<Arc<Lease>> = lock(&self.leases).clone();
        for lease in leases {
            self.check_current(&lease)?;
            let before = lease.renewed_ms.load(Ordering::Relaxed);
            let ok = self
                .block_on(lease.renew(self.store.as_ref()))?
                .map_err(|e| self.err(&lease.key, e))?;
            if !ok {
                return Err(self.lease_error(&lease, now_ms() - before));
            }
        }
        Ok(())
    }

    /// Before a chunk delete under the gc lease: it must still be current.
    fn check_gc_lease(&self) -> Result<()> {
        match lock(&self.gc_lease).clone() {
            Some(lease) => self.check_current(&lease),
            None => Ok(()),
        }
    }
}

/// Deletes its lease when dropped (after stopping the renewals).
struct LeaseGuard {
    inner: Arc<Inner>,
    lease: Arc<Lease>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    writer: bool,
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("lease", &self.inner.url_of(&self.lease.key))
            .finish_non_exhaustive()
    }
}

impl LockGuard for LeaseGuard {}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.writer {
            lock(&self.inner.leases).retain(|l| !Arc::ptr_eq(l, &self.lease));
        } else {
            let mut gc = lock(&self.inner.gc_lease);
            if gc.as_ref().is_some_and(|l| Arc::ptr_eq(l, &self.lease)) {
                *gc = None;
            }
        }
        let lease = self.lease.clone();
        let heartbeat = self.heartbeat.take();
        // Best effort: a lease left behind goes stale after the timeout.
        let _ = self.inner.block_on(async {
            // Waits for a renewal in flight, so none lands after the delete.
            let was_ours = lease.etag.lock().await.take().is_some();
            if let Some(h) = heartbeat {
                h.abort();
            }
            if was_ours && !lease.lost.load(Ordering::Relaxed) {
                let _ = self.inner.store.delete(&lease.key).await;
            }
        });
    }
}

impl Storage for ObjectStorage {
    fn location(&self) -> String {
        self.inner.url.clone()
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        self.inner.url_of(&self.inner.chunk_key(id))
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        self.inner.url_of(&self.inner.manifest_key(name))
    }

    fn config_path(&self) -> PathBuf {
        self.inner.url_of(&self.inner.key(&[CONFIG_FILE]))
    }

    fn has_chunk(&self, id: &ChunkId) -> Result<bool> {
        Ok(self.inner.head(&self.inner.chunk_key(id))?.is_some())
    }

    /// One PUT. `Store::put_chunk` already skipped chunks that exist (a HEAD via
    /// `has_chunk`); a concurrent save of the same content writes identical bytes.
    fn put_chunk(&self, id: &ChunkId, parts: &[&[u8]]) -> Result<()> {
        let payload: PutPayload = parts.iter().map(|p| Bytes::copy_from_slice(p)).collect();
        self.inner.put(&self.inner.chunk_key(id), payload)
    }

    fn open_chunk(&self, id: &ChunkId) -> Result<Box<dyn Read + Send>> {
        let key = self.inner.chunk_key(id);
        match self.inner.get(&key)? {
            Some(b) => Ok(Box::new(Cursor::new(b))),
            None => Err(Error::corrupt(
                self.inner.url_of(&key),
                "chunk object is missing",
            )),
        }
    }

    fn list_chunks(&self) -> Result<Vec<(ChunkId, u64)>> {
        let dir = self.inner.key(&[layout::CHUNKS]);
        let mut out = Vec::new();
        for m in self.inner.list(&dir)? {
            let Some(parts) = m.location.prefix_match(&dir) else {
                continue;
            };
            let parts: Vec<_> = parts.collect();
            if let [fan, rest] = &parts[..] {
                if let Some(id) = layout::chunk_from_parts(fan.as_ref(), rest.as_ref()) {
                    out.push((id, m.size));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete_chunk(&self, id: &ChunkId) -> Result<()> {
        self.inner.check_gc_lease()?;
        self.inner.delete(&self.inner.chunk_key(id))
    }

    fn preferred_chunk_size(&self) -> Option<usize> {
        self.inner.chunk_size
    }

    /// Nothing to do: a PUT is durable when it returns.
    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn put_manifest(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.check_leases()?;
        self.inner.put(
            &self.inner.manifest_key(name),
            PutPayload::from(Bytes::copy_from_slice(bytes)),
        )
    }

    fn get_manifest(&self, name: &str) -> Result<Vec<u8>> {
        match self.inner.get(&self.inner.manifest_key(name))? {
            Some(b) => Ok(b.to_vec()),
            None => Err(Error::NotFound {
                what: "checkpoint",
                name: name.to_string(),
                location: format!("store {}", self.inner.url),
            }),
        }
    }

    fn list_manifests(&self) -> Result<Vec<String>> {
        let dir = self.inner.key(&[layout::MANIFESTS]);
        let mut out = Vec::new();
        for m in self.inner.list(&dir)? {
            let Some(parts) = m.location.prefix_match(&dir) else {
                continue;
            };
            let parts: Vec<_> = parts.collect();
            if let [file] = &parts[..] {
                if let Some(stem) = layout::manifest_name(file.as_ref()) {
                    out.push(stem.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete_manifest(&self, name: &str) -> Result<bool> {
        // DELETE does not say whether the object existed; ask first.
        let key = self.inner.manifest_key(name);
        if self.inner.head(&key)?.is_none() {
            return Ok(false);
        }
        self.inner.delete(&key)?;
        Ok(true)
    }

    fn manifest_size(&self, name: &str) -> Result<u64> {
        let key = self.inner.manifest_key(name);
        match self.inner.head(&key)? {
            Some(m) => Ok(m.size),
            None => Err(Error::NotFound {
                what: "checkpoint",
                name: name.into(),
                location: self.location(),
            }),
        }
    }

    fn lock_shared(&self) -> Result<Box<dyn LockGuard>> {
        let inner = &self.inner;
        let mut backoff = Backoff::new();
        loop {
            // Do not even announce ourselves while a gc runs.
            if inner.fresh_gc_lease()?.is_some() {
                backoff.sleep();
                continue;
            }
            let key = inner.key(&["locks", &format!("{WRITER_PREFIX}{}", unique_id())]);
            let Some(lease) = inner.write_lease(key, "writer", false)? else {
                continue; // cannot happen for an overwrite; try another name
            };
            // Our lease is visible now; a gc that created its lease before this
            // point may have missed it, so look again and yield to it.
            if inner.fresh_gc_lease()?.is_some() {
                *lease.etag.blocking_lock() = None;
                inner.delete(&lease.key)?;
                backoff.sleep();
                continue;
            }
            return inner.hold(lease, true);
        }
    }

    fn lock_exclusive(&self) -> Result<Box<dyn LockGuard>> {
        let inner = &self.inner;
        let key = inner.key(&["locks", GC_LEASE]);
        let mut backoff = Backoff::new();
        let lease = loop {
            if let Some(lease) = inner.write_lease(key.clone(), "gc", true)? {
                break lease;
            }
            // Another gc holds it, or one that died: replace a stale lease.
            match inner.head(&key)? {
                Some(meta) if inner.is_stale(&meta, inner.server_now_ms()?) => {
                    inner.delete(&key)?
                }
                Some(_) => backoff.sleep(),
                None => {}
            }
        };
        // From here the guard releases the gc lease, also on error.
        let guard = inner.hold(lease, false)?;
        let mut backoff = Backoff::new();
        // Wait for running saves; remove the leases of dead ones before any
        // chunk is deleted, so a frozen writer that wakes up cannot commit.
        while inner.reap_writer_leases()? > 0 {
            backoff.sleep();
        }
        Ok(guard)
    }

    /// No staging objects exist on S3 (an interrupted PUT leaves nothing);
    /// the leftovers of crashed writers are their stale leases. Returns how
    /// many were removed since the last call (including by `lock_exclusive`).
    fn clean_staging(&self) -> Result<u64> {
        self.inner.reap_writer_leases()?;
        Ok(self.inner.reaped.swap(0, Ordering::Relaxed))
    }

    fn get_config(&self) -> Result<Option<Vec<u8>>> {
        Ok(self
            .inner
            .get(&self.inner.key(&[CONFIG_FILE]))?
            .map(|b| b.to_vec()))
    }

    fn put_config(&self, bytes: &[u8]) -> Result<()> {
        self.inner.put(
            &self.inner.key(&[CONFIG_FILE]),
            PutPayload::from(Bytes::copy_from_slice(bytes)),
        )
    }
}
