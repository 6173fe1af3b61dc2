//! End-to-end tests of `Store` + `Writer` on real files in temporary
//! directories. The only stand-in is `FailingStorage`, a wrapper around
//! `LocalStorage` that can fail or slow down writes on demand.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns are not covered by allow-unwrap-in-tests

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hindsight_core::checkpoint::storage::LockGuard;
use hindsight_core::checkpoint::store::blobs_under;
use hindsight_core::{
    fingerprint, Array, ArrayLib, Blob, ChunkId, Codec, Error, LocalStorage, Node, SaveHandle,
    SaveStats, Storage, Store, StoreOptions, Writer, WriterOptions,
};

const CS: usize = 4096;

fn store_options() -> StoreOptions {
    StoreOptions {
        chunk_size: CS,
        ..Default::default()
    }
}

fn writer_options() -> WriterOptions {
    WriterOptions {
        staging_bytes: 64 * CS,
        threads: 2,
        nice: 0,
    }
}

fn new_store(dir: &Path) -> Arc<Store> {
    Arc::new(Store::open_local(dir, true, Some(store_options())).unwrap())
}

/// Deterministic pseudo-random bytes (splitmix64); each seed gives other bytes.
fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0xA076_1D64_78BD_642F) ^ 0xE703_7ED1_A0B4_28DB;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(n);
    out
}

fn key(k: &str) -> Node {
    Node::Str(k.into())
}

fn dict(items: Vec<(&str, Node)>) -> Node {
    Node::Dict(items.into_iter().map(|(k, v)| (key(k), v)).collect())
}

/// Stage each value as a `Bytes` entry of a flat dict and commit it.
fn save(w: &Writer, name: &str, items: &[(&str, &[u8])]) -> SaveHandle {
    let mut b = w.begin(name).unwrap();
    let mut entries = Vec::new();
    for (k, v) in items {
        entries.push((*k, Node::Bytes(b.stage(v).unwrap())));
    }
    b.commit(dict(entries), BTreeMap::new())
}

fn save_wait(w: &Writer, name: &str, items: &[(&str, &[u8])]) -> SaveStats {
    save(w, name, items).wait().unwrap()
}

/// The blob at key path `key` of checkpoint `name`, through the load path
/// (parallel, verified) every front end uses.
fn read_key(store: &Store, name: &str, key: &str) -> hindsight_core::Result<Vec<u8>> {
    let path: Vec<String> = key.split('/').map(String::from).collect();
    let node = store.manifest(name)?.root.select(&path).cloned().unwrap();
    let mut bufs = store.read_blobs(name, &node, &path, 3, &|| false)?;
    assert_eq!(bufs.len(), 1);
    Ok(bufs.remove(0))
}

/// Every blob of a checkpoint, read and verified in one call, by key path.
fn load(store: &Store, name: &str) -> BTreeMap<String, Vec<u8>> {
    let m = store.manifest(name).unwrap();
    let mut keys = Vec::new(); // in tree order, as the reader returns them
    m.root
        .for_each_blob(&mut Vec::new(), &mut |p, _| keys.push(p.join("/")));
    let bufs = store.read_blobs(name, &m.root, &[], 4, &|| false).unwrap();
    keys.into_iter().zip(bufs).collect()
}

fn chunk_ids(store: &Store, name: &str) -> Vec<ChunkId> {
    let m = store.manifest(name).unwrap();
    let mut ids = Vec::new();
    m.root.for_each_blob(&mut Vec::new(), &mut |_, b| {
        ids.extend(b.chunks.iter().map(|c| c.id))
    });
    ids.sort();
    ids.dedup();
    ids
}

fn assert_verifies(store: &Store) {
    let (n, problems) = store.verify(&[], |_| {}).unwrap();
    assert_eq!(n, store.list().unwrap().len());
    assert!(
        problems.is_empty(),
        "{:?}",
        problems
            .iter()
            .map(|p| p.error.to_string())
            .collect::<Vec<_>>()
    );
}

/// The tree with blob contents erased, to compare structure and scalar values.
fn shape_of(node: &Node) -> Node {
    let mut n = node.clone();
    n.for_each_blob_mut(&mut |b| {
        b.chunks.clear();
        b.pending = None;
    });
    n
}

fn chunks_for(n: usize) -> usize {
    n.div_ceil(CS)
}

// ---------------------------------------------------------------------------
// A storage wrapper that fails (ENOSPC) or slows down writes on demand.

#[derive(Debug)]
struct FailingStorage {
    inner: LocalStorage,
    fail_chunks: Arc<AtomicBool>,
    fail_manifests: Arc<AtomicBool>,
    /// Sleep this long in every `put_chunk` (a slow disk).
    chunk_delay: Duration,
}

fn enospc(path: PathBuf) -> Error {
    Error::io(path, std::io::Error::from_raw_os_error(libc::ENOSPC))
}

impl Storage for FailingStorage {
    fn location(&self) -> String {
        self.inner.location()
    }
    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        self.inner.chunk_path(id)
    }
    fn manifest_path(&self, name: &str) -> PathBuf {
        self.inner.manifest_path(name)
    }
    fn has_chunk(&self, id: &ChunkId) -> hindsight_core::Result<bool> {
        self.inner.has_chunk(id)
    }
    fn put_chunk(&self, id: &ChunkId, parts: &[&[u8]]) -> hindsight_core::Result<()> {
        if !self.chunk_delay.is_zero() {
            std::thread::sleep(self.chunk_delay);
        }
        if self.fail_chunks.load(Ordering::SeqCst) {
            return Err(enospc(self.inner.chunk_path(id)));
        }
        self.inner.put_chunk(id, parts)
    }
    fn open_chunk(&self, id: &ChunkId) -> hindsight_core::Result<Box<dyn Read + Send>> {
        self.inner.open_chunk(id)
    }
    fn list_chunks(&self) -> hindsight_core::Result<Vec<(ChunkId, u64)>> {
        self.inner.list_chunks()
    }
    fn delete_chunk(&self, id: &ChunkId) -> hindsight_core::Result<()> {
        self.inner.delete_chunk(id)
    }
    fn sync(&self) -> hindsight_core::Result<()> {
        self.inner.sync()
    }
    fn put_manifest(&self, name: &str, bytes: &[u8]) -> hindsight_core::Result<()> {
        if self.fail_manifests.load(Ordering::SeqCst) {
            return Err(enospc(self.inner.manifest_path(name)));
        }
        self.inner.put_manifest(name, bytes)
    }
    fn get_manifest(&self, name: &str) -> hindsight_core::Result<Vec<u8>> {
        self.inner.get_manifest(name)
    }
    fn list_manifests(&self) -> hindsight_core::Result<Vec<String>> {
        self.inner.list_manifests()
    }
    fn delete_manifest(&self, name: &str) -> hindsight_core::Result<bool> {
        self.inner.delete_manifest(name)
    }
    fn manifest_size(&self, name: &str) -> hindsight_core::Result<u64> {
        self.inner.manifest_size(name)
    }
    fn lock_shared(&self) -> hindsight_core::Result<Box<dyn LockGuard>> {
        self.inner.lock_shared()
    }
    fn lock_exclusive(&self) -> hindsight_core::Result<Box<dyn LockGuard>> {
        self.inner.lock_exclusive()
    }
    fn clean_staging(&self) -> hindsight_core::Result<u64> {
        self.inner.clean_staging()
    }
}

struct Faulty {
    dir: tempfile::TempDir,
    store: Arc<Store>,
    fail_chunks: Arc<AtomicBool>,
    fail_manifests: Arc<AtomicBool>,
}

fn faulty_store(chunk_delay: Duration) -> Faulty {
    let dir = tempfile::tempdir().unwrap();
    // Create it as a real local store (HINDSIGHT.json), so it can be reopened.
    drop(new_store(dir.path()));
    let fail_chunks = Arc::new(AtomicBool::new(false));
    let fail_manifests = Arc::new(AtomicBool::new(false));
    let storage = FailingStorage {
        inner: LocalStorage::open(dir.path()).unwrap(),
        fail_chunks: fail_chunks.clone(),
        fail_manifests: fail_manifests.clone(),
        chunk_delay,
    };
    let store = Arc::new(Store::with_storage(Arc::new(storage), store_options()).unwrap());
    Faulty {
        dir,
        store,
        fail_chunks,
        fail_manifests,
    }
}

// ---------------------------------------------------------------------------

#[test]
fn round_trip_of_every_node_kind() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();

    let sizes = [
        ("empty", 0),
        ("one", 1),
        ("exact", CS),
        ("plus_one", CS + 1),
        ("several", 5 * CS + 123),
    ];
    let mut expected: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let weight = rand_bytes(32 * 128 * 4, 100); // torch float32 [32, 128]: 4 chunks exactly
    let table = rand_bytes(1000 * 8, 101); // numpy <f8 [1000]
    let pickled = rand_bytes(300, 102);

    let mut b = w.begin("rt").unwrap();
    let mut byte_nodes = Vec::new();
    for (i, (k, n)) in sizes.iter().enumerate() {
        let data = rand_bytes(*n, i as u64 + 1);
        byte_nodes.push((*k, Node::Bytes(b.stage(&data).unwrap())));
        expected.insert(format!("bytes/{k}"), data);
    }
    let arrays = b.stage_many(&[&weight, &table], 2, &|| false).unwrap();
    let pickle_blob = b.stage(&pickled).unwrap();
    // The fingerprint computed while copying equals one of the live bytes.
    let segment = b.fingerprint_segment();
    assert_eq!(arrays[0].fingerprint, fingerprint(&weight, segment, 2));
    assert_eq!(arrays[1].fingerprint, fingerprint(&table, segment, 1));
    assert_ne!(arrays[0].fingerprint, arrays[1].fingerprint);
    let [wblob, tblob]: [Blob; 2] = arrays
        .into_iter()
        .map(|s| s.blob)
        .collect::<Vec<_>>()
        .try_into()
        .unwrap();
    expected.insert("model/weight".into(), weight.clone());
    expected.insert("model/table".into(), table.clone());
    expected.insert("tuple/4".into(), pickled.clone());

    let tree = Node::Dict(vec![
        (key("bytes"), dict(byte_nodes)),
        (
            key("model"),
            dict(vec![
                (
                    "weight",
                    Node::Array(Box::new(Array {
                        lib: ArrayLib::Torch,
                        dtype: "float32".into(),
                        shape: vec![32, 128],
                        byte_order: "little".into(),
                        device: Some("cuda:0".into()),
                        data: wblob,
                    })),
                ),
                (
                    "table",
                    Node::Array(Box::new(Array {
                        lib: ArrayLib::Numpy,
                        dtype: "<f8".into(),
                        shape: vec![1000],
                        byte_order: "little".into(),
                        device: None,
                        data: tblob,
                    })),
                ),
            ]),
        ),
        (
            key("scalars"),
            Node::List(vec![
                Node::Int(0),
                Node::Int(-1),
                Node::Int(i64::MAX),
                Node::Int(i64::MIN),
                Node::BigInt("-123456789012345678901234567890".into()),
                Node::BigInt("18446744073709551616".into()),
                Node::Float(1.5f64.to_bits()),
                Node::Float(f64::NAN.to_bits()),
                Node::Float(0x7ff8_dead_beef_0001), // NaN with a payload
                Node::Float(0xfff0_0000_0000_0001), // negative signalling NaN
                Node::Float(f64::INFINITY.to_bits()),
                Node::Float(f64::NEG_INFINITY.to_bits()),
                Node::Float((-0.0f64).to_bits()),
                Node::Float(f64::MIN_POSITIVE.to_bits() >> 1), // subnormal
                Node::Bool(true),
                Node::Bool(false),
                Node::None,
                Node::Str(String::new()),
                Node::Str("unicode ✓ \u{0} \"quoted\"".into()),
            ]),
        ),
        (
            key("tuple"),
            Node::Tuple(vec![
                Node::Int(1),
                Node::Tuple(vec![]),
                Node::List(vec![]),
                Node::Dict(vec![]),
                Node::Pickle(pickle_blob),
            ]),
        ),
        (Node::Int(7), key("int key")),
        (Node::None, Node::Bool(true)),
        (Node::Bool(false), Node::List(vec![Node::None])),
    ]);
    let meta: BTreeMap<String, String> = [("epoch", "3"), ("loss", "0.25")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let stats = b.commit(tree.clone(), meta.clone()).wait().unwrap();

    let total: usize = expected.values().map(|v| v.len()).sum();
    let nchunks: usize = expected.values().map(|v| chunks_for(v.len())).sum();
    assert_eq!(stats.bytes_staged, total as u64);
    assert_eq!(stats.chunks_written, nchunks as u64);
    assert_eq!(stats.chunks_deduplicated, 0);
    assert!(stats.bytes_written > total as u64);
    assert_eq!(w.staging_in_use(), 0);
    drop(w);
    drop(store);

    // Reopen from disk, as another process would.
    let store = Store::open_local(dir.path(), false, None).unwrap();
    assert_eq!(store.options().chunk_size, CS);
    assert_eq!(store.list().unwrap(), ["rt"]);
    let m = store.manifest("rt").unwrap();
    assert_eq!(m.name, "rt");
    assert_eq!(m.meta, meta);
    assert!(m.created_ms > 0);
    assert_eq!(shape_of(&m.root), shape_of(&tree));
    let blobs = blobs_under(&m.root);
    assert_eq!(
        blobs.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (k, blob) in &blobs {
        let want = &expected[k];
        assert!(blob.pending.is_none());
        assert_eq!(blob.nbytes, want.len() as u64, "{k}");
        assert_eq!(blob.chunks.len(), chunks_for(want.len()), "{k}");
        assert!(blob.chunks.iter().all(|c| c.len > 0 && c.len <= CS as u64));
        assert_eq!(&read_key(&store, "rt", k).unwrap(), want, "{k}");
    }
    assert_eq!(load(&store, "rt"), expected);
    assert_verifies(&store);
}

#[test]
fn zstd_store_round_trips_and_compresses() {
    let dir = tempfile::tempdir().unwrap();
    let opts = StoreOptions {
        codec: Codec::Zstd,
        ..store_options()
    };
    let store = Arc::new(Store::open_local(dir.path(), true, Some(opts)).unwrap());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let zeros_ish: Vec<u8> = (0..3 * CS).map(|i| (i / 100) as u8).collect();
    let random = rand_bytes(2 * CS + 5, 1);
    save_wait(&w, "z", &[("c", &zeros_ish), ("r", &random)]);
    drop(w);
    let store = Store::open_local(dir.path(), false, None).unwrap();
    assert_eq!(store.options().codec, Codec::Zstd);
    let got = load(&store, "z");
    assert_eq!(got["c"], zeros_ish);
    assert_eq!(got["r"], random);
    let u = store.usage().unwrap();
    assert!(u.stored_bytes < u.unique_bytes, "{u:?}");
    assert_verifies(&store);
    // Options are fixed at creation.
    assert!(matches!(
        Store::open_local(dir.path(), false, Some(store_options())),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn identical_data_is_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let data = rand_bytes(6 * CS + 100, 7);
    let small = rand_bytes(10, 8);
    let n = (chunks_for(data.len()) + 1) as u64;

    let first = save_wait(&w, "a", &[("w", &data), ("s", &small)]);
    assert_eq!(first.chunks_written, n);
    assert_eq!(first.chunks_deduplicated, 0);

    let second = save_wait(&w, "b", &[("w", &data), ("s", &small)]);
    assert_eq!(second.chunks_written, 0);
    assert_eq!(second.chunks_deduplicated, n);
    // Only the manifest was written.
    assert_eq!(
        second.bytes_written,
        store.storage().manifest_size("b").unwrap()
    );

    let u = store.usage().unwrap();
    let len = (data.len() + small.len()) as u64;
    assert_eq!(u.checkpoints, 2);
    assert_eq!(u.unique_bytes, len);
    assert_eq!(u.logical_bytes, 2 * u.unique_bytes);
    assert_eq!(u.chunks as u64, n);
    assert_eq!(u.unreferenced_chunks, 0);
    assert_eq!(store.storage().list_chunks().unwrap().len() as u64, n);
    assert_eq!(chunk_ids(&store, "a"), chunk_ids(&store, "b"));
    assert_eq!(load(&store, "b")["w"], data);

    // The same bytes twice within one save (written concurrently by two threads).
    let twice = rand_bytes(4 * CS, 9);
    save_wait(&w, "c", &[("x", &twice), ("y", &twice)]);
    let got = load(&store, "c");
    assert_eq!((&got["x"], &got["y"]), (&twice, &twice));
    assert_eq!(chunk_ids(&store, "c").len(), chunks_for(twice.len()));
    assert_verifies(&store);
}

#[test]
fn pending_blob_reused_by_a_later_save() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let frozen = rand_bytes(3 * CS + 5, 1);
    let x: Vec<Vec<u8>> = (0..3).map(|i| rand_bytes(2 * CS, 10 + i)).collect();

    // Save 1 stages the frozen tensor once; keep its (pending) blob.
    let mut b = w.begin("s1").unwrap();
    let fb = b.stage(&frozen).unwrap();
    let x1 = b.stage(&x[0]).unwrap();
    assert!(fb.pending.is_some() && fb.chunks.is_empty());
    let h1 = b.commit(
        dict(vec![
            ("frozen", Node::Bytes(fb.clone())),
            ("x", Node::Bytes(x1)),
        ]),
        BTreeMap::new(),
    );

    // Save 2, made without waiting for save 1, reuses it without staging.
    let mut b = w.begin("s2").unwrap();
    b.note_reused(frozen.len() as u64);
    let x2 = b.stage(&x[1]).unwrap();
    let h2 = b.commit(
        dict(vec![
            ("frozen", Node::Bytes(fb.clone())),
            ("x", Node::Bytes(x2)),
        ]),
        BTreeMap::new(),
    );
    let s2 = h2.wait().unwrap();
    assert_eq!(s2.bytes_reused, frozen.len() as u64);
    assert_eq!(s2.bytes_staged, x[1].len() as u64);
    assert_eq!(s2.chunks_written, chunks_for(x[1].len()) as u64);
    h1.wait().unwrap();

    // Save 3, after both are durable, still resolves the same blob.
    let mut b = w.begin("s3").unwrap();
    let x3 = b.stage(&x[2]).unwrap();
    b.commit(
        dict(vec![
            ("frozen", Node::Bytes(fb.clone())),
            ("x", Node::Bytes(x3)),
        ]),
        BTreeMap::new(),
    )
    .wait()
    .unwrap();

    let frozen_chunks = |name: &str| {
        blobs_under(&store.manifest(name).unwrap().root)["frozen"]
            .chunks
            .clone()
    };
    assert_eq!(frozen_chunks("s1").len(), chunks_for(frozen.len()));
    assert_eq!(frozen_chunks("s1"), frozen_chunks("s2"));
    assert_eq!(frozen_chunks("s1"), frozen_chunks("s3"));
    for (i, name) in ["s1", "s2", "s3"].into_iter().enumerate() {
        let got = load(&store, name);
        assert_eq!(got["frozen"], frozen, "{name}");
        assert_eq!(got["x"], x[i], "{name}");
    }

    // The reused chunks outlive the checkpoint that wrote them.
    store.remove("s1").unwrap();
    store.gc().unwrap();
    assert_eq!(load(&store, "s3")["frozen"], frozen);
    assert_verifies(&store);
}

#[test]
fn staged_bytes_are_a_snapshot() {
    // A slow disk, so the chunks are written well after the source changed.
    let f = faulty_store(Duration::from_millis(5));
    let w = Writer::new(f.store.clone(), writer_options()).unwrap();
    let mut buf = rand_bytes(6 * CS + 17, 3);
    let original = buf.clone();
    let mut b = w.begin("snap").unwrap();
    let blob = b.stage(&buf).unwrap();
    buf.fill(0xAB);
    let h = b.commit(dict(vec![("w", Node::Bytes(blob))]), BTreeMap::new());
    buf.fill(0xCD);
    h.wait().unwrap();
    assert_eq!(load(&f.store, "snap")["w"], original);
}

#[test]
fn staging_stays_within_its_budget() {
    let f = faulty_store(Duration::from_millis(5));
    let limit = 3 * CS;
    let w = Writer::new(
        f.store.clone(),
        WriterOptions {
            staging_bytes: limit,
            threads: 1,
            nice: 0,
        },
    )
    .unwrap();
    assert_eq!(w.staging_limit(), limit);
    let data = rand_bytes(50 * CS, 9);
    let stop = AtomicBool::new(false);
    let max_seen = AtomicUsize::new(0);
    let samples = AtomicUsize::new(0);
    let staged_in = std::thread::scope(|sc| {
        sc.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                max_seen.fetch_max(w.staging_in_use(), Ordering::SeqCst);
                samples.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        let t = Instant::now();
        let mut b = w.begin("big").unwrap();
        let blob = b.stage(&data).unwrap();
        let staged_in = t.elapsed();
        b.commit(dict(vec![("w", Node::Bytes(blob))]), BTreeMap::new())
            .wait()
            .unwrap();
        stop.store(true, Ordering::SeqCst);
        staged_in
    });
    let max_seen = max_seen.load(Ordering::SeqCst);
    assert!(max_seen <= limit, "{max_seen} > {limit}");
    assert!(max_seen > 0, "sampler never saw staging in use");
    assert!(samples.load(Ordering::SeqCst) > 10);
    // Staging had to wait for at least 47 of the slow writes to free budget.
    assert!(staged_in >= Duration::from_millis(47 * 5), "{staged_in:?}");
    assert_eq!(w.staging_in_use(), 0);
    assert_eq!(load(&f.store, "big")["w"], data);
}

#[test]
fn a_budget_smaller_than_one_chunk_still_makes_progress() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(
        store.clone(),
        WriterOptions {
            staging_bytes: CS / 2,
            threads: 2,
            nice: 0,
        },
    )
    .unwrap();
    let data = rand_bytes(4 * CS + 10, 6);
    save_wait(&w, "tiny-budget", &[("w", &data)]);
    assert_eq!(load(&store, "tiny-budget")["w"], data);
    assert_eq!(w.staging_in_use(), 0);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fail {
    Chunk,
    Manifest,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Observe {
    /// The save's own handle.
    Wait,
    /// The next `begin`.
    Begin,
    /// `flush`.
    Flush,
}

fn wait_done(h: &SaveHandle) {
    let t = Instant::now();
    while !h.is_done() {
        assert!(t.elapsed() < Duration::from_secs(20), "save never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn storage_failure(fail: Fail, observe: Observe) {
    let ctx = format!("{fail:?}/{observe:?}");
    let f = faulty_store(Duration::ZERO);
    let w = Writer::new(f.store.clone(), writer_options()).unwrap();
    let good = rand_bytes(3 * CS, 1);
    save_wait(&w, "good", &[("w", &good)]);

    let flag = match fail {
        Fail::Chunk => &f.fail_chunks,
        Fail::Manifest => &f.fail_manifests,
    };
    flag.store(true, Ordering::SeqCst);
    // New bytes, so the chunks are not deduplicated away.
    let bad = rand_bytes(3 * CS, 2);
    let h = save(&w, "bad", &[("w", &bad)]);
    let err = match observe {
        Observe::Wait => {
            let e = h.wait().unwrap_err();
            // Reported once, to the handle: not again.
            w.flush().unwrap();
            drop(w.begin("unused").unwrap());
            w.flush().unwrap();
            e
        }
        Observe::Begin => {
            wait_done(&h);
            let e = w.begin("next").unwrap_err();
            w.flush().unwrap();
            e
        }
        Observe::Flush => {
            let e = w.flush().unwrap_err();
            w.flush().unwrap();
            e
        }
    };
    let Error::Background { checkpoint, .. } = &err else {
        panic!("{ctx}: expected Background, got {err:?}");
    };
    assert!(checkpoint.starts_with("bad"), "{ctx}: {checkpoint}");
    let Error::StorageFull { path, source } = err.root() else {
        panic!("{ctx}: expected StorageFull, got {:?}", err.root());
    };
    assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{ctx}");
    match fail {
        Fail::Chunk => assert!(
            path.starts_with(f.dir.path().join("chunks")),
            "{ctx}: {path:?}"
        ),
        Fail::Manifest => assert_eq!(path, &f.store.storage().manifest_path("bad"), "{ctx}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("bad") && msg.contains(&*path.to_string_lossy()),
        "{ctx}: {msg}"
    );
    // The handle keeps its outcome even when someone else reported it.
    assert!(matches!(
        h.wait().unwrap_err().root(),
        Error::StorageFull { .. }
    ));
    w.flush().unwrap();

    // Nothing half-written became visible; earlier checkpoints are intact.
    assert_eq!(f.store.list().unwrap(), ["good"], "{ctx}");
    assert_eq!(load(&f.store, "good")["w"], good, "{ctx}");
    assert!(matches!(
        f.store.manifest("bad"),
        Err(Error::NotFound { .. })
    ));

    // Once there is space again, saving works.
    flag.store(false, Ordering::SeqCst);
    save_wait(&w, "later", &[("w", &bad)]);
    w.flush().unwrap();
    assert_eq!(f.store.list().unwrap(), ["good", "later"], "{ctx}");
    assert_eq!(load(&f.store, "later")["w"], bad, "{ctx}");
    assert_verifies(&f.store);
}

#[test]
fn storage_full_is_reported_once_and_leaves_no_checkpoint() {
    for fail in [Fail::Chunk, Fail::Manifest] {
        for observe in [Observe::Wait, Observe::Begin, Observe::Flush] {
            storage_failure(fail, observe);
        }
    }
}

#[test]
fn later_save_reusing_a_failed_saves_blob_fails_cleanly() {
    let f = faulty_store(Duration::ZERO);
    let w = Writer::new(f.store.clone(), writer_options()).unwrap();
    f.fail_chunks.store(true, Ordering::SeqCst);
    let data = rand_bytes(2 * CS, 4);
    let mut b = w.begin("bad").unwrap();
    let blob = b.stage(&data).unwrap();
    let h1 = b.commit(
        dict(vec![("w", Node::Bytes(blob.clone()))]),
        BTreeMap::new(),
    );
    assert!(h1.wait().is_err());
    f.fail_chunks.store(false, Ordering::SeqCst);
    let b = w.begin("reuser").unwrap();
    let e = b
        .commit(dict(vec![("w", Node::Bytes(blob))]), BTreeMap::new())
        .wait()
        .unwrap_err();
    assert!(e.to_string().contains("reuser"), "{e}");
    assert!(f.store.list().unwrap().is_empty());
}

#[test]
fn corruption_is_detected_and_located() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let weight = rand_bytes(3 * CS, 1);
    let other = rand_bytes(2 * CS, 2);
    let mut b = w.begin("c1").unwrap();
    let wb = b.stage(&weight).unwrap();
    let ob = b.stage(&other).unwrap();
    b.commit(
        dict(vec![
            ("model", dict(vec![("w", Node::Bytes(wb))])),
            ("other", Node::Bytes(ob)),
        ]),
        BTreeMap::new(),
    )
    .wait()
    .unwrap();
    let c2_data = rand_bytes(CS, 3);
    save_wait(&w, "c2", &[("x", &c2_data)]);
    drop(w);
    assert_verifies(&store);

    // Flip one payload byte in the second chunk of model/w.
    let blobs = blobs_under(&store.manifest("c1").unwrap().root);
    let wblob = &blobs["model/w"];
    let chunk = store.storage().chunk_path(&wblob.chunks[1].id);
    let mut bytes = fs::read(&chunk).unwrap();
    bytes[16 + 100] ^= 0x04;
    fs::write(&chunk, &bytes).unwrap();

    // The load path names the file, the checkpoint and the key.
    match read_key(&store, "c1", "model/w") {
        Err(Error::Corrupt {
            path,
            checkpoint,
            key_path,
            ..
        }) => {
            assert_eq!(path, chunk);
            assert_eq!(checkpoint.as_deref(), Some("c1"));
            assert_eq!(key_path.as_deref(), Some("model/w"));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(read_key(&store, "c1", "other").unwrap(), other);

    let (n, problems) = store.verify(&[], |_| {}).unwrap();
    assert_eq!(n, 2);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].checkpoint.as_deref(), Some("c1"));
    let msg = problems[0].error.to_string();
    for part in ["c1", "model/w", &*chunk.to_string_lossy()] {
        assert!(msg.contains(part), "{part:?} not in {msg}");
    }
    let (_, only_c2) = store.verify(&["c2".into()], |_| {}).unwrap();
    assert!(only_c2.is_empty());

    // A missing chunk file is reported too.
    let gone = store.storage().chunk_path(&blobs["other"].chunks[0].id);
    fs::remove_file(&gone).unwrap();
    let (_, problems) = store.verify(&[], |_| {}).unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
    let msg = problems[1].error.to_string();
    assert!(
        msg.contains("c1") && msg.contains("other") && msg.contains(&*gone.to_string_lossy()),
        "{msg}"
    );

    // A truncated manifest is corruption naming its file.
    let mpath = store.storage().manifest_path("c2");
    let bytes = fs::read(&mpath).unwrap();
    fs::write(&mpath, &bytes[..bytes.len() - 10]).unwrap();
    match store.manifest("c2") {
        Err(e @ Error::Corrupt { .. }) => {
            let Error::Corrupt { path, .. } = &e else {
                unreachable!()
            };
            assert_eq!(path, &mpath);
            assert!(e.to_string().contains(&*mpath.to_string_lossy()), "{e}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let (_, problems) = store.verify(&["c2".into()], |_| {}).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].checkpoint.as_deref(), Some("c2"));
    assert!(matches!(problems[0].error, Error::Corrupt { .. }));
    // gc goes on, naming it, and deletes nothing its bytes name (issue 22:
    // one unreadable manifest no longer stops gc for the whole store).
    let chunks = store.storage().list_chunks().unwrap().len();
    let r = store.gc().unwrap();
    assert_eq!(r.unreadable.len(), 1, "{:?}", r.unreadable);
    assert_eq!(r.unreadable[0].0, "c2");
    assert_eq!(r.chunks_removed, 0);
    assert_eq!(store.storage().list_chunks().unwrap().len(), chunks);

    // A manifest copied under another name is not taken for that checkpoint.
    fs::copy(store.storage().manifest_path("c1"), &mpath).unwrap();
    let e = store.manifest("c2").unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
    assert!(e.to_string().contains("'c1' under the name 'c2'"), "{e}");
}

#[test]
fn gc_removes_exactly_the_unreferenced_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let shared = rand_bytes(3 * CS, 1);
    let only_a = rand_bytes(2 * CS + 1, 2);
    let only_b = rand_bytes(CS, 3);
    save_wait(&w, "a", &[("shared", &shared), ("mine", &only_a)]);
    save_wait(&w, "b", &[("shared", &shared), ("mine", &only_b)]);
    drop(w);
    let a = chunk_ids(&store, "a");
    let b = chunk_ids(&store, "b");
    let a_only: Vec<ChunkId> = a.iter().filter(|id| !b.contains(id)).copied().collect();
    assert_eq!(a_only.len(), chunks_for(only_a.len()));

    // A leftover of a crashed writer.
    let stale = dir.path().join("tmp").join("4242-1-1.tmp");
    fs::write(&stale, b"half a chunk").unwrap();

    // Nothing to collect while both checkpoints exist (except the stale file).
    let r = store.gc().unwrap();
    assert_eq!((r.chunks_removed, r.bytes_removed), (0, 0));
    assert_eq!(r.staging_files_removed, 1);
    assert!(!stale.exists());

    fs::write(&stale, b"again").unwrap();
    store.remove("a").unwrap();
    assert!(matches!(store.remove("a"), Err(Error::NotFound { .. })));
    let sizes: BTreeMap<ChunkId, u64> =
        store.storage().list_chunks().unwrap().into_iter().collect();
    let r = store.gc().unwrap();
    assert_eq!(r.chunks_removed, a_only.len());
    assert_eq!(
        r.bytes_removed,
        a_only.iter().map(|id| sizes[id]).sum::<u64>()
    );
    assert_eq!(r.staging_files_removed, 1);
    assert!(!stale.exists());
    assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);

    let left: Vec<ChunkId> = store
        .storage()
        .list_chunks()
        .unwrap()
        .into_iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(left, b);
    assert_verifies(&store);
    let got = load(&store, "b");
    assert_eq!(got["shared"], shared);
    assert_eq!(got["mine"], only_b);

    let again = store.gc().unwrap();
    assert_eq!(again, Default::default());
    assert_eq!(store.usage().unwrap().unreferenced_chunks, 0);
}

#[test]
fn gc_running_beside_a_writer_never_breaks_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let frozen = rand_bytes(2 * CS + 3, 1);
    let stop = AtomicBool::new(false);

    let (saves, gcs, collected) = std::thread::scope(|sc| {
        let gc = sc.spawn(|| {
            let (mut runs, mut removed) = (0usize, 0usize);
            while !stop.load(Ordering::SeqCst) {
                removed += store.gc().unwrap().chunks_removed;
                runs += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            (runs, removed)
        });
        let saver = sc.spawn(|| {
            let deadline = Instant::now() + Duration::from_millis(1500);
            let mut frozen_blob: Option<Blob> = None;
            let mut previous: Option<SaveHandle> = None;
            let mut i = 0usize;
            while Instant::now() < deadline || i < 4 {
                let data = rand_bytes(3 * CS + i, 1000 + i as u64);
                let mut b = w.begin(&format!("step-{i:04}")).unwrap();
                let fb = match &frozen_blob {
                    Some(fb) => {
                        b.note_reused(fb.nbytes);
                        fb.clone()
                    }
                    None => {
                        let fb = b.stage(&frozen).unwrap();
                        frozen_blob = Some(fb.clone());
                        fb
                    }
                };
                let x = b.stage(&data).unwrap();
                let h = b.commit(
                    dict(vec![("frozen", Node::Bytes(fb)), ("x", Node::Bytes(x))]),
                    BTreeMap::new(),
                );
                // Keep one save in flight while the previous one is waited on,
                // then apply a keep-the-last-two retention.
                if let Some(p) = previous.replace(h) {
                    p.wait().unwrap();
                }
                if i >= 3 {
                    store.remove(&format!("step-{:04}", i - 3)).unwrap();
                }
                i += 1;
            }
            previous.take().unwrap().wait().unwrap();
            stop.store(true, Ordering::SeqCst);
            i
        });
        let saves = saver.join().unwrap();
        let (gcs, collected) = gc.join().unwrap();
        (saves, gcs, collected)
    });
    w.flush().unwrap();
    assert!(saves >= 4 && gcs >= 2, "saves {saves}, gc runs {gcs}");

    let names = store.list().unwrap();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names.last().unwrap(), &format!("step-{:04}", saves - 1));
    assert_verifies(&store);
    for name in &names {
        let i: usize = name["step-".len()..].parse().unwrap();
        let got = load(&store, name);
        assert_eq!(got["frozen"], frozen, "{name}");
        assert_eq!(got["x"], rand_bytes(3 * CS + i, 1000 + i as u64), "{name}");
    }
    let last = store.gc().unwrap();
    assert!(
        collected + last.chunks_removed > 0,
        "gc never collected the removed checkpoints' chunks"
    );
    assert_eq!(store.usage().unwrap().unreferenced_chunks, 0);
    assert_verifies(&store);
}

#[test]
fn abandoned_saves_leave_nothing_and_block_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let flushes = |w: &Writer| w.flush_timeout(Some(Duration::from_secs(20))).unwrap();

    // Dropped with data staged, and dropped with nothing staged.
    let mut b = w.begin("abandoned").unwrap();
    let _ = b.stage(&rand_bytes(5 * CS, 1)).unwrap();
    drop(b);
    drop(w.begin("empty").unwrap());
    assert!(flushes(&w));
    assert!(store.list().unwrap().is_empty());

    let data = rand_bytes(2 * CS, 2);
    save_wait(&w, "next", &[("w", &data)]);

    // A stage interrupted part way (Ctrl-C), then the builder is dropped.
    let big = rand_bytes(10 * CS, 3);
    let calls = AtomicUsize::new(0);
    let cancel_after_3 = || calls.fetch_add(1, Ordering::SeqCst) >= 3;
    let mut b = w.begin("interrupted").unwrap();
    let e = b.stage_many(&[&big], 1, &cancel_after_3).unwrap_err();
    assert!(matches!(e, Error::Interrupted { .. }), "{e:?}");
    drop(b);
    if !flushes(&w) {
        // Dropping the writer would wait for the stuck save forever.
        std::mem::forget(w);
        panic!("flush never finished after an interrupted stage");
    }

    // An interrupted stage, then a commit of what was staged before it.
    let small = rand_bytes(CS + 1, 4);
    calls.store(0, Ordering::SeqCst);
    let mut b = w.begin("partial").unwrap();
    let ok = b.stage(&small).unwrap();
    assert!(b.stage_many(&[&big], 1, &cancel_after_3).is_err());
    let h = b.commit(dict(vec![("w", Node::Bytes(ok))]), BTreeMap::new());
    match h.wait_timeout(Some(Duration::from_secs(20))) {
        Ok(Some(_)) => {}
        other => {
            std::mem::forget(w);
            panic!("commit after an interrupted stage: {other:?}");
        }
    }
    assert!(flushes(&w));

    assert_eq!(store.list().unwrap(), ["next", "partial"]);
    assert_eq!(load(&store, "next")["w"], data);
    assert_eq!(load(&store, "partial")["w"], small);
    store.gc().unwrap();
    assert_verifies(&store);
    assert_eq!(w.staging_in_use(), 0);
}

#[test]
fn dropping_the_writer_finishes_committed_saves() {
    let f = faulty_store(Duration::from_millis(2));
    let data = rand_bytes(8 * CS, 5);
    {
        let w = Writer::new(f.store.clone(), writer_options()).unwrap();
        let _ = save(&w, "pending", &[("w", &data)]);
    }
    let store = Store::open_local(f.dir.path(), false, None).unwrap();
    assert_eq!(store.list().unwrap(), ["pending"]);
    assert_eq!(load(&store, "pending")["w"], data);
}

/// Lent bytes with a gate: `ready` blocks until the test opens it (or
/// fails it), like a device copy still in flight.
#[derive(Debug)]
struct Gated {
    data: Vec<u8>,
    state: std::sync::Mutex<Option<Result<(), String>>>,
    cv: std::sync::Condvar,
    calls: AtomicUsize,
}

impl Gated {
    fn new(data: Vec<u8>) -> Arc<Gated> {
        Arc::new(Gated {
            data,
            state: std::sync::Mutex::new(None),
            cv: std::sync::Condvar::new(),
            calls: AtomicUsize::new(0),
        })
    }
    fn settle(&self, r: Result<(), String>) {
        *self.state.lock().unwrap() = Some(r);
        self.cv.notify_all();
    }
}

impl hindsight_core::Lent for Gated {
    fn len(&self) -> usize {
        self.data.len()
    }
    fn ready(&self) -> Result<(), String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut st = self.state.lock().unwrap();
        while st.is_none() {
            st = self.cv.wait(st).unwrap();
        }
        st.clone().unwrap()
    }
    fn bytes(&self) -> &[u8] {
        &self.data
    }
}

fn lend_save(w: &Writer, name: &str, host: &[u8], lent: &Arc<Gated>) -> SaveHandle {
    let mut b = w.begin(name).unwrap();
    let h = b.stage(host).unwrap();
    let buf: Arc<dyn hindsight_core::Lent> = lent.clone();
    let mut blobs = b.lend(vec![buf]);
    let l = blobs.remove(0);
    b.commit(
        dict(vec![("host", Node::Bytes(h)), ("lent", Node::Bytes(l))]),
        BTreeMap::new(),
    )
}

#[test]
fn lent_bytes_are_written_once_ready_and_not_before() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let host = rand_bytes(3 * CS + 5, 1);
    let lent = Gated::new(rand_bytes(5 * CS + 17, 2));
    let h = lend_save(&w, "a", &host, &lent);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!h.is_done(), "a save must wait for its lent bytes");
    assert!(
        store.list().unwrap().is_empty(),
        "nothing visible before the bytes are final"
    );
    assert!(lent.calls.load(Ordering::SeqCst) >= 1);
    lent.settle(Ok(()));
    let stats = h.wait().unwrap();
    assert_eq!(stats.bytes_staged, (host.len() + lent.data.len()) as u64);
    let got = load(&store, "a");
    assert_eq!(got["host"], host);
    assert_eq!(got["lent"], lent.data);
    assert_verifies(&store);
    // The writer drops its references once the chunks are written.
    w.flush().unwrap();
    assert_eq!(Arc::strong_count(&lent), 1);
}

#[test]
fn a_failed_device_copy_fails_the_save_and_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let lent = Gated::new(rand_bytes(2 * CS, 3));
    let h = lend_save(&w, "bad", b"host bytes", &lent);
    lent.settle(Err("CUDA error: an illegal memory access".into()));
    let e = h.wait().unwrap_err();
    assert!(
        matches!(e.root(), Error::Device { checkpoint, detail }
        if checkpoint == "bad" && detail.contains("illegal memory access")),
        "{e}"
    );
    assert!(store.list().unwrap().is_empty());
    // A later save works, and the failure was reported once, by its handle.
    save_wait(&w, "good", &[("x", b"1")]);
    assert_eq!(store.list().unwrap(), vec!["good".to_string()]);
}

/// Small blobs staged together share pack chunks (one file for many: chunk
/// files were most of a small model's checkpoint cost); each reads back
/// alone, verified; its fingerprint is the one the unchanged-tensor proof
/// computes from the live bytes; a damaged pack fails the keys in it by name.
#[test]
fn small_blobs_staged_together_share_packs_and_read_back_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path()); // chunk size 4 KiB: blobs up to 1 KiB are packed
    let w = Writer::new(store.clone(), writer_options()).unwrap();
    let smalls: Vec<Vec<u8>> = (0..40)
        .map(|i| rand_bytes(100 + i * 20, i as u64))
        .collect();
    let big = rand_bytes(3 * CS + 5, 99);
    let mut srcs: Vec<&[u8]> = smalls.iter().map(Vec::as_slice).collect();
    srcs.insert(7, &big);
    let mut b = w.begin("packed").unwrap();
    let staged = b.stage_many(&srcs, 2, &|| false).unwrap();
    let want = hindsight_core::fingerprint_many(&srcs, CS, 1);
    assert_eq!(
        staged.iter().map(|s| s.fingerprint).collect::<Vec<_>>(),
        want,
        "fingerprints of packed blobs are those of their bytes"
    );
    let keys: Vec<String> = (0..srcs.len()).map(|i| format!("k{i:02}")).collect();
    let entries: Vec<(&str, Node)> = keys
        .iter()
        .zip(staged)
        .map(|(k, s)| (k.as_str(), Node::Bytes(s.blob)))
        .collect();
    b.commit(dict(entries), BTreeMap::new()).wait().unwrap();
    // 19,600 bytes of small blobs in packs of up to 4 KiB, and the big one's 4 chunks.
    let ids = chunk_ids(&store, "packed");
    assert!(ids.len() <= 4 + 6, "{} chunk files for 41 blobs", ids.len());
    let got = load(&store, "packed");
    for (k, src) in keys.iter().zip(&srcs) {
        assert_eq!(got[k].as_slice(), *src, "{k}");
    }
    let (_, problems) = store.verify(&[], |_| {}).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    // A manifest (checksum intact) whose slices point at each other's bytes
    // in an intact pack: verify reports both keys, as a load refuses them.
    let mut swapped = store.manifest("packed").unwrap();
    swapped.name = "swapped".into();
    let mut owns = Vec::new();
    swapped.root.for_each_blob(&mut Vec::new(), &mut |p, b| {
        if let Some(s) = b.chunks.first().and_then(|c| c.pack.as_ref()) {
            owns.push((p.join("/"), s.own));
        }
    });
    let (a, b) = (owns[0].clone(), owns[1].clone());
    swapped.root.for_each_blob_mut(&mut |blob| {
        if let Some(s) = blob.chunks.first_mut().and_then(|c| c.pack.as_mut()) {
            if s.own == a.1 {
                s.own = b.1;
            } else if s.own == b.1 {
                s.own = a.1;
            }
        }
    });
    store
        .storage()
        .put_manifest("swapped", &swapped.encode().unwrap())
        .unwrap();
    let (_, problems) = store.verify(&["swapped".to_string()], |_| {}).unwrap();
    let text: Vec<String> = problems.iter().map(|p| p.error.to_string()).collect();
    assert_eq!(problems.len(), 2, "{text:?}");
    for key in [&a.0, &b.0] {
        assert!(
            text.iter()
                .any(|t| t.contains(key.as_str()) && t.contains("does not match its hash")),
            "{key}: {text:?}"
        );
        assert!(read_key(&store, "swapped", key).is_err());
    }
    store.storage().delete_manifest("swapped").unwrap();
    // Saved again unchanged: every pack deduplicated.
    let mut b = w.begin("again").unwrap();
    let staged = b.stage_many(&srcs, 1, &|| false).unwrap();
    let entries: Vec<(&str, Node)> = keys
        .iter()
        .zip(staged)
        .map(|(k, s)| (k.as_str(), Node::Bytes(s.blob)))
        .collect();
    let stats = b.commit(dict(entries), BTreeMap::new()).wait().unwrap();
    assert_eq!(stats.chunks_written, 0, "{stats:?}");

    // Damage the pack holding k00: its keys fail by name, the others read.
    let m = store.manifest("packed").unwrap();
    let first = m.root.select(&["k00".to_string()]).unwrap();
    let mut pack = None;
    first.for_each_blob(&mut Vec::new(), &mut |_, b| {
        pack = Some(b.chunks[0].clone())
    });
    let pack = pack.unwrap();
    assert!(pack.pack.is_some(), "k00 is in a pack");
    let path = store.storage().chunk_path(&pack.id);
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&path, bytes).unwrap();
    let e = read_key(&store, "packed", "k00").unwrap_err();
    assert!(
        matches!(e, Error::Corrupt { .. }) && e.to_string().contains("k00"),
        "{e}"
    );
    assert_eq!(read_key(&store, "packed", "k07").unwrap(), big);
    let (_, problems) = store.verify(&["packed".to_string()], |_| {}).unwrap();
    assert!(!problems.is_empty());
}
