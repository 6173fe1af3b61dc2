//! End-to-end tests: run the real `hindsight` binary against real stores.

// Test helpers outside `#[test]` functions may unwrap too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use hindsight_core::{Array, ArrayLib, Node, Store, Writer, WriterOptions};

mod common;

/// A fresh store in a temporary directory.
struct TestStore {
    _dir: tempfile::TempDir,
    root: PathBuf,
    writer: Writer,
}

impl TestStore {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let store = Arc::new(Store::open_local(&root, true, None).unwrap());
        let writer = Writer::new(
            store,
            WriterOptions {
                staging_bytes: 16 << 20,
                threads: 2,
                nice: 0,
            },
        )
        .unwrap();
        TestStore {
            _dir: dir,
            root,
            writer,
        }
    }

    /// Save a checkpoint holding float32 tensors (`key`, values) plus extra plain entries.
    fn save(&self, name: &str, tensors: &[(&str, Vec<f32>)], extra: Vec<(Node, Node)>) {
        self.save_with_meta(name, tensors, extra, BTreeMap::new());
    }

    fn save_with_meta(
        &self,
        name: &str,
        tensors: &[(&str, Vec<f32>)],
        extra: Vec<(Node, Node)>,
        meta: BTreeMap<String, String>,
    ) {
        let mut b = self.writer.begin(name).unwrap();
        let mut items = Vec::new();
        for (key, values) in tensors {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let blob = b.stage(&bytes).unwrap();
            items.push((
                Node::Str(key.to_string()),
                Node::Array(Box::new(Array {
                    lib: ArrayLib::Torch,
                    dtype: "float32".into(),
                    shape: vec![values.len() as u64],
                    byte_order: "little".into(),
                    device: None,
                    data: blob,
                })),
            ));
        }
        items.extend(extra);
        b.commit(Node::Dict(items), meta).wait().unwrap();
    }

    fn path(&self) -> &str {
        self.root.to_str().unwrap()
    }

    /// Every chunk file under `chunks/`, as paths relative to the store root.
    fn chunk_files(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for fan in std::fs::read_dir(self.root.join("chunks")).unwrap() {
            let fan = fan.unwrap().path();
            for f in std::fs::read_dir(&fan).unwrap() {
                out.push(f.unwrap().path().strip_prefix(&self.root).unwrap().into());
            }
        }
        out.sort();
        out
    }
}

fn floats(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| seed + i as f32 * 0.5).collect()
}

struct Output {
    code: i32,
    stdout: String,
    stderr: String,
}

/// A project home that does not exist: the tests here never fall back to a
/// project's store (see `runs.rs` for those that do).
const NO_HOME: &str = "/nonexistent/hindsight-home";

/// Run `hindsight ARGS` with HINDSIGHT_STORE unset (or set to `env_store`),
/// replacing `store` in the output with `<STORE>`.
fn hindsight_env(args: &[&str], store: Option<&Path>, env_store: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hindsight"));
    cmd.args(args)
        .env_remove("HINDSIGHT_STORE")
        .env("HINDSIGHT_HOME", NO_HOME);
    if let Some(s) = env_store {
        cmd.env("HINDSIGHT_STORE", s);
    }
    let o = cmd.output().unwrap();
    let clean = |b: Vec<u8>| {
        let s = String::from_utf8(b).unwrap();
        match store {
            Some(p) => s.replace(p.to_str().unwrap(), "<STORE>"),
            None => s,
        }
    };
    Output {
        code: o.status.code().unwrap(),
        stdout: clean(o.stdout),
        stderr: clean(o.stderr),
    }
}

fn hindsight(args: &[&str], store: &TestStore) -> Output {
    hindsight_env(args, Some(&store.root), None)
}

#[test]
fn ls_lists_checkpoints_in_aligned_columns() {
    let s = TestStore::new();
    s.save("ckpt-1", &[("w", floats(1024, 0.0))], vec![]);
    s.save(
        "epoch-10",
        &[("w", floats(300_000, 1.0)), ("b", floats(4, 2.0))],
        vec![(Node::Str("step".into()), Node::Int(10))],
    );
    let o = hindsight(&["ls", "--store", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stderr, "");
    common::masked(|| {
        insta::assert_snapshot!(o.stdout, @r"
        NAME      CREATED                 SIZE  ARRAYS
        ckpt-1    YYYY-MM-DD hh:mm:ss  4.0 KiB       1
        epoch-10  YYYY-MM-DD hh:mm:ss  1.1 MiB       2
        ");
    });

    // The store can also be given positionally or through the environment.
    let positional = hindsight(&["ls", s.path()], &s);
    assert_eq!(positional.stdout, o.stdout);
    let env = hindsight_env(&["ls"], Some(&s.root), Some(s.path()));
    assert_eq!(env.stdout, o.stdout);
    // The positional store wins over --store and the environment.
    let other = TestStore::new();
    let over = hindsight_env(
        &["ls", "--store", other.path(), s.path()],
        Some(&s.root),
        Some(other.path()),
    );
    assert_eq!(over.stdout, o.stdout);
}

#[test]
fn ls_time_column_is_the_creation_time_in_utc() {
    let s = TestStore::new();
    s.save("a", &[("w", floats(8, 0.0))], vec![]);
    let created_ms = Store::open_local(&s.root, false, None)
        .unwrap()
        .manifest("a")
        .unwrap()
        .created_ms;
    let o = hindsight(&["ls", "--json", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v[0]["created_ms"], created_ms);
    // The text column and the JSON field agree.
    let text = hindsight(&["ls", s.path()], &s).stdout;
    let created = v[0]["created"].as_str().unwrap();
    assert_eq!(created.len(), 20, "{created}");
    assert!(created.ends_with('Z'), "{created}");
    let column = created.replace('T', " ").replace('Z', "");
    assert!(text.contains(&column), "{text} vs {column}");
    // And it is now (the save just happened), by whole days since the epoch.
    let now_days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        / 86_400;
    assert_eq!(created_ms / 86_400_000, now_days);
}

#[test]
fn ls_of_an_empty_store_prints_only_the_header() {
    let s = TestStore::new();
    let o = hindsight(&["ls", s.path()], &s);
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (0, "NAME  CREATED  SIZE  ARRAYS\n", "")
    );
    let o = hindsight(&["ls", "--json", s.path()], &s);
    assert_eq!((o.code, o.stdout.as_str()), (0, "[]\n"));
}

#[test]
fn ls_json_describes_each_checkpoint() {
    let s = TestStore::new();
    let meta = BTreeMap::from([("epoch".to_string(), "3".to_string())]);
    s.save_with_meta("ckpt-1", &[("w", floats(16, 0.0))], vec![], meta);
    let o = hindsight(&["ls", "--json", "-s", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let mut v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    v[0]["created"] = "<TIME>".into();
    v[0]["created_ms"] = 0.into();
    assert_eq!(
        v,
        serde_json::json!([{
            "name": "ckpt-1",
            "created": "<TIME>",
            "created_ms": 0,
            "logical_bytes": 64,
            "arrays": 1,
            "meta": {"epoch": "3"},
        }])
    );
}

#[test]
fn show_prints_header_rows_and_total() {
    let s = TestStore::new();
    let meta = BTreeMap::from([
        ("epoch".to_string(), "3".to_string()),
        ("loss".to_string(), "0.25".to_string()),
    ]);
    s.save_with_meta(
        "ckpt-1",
        &[("w", floats(4096, 0.0)), ("b", floats(4, 1.0))],
        vec![
            (Node::Str("step".into()), Node::Int(300)),
            (Node::Str("name".into()), Node::Str("resnet".into())),
        ],
        meta,
    );
    let o = hindsight(&["show", "ckpt-1", "--store", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stderr, "");
    common::masked(|| {
        insta::assert_snapshot!(o.stdout, @r#"
        checkpoint  ckpt-1
        created     YYYY-MM-DD hh:mm:ss UTC
        format      1
        meta        epoch=3
        meta        loss=0.25

        KEY   TYPE                      SIZE
        w     tensor float32[4096]  16.0 KiB
        b     tensor float32[4]         16 B
        step  int 300                      -
        name  str "resnet"                 -
        total: 16.0 KiB (16400 bytes), 2 arrays
        "#);
    });
}

#[test]
fn show_of_an_unknown_checkpoint_fails_with_code_1() {
    let s = TestStore::new();
    let o = hindsight(&["show", "nope", "--store", s.path()], &s);
    assert_eq!(o.code, 1);
    assert_eq!(o.stdout, "");
    assert_eq!(
        o.stderr,
        "error: checkpoint not found: nope (store <STORE>)\n"
    );
}

#[test]
fn verify_of_an_intact_store_exits_0() {
    let s = TestStore::new();
    s.save("a", &[("w", floats(1000, 0.0))], vec![]);
    s.save("b", &[("w", floats(1000, 0.0))], vec![]);
    let o = hindsight(&["verify", s.path()], &s);
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (
            0,
            "ok   a\nok   b\nverified 2 checkpoints: all intact\n",
            ""
        )
    );
    let o = hindsight(&["verify", s.path(), "--name", "b"], &s);
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (0, "ok   b\nverified 1 checkpoint: all intact\n", "")
    );
}

#[test]
fn verify_names_checkpoint_key_and_file_of_a_flipped_byte() {
    let s = TestStore::new();
    s.save("good", &[("w", floats(1000, 0.0))], vec![]);
    s.save("ckpt-1", &[("w", floats(1000, 7.0))], vec![]);
    // The chunk that holds ckpt-1's `w`.
    let store = Store::open_local(&s.root, false, None).unwrap();
    let m = store.manifest("ckpt-1").unwrap();
    let Node::Dict(items) = &m.root else {
        panic!("not a dict")
    };
    let Node::Array(a) = &items[0].1 else {
        panic!("not an array")
    };
    let hex = a.data.chunks[0].id.to_hex();
    let rel = PathBuf::from("chunks").join(&hex[..2]).join(&hex[2..]);
    assert!(s.chunk_files().contains(&rel));

    let file = s.root.join(&rel);
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();

    let o = hindsight(&["verify", "--store", s.path()], &s);
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert_eq!(o.stderr, "");
    assert_eq!(
        o.stdout,
        format!(
            "FAIL ckpt-1: corrupt checkpoint 'ckpt-1' at key 'w': chunk content does not match \
             its hash (quarantined: the next save holding these bytes writes them again) \
             (file <STORE>/{})\nok   good\nverified 2 checkpoints: 1 problem\n",
            rel.display()
        )
    );
    // The damaged chunk is out of use (dedup will not trust it) but kept aside.
    assert!(!file.exists());
    assert!(s.root.join("quarantine").join(&hex).exists());

    // Only the intact one: exit 0.
    let o = hindsight(&["verify", "--store", s.path(), "--name", "good"], &s);
    assert_eq!(o.code, 0, "{}", o.stdout);
}

#[test]
fn verify_of_an_unknown_name_is_a_problem() {
    let s = TestStore::new();
    let o = hindsight(&["verify", s.path(), "-n", "nope", "-n", "nope"], &s);
    assert_eq!(o.code, 1);
    assert_eq!(
        o.stdout,
        "FAIL nope: checkpoint not found: nope (store <STORE>)\nverified 1 checkpoint: 1 problem\n"
    );
}

#[test]
fn rm_removes_and_reports_unknown_names() {
    let s = TestStore::new();
    s.save("a", &[("w", floats(10, 0.0))], vec![]);
    s.save("b", &[("w", floats(10, 1.0))], vec![]);

    let o = hindsight(&["rm", "nope", "--store", s.path()], &s);
    assert_eq!(o.code, 1);
    assert_eq!(o.stdout, "");
    assert_eq!(
        o.stderr,
        "error: checkpoint not found: nope (store <STORE>)\n"
    );

    // An unknown name does not stop the others.
    let o = hindsight(&["rm", "-s", s.path(), "a", "missing", "b"], &s);
    assert_eq!(o.code, 1);
    assert_eq!(
        o.stdout,
        "removed a\nremoved b\nnote: the space is reclaimed when you run `hindsight gc`\n"
    );
    assert_eq!(
        o.stderr,
        "error: checkpoint not found: missing (store <STORE>)\n"
    );
    let o = hindsight(&["ls", s.path()], &s);
    assert_eq!(o.stdout, "NAME  CREATED  SIZE  ARRAYS\n");
}

#[test]
fn a_missing_store_is_an_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-store");
    for args in [
        vec!["ls", missing.to_str().unwrap()],
        vec!["du", "--store", missing.to_str().unwrap()],
        vec!["show", "x", "--store", missing.to_str().unwrap()],
    ] {
        let o = hindsight_env(&args, Some(&missing), None);
        assert_eq!(o.code, 1, "{args:?}");
        assert_eq!(o.stdout, "");
        assert_eq!(
            o.stderr,
            "error: store not found: <STORE> (no HINDSIGHT.json in that directory)\n"
        );
    }
    // The CLI never creates a store.
    assert!(!missing.exists());
}

#[test]
fn no_store_given_is_a_usage_error() {
    for args in [
        &["ls"][..],
        &["gc"],
        &["du", "--json"],
        &["verify"],
        &["rm", "x"],
    ] {
        let o = hindsight_env(args, None, None);
        assert_eq!(o.code, 2, "{args:?}");
        assert_eq!(o.stdout, "");
        assert_eq!(
            o.stderr,
            "error: no store given: pass --store PATH or set HINDSIGHT_STORE \
             (the project home /nonexistent/hindsight-home has no store)\n"
        );
    }
    // An empty HINDSIGHT_STORE counts as unset.
    let o = hindsight_env(&["ls"], None, Some(""));
    assert_eq!(o.code, 2);
    assert_eq!(
        o.stderr,
        "error: no store given: pass --store PATH or set HINDSIGHT_STORE \
         (the project home /nonexistent/hindsight-home has no store)\n"
    );
}

#[test]
fn usage_errors_exit_2_and_help_exits_0() {
    let o = hindsight_env(&["ls", "--bogus"], None, None);
    assert_eq!(o.code, 2);
    assert!(
        o.stderr.contains("unexpected argument '--bogus'"),
        "{}",
        o.stderr
    );
    let o = hindsight_env(&["rm"], None, None);
    assert_eq!(o.code, 2);
    assert!(o.stderr.contains("<NAME>..."), "{}", o.stderr);
    let o = hindsight_env(&["--help"], None, None);
    assert_eq!(o.code, 0);
    assert!(
        o.stdout.contains("Usage: hindsight [OPTIONS] <COMMAND>"),
        "{}",
        o.stdout
    );
    assert_eq!(o.stderr, "");
}

#[test]
fn du_reports_the_dedup_ratio() {
    let s = TestStore::new();
    let data = floats(16 * 1024, 3.0); // 64 KiB
    s.save("a", &[("w", data.clone())], vec![]);
    s.save("b", &[("w", data)], vec![]);
    let o = hindsight(&["du", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stderr, "");
    let lines: Vec<&str> = o.stdout.lines().collect();
    assert_eq!(lines.len(), 7, "{}", o.stdout);
    assert_eq!(lines[0], "checkpoints          2");
    assert_eq!(lines[1], "logical size         128.0 KiB (131072 bytes)");
    assert_eq!(lines[2], "unique size          64.0 KiB (65536 bytes)");
    // Stored: one chunk (header + data) plus two small manifests.
    assert!(
        lines[3].starts_with("stored size          64."),
        "{}",
        lines[3]
    );
    let ratio: f64 = lines[4]
        .strip_prefix("dedup ratio          ")
        .and_then(|r| r.strip_suffix('x'))
        .unwrap()
        .parse()
        .unwrap();
    assert!((1.9..2.0).contains(&ratio), "{ratio}");
    assert_eq!(lines[5], "chunks               1");
    assert_eq!(lines[6], "unreferenced chunks  0");

    let o = hindsight(&["du", "--json", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["store"], "<STORE>");
    assert_eq!(v["checkpoints"], 2);
    assert_eq!(v["logical_bytes"], 131072);
    assert_eq!(v["unique_bytes"], 65536);
    assert_eq!(v["chunks"], 1);
    assert_eq!(v["unreferenced_chunks"], 0);
    let stored = v["stored_bytes"].as_u64().unwrap();
    assert!((65536 + 16..70_000).contains(&stored), "{stored}");
    let r = v["dedup_ratio"].as_f64().unwrap();
    assert!((r - 131072.0 / stored as f64).abs() < 1e-9, "{r}");
}

#[test]
fn gc_removes_chunks_after_rm() {
    let s = TestStore::new();
    s.save("keep", &[("w", floats(1024, 0.0))], vec![]);
    s.save(
        "drop",
        &[("w", floats(1024, 5.0)), ("b", floats(256, 9.0))],
        vec![],
    );
    assert_eq!(s.chunk_files().len(), 3);

    let o = hindsight(&["gc", s.path()], &s);
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (
            0,
            "removed 0 unreferenced chunks (0 B), 0 staging files\n",
            ""
        )
    );

    let o = hindsight(&["rm", "drop", "--store", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = hindsight(&["du", s.path()], &s);
    assert!(
        o.stdout
            .contains("unreferenced chunks  2 (run `hindsight gc` to remove them)\n"),
        "{}",
        o.stdout
    );

    let o = hindsight(&["gc", "--store", s.path()], &s);
    // 4 KiB + 1 KiB of data plus a 16-byte header per chunk.
    assert_eq!(
        (o.code, o.stdout.as_str(), o.stderr.as_str()),
        (
            0,
            "removed 2 unreferenced chunks (5.0 KiB), 0 staging files\n",
            ""
        )
    );
    assert_eq!(s.chunk_files().len(), 1);
    let o = hindsight(&["verify", s.path()], &s);
    assert_eq!(o.code, 0, "{}", o.stdout);
    assert_eq!(o.stdout, "ok   keep\nverified 1 checkpoint: all intact\n");
}

#[test]
fn an_unreadable_manifest_is_reported_without_hiding_the_others() {
    let s = TestStore::new();
    s.save("good", &[("w", floats(16, 0.0))], vec![]);
    std::fs::write(s.root.join("manifests/bad.hsm"), b"garbage").unwrap();
    let o = hindsight(&["ls", s.path()], &s);
    assert_eq!(o.code, 1);
    common::masked(|| {
        insta::assert_snapshot!(o.stdout, @r"
        NAME  CREATED              SIZE  ARRAYS
        good  YYYY-MM-DD hh:mm:ss  64 B       1
        ");
    });
    assert_eq!(
        o.stderr,
        "error: corrupt data: not a hindsight manifest (bad magic or truncated) \
         (file <STORE>/manifests/bad.hsm)\n"
    );
    // gc deletes nothing on partial knowledge, and says so, naming the file
    // and the way out.
    let o = hindsight(&["gc", s.path()], &s);
    assert_eq!(
        (o.code, o.stdout.as_str()),
        (1, "removed 0 unreferenced chunks (0 B), 0 staging files\n")
    );
    assert!(o.stderr.contains("manifests/bad.hsm"), "{}", o.stderr);
    assert!(
        o.stderr.contains("gc removes no chunk while it is there")
            && o.stderr.contains("`hindsight rm bad`"),
        "{}",
        o.stderr
    );
    let o = hindsight(&["verify", s.path()], &s);
    assert_eq!(o.code, 1);
    assert!(
        o.stdout.starts_with("FAIL bad: corrupt data: "),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout
            .ends_with("ok   good\nverified 2 checkpoints: 1 problem\n"),
        "{}",
        o.stdout
    );
}

/// This binary is built without the `s3` feature of hindsight-core (the
/// Python package's `hindsight` has it): an S3 URL is refused by name, not
/// taken for a directory.
#[cfg(not(feature = "s3"))]
#[test]
fn an_s3_url_without_s3_support_is_a_clear_error() {
    let o = hindsight_env(&["ls", "s3://bucket/ckpts"], None, None);
    assert_eq!(o.code, 1);
    assert_eq!(o.stdout, "");
    assert!(
        o.stderr.contains("s3://bucket/ckpts")
            && o.stderr.contains("no S3 support")
            && !o.stderr.contains("HINDSIGHT.json"),
        "{}",
        o.stderr
    );
}

/// Issue 22: `--backoff 1e300` ended in a Rust panic (a duration too large
/// to represent). Every duration is checked where it is parsed.
#[test]
fn a_duration_out_of_range_is_a_usage_error_not_a_panic() {
    for args in [
        ["run", "--backoff", "1e300", "--", "true"],
        ["run", "--hang-timeout", "1e300", "--", "true"],
        ["run", "--backoff", "-1", "--", "true"],
        ["run", "--backoff", "inf", "--", "true"],
    ] {
        let o = hindsight_env(&args, None, None);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert!(
            o.stderr.contains("give a number of seconds"),
            "{args:?}: {}",
            o.stderr
        );
        assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    }
}

#[test]
fn where_names_the_home_and_the_rule_that_chose_it() {
    const NOTE: &str = "A training script finds its home the same way, from the script's \
                        directory; set $HINDSIGHT_HOME to put it elsewhere.\n";
    let o = hindsight_env(&["where"], None, None);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(
        o.stdout,
        format!(
            "home   {NO_HOME}   ($HINDSIGHT_HOME names it)\n\
             runs   {NO_HOME}/logs.db (none yet: the first recording creates it)\n\
             store  {NO_HOME}/store (none yet: the first checkpoint creates it)\n{NOTE}"
        )
    );
    // Without $HINDSIGHT_HOME: the enclosing git work tree, from a subdirectory.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join(".git")).unwrap();
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    std::fs::create_dir_all(root.join(".hindsight/store")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_hindsight"))
        .arg("where")
        .current_dir(root.join("a/b"))
        .env_remove("HINDSIGHT_HOME")
        .env_remove("HINDSIGHT_STORE")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let r = root.display();
    assert_eq!(
        String::from_utf8(o.stdout).unwrap(),
        format!(
            "home   {r}/.hindsight   (.hindsight in the git work tree {r})\n\
             runs   {r}/.hindsight/logs.db (none yet: the first recording creates it)\n\
             store  {r}/.hindsight/store\n{NOTE}"
        )
    );
}

/// A run database at `path` holding one run that logged `values` as
/// `loss` at epochs 0, 1, ...
fn project_db(path: &Path, values: &[&str]) {
    use hindsight_core::runs::db::{LogDb, LogRow, NewRun, Phase};
    let db = LogDb::open(path).unwrap();
    let run = db
        .create_run(&NewRun {
            script: "t.py".into(),
            script_abs: "/p/t.py".into(),
            project_root: "/p".into(),
            source_hash: "h".into(),
            args_json: "{}".into(),
            host: "h".into(),
            versions_json: "{}".into(),
            ..NewRun::default()
        })
        .unwrap();
    let rows: Vec<LogRow> = values
        .iter()
        .enumerate()
        .map(|(e, v)| LogRow {
            name: "loss".into(),
            ctx: vec![("epoch".into(), e as i64)],
            rep: 0,
            value_json: (*v).into(),
        })
        .collect();
    db.append_logs(&run, Phase::Record, &rows).unwrap();
}

/// Issue 22: `hindsight verify` of a project checks its run database too,
/// and a changed digit inside a logged value (which SQLite's own checks do
/// not see) is named.
#[test]
fn verify_of_a_project_checks_its_run_database() {
    let s = TestStore::new();
    let home = s.root.parent().unwrap().to_path_buf();
    let db_path = home.join("logs.db");
    project_db(&db_path, &["0.123456", "0.654321"]);
    let verify = || {
        let o = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .arg("verify")
            .env_remove("HINDSIGHT_STORE")
            .env("HINDSIGHT_HOME", &home)
            .output()
            .unwrap();
        let text = String::from_utf8(o.stdout).unwrap();
        (
            o.status.code().unwrap(),
            text.replace(home.to_str().unwrap(), "<HOME>"),
        )
    };
    assert_eq!(
        verify(),
        (
            0,
            "verified 0 checkpoints: all intact\nok   <HOME>/logs.db: run database intact\n".into()
        )
    );
    // One digit of a value, changed in the file: the page stays valid SQLite.
    let mut bytes = std::fs::read(&db_path).unwrap();
    let at = bytes
        .windows(8)
        .position(|w| w == b"0.654321")
        .expect("the value is in the main database file after close");
    bytes[at + 2] = b'7';
    std::fs::write(&db_path, bytes).unwrap();
    let (code, out) = verify();
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL <HOME>/logs.db: ")
            && out.contains("1 value row(s) of table logs fail their checksum")
            && out.contains("loss at {\"epoch\":1}"),
        "{out}"
    );
    // Naming a store: only the store is verified.
    let o = hindsight(&["verify", s.path()], &s);
    assert_eq!(
        (o.code, o.stdout.as_str()),
        (0, "verified 0 checkpoints: all intact\n")
    );
}

/// Issue 22: a damaged run database names the way forward, and `hindsight
/// repair` takes it: every intact row kept, the damaged file kept beside.
#[test]
fn repair_rebuilds_a_damaged_run_database() {
    use hindsight_core::runs::db::LogDb;
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().canonicalize().unwrap();
    let db_path = home.join("logs.db");
    let repair = || {
        let o = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .arg("repair")
            .env_remove("HINDSIGHT_STORE")
            .env("HINDSIGHT_HOME", &home)
            .output()
            .unwrap();
        let clean = |b: Vec<u8>| {
            String::from_utf8(b)
                .unwrap()
                .replace(home.to_str().unwrap(), "<HOME>")
        };
        (o.status.code().unwrap(), clean(o.stdout), clean(o.stderr))
    };
    let (code, _, err) = repair();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no hindsight project"), "{err}");
    project_db(&db_path, &["0.023456", "0.123456", "0.223456"]);
    assert_eq!(
        repair(),
        (
            0,
            "<HOME>/logs.db: intact, nothing to repair\n".into(),
            String::new()
        )
    );
    let mut bytes = std::fs::read(&db_path).unwrap();
    let at = bytes.windows(8).position(|w| w == b"0.123456").unwrap();
    bytes[at + 3] = b'9';
    std::fs::write(&db_path, bytes).unwrap();
    let (code, out, err) = repair();
    assert_eq!(code, 0, "{err}");
    let damaged = out
        .lines()
        .last()
        .unwrap()
        .strip_prefix("the damaged file is kept as <HOME>/")
        .unwrap()
        .to_string();
    assert!(damaged.starts_with("logs.db-damaged-"), "{out}");
    assert_eq!(
        out,
        format!(
            "<HOME>/logs.db: rebuilt from its readable rows\n  \
             runs       1 kept\n  \
             sources    0 kept\n  \
             iterations 0 kept\n  \
             batches    0 kept\n  \
             logs       2 kept; dropped: 1 failed their checksum\n\
             the damaged file is kept as <HOME>/{damaged}\n"
        )
    );
    assert!(home.join(&damaged).is_file());
    let db = LogDb::open_checked(&db_path).unwrap();
    db.verify().unwrap();
}

#[test]
fn settings_lists_each_variable_with_its_value_and_names_a_bad_one() {
    let run = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hindsight"));
        cmd.arg("settings");
        for s in hindsight_core::settings::ALL {
            cmd.env_remove(s.name);
        }
        cmd.envs(env.iter().copied());
        let o = cmd.output().unwrap();
        (
            o.status.code().unwrap(),
            String::from_utf8(o.stdout).unwrap(),
        )
    };
    let (code, out) = run(&[("HINDSIGHT_EPSILON", "0.1")]);
    assert_eq!(code, 0);
    // Users' variables only, each once, the value set here shown.
    for s in hindsight_core::settings::ALL {
        let listed = out.matches(&format!("{} (", s.name)).count();
        assert_eq!(listed, usize::from(!s.internal), "{}", s.name);
    }
    assert!(out.contains("HINDSIGHT_EPSILON (float): = 0.1\n"), "{out}");
    assert!(out.contains("HINDSIGHT_HOME (path): unset\n"), "{out}");
    // A value that does not parse is named, with why, and the exit code says so.
    let (code, out) = run(&[("HINDSIGHT_RESUME", "maybe")]);
    assert_eq!(code, 1);
    insta::assert_snapshot!(
        out.lines().find(|l| l.starts_with("HINDSIGHT_RESUME")).unwrap(),
        @r#"HINDSIGHT_RESUME (flag): INVALID: invalid $HINDSIGHT_RESUME: "maybe" is not a flag: give 1 or 0"#
    );
}
