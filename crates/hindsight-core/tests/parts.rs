//! Multi-rank checkpoints against a real store: each rank's part is saved
//! by the background writer under its hidden name; nothing is listed until
//! the merged manifest commits; gc keeps the chunks of parts in flight and
//! removes parts no commit will use; a region is read from the pieces.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hindsight_core::checkpoint::format::{Array, ArrayLib, Node, Shard, Sharded};
use hindsight_core::checkpoint::parts::RegionRequest;
use hindsight_core::checkpoint::replica::{LeftOut, Replica};
use hindsight_core::checkpoint::shard;
use hindsight_core::{Store, StoreOptions, Writer, WriterOptions};

fn store(dir: &std::path::Path) -> Arc<Store> {
    let opts = StoreOptions {
        chunk_size: 4096,
        ..Default::default()
    };
    Arc::new(Store::open_local(dir, true, Some(opts)).unwrap())
}

/// Columns of the whole array: 8 rows of COLS float32 values, element i = i
/// (each rank's half is 4 chunks of the store's 4 KiB).
const COLS: u64 = 1024;

fn whole() -> Vec<u8> {
    (0..8 * COLS as u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect()
}

/// Rank `rank` of 2 saves its half of the rows, and a step both agree on,
/// in save attempt "a1".
fn save_part(w: &Writer, name: &str, rank: u64) {
    save_part_of(w, name, rank, "a1", 5);
}

fn save_part_of(w: &Writer, name: &str, rank: u64, attempt: &str, step: i64) {
    let half = 4 * COLS as usize * 4;
    let rows = &whole()[rank as usize * half..(rank as usize + 1) * half];
    let mut b = w
        .begin(&shard::part_name(name, rank, 2, attempt).unwrap())
        .unwrap();
    let piece = Shard {
        offset: vec![rank * 4, 0],
        array: Array {
            lib: ArrayLib::Torch,
            dtype: "float32".into(),
            shape: vec![4, COLS],
            byte_order: "little".into(),
            device: None,
            data: b.stage(rows).unwrap(),
        },
    };
    let root = Node::Dict(vec![
        (
            Node::Str("w".into()),
            Node::Sharded(Box::new(Sharded {
                shape: vec![8, COLS],
                shards: vec![piece],
            })),
        ),
        (Node::Str("step".into()), Node::Int(step)),
    ]);
    b.commit(root, BTreeMap::new()).wait().unwrap();
}

#[test]
fn parts_commit_once_survive_gc_and_read_back_by_region() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = Writer::new(s.clone(), WriterOptions::default()).unwrap();
    save_part(&w, "ck", 0);
    // One rank's part is durable: nothing is listed, the commit waits for
    // the other and gives up naming it.
    assert!(s.list().unwrap().is_empty());
    let e = s
        .commit_parts("ck", 2, "a1", Duration::from_millis(50), &|| false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank(s) 1 of 2 committed no part"), "{e}");
    // gc meanwhile keeps the chunks of the part in flight.
    s.gc().unwrap();
    save_part(&w, "ck", 1);
    let m = s
        .commit_parts("ck", 2, "a1", Duration::from_secs(5), &|| false)
        .unwrap();
    assert_eq!(shard::saved_world(&m.meta), Some(2));
    assert_eq!(s.list().unwrap(), vec!["ck".to_string()]);
    assert!(s.parts_present("ck", 2, "a1").unwrap().is_empty());
    assert!(s.verify(&[], |_| {}).unwrap().1.is_empty());
    // Rows 3..6, columns 1..3: across both pieces.
    let got = s
        .read_regions(
            "ck",
            &[RegionRequest {
                path: vec!["w".into()],
                whole: vec![8, COLS],
                offset: vec![3, 1],
                shape: vec![3, 2],
            }],
            2,
            &|| false,
        )
        .unwrap();
    let want: Vec<u8> = (3..6u32)
        .flat_map(|r| (1..3u32).map(move |c| r * COLS as u32 + c))
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    assert_eq!(got[0].data, want);
    // A leftover part of a committed checkpoint (its committer died before
    // removing it) is removed by gc; so is one of a job long dead.
    save_part(&w, "ck", 0);
    let committed = s.manifest("ck").unwrap().created_ms;
    assert_eq!(
        s.remove_stale_parts(committed).unwrap(),
        0,
        "a newer save in flight stays"
    );
    save_part(&w, "gone", 1);
    let later = committed + shard_stale_ms() + 1_000;
    assert_eq!(s.remove_stale_parts(later).unwrap(), 2);
    assert!(s.parts_present("gone", 2, "a1").unwrap().is_empty());
}

/// A rank resuming a sharded model reads its own box of each sharded
/// array, never the whole one: the tree comes back without the arrays it
/// asks to leave out (their whole shapes listed), the rest read as usual.
#[test]
fn a_read_leaves_out_the_arrays_asked_and_reads_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = Writer::new(s.clone(), WriterOptions::default()).unwrap();
    save_part(&w, "ck", 0);
    save_part(&w, "ck", 1);
    s.commit_parts("ck", 2, "a1", Duration::from_secs(5), &|| false)
        .unwrap();
    let r = Replica::single(s.clone());
    let path = |p: &[&str]| p.iter().map(|k| k.to_string()).collect::<Vec<_>>();
    // "step" is no array and "nope" is not there: both read as usual.
    let skip = [path(&["w"]), path(&["step"]), path(&["nope"])];
    let read = r.read_leaving_out("ck", &[], &skip, 2, &|| false).unwrap();
    assert_eq!(
        read.left_out,
        vec![LeftOut {
            path: path(&["w"]),
            dtype: "float32".into(),
            shape: vec![8, COLS],
        }]
    );
    assert!(
        read.buffers.is_empty(),
        "no byte of the array left out was read"
    );
    assert_eq!(read.node.select(&path(&["w"])), Some(&Node::None));
    assert_eq!(read.node.select(&path(&["step"])), Some(&Node::Int(5)));
    // Without `skip`, the same read consolidates the pieces into the whole.
    let all = r.read("ck", &[], 2, &|| false).unwrap();
    assert!(all.left_out.is_empty());
    assert_eq!(all.buffers, vec![whole()]);
    // Rank 1's piece damaged: rank 0's box reads without touching it; a
    // box over it fails naming the array, not a position in the read.
    let m = s.manifest("ck").unwrap();
    let Some(Node::Sharded(w_node)) = m.root.select(&path(&["w"])) else {
        panic!("w is sharded")
    };
    let piece = w_node.shards.iter().find(|p| p.offset[0] == 4).unwrap();
    let file = s.storage().chunk_path(&piece.array.data.chunks[0].id);
    let mut bytes = std::fs::read(&file).unwrap();
    *bytes.last_mut().unwrap() ^= 0xFF;
    let mut perms = std::fs::metadata(&file).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perms.set_readonly(false);
    std::fs::set_permissions(&file, perms).unwrap();
    std::fs::write(&file, bytes).unwrap();
    let rows = |from: u64| RegionRequest {
        path: path(&["w"]),
        whole: vec![8, COLS],
        offset: vec![from, 0],
        shape: vec![4, COLS],
    };
    let mine = s.read_regions("ck", &[rows(0)], 2, &|| false).unwrap();
    assert_eq!(mine[0].data, whole()[..4 * COLS as usize * 4]);
    let e = s
        .read_regions("ck", &[rows(4)], 2, &|| false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("checkpoint 'ck' at key 'w'"), "{e}");
}

fn shard_stale_ms() -> u64 {
    hindsight_core::checkpoint::parts::STALE_PART.as_millis() as u64
}

/// The reproduction, on the store: a save of "ck" whose rank 0 died
/// before its part was written leaves rank 1's part; the next save of "ck"
/// (another attempt) commits its own two parts only, never the stale one.
#[test]
fn a_commit_merges_only_the_parts_of_its_own_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = Writer::new(s.clone(), WriterOptions::default()).unwrap();
    save_part_of(&w, "ck", 1, "first", 1); // rank 0 of "first" was killed
    save_part_of(&w, "ck", 0, "second", 2);
    // Rank 1 of "second" has not written yet: "first"'s rank 1 is not taken for it.
    let e = s
        .commit_parts("ck", 2, "second", Duration::from_millis(50), &|| false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank(s) 1 of 2 committed no part"), "{e}");
    save_part_of(&w, "ck", 1, "second", 2);
    let m = s
        .commit_parts("ck", 2, "second", Duration::from_secs(5), &|| false)
        .unwrap();
    assert_eq!(
        m.meta.get(shard::META_ATTEMPT).map(String::as_str),
        Some("second")
    );
    let Node::Dict(items) = &m.root else { panic!() };
    let step = items
        .iter()
        .find(|(k, _)| *k == Node::Str("step".into()))
        .unwrap();
    assert_eq!(
        step.1,
        Node::Int(2),
        "every part of the committed checkpoint is the second save's"
    );
    // The stale part stays hidden, and gc removes it (the commit is newer).
    assert_eq!(s.list().unwrap(), vec!["ck".to_string()]);
    assert_eq!(s.parts_present("ck", 2, "first").unwrap(), vec![1]);
    s.gc().unwrap();
    assert!(s.parts_present("ck", 2, "first").unwrap().is_empty());
}

/// Issue 42, item 6: `verify` runs what a load runs. Manifests re-encoded
/// (so their own checksums pass) with pieces that overlap, leave a hole,
/// claim a larger whole, repeat, or are gone: a load refuses each, and
/// verify names each as a problem, never "intact".
#[test]
fn verify_refuses_every_sharded_checkpoint_a_load_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = Writer::new(s.clone(), WriterOptions::default()).unwrap();
    save_part(&w, "ck", 0);
    save_part(&w, "ck", 1);
    s.commit_parts("ck", 2, "a1", Duration::from_secs(5), &|| false)
        .unwrap();
    assert!(s.verify(&[], |_| {}).unwrap().1.is_empty());
    let crafted = |name: &str, edit: &dyn Fn(&mut Sharded)| {
        let mut m = s.manifest("ck").unwrap();
        let Node::Dict(items) = &mut m.root else {
            panic!()
        };
        let Node::Sharded(sh) = &mut items[0].1 else {
            panic!()
        };
        edit(sh);
        m.name = name.into();
        s.storage()
            .put_manifest(name, &m.encode().unwrap())
            .unwrap();
    };
    crafted("overlap", &|sh| sh.shards[1].offset = vec![3, 0]);
    crafted("hole", &|sh| sh.shards[1].offset = vec![4, 0]);
    crafted("hole", &|sh| {
        sh.shards.truncate(1);
    });
    crafted("larger", &|sh| sh.shape = vec![16, COLS]);
    crafted("repeated", &|sh| {
        let again = sh.shards[1].clone();
        sh.shards.push(again);
    });
    crafted("none", &|sh| sh.shards.clear());
    let r = Replica::single(s.clone());
    let (_, problems) = s.verify(&[], |_| {}).unwrap();
    for name in ["overlap", "hole", "larger", "repeated", "none"] {
        assert!(
            r.read(name, &[], 2, &|| false).is_err(),
            "a load of {name} is refused"
        );
        let p = problems
            .iter()
            .find(|p| p.checkpoint.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("verify says {name} is intact: {problems:?}"));
        assert!(
            p.error.to_string().contains("cannot be loaded"),
            "{}",
            p.error
        );
    }
    assert!(!problems
        .iter()
        .any(|p| p.checkpoint.as_deref() == Some("ck")));
}

/// Issue 42, item 1: of two jobs saving one name at once, the save requested
/// later keeps the name, and the other, committing after it, gets an error
/// naming the conflict instead of overwriting it with older state. Both
/// for multi-rank commits (another attempt) and for whole saves (two
/// writers of one store).
#[test]
fn of_two_saves_of_one_name_at_once_the_older_committing_last_is_refused_naming_the_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path());
    let w = Writer::new(s.clone(), WriterOptions::default()).unwrap();
    save_part_of(&w, "ck", 0, "older", 1);
    save_part_of(&w, "ck", 1, "older", 1);
    std::thread::sleep(Duration::from_millis(5));
    save_part_of(&w, "ck", 0, "newer", 2);
    save_part_of(&w, "ck", 1, "newer", 2);
    s.commit_parts("ck", 2, "newer", Duration::from_secs(5), &|| false)
        .unwrap();
    let e = s
        .commit_parts("ck", 2, "older", Duration::from_secs(5), &|| false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("checkpoint 'ck'") && e.contains("another save of this name"),
        "{e}"
    );
    let kept = s.manifest("ck").unwrap();
    assert_eq!(
        kept.meta.get(shard::META_ATTEMPT).map(String::as_str),
        Some("newer")
    );
    // Two writers of one store, one name: the first requested commits last.
    let other = Writer::new(store(dir.path()), WriterOptions::default()).unwrap();
    let mut first = w.begin("latest").unwrap();
    let a = first.stage(&[1u8; 64]).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut second = other.begin("latest").unwrap();
    let b = second.stage(&[2u8; 64]).unwrap();
    let leaf = |data| {
        Node::Array(Box::new(Array {
            lib: ArrayLib::Torch,
            dtype: "uint8".into(),
            shape: vec![64],
            byte_order: "little".into(),
            device: None,
            data,
        }))
    };
    second.commit(leaf(b), BTreeMap::new()).wait().unwrap();
    let e = first
        .commit(leaf(a), BTreeMap::new())
        .wait()
        .unwrap_err()
        .to_string();
    assert!(e.contains("another save of this name"), "{e}");
    let m = s.manifest("latest").unwrap();
    let again = Writer::new(store(dir.path()), WriterOptions::default()).unwrap();
    let mut later = again.begin("latest").unwrap();
    let c = later.stage(&[3u8; 64]).unwrap();
    later.commit(leaf(c), BTreeMap::new()).wait().unwrap();
    assert!(s.manifest("latest").unwrap().created_ms >= m.created_ms);
}
