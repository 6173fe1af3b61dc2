//! Crafted, checksum-valid manifests (issue 11): whatever a hostile or buggy
//! writer puts in a manifest, opening and loading it gives a `Corrupt` error
//! and never panics, aborts or returns bytes that were not stored. Fourteen
//! regression cases, then a property test that mutates a real manifest at
//! random places with hostile values and re-signs it.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use hindsight_core::checkpoint::format::MANIFEST_MAGIC;
use hindsight_core::{
    Array, ArrayLib, Error, ErrorKind, Node, Store, StoreOptions, Writer, WriterOptions,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn new_store(dir: &Path) -> Arc<Store> {
    let opts = StoreOptions {
        chunk_size: 4096,
        ..Default::default()
    };
    Arc::new(Store::open_local(dir, true, Some(opts)).unwrap())
}

/// A real checkpoint "base": a float32 array of 3000 elements (3 chunks),
/// a bytes value and an int-keyed dict, as an optimizer state has.
fn base_manifest(store: &Arc<Store>) -> Value {
    let w = Writer::new(store.clone(), WriterOptions::default()).unwrap();
    let data: Vec<u8> = (0..12_000u32).map(|i| (i % 251) as u8).collect();
    let mut b = w.begin("base").unwrap();
    let arr = Node::Array(Box::new(Array {
        lib: ArrayLib::Torch,
        dtype: "float32".into(),
        shape: vec![3000],
        byte_order: "little".into(),
        device: None,
        data: b.stage(&data).unwrap(),
    }));
    let bytes = Node::Bytes(b.stage(b"hello").unwrap());
    let root = Node::Dict(vec![
        (Node::Str("w".into()), arr),
        (Node::Str("b".into()), bytes),
        (
            Node::Str("state".into()),
            Node::Dict(vec![(Node::Int(0), Node::Float(1.5f64.to_bits()))]),
        ),
    ]);
    b.commit(root, BTreeMap::new()).wait().unwrap();
    w.flush().unwrap();
    let raw = std::fs::read(store.storage().manifest_path("base")).unwrap();
    serde_json::from_slice(&raw[16..raw.len() - 32]).unwrap()
}

/// A manifest file with a valid checksum around `body`.
fn sign(body: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(body).unwrap();
    let mut out = Vec::new();
    out.extend_from_slice(MANIFEST_MAGIC);
    out.extend_from_slice(&hindsight_core::checkpoint::format::FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Write `body` as checkpoint `name` and load all of it the way every front
/// end does (manifest, then the verified parallel reader).
fn load_crafted(store: &Store, name: &str, body: &Value) -> hindsight_core::Result<Vec<Vec<u8>>> {
    let mut body = body.clone();
    body["name"] = json!(name);
    std::fs::write(store.storage().manifest_path(name), sign(&body)).unwrap();
    let m = store.manifest(name)?;
    store.read_blobs(name, &m.root, &[], 2, &|| false)
}

fn assert_corrupt(r: hindsight_core::Result<Vec<Vec<u8>>>, case: &str) {
    match r {
        Err(e @ Error::Corrupt { .. }) => assert_eq!(e.kind(), ErrorKind::Corrupt),
        Err(e) => panic!("{case}: expected a Corrupt error, got {e:?}"),
        Ok(_) => panic!("{case}: a crafted manifest loaded"),
    }
}

/// The node of key `k` in the root dict of a manifest body.
fn entry<'a>(body: &'a mut Value, k: &str) -> &'a mut Value {
    let items = body["root"]["v"].as_array_mut().unwrap();
    let i = items.iter().position(|kv| kv[0]["v"] == json!(k)).unwrap();
    &mut items[i][1]
}

#[test]
fn the_base_manifest_loads() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let base = base_manifest(&store);
    let bufs = load_crafted(&store, "copy", &base).unwrap();
    assert_eq!(bufs[0].len(), 12_000);
}

#[test]
fn crafted_manifests_are_corrupt_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let base = base_manifest(&store);
    type Craft = fn(&mut Value);
    let cases: Vec<(&str, Craft)> = vec![
        ("chunk lengths whose sum wraps u64", |b| {
            let d = &mut entry(b, "w")["v"]["data"];
            d["chunks"][0]["len"] = json!(u64::MAX);
            d["chunks"][1]["len"] = json!(2);
            d["nbytes"] = json!(1);
        }),
        ("nbytes of 2^40 backed by repeated 1 GiB chunk refs", |b| {
            let d = &mut entry(b, "b")["v"];
            let c = d["chunks"][0].clone();
            let mut chunks = Vec::new();
            for _ in 0..1024 {
                let mut c = c.clone();
                c["len"] = json!(1u64 << 30);
                chunks.push(c);
            }
            d["chunks"] = json!(chunks);
            d["nbytes"] = json!(1u64 << 40);
        }),
        ("a blob node as a dict key", |b| {
            let items = b["root"]["v"].as_array_mut().unwrap();
            let blob = items[1][1].clone();
            items[0][0] = blob;
        }),
        ("an array node as a dict key", |b| {
            let items = b["root"]["v"].as_array_mut().unwrap();
            let arr = items[0][1].clone();
            items[1][0] = arr;
        }),
        ("a list as a dict key", |b| {
            b["root"]["v"][0][0] = json!({"t": "list", "v": []});
        }),
        ("a bigint of 100000 digits", |b| {
            *entry(b, "state") = json!({"t": "bigint", "v": "9".repeat(100_000)});
        }),
        ("a bigint that is not a number", |b| {
            *entry(b, "state") = json!({"t": "bigint", "v": "12a"});
        }),
        ("numpy dtype <f3", |b| {
            let a = &mut entry(b, "w")["v"];
            a["lib"] = json!("numpy");
            a["dtype"] = json!("<f3");
            a["shape"] = json!([4000]);
        }),
        ("unknown torch dtype", |b| {
            entry(b, "w")["v"]["dtype"] = json!("float128");
        }),
        ("shape [0, 2^63]", |b| {
            let a = &mut entry(b, "w")["v"];
            a["shape"] = json!([0, 1u64 << 63]);
            a["data"] = json!({"nbytes": 0, "chunks": []});
        }),
        ("a shape whose byte count overflows", |b| {
            entry(b, "w")["v"]["shape"] = json!([1u64 << 32, 1u64 << 32, 1u64 << 32]);
        }),
        ("array bytes that do not match its shape", |b| {
            entry(b, "w")["v"]["shape"] = json!([2999]);
        }),
        ("a zero-length chunk", |b| {
            let d = &mut entry(b, "b")["v"];
            let mut c = d["chunks"][0].clone();
            c["len"] = json!(0);
            d["chunks"].as_array_mut().unwrap().push(c);
        }),
        ("big-endian byte order", |b| {
            entry(b, "w")["v"]["byte_order"] = json!("big");
        }),
    ];
    assert_eq!(cases.len(), 14);
    for (i, (case, craft)) in cases.into_iter().enumerate() {
        let mut body = base.clone();
        craft(&mut body);
        assert_corrupt(load_crafted(&store, &format!("crafted{i}"), &body), case);
    }
}

/// Hostile replacements for any JSON value of a manifest.
fn nasty() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 40)),
        Just(json!(1u64 << 63)),
        Just(json!(1.5)),
        Just(json!("")),
        Just(json!("<f3")),
        Just(json!("9".repeat(5000))),
        Just(json!([])),
        Just(json!({})),
        Just(json!({"t": "list", "v": []})),
        Just(json!({"t": "bytes", "v": {"nbytes": 5, "chunks": []}})),
        Just(json!({"t": "bigint", "v": "-"})),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|i| json!(i)),
    ]
}

/// Every place in `v` (JSON pointers), containers included.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                pointers(x, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

proptest! {
    // Bounded for CI; `make chaos` runs many more cases.
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("HINDSIGHT_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
    ))]

    #[test]
    fn mutated_manifests_load_exactly_or_are_corrupt(
        picks in prop::collection::vec((any::<prop::sample::Index>(), nasty()), 1..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = new_store(dir.path());
        let base = base_manifest(&store);
        let original = load_crafted(&store, "orig", &base).unwrap();
        let mut body = base.clone();
        for (idx, value) in picks {
            let mut ps = Vec::new();
            pointers(&body["root"], String::from("/root"), &mut ps);
            let p = idx.get(&ps).clone();
            if let Some(slot) = body.pointer_mut(&p) {
                *slot = value;
            }
        }
        match load_crafted(&store, "mutant", &body) {
            // A mutation that kept the manifest valid (say, a changed float)
            // still only returns stored, verified bytes.
            Ok(bufs) => {
                for b in &bufs {
                    prop_assert!(original.iter().any(|o| o == b) || b.is_empty() || b == b"hello");
                }
            }
            Err(Error::Corrupt { .. } | Error::NotFound { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error kind: {e:?}"),
        }
    }
}

#[test]
fn a_manifest_that_lies_about_a_chunk_never_quarantines_the_good_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let base = base_manifest(&store);
    // The bytes blob claims one byte more than its (intact) chunk holds.
    let mut body = base.clone();
    let d = &mut entry(&mut body, "b")["v"];
    d["chunks"][0]["len"] = json!(6);
    d["nbytes"] = json!(6);
    assert_corrupt(load_crafted(&store, "liar", &body), "length lie");
    // The chunk was not blamed: the real checkpoint still loads.
    assert!(!dir.path().join("quarantine").exists());
    let bufs = load_crafted(&store, "honest", &base).unwrap();
    assert!(bufs.iter().any(|b| b == b"hello"));
}

/// Issue 22: one checkpoint whose manifest does not decode (a tree deeper
/// than the reader takes, written by an older hindsight) poisoned gc and
/// usage for the whole store. They skip and name it now, and gc keeps every
/// chunk its bytes name; a manifest of another format version still stops
/// gc (what it references cannot be known).
#[test]
fn store_wide_operations_skip_and_name_a_manifest_that_does_not_decode() {
    let dir = tempfile::tempdir().unwrap();
    let store = new_store(dir.path());
    let mut body = base_manifest(&store);
    let mut root = body["root"].clone();
    for i in 0..41 {
        root = json!({"t": "dict", "v": [[{"t": "str", "v": format!("k{i}")}, root]]});
    }
    body["root"] = root;
    body["name"] = json!("deep");
    store.storage().put_manifest("deep", &sign(&body)).unwrap();
    store.remove("base").unwrap(); // the deep one is all that references the chunks
    let chunks = store.storage().list_chunks().unwrap().len();
    assert!(chunks >= 4);

    let u = store.usage().unwrap();
    assert_eq!(u.checkpoints, 0);
    assert_eq!(u.unreadable.len(), 1);
    assert_eq!(u.unreadable[0].0, "deep");
    assert!(
        u.unreadable[0].1.contains("does not parse"),
        "{:?}",
        u.unreadable
    );
    assert_eq!(u.unreferenced_chunks, 0, "its chunks count as referenced");

    let r = store.gc().unwrap();
    assert_eq!(r.chunks_removed, 0, "gc kept the chunks the manifest names");
    assert_eq!(r.unreadable[0].0, "deep");
    assert_eq!(store.storage().list_chunks().unwrap().len(), chunks);

    // Removed, its chunks go.
    store.remove("deep").unwrap();
    assert_eq!(store.gc().unwrap().chunks_removed, chunks);

    // A file whose name is no checkpoint name (put there by hand): skipped
    // and named with the way out, gc goes on.
    let stray = store
        .storage()
        .manifest_path("x")
        .with_file_name("my copy.hsm");
    std::fs::write(&stray, b"anything").unwrap();
    let r = store.gc().unwrap();
    assert_eq!(r.unreadable.len(), 1);
    assert_eq!(r.unreadable[0].0, "my copy");
    assert!(r.unreadable[0].1.contains("by hand"), "{:?}", r.unreadable);
    assert_eq!(store.usage().unwrap().unreadable.len(), 1);
    std::fs::remove_file(&stray).unwrap();

    // Another format version, or bytes that are no manifest at all: what
    // they reference cannot be known. Usage and gc still answer, naming
    // them, and gc removes no chunk while one is there.
    base_manifest(&store);
    store.remove("base").unwrap(); // its chunks: what a gc would remove
    let unreferenced = store.storage().list_chunks().unwrap().len();
    assert!(unreferenced >= 2);
    let mut other = sign(&body);
    other[4..8].copy_from_slice(&99u32.to_le_bytes());
    for (name, bytes) in [("future", other), ("garbage", b"not a manifest".to_vec())] {
        store.storage().put_manifest(name, &bytes).unwrap();
        let u = store.usage().unwrap();
        assert!(
            u.unreadable.iter().any(|(n, _)| n == name),
            "{:?}",
            u.unreadable
        );
        let r = store.gc().unwrap();
        assert_eq!(
            r.chunks_removed, 0,
            "{name}: gc removed a chunk it cannot vouch for"
        );
        let why = &r.unreadable.iter().find(|(n, _)| n == name).unwrap().1;
        assert!(
            why.contains("gc removes no chunk") && why.contains(&format!("hindsight rm {name}")),
            "{why}"
        );
        if name == "future" {
            assert!(why.contains("format version 99"), "{why}");
        }
        assert_eq!(store.storage().list_chunks().unwrap().len(), unreferenced);
        store.remove(name).unwrap();
    }
    assert_eq!(store.gc().unwrap().chunks_removed, unreferenced);
}
