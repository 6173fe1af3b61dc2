//! `Replica`: what every front end opens. Local-first semantics (list union,
//! read where present, removal order, verify and gc of both sides), the
//! verified parallel read path, and retention by checkpoint id.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns are not covered by allow-unwrap-in-tests

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hindsight_core::checkpoint::retention::{BestMode, Retention};
use hindsight_core::{
    CheckpointId, CheckpointKind, Error, MetricSource, Node, Replica, Store, StoreOptions,
    WriterOptions,
};

fn options() -> StoreOptions {
    StoreOptions {
        chunk_size: 4096,
        ..Default::default()
    }
}

fn writer_options() -> WriterOptions {
    WriterOptions {
        staging_bytes: 1 << 20,
        threads: 2,
        nice: 0,
    }
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn save(w: &hindsight_core::Writer, name: &str, data: &[u8], meta: &[(&str, &str)]) {
    let mut b = w.begin(name).unwrap();
    let blob = b.stage(data).unwrap();
    let root = Node::Dict(vec![(Node::Str("w".into()), Node::Bytes(blob))]);
    let meta: BTreeMap<String, String> = meta
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    b.commit(root, meta).wait().unwrap();
}

fn read_w(r: &Replica, name: &str) -> hindsight_core::Result<Vec<u8>> {
    let t = r.read(name, &["w".to_string()], 2, &|| false)?;
    Ok(t.buffers.into_iter().next().unwrap_or_default())
}

#[test]
fn local_first_lists_reads_removes_and_verifies_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let (dest, local) = (dir.path().join("dest"), dir.path().join("local"));
    Store::open_local(&dest, true, Some(options())).unwrap();
    let r = Replica::open(dest.to_str().unwrap(), Some(&local), false, None).unwrap();
    assert_eq!(
        r.local_location().as_deref(),
        Some(&*local.to_string_lossy())
    );
    // The local copy took the destination's options.
    assert_eq!(r.primary().options().chunk_size, 4096);
    let w = r.start_writer(writer_options()).unwrap();
    let (a, b) = (bytes(10_000, 1), bytes(9_000, 2));
    save(&w, "a", &a, &[]);
    save(&w, "b", &b, &[]);
    w.flush().unwrap(); // waits for the uploads too
    assert_eq!(r.destination().list().unwrap(), ["a", "b"]);

    // A checkpoint only at the destination is listed and read from there.
    r.primary().remove("b").unwrap();
    assert_eq!(r.list().unwrap(), ["a", "b"]);
    assert_eq!(read_w(&r, "b").unwrap(), b);
    assert_eq!(read_w(&r, "a").unwrap(), a);

    let (n, problems) = r.verify(&[], |_| {}).unwrap();
    assert_eq!((n, problems.len()), (2, 0));
    let (_, missing) = r.verify(&["nope".into()], |_| {}).unwrap();
    assert_eq!(missing.len(), 1);

    // Removal goes from both sides; a second removal reports NotFound.
    r.remove("a").unwrap();
    assert!(!r.primary().list().unwrap().contains(&"a".to_string()));
    assert_eq!(r.destination().list().unwrap(), ["b"]);
    assert!(matches!(r.remove("a"), Err(Error::NotFound { .. })));
    let gc = r.gc().unwrap();
    assert!(gc.chunks_removed > 0);
    assert_eq!(read_w(&r, "b").unwrap(), b);
    assert!(matches!(
        r.read("b", &["x".to_string()], 1, &|| false),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn read_path_reports_damage_with_checkpoint_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open_local(dir.path(), true, Some(options())).unwrap());
    let r = Replica::single(store.clone());
    let w = r.start_writer(writer_options()).unwrap();
    let data = bytes(20_000, 3);
    save(&w, "c", &data, &[]);
    assert_eq!(read_w(&r, "c").unwrap(), data);
    let m = store.manifest("c").unwrap();
    let Node::Dict(items) = &m.root else { panic!() };
    let Node::Bytes(blob) = &items[0].1 else {
        panic!()
    };
    let chunk = store.storage().chunk_path(&blob.chunks[2].id);
    let mut raw = std::fs::read(&chunk).unwrap();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    std::fs::write(&chunk, raw).unwrap();
    match read_w(&r, "c") {
        Err(Error::Corrupt {
            checkpoint,
            key_path,
            path,
            ..
        }) => {
            assert_eq!(checkpoint.as_deref(), Some("c"));
            assert_eq!(key_path.as_deref(), Some("w"));
            assert_eq!(path, chunk);
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // A cancelled read stops with Interrupted, not with partial data.
    assert!(matches!(
        r.read("c", &[], 2, &|| true),
        Err(Error::Interrupted { .. })
    ));
}

#[test]
fn retention_by_id_with_metrics_from_meta_or_caller() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open_local(dir.path(), true, Some(options())).unwrap());
    let r = Replica::single(store);
    let w = r.start_writer(writer_options()).unwrap();
    let id = |p: &str, i, k| CheckpointId::new(p, "epoch", i, k).unwrap().name();
    let metrics = [0.5, 0.1, 0.4, 0.3];
    for (i, m) in metrics.iter().enumerate() {
        let i = i as u64;
        save(
            &w,
            &id("run", i, CheckpointKind::Step(7)),
            &bytes(100, 0),
            &[],
        );
        let metric = m.to_string();
        save(
            &w,
            &id("run", i, CheckpointKind::Block),
            &bytes(100, i as u8),
            &[("monitor", "val"), ("metric", &metric)],
        );
    }
    save(
        &w,
        &id("run", 4, CheckpointKind::Step(9)),
        &bytes(100, 9),
        &[],
    );
    save(
        &w,
        &id("other", 0, CheckpointKind::Block),
        &bytes(10, 0),
        &[],
    );
    assert_eq!(r.checkpoints("run").unwrap().len(), 9);

    let policy = Retention {
        keep_last: Some(1),
        keep_best: Some((1, BestMode::Min)),
        keep_every: None,
        keep_spread: None,
    };
    let removed = r
        .apply_retention("run", &policy, MetricSource::Meta { monitor: "val" })
        .unwrap();
    assert_eq!(removed.len(), 6, "{removed:?}");
    let left: Vec<String> = r
        .checkpoints("run")
        .unwrap()
        .iter()
        .map(|i| i.name())
        .collect();
    assert_eq!(
        left,
        [
            "run.epoch-000001",                // best (0.1)
            "run.epoch-000003",                // newest block
            "run.epoch-000004.step-000000009", // newer than every block
        ]
    );
    assert_eq!(r.checkpoints("other").unwrap().len(), 1);

    // The caller's metrics (by outer index) rank instead: now epoch 3 is best.
    let by_index: HashMap<u64, f64> = [(1, 0.9), (3, 0.2)].into_iter().collect();
    let policy = Retention {
        keep_last: None,
        keep_best: Some((1, BestMode::Min)),
        keep_every: None,
        keep_spread: None,
    };
    let removed = r
        .apply_retention("run", &policy, MetricSource::ByIndex(&by_index))
        .unwrap();
    assert_eq!(removed, ["run.epoch-000001"]);
}
