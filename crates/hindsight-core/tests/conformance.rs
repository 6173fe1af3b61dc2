//! Storage conformance suite: every [`Storage`] backend must pass
//! [`check_backend`] (and [`check_staging_cleanup`] with a backend-specific way
//! to leave staging leftovers behind). Add a backend by adding one `#[test]`
//! that calls them with a factory for fresh, empty instances.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns are not covered by allow-unwrap-in-tests

use std::fs;
use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use hindsight_core::checkpoint::format::{chunk_header, Codec};
use hindsight_core::{ChunkId, Error, LocalStorage, Storage};

/// An encoded raw chunk file for `raw`, as the store would write it.
fn encoded(raw: &[u8]) -> (ChunkId, Vec<u8>, Vec<u8>) {
    (
        ChunkId::of(raw),
        chunk_header(Codec::Raw, raw.len() as u64).to_vec(),
        raw.to_vec(),
    )
}

fn read_all(s: &dyn Storage, id: &ChunkId) -> Vec<u8> {
    let mut r = s.open_chunk(id).expect("open_chunk");
    let mut out = Vec::new();
    r.read_to_end(&mut out).expect("read chunk");
    out
}

/// Run every generic check; `make` returns a fresh, empty backend each call.
pub fn check_backend(make: impl Fn() -> Arc<dyn Storage>) {
    chunk_round_trip(&*make());
    put_existing_chunk_is_harmless(&*make());
    list_chunks_reports_ids_and_sizes(&*make());
    delete_chunk_is_idempotent(&*make());
    quarantined_chunk_is_out_of_use_and_can_be_written_again(&*make());
    manifests(&*make());
    missing_manifest_is_not_found(&*make());
    sync_works(&*make());
    shared_lock_is_shared(make());
    clean_staging_keeps_committed_data(&*make());
}

/// `plant` leaves at least one staging leftover in the backend (the way a crashed
/// writer would) and returns how many it left; `clean_staging` must remove them.
pub fn check_staging_cleanup(
    make: impl Fn() -> Arc<dyn Storage>,
    plant: impl Fn(&dyn Storage) -> u64,
) {
    let s = make();
    let (id, h, p) = encoded(b"committed chunk");
    s.put_chunk(&id, &[&h, &p]).unwrap();
    s.sync().unwrap();
    s.put_manifest("keep", b"manifest").unwrap();
    let n = plant(&*s);
    assert!(n > 0, "plant must leave something to clean");
    let _g = s.lock_exclusive().unwrap();
    assert_eq!(s.clean_staging().unwrap(), n);
    assert_eq!(s.clean_staging().unwrap(), 0, "second clean finds nothing");
    assert!(s.has_chunk(&id).unwrap());
    assert_eq!(read_all(&*s, &id), [h, p].concat());
    assert_eq!(s.get_manifest("keep").unwrap(), b"manifest");
}

fn chunk_round_trip(s: &dyn Storage) {
    assert!(!s.location().is_empty());
    for raw in [&b""[..], b"x", &[7u8; 10_000][..]] {
        let (id, h, p) = encoded(raw);
        assert!(!s.has_chunk(&id).unwrap());
        s.put_chunk(&id, &[&h, &p]).unwrap();
        assert!(s.has_chunk(&id).unwrap());
        assert_eq!(read_all(s, &id), [h, p].concat());
    }
    // Parts are concatenated, however many there are.
    let id = ChunkId::of(b"three parts");
    s.put_chunk(&id, &[b"ab", b"", b"cd"]).unwrap();
    assert_eq!(read_all(s, &id), b"abcd");

    // A missing chunk is an error naming it, never an empty read.
    let missing = ChunkId::of(b"never stored");
    assert!(!s.has_chunk(&missing).unwrap());
    let e = s.open_chunk(&missing).err().expect("missing chunk opens");
    let hex = missing.to_hex();
    assert!(e.to_string().contains(&hex[2..]), "{e}");
    let p1 = s.chunk_path(&id);
    assert_ne!(p1, s.chunk_path(&missing));
    assert!(p1.to_string_lossy().contains(&id.to_hex()[2..]));
}

fn put_existing_chunk_is_harmless(s: &dyn Storage) {
    let (id, h, p) = encoded(&[42u8; 5000]);
    s.put_chunk(&id, &[&h, &p]).unwrap();
    s.put_chunk(&id, &[&h, &p]).unwrap();
    assert!(s.has_chunk(&id).unwrap());
    assert_eq!(read_all(s, &id), [&h[..], &p[..]].concat());
    assert_eq!(s.list_chunks().unwrap().len(), 1);
}

fn list_chunks_reports_ids_and_sizes(s: &dyn Storage) {
    assert!(s.list_chunks().unwrap().is_empty());
    let mut want = Vec::new();
    for n in [0usize, 1, 100, 4096, 70_000] {
        let raw: Vec<u8> = (0..n).map(|i| (i * 31 + n) as u8).collect();
        let (id, h, p) = encoded(&raw);
        s.put_chunk(&id, &[&h, &p]).unwrap();
        want.push((id, (h.len() + p.len()) as u64));
    }
    s.sync().unwrap();
    // Manifests are not chunks.
    s.put_manifest("m", b"not a chunk").unwrap();
    let mut got = s.list_chunks().unwrap();
    got.sort();
    want.sort();
    assert_eq!(got, want);
}

fn quarantined_chunk_is_out_of_use_and_can_be_written_again(s: &dyn Storage) {
    let (a, ha, pa) = encoded(b"rotten chunk");
    s.put_chunk(&a, &[&ha, &pa]).unwrap();
    s.sync().unwrap();
    s.quarantine_chunk(&a).unwrap();
    assert!(!s.has_chunk(&a).unwrap(), "dedup must not find it");
    assert!(s.list_chunks().unwrap().iter().all(|c| c.0 != a));
    s.quarantine_chunk(&a).unwrap(); // already gone: fine
    s.put_chunk(&a, &[&ha, &pa]).unwrap();
    s.sync().unwrap();
    assert!(s.has_chunk(&a).unwrap());
    assert_eq!(read_all(s, &a), [ha.as_slice(), pa.as_slice()].concat());
}

fn delete_chunk_is_idempotent(s: &dyn Storage) {
    let (a, ha, pa) = encoded(b"chunk a");
    let (b, hb, pb) = encoded(b"chunk b");
    s.put_chunk(&a, &[&ha, &pa]).unwrap();
    s.put_chunk(&b, &[&hb, &pb]).unwrap();
    s.delete_chunk(&a).unwrap();
    assert!(!s.has_chunk(&a).unwrap());
    assert!(
        s.has_chunk(&b).unwrap(),
        "deleting one chunk keeps the others"
    );
    s.delete_chunk(&a).unwrap();
    s.delete_chunk(&ChunkId::of(b"never stored")).unwrap();
    s.sync().unwrap();
    let ids: Vec<ChunkId> = s.list_chunks().unwrap().into_iter().map(|c| c.0).collect();
    assert_eq!(ids, vec![b]);
    assert!(s.open_chunk(&a).is_err());
}

fn manifests(s: &dyn Storage) {
    assert!(s.list_manifests().unwrap().is_empty());
    s.put_manifest("epoch-2", b"two").unwrap();
    s.put_manifest("epoch-1", b"one").unwrap();
    s.put_manifest("a.b_c-d=e+f@g,h", b"odd name").unwrap();
    let mut names = s.list_manifests().unwrap();
    names.sort();
    assert_eq!(names, ["a.b_c-d=e+f@g,h", "epoch-1", "epoch-2"]);
    assert_eq!(s.get_manifest("epoch-1").unwrap(), b"one");
    assert_eq!(s.get_manifest("a.b_c-d=e+f@g,h").unwrap(), b"odd name");
    assert_eq!(s.manifest_size("epoch-2").unwrap(), 3);

    // Replace: the new bytes, whatever their length.
    s.put_manifest("epoch-1", b"one, replaced by longer bytes")
        .unwrap();
    assert_eq!(
        s.get_manifest("epoch-1").unwrap(),
        b"one, replaced by longer bytes"
    );
    s.put_manifest("epoch-1", b"1").unwrap();
    assert_eq!(s.get_manifest("epoch-1").unwrap(), b"1");
    assert_eq!(s.manifest_size("epoch-1").unwrap(), 1);
    assert_eq!(s.list_manifests().unwrap().len(), 3);

    // Empty and large bodies.
    s.put_manifest("empty", b"").unwrap();
    assert_eq!(s.get_manifest("empty").unwrap(), b"");
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    s.put_manifest("big", &big).unwrap();
    assert_eq!(s.get_manifest("big").unwrap(), big);

    // Delete.
    assert!(s.delete_manifest("epoch-2").unwrap());
    assert!(!s.delete_manifest("epoch-2").unwrap());
    assert!(!s.delete_manifest("never-existed").unwrap());
    let mut names = s.list_manifests().unwrap();
    names.sort();
    assert_eq!(names, ["a.b_c-d=e+f@g,h", "big", "empty", "epoch-1"]);
    assert!(matches!(
        s.get_manifest("epoch-2"),
        Err(Error::NotFound { .. })
    ));
    // Manifests and chunks are separate name spaces.
    assert!(s.list_chunks().unwrap().is_empty());
    assert_ne!(s.manifest_path("x"), s.manifest_path("y"));
}

fn missing_manifest_is_not_found(s: &dyn Storage) {
    match s.get_manifest("no-such-checkpoint") {
        Err(e @ Error::NotFound { .. }) => {
            let Error::NotFound { name, .. } = &e else {
                unreachable!()
            };
            assert_eq!(name, "no-such-checkpoint");
            assert!(e.to_string().contains("no-such-checkpoint"), "{e}");
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
}

fn sync_works(s: &dyn Storage) {
    s.sync().unwrap(); // nothing pending
    let mut ids = Vec::new();
    for i in 0..20u32 {
        let (id, h, p) = encoded(&i.to_le_bytes());
        s.put_chunk(&id, &[&h, &p]).unwrap();
        ids.push(id);
    }
    s.sync().unwrap();
    s.sync().unwrap();
    for id in &ids {
        assert!(s.has_chunk(id).unwrap());
    }
    s.delete_chunk(&ids[0]).unwrap();
    s.sync().unwrap();
    assert!(!s.has_chunk(&ids[0]).unwrap());
}

fn shared_lock_is_shared(s: Arc<dyn Storage>) {
    // Two shared guards at once (as two saves, or two processes, hold them).
    let (tx, rx) = mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        let a = s2.lock_shared();
        let b = s2.lock_shared();
        let _ = tx.send((a, b));
    });
    let (a, b) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("second shared lock blocked");
    let (a, b) = (a.unwrap(), b.unwrap());

    // The exclusive lock waits for both to go.
    let (tx, rx) = mpsc::channel();
    let s3 = s.clone();
    std::thread::spawn(move || {
        let g = s3.lock_exclusive();
        let _ = tx.send(g.is_ok());
        drop(g);
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "exclusive lock granted while shared locks are held"
    );
    drop(a);
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "exclusive lock granted while a shared lock is held"
    );
    drop(b);
    assert!(rx
        .recv_timeout(Duration::from_secs(10))
        .expect("exclusive lock not granted after shared locks were dropped"));

    // And a shared lock is available again afterwards.
    drop(s.lock_shared().unwrap());
}

fn clean_staging_keeps_committed_data(s: &dyn Storage) {
    let (id, h, p) = encoded(b"keep me");
    s.put_chunk(&id, &[&h, &p]).unwrap();
    s.sync().unwrap();
    s.put_manifest("m", b"keep me too").unwrap();
    let _g = s.lock_exclusive().unwrap();
    // Completed puts leave nothing behind to clean.
    assert_eq!(s.clean_staging().unwrap(), 0);
    assert_eq!(read_all(s, &id), [h, p].concat());
    assert_eq!(s.get_manifest("m").unwrap(), b"keep me too");
    assert_eq!(s.list_manifests().unwrap(), ["m"]);
}

/// Fresh local stores, each in its own directory under `parent`.
fn local_factory(parent: &Path) -> impl Fn() -> Arc<dyn Storage> + '_ {
    let n = AtomicUsize::new(0);
    move || {
        let dir = parent.join(format!("store-{}", n.fetch_add(1, Ordering::Relaxed)));
        Arc::new(LocalStorage::open(&dir).unwrap())
    }
}

#[test]
fn local_storage_conforms() {
    let dir = tempfile::tempdir().unwrap();
    check_backend(local_factory(dir.path()));
    check_staging_cleanup(local_factory(&dir.path().join("staging")), |s| {
        // A crashed writer leaves files in tmp/ under the store root.
        let tmp = Path::new(&s.location()).join("tmp");
        fs::write(tmp.join("123-4-5.tmp"), b"half a chunk").unwrap();
        fs::write(tmp.join("123-6-7.tmp"), b"").unwrap();
        2
    });
}

/// The same suite against object storage, one test per scheme. Each runs
/// when its variable names a bucket or container it may write to:
/// `HINDSIGHT_TEST_S3_URL=s3://bucket/prefix` (endpoint and credentials from
/// the usual `AWS_*` variables; `make test-rust` starts moto on loopback),
/// `HINDSIGHT_TEST_AZURE_URL=az://container/prefix` (the `AZURE_STORAGE_*`
/// variables; Azurite on loopback), `HINDSIGHT_TEST_XROOTD_URL=root://host//path`
/// (the XRootD client's variables; `tests/xrootdutil.py` starts an xrootd).
#[cfg(feature = "s3")]
mod objects {
    use super::*;
    use futures_util::TryStreamExt;
    use hindsight_core::checkpoint::location::ObjectUrl;
    use hindsight_core::checkpoint::object::connect;
    use hindsight_core::{ObjectStorage, Store, StoreOptions};
    use object_store::path::Path as Key;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
    use std::time::Instant;

    /// The lease timeout of the tests (production: 10 minutes). XRootD's gets
    /// more room: each of its operations is a client process, and the client
    /// resolves the host's own addresses at start, which on a host with a
    /// slow DNS server can take a second or more.
    const LEASE: Duration = Duration::from_secs(3);
    const XROOTD_LEASE: Duration = Duration::from_secs(8);

    /// Raw access to the bucket, to leave behind what crashed processes leave.
    struct Raw {
        rt: tokio::runtime::Runtime,
        client: Arc<dyn ObjectStore>,
        root: String,
    }

    impl Raw {
        /// The same client a store of `url` uses (`object::connect`).
        fn new(url: &str) -> Raw {
            let url = ObjectUrl::parse(url, "test URL").unwrap();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            Raw {
                rt,
                client: connect(&url).unwrap(),
                root: url.root(),
            }
        }

        /// The key of `rel` under a storage's location.
        fn key(&self, s: &dyn Storage, rel: &str) -> Key {
            let loc = s.location();
            let prefix = loc.strip_prefix(&self.root).unwrap().trim_matches('/');
            Key::from(format!("{prefix}/{rel}"))
        }

        fn put(&self, key: &Key, body: &'static [u8]) {
            self.rt
                .block_on(self.client.put(key, PutPayload::from_static(body)))
                .unwrap();
        }

        fn list(&self, dir: &Key) -> Vec<Key> {
            self.rt
                .block_on(self.client.list(Some(dir)).try_collect::<Vec<_>>())
                .unwrap()
                .into_iter()
                .map(|m| m.location)
                .collect()
        }

        fn delete(&self, key: &Key) {
            self.rt.block_on(self.client.delete(key)).unwrap();
        }
    }

    fn unique() -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        format!("{}-{nanos}", std::process::id())
    }

    /// Fresh, empty storages, each under its own prefix below `base`.
    fn factory(base: String, lease: Option<Duration>) -> impl Fn() -> Arc<dyn Storage> {
        let n = AtomicUsize::new(0);
        let run = unique();
        move || {
            let url = format!(
                "{base}/conformance-{run}-{}",
                n.fetch_add(1, Ordering::Relaxed)
            );
            let mut s = ObjectStorage::open(&url).unwrap();
            if let Some(t) = lease {
                s = s.with_lease_timeout(t);
            }
            Arc::new(s)
        }
    }

    /// A writer killed mid-save leaves its lease behind: gc waits until the
    /// lease is stale, then proceeds; a dead gc's lease stops saves only as long.
    fn dead_leases_expire(make: impl Fn() -> Arc<dyn Storage>, raw: &Raw, lease: Duration) {
        let s = make();
        raw.put(&raw.key(&*s, "locks/writer-dead"), b"{}");
        let t = Instant::now();
        drop(s.lock_exclusive().unwrap());
        let waited = t.elapsed();
        assert!(
            waited >= lease - Duration::from_millis(1500),
            "gc ignored a fresh writer lease ({waited:?})"
        );
        assert!(waited < lease * 4, "gc waited {waited:?}");

        raw.put(&raw.key(&*s, "locks/gc"), b"{}");
        let t = Instant::now();
        drop(s.lock_shared().unwrap());
        let waited = t.elapsed();
        assert!(
            waited >= lease - Duration::from_millis(1500),
            "save ignored a fresh gc lease ({waited:?})"
        );
        assert!(waited < lease * 4, "save waited {waited:?}");
        // The stale gc lease is replaced by the next gc.
        drop(s.lock_exclusive().unwrap());
        assert!(
            raw.list(&raw.key(&*s, "locks")).is_empty(),
            "leases left behind"
        );
    }

    /// A save whose lease was removed (a gc took it for dead) must not commit.
    fn lost_lease_blocks_commit(make: impl Fn() -> Arc<dyn Storage>, raw: &Raw) {
        let s = make();
        let g = s.lock_shared().unwrap();
        let leases = raw.list(&raw.key(&*s, "locks"));
        assert_eq!(leases.len(), 1, "{leases:?}");
        raw.delete(&leases[0]);
        let e = s.put_manifest("m", b"manifest").unwrap_err();
        assert!(e.to_string().contains("lease"), "{e}");
        assert!(s.list_manifests().unwrap().is_empty());
        drop(g);
        let g = s.lock_shared().unwrap();
        s.put_manifest("m", b"manifest").unwrap();
        drop(g);
        assert_eq!(s.list_manifests().unwrap(), ["m"]);
        assert!(raw.list(&raw.key(&*s, "locks")).is_empty());
    }

    fn store_by_url(base: &str) {
        let url = format!("{base}/store-{}", unique());
        assert!(matches!(
            Store::open_url(&url, false, None),
            Err(Error::NotFound { .. })
        ));
        let opts = StoreOptions {
            chunk_size: 1 << 20,
            ..Default::default()
        };
        let store = Store::open_url(&url, true, Some(opts.clone())).unwrap();
        assert_eq!(store.location(), url);
        assert_eq!(store.options(), &opts);
        let id = ChunkId::of(b"unreferenced");
        assert!(store.put_chunk(b"unreferenced", &id).unwrap() > 0);
        assert_eq!(store.put_chunk(b"unreferenced", &id).unwrap(), 0, "dedup");
        let again = Store::open_url(&url, false, None).unwrap();
        assert_eq!(again.options(), &opts);
        let report = again.gc().unwrap();
        assert_eq!(report.chunks_removed, 1);
        assert!(!again.storage().has_chunk(&id).unwrap());
        let other = StoreOptions {
            chunk_size: 2 << 20,
            ..Default::default()
        };
        assert!(matches!(
            Store::open_url(&url, false, Some(other)),
            Err(Error::InvalidArgument { .. })
        ));
    }

    /// The whole suite against the object store `var` names, or a note why not.
    fn conforms(var: &str, example: &str, lease: Duration) {
        let Some(base) = std::env::var(var).ok().filter(|u| !u.is_empty()) else {
            eprintln!("note: skipped; set {var}={example} (and the server's variables) to run it");
            return;
        };
        let base = base.trim_end_matches('/').to_string();
        let raw = Raw::new(&base);
        check_backend(factory(base.clone(), None));
        check_staging_cleanup(factory(base.clone(), Some(lease)), |s| {
            // Two writers and a gc killed mid-run; their leases go stale.
            raw.put(&raw.key(s, "locks/writer-1-dead"), b"{}");
            raw.put(&raw.key(s, "locks/writer-2-dead"), b"{}");
            raw.put(&raw.key(s, "locks/gc"), b"{}");
            std::thread::sleep(lease + Duration::from_millis(1500));
            2
        });
        dead_leases_expire(factory(base.clone(), Some(lease)), &raw, lease);
        lost_lease_blocks_commit(factory(base.clone(), Some(lease)), &raw);
        store_by_url(&base);
    }

    #[test]
    fn s3_storage_conforms() {
        conforms("HINDSIGHT_TEST_S3_URL", "s3://bucket/prefix", LEASE);
    }

    #[test]
    fn azure_storage_conforms() {
        conforms("HINDSIGHT_TEST_AZURE_URL", "az://container/prefix", LEASE);
    }

    #[test]
    fn xrootd_storage_conforms() {
        conforms(
            "HINDSIGHT_TEST_XROOTD_URL",
            "root://host:port//path",
            XROOTD_LEASE,
        );
    }
}

#[cfg(not(feature = "s3"))]
#[test]
fn object_storage_conforms() {
    eprintln!("note: object store conformance skipped; build with `--features s3` to run it");
}
