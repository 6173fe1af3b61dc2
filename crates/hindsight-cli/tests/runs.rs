//! End-to-end tests of the project commands (`runs`, `logs`, `show RUN`,
//! `replay`) and of the project home: the real `hindsight` binary against a
//! real run database and store in a temporary project.

// Test helpers outside `#[test]` functions may unwrap too: a panic is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use hindsight_core::runs::db::{IterationRow, LogDb, LogRow, NewRun, Phase, RunStatus};
use hindsight_core::{Array, ArrayLib, Node, Store, Writer, WriterOptions};

mod common;

/// 2024-03-01 12:00:00 UTC.
const T0: u64 = 1_709_294_400_000;
const HOUR: u64 = 3_600_000;

/// A project home (`$HINDSIGHT_HOME`) in a temporary directory.
struct Project {
    _dir: tempfile::TempDir,
    /// The temporary directory, symbolic links resolved (as the current
    /// directory of a process appears to it).
    root: PathBuf,
    home: PathBuf,
    /// Run ids, in the order created, and the placeholders that replace
    /// their random suffixes in output.
    ids: Vec<String>,
    /// A source hash, replaced by `<SOURCE>` in output.
    source: Option<String>,
}

impl Project {
    /// A home without a database or store.
    fn empty() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let home = root.join("home");
        Project {
            _dir: dir,
            root,
            home,
            ids: Vec::new(),
            source: None,
        }
    }

    fn db(&self) -> LogDb {
        LogDb::open(&self.home.join("logs.db")).unwrap()
    }

    fn create_run(&mut self, db: &LogDb, run: NewRun) -> String {
        let id = db.create_run(&run).unwrap();
        self.ids.push(id.clone());
        id
    }

    /// `hindsight` with `$HINDSIGHT_HOME` set to the home and
    /// `$HINDSIGHT_STORE` unset, in the temporary directory.
    fn command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hindsight"));
        cmd.env("HINDSIGHT_HOME", &self.home)
            .env_remove("HINDSIGHT_STORE")
            .current_dir(&self.root);
        cmd
    }

    /// Run `hindsight ARGS` (see [`Project::command`]).
    fn hs(&self, args: &[&str]) -> Output {
        self.output(self.command().args(args))
    }

    /// Run a prepared command, normalizing its output.
    fn output(&self, cmd: &mut Command) -> Output {
        let o = cmd.output().unwrap();
        let clean = |b: Vec<u8>| {
            let mut s = String::from_utf8(b).unwrap();
            for (i, id) in self.ids.iter().enumerate() {
                // Same width: keeps table columns aligned.
                s = s.replace(id, &format!("{}<run{}>", &id[..16], i + 1));
            }
            if let Some(hash) = &self.source {
                s = s.replace(hash, "<SOURCE>");
            }
            s.replace(self.home.to_str().unwrap(), "<HOME>")
                .replace(self.root.to_str().unwrap(), "<TMP>")
        };
        Output {
            code: o.status.code().unwrap(),
            stdout: clean(o.stdout),
            stderr: clean(o.stderr),
        }
    }
}

#[derive(Debug, PartialEq)]
struct Output {
    code: i32,
    stdout: String,
    stderr: String,
}

/// What a test expects: exit code, stdout, stderr.
fn expect(code: i32, stdout: &str, stderr: &str) -> Output {
    Output {
        code,
        stdout: stdout.into(),
        stderr: stderr.into(),
    }
}

fn new_run(script: &str, started_ms: u64, args: &str) -> NewRun {
    NewRun {
        script: script.into(),
        script_abs: format!("/src/proj/{script}"),
        project_root: "/src/proj".into(),
        source_hash: "0".repeat(64),
        args_json: args.into(),
        started_ms: Some(started_ms),
        host: "box".into(),
        pid: 4242,
        ..NewRun::default()
    }
}

fn row(name: &str, ctx: &[(&str, i64)], value: &str) -> LogRow {
    LogRow {
        name: name.into(),
        ctx: ctx.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        rep: 0,
        value_json: value.into(),
    }
}

fn iteration(idx: u64, seconds: f64, checkpoint: Option<&str>) -> IterationRow {
    IterationRow {
        value: None,
        loop_name: "epoch".into(),
        idx,
        seconds,
        checkpoint: checkpoint.map(String::from),
        materialize_seconds: checkpoint.map(|_| 0.25),
        restore_seconds: None,
    }
}

/// Three runs:
/// 1. `train.py` (completed, 1:02:03): `loss` per epoch and step, `acc` per
///    epoch, `final` at top level; a replay that agrees on `loss` at (0, 0),
///    disagrees at (1, 0) and adds `grad_norm`; two timed epochs.
/// 2. `train.py` (failed, no end time), nothing logged.
/// 3. `eval.py` (running, the newest), `loss` per step.
fn project() -> Project {
    let mut p = Project::empty();
    let db = p.db();

    let files = BTreeMap::from([
        ("train.py".to_string(), "print('train')\n".to_string()),
        ("model.py".to_string(), "W = 1\n".to_string()),
    ]);
    let mut r = new_run(
        "train.py",
        T0,
        r#"{"lr": 0.1, "epochs": 2, "tags": ["a", "b"]}"#,
    );
    r.source_hash = db.put_source(&files).unwrap();
    p.source = Some(r.source_hash.clone());
    r.git_commit = Some("0123456789abcdef0123456789abcdef01234567".into());
    r.git_dirty = Some(true);
    r.versions_json = r#"{"python": "3.11.4", "torch": "2.3.0", "cuda": null}"#.into();
    let train = p.create_run(&db, r);
    let mut rec = Vec::new();
    for e in 0..2 {
        for s in 0..2 {
            // As Python writes floats: `1.0`, `0.5`.
            let loss = format!("{:?}", 1.0 / (1 + 2 * e + s) as f64);
            rec.push(row("loss", &[("epoch", e), ("step", s)], &loss));
        }
        rec.push(row("acc", &[("epoch", e)], &format!("0.{}", 6 + e)));
    }
    rec.push(row("final", &[], r#"{"best": 0.7, "note": "ok"}"#));
    db.append_logs(&train, Phase::Record, &rec).unwrap();
    db.append_logs(
        &train,
        Phase::Replay,
        &[
            row("loss", &[("epoch", 0), ("step", 0)], "1"),
            row("grad_norm", &[("epoch", 0), ("step", 0)], "2.5"),
            row("loss", &[("epoch", 1), ("step", 0)], "0.34"),
            row("grad_norm", &[("epoch", 1), ("step", 0)], "NaN"),
        ],
    )
    .unwrap();
    db.record_iterations(
        &train,
        &[
            iteration(0, 1.5, Some("ck-epoch-0")),
            iteration(1, 2.25, None),
        ],
    )
    .unwrap();
    db.set_status(&train, RunStatus::Completed, Some(T0 + HOUR + 123_000))
        .unwrap();

    let failed = p.create_run(&db, new_run("train.py", T0 + 6 * HOUR, "{}"));
    db.set_status(&failed, RunStatus::Failed, None).unwrap();

    let eval = p.create_run(
        &db,
        new_run(
            "eval.py",
            T0 + 20 * HOUR + 1_800_000,
            r#"{"checkpoint": "runs/very/long/path/to/model.pt", "batch_size": 64}"#,
        ),
    );
    db.append_logs(
        &eval,
        Phase::Record,
        &[
            row("loss", &[("step", 0)], "0.9"),
            row("loss", &[("step", 10)], "0.8"),
            row("loss", &[("step", 2)], "0.85"),
        ],
    )
    .unwrap();
    p
}

// ---------------------------------------------------------------------------
// runs

#[test]
fn runs_lists_newest_first() {
    // ARGS shows, per script, the arguments that differ between its runs
    // (a missing one counts), in full up to 24 characters per value.
    let p = project();
    assert_eq!(
        p.hs(&["runs"]),
        expect(
            0,
            "\
RUN                     STATUS     STARTED              DURATION  SCRIPT    ARGS
20240302-083000-<run3>  running    2024-03-02 08:30:00   running  eval.py   checkpoint=\"runs/very/long/path/... batch_size=64
20240301-180000-<run2>  failed     2024-03-01 18:00:00         -  train.py  -
20240301-120000-<run1>  completed  2024-03-01 12:00:00   1:02:03  train.py  lr=0.1 epochs=2 tags=[\"a\",\"b\"]
",
            ""
        )
    );
    let limited = p.hs(&["runs", "--limit", "1"]);
    assert_eq!(limited.code, 0);
    assert_eq!(limited.stdout.lines().count(), 2, "{}", limited.stdout);
    assert!(limited.stdout.contains("<run3>"), "{}", limited.stdout);
}

#[test]
fn runs_json_has_every_field() {
    let p = project();
    let o = p.hs(&["runs", "--json", "-n", "3"]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let runs = v.as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["status"], "running");
    assert_eq!(runs[0]["duration_seconds"], serde_json::Value::Null);
    assert_eq!(runs[1]["ended"], serde_json::Value::Null);
    assert_eq!(
        runs[2],
        serde_json::json!({
            "id": "20240301-120000-<run1>",
            "status": "completed",
            "script": "train.py",
            "script_abs": "/src/proj/train.py",
            "project_root": "/src/proj",
            "started": "2024-03-01T12:00:00Z",
            "started_ms": T0,
            "ended": "2024-03-01T13:02:03Z",
            "ended_ms": T0 + HOUR + 123_000,
            "duration_seconds": 3723.0,
            "host": "box",
            "pid": 4242,
            "git_commit": "0123456789abcdef0123456789abcdef01234567",
            "git_dirty": true,
            "source_hash": runs[2]["source_hash"],
            "resume_key": null,
            "args": {"lr": 0.1, "epochs": 2, "tags": ["a", "b"]},
            "versions": {"python": "3.11.4", "torch": "2.3.0", "cuda": null},
        })
    );
    // Arguments keep the order they were written in.
    assert!(
        o.stdout
            .contains("\"args\": {\n      \"lr\": 0.1,\n      \"epochs\": 2,"),
        "{}",
        o.stdout
    );
}

#[test]
fn runs_of_an_empty_database_prints_only_the_header() {
    let p = Project::empty();
    drop(p.db());
    assert_eq!(
        p.hs(&["runs"]),
        expect(0, "RUN  STATUS  STARTED  DURATION  SCRIPT  ARGS\n", "")
    );
    assert_eq!(p.hs(&["runs", "--json"]), expect(0, "[]\n", ""));
    // `logs` needs a run.
    assert_eq!(
        p.hs(&["logs", "loss"]),
        expect(
            1,
            "",
            "error: no runs recorded in <HOME>/logs.db: run a script that uses hindsight first\n"
        )
    );
}

#[test]
fn commands_without_a_project_fail_with_code_1() {
    let p = Project::empty();
    let msg = "error: no hindsight project at <HOME> (no logs.db): \
               run a script that uses hindsight first\n";
    for args in [&["runs"][..], &["logs", "loss"], &["logs"]] {
        assert_eq!(p.hs(args), expect(1, "", msg), "{args:?}");
    }
    // The CLI never creates a project.
    assert!(!p.home.exists());
    // A home that is a file is named as such (issue 22: it read "no project").
    std::fs::write(&p.home, b"").unwrap();
    let msg = "error: invalid project home: <HOME> is a file, not a directory: \
               move it aside (or set $HINDSIGHT_HOME to a directory)\n";
    assert_eq!(p.hs(&["runs"]), expect(1, "", msg));
    std::fs::remove_file(&p.home).unwrap();
    // `show` of neither a run nor a checkpoint: no store to look in.
    assert_eq!(
        p.hs(&["show", "x"]),
        expect(
            2,
            "",
            "error: no store given: pass --store PATH or set HINDSIGHT_STORE \
             (the project home <HOME> has no store)\n"
        )
    );
}

// ---------------------------------------------------------------------------
// logs

#[test]
fn logs_default_to_the_latest_run() {
    let p = project();
    // Rows in context order (step 2 before step 10), not write order.
    let expected = expect(0, "step  loss\n   0   0.9\n   2  0.85\n  10   0.8\n", "");
    assert_eq!(p.hs(&["logs", "loss"]), expected);
    // The same as naming the run.
    assert_eq!(p.hs(&["logs", &p.ids[2], "loss"]), expected);
    // Without names: everything the run logged.
    assert_eq!(p.hs(&["logs"]), expected);
}

#[test]
fn logs_of_a_run_show_record_values_and_mark_differing_replays() {
    let p = project();
    let run = p.ids[0].as_str();
    assert_eq!(
        p.hs(&["logs", run, "loss", "acc", "grad_norm"]),
        expect(
            0,
            "\
epoch  step                               loss  acc  grad_norm
    0                                           0.6
    0     0                                1.0             2.5
    0     1                                0.5
    1                                           0.7
    1     0  0.3333333333333333 (replay: 0.34)             NaN
    1     1                               0.25
",
            ""
        )
    );
    // Only one phase: no markers.
    assert_eq!(
        p.hs(&["logs", run, "loss", "--phase", "record"]),
        expect(
            0,
            "\
epoch  step                loss
    0     0                 1.0
    0     1                 0.5
    1     0  0.3333333333333333
    1     1                0.25
",
            ""
        )
    );
    assert_eq!(
        p.hs(&["logs", run, "loss", "grad_norm", "--phase", "replay"]),
        expect(
            0,
            "\
epoch  step  loss  grad_norm
    0     0     1        2.5
    1     0  0.34        NaN
",
            ""
        )
    );
    // All names; the top-level context first, with empty loop columns.
    assert_eq!(
        p.hs(&["logs", run]),
        expect(
            0,
            "\
epoch  step                               loss  acc                     final  grad_norm
                                                     {\"best\":0.7,\"note\":\"ok\"}
    0                                           0.6
    0     0                                1.0                                       2.5
    0     1                                0.5
    1                                           0.7
    1     0  0.3333333333333333 (replay: 0.34)                                       NaN
    1     1                               0.25
",
            ""
        )
    );
}

#[test]
fn logs_json_lists_context_values_and_replays() {
    let p = project();
    let o = p.hs(&["logs", &p.ids[0], "loss", "grad_norm", "final", "--json"]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    // NaN is written as Python's json module writes (and reads) it.
    assert!(o.stdout.contains("\"grad_norm\": NaN"), "{}", o.stdout);
    let v: serde_json::Value = serde_json::from_str(&o.stdout.replace("NaN", "\"NaN\"")).unwrap();
    assert_eq!(
        v,
        serde_json::json!([
            {"ctx": {}, "rep": 0, "values": {"final": {"best": 0.7, "note": "ok"}},
             "replayed": {"final": false}, "diverged": {}, "flags": {}},
            {"ctx": {"epoch": 0, "step": 0}, "rep": 0, "values": {"loss": 1.0, "grad_norm": 2.5},
             "replayed": {"loss": true, "grad_norm": true}, "diverged": {}, "flags": {}},
            {"ctx": {"epoch": 0, "step": 1}, "rep": 0, "values": {"loss": 0.5},
             "replayed": {"loss": false}, "diverged": {}, "flags": {}},
            {"ctx": {"epoch": 1, "step": 0}, "rep": 0, "values": {"loss": 0.3333333333333333, "grad_norm": "NaN"},
             "replayed": {"loss": true, "grad_norm": true}, "diverged": {"loss": 0.34}, "flags": {}},
            {"ctx": {"epoch": 1, "step": 1}, "rep": 0, "values": {"loss": 0.25},
             "replayed": {"loss": false}, "diverged": {}, "flags": {}},
        ])
    );
}

#[test]
fn logs_of_an_unknown_run_or_name_fail_with_code_1() {
    let p = project();
    assert_eq!(
        p.hs(&["logs", "20200101-000000-000000", "loss"]),
        expect(
            1,
            "",
            "error: run not found: 20200101-000000-000000 (<HOME>/logs.db)\n"
        )
    );
    assert_eq!(
        p.hs(&["logs", &p.ids[0], "nope", "loss", "lr"]),
        expect(
            1,
            "",
            "error: run 20240301-120000-<run1> never logged 'nope', 'lr' \
             (it logged: loss, acc, final, grad_norm)\n"
        )
    );
    // A first argument that is not a run id is a name, of the latest run.
    assert_eq!(
        p.hs(&["logs", "acc"]),
        expect(
            1,
            "",
            "error: run 20240302-083000-<run3> never logged 'acc' (it logged: loss)\n"
        )
    );
    assert_eq!(
        p.hs(&["logs", &p.ids[1], "loss"]),
        expect(
            1,
            "",
            "error: run 20240301-180000-<run2> never logged 'loss' (it logged nothing)\n"
        )
    );
    let o = p.hs(&["logs", "--phase", "both", "loss"]);
    assert_eq!(o.code, 2);
    assert!(
        o.stderr
            .contains("invalid value 'both' for '--phase <PHASE>'"),
        "{}",
        o.stderr
    );
}

// ---------------------------------------------------------------------------
// show

#[test]
fn show_prints_a_run() {
    let p = project();
    assert_eq!(
        p.hs(&["show", &p.ids[0]]),
        expect(
            0,
            "\
run         20240301-120000-<run1>
status      completed
script      train.py
script path /src/proj/train.py
project     /src/proj
started     2024-03-01 12:00:00 UTC
ended       2024-03-01 13:02:03 UTC
duration    1:02:03
host        box (pid 4242)
git         0123456789abcdef0123456789abcdef01234567 (dirty)
source      <SOURCE> (2 files)
args        {
              \"lr\": 0.1,
              \"epochs\": 2,
              \"tags\": [
                \"a\",
                \"b\"
              ]
            }
version     python=3.11.4
version     torch=2.3.0
version     cuda=null

LOG        RECORD  REPLAY  DIVERGED
loss            4       2         1
acc             2       0         0
final           1       0         0
grad_norm       0       2         0

LOOP   ITERATIONS  CHECKPOINTS  SECONDS
epoch           2            1     3.75
",
            ""
        )
    );
}

#[test]
fn show_prints_a_run_that_logged_nothing() {
    let p = project();
    let o = p.hs(&["show", &p.ids[1]]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    assert!(
        o.stdout
            .contains("ended       -\nduration    -\nhost        box (pid 4242)\ngit         -\n"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout
            .ends_with("args        {}\n\nno logs\n\nno loop iterations recorded\n"),
        "{}",
        o.stdout
    );
}

/// Save a small checkpoint into `<home>/store`, creating the store.
fn save_checkpoint(home: &Path, name: &str) {
    let store = Arc::new(Store::open_local(&home.join("store"), true, None).unwrap());
    let writer = Writer::new(
        store,
        WriterOptions {
            staging_bytes: 1 << 20,
            threads: 1,
            nice: 0,
        },
    )
    .unwrap();
    let mut b = writer.begin(name).unwrap();
    let bytes: Vec<u8> = (0..16u32).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let blob = b.stage(&bytes).unwrap();
    let root = Node::Dict(vec![(
        Node::Str("w".into()),
        Node::Array(Box::new(Array {
            lib: ArrayLib::Torch,
            dtype: "float32".into(),
            shape: vec![16],
            byte_order: "little".into(),
            device: None,
            data: blob,
        })),
    )]);
    b.commit(root, BTreeMap::new()).wait().unwrap();
}

#[test]
fn show_of_a_checkpoint_uses_the_project_store() {
    let p = project();
    save_checkpoint(&p.home, "ck-epoch-0");
    let o = p.hs(&["show", "ck-epoch-0"]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    common::masked(|| {
        insta::assert_snapshot!(o.stdout, @r"
        checkpoint  ck-epoch-0
        created     YYYY-MM-DD hh:mm:ss UTC
        format      1

        KEY  TYPE                SIZE
        w    tensor float32[16]  64 B
        total: 64 B (64 bytes), 1 array
        ");
    });
    // Neither a run nor a checkpoint.
    assert_eq!(
        p.hs(&["show", "nope"]),
        expect(
            1,
            "",
            "error: checkpoint not found: nope (store <HOME>/store)\n"
        )
    );
}

#[test]
fn store_commands_default_to_the_project_store() {
    let p = Project::empty();
    save_checkpoint(&p.home, "a");
    let o = p.hs(&["ls"]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    common::masked(|| {
        insta::assert_snapshot!(o.stdout, @r"
        NAME  CREATED              SIZE  ARRAYS
        a     YYYY-MM-DD hh:mm:ss  64 B       1
        ");
    });
    assert_eq!(
        p.hs(&["verify"]),
        expect(0, "ok   a\nverified 1 checkpoint: all intact\n", "")
    );
    // --store, $HINDSIGHT_STORE and the positional STORE still win.
    let other = p.root.join("other");
    std::fs::create_dir(&other).unwrap();
    let msg = "error: store not found: <TMP>/other (no HINDSIGHT.json in that directory)\n";
    let other = other.to_str().unwrap();
    assert_eq!(p.hs(&["ls", "--store", other]), expect(1, "", msg));
    assert_eq!(p.hs(&["ls", other]), expect(1, "", msg));
    assert_eq!(
        p.output(p.command().arg("ls").env("HINDSIGHT_STORE", other)),
        expect(1, "", msg)
    );
    // An empty $HINDSIGHT_STORE counts as unset.
    let o = p.output(p.command().arg("verify").env("HINDSIGHT_STORE", ""));
    assert_eq!(o.stdout, "ok   a\nverified 1 checkpoint: all intact\n");
    // --home picks another project.
    assert_eq!(
        p.hs(&["ls", "--home", other]),
        expect(
            2,
            "",
            "error: no store given: pass --store PATH or set HINDSIGHT_STORE \
             (the project home <TMP>/other has no store)\n"
        )
    );
}

// ---------------------------------------------------------------------------
// One grammar: every command's help and main usage errors, the Python
// package's commands among them

/// A command line the grammar accepts for a Python command reaches the
/// Python package; this binary (the engine without Python) names it.
#[test]
fn python_commands_are_parsed_here_and_carried_out_by_the_package() {
    let p = Project::empty();
    for args in [
        &["replay", "train.py", "-j", "4", "--where", "epoch > 2"][..],
        &["plot", "loss", "-o", "x.png"],
        &["export", "loss", "--tensorboard", "tb"],
        &["record", "train.py", "--lr", "1", "--help"],
        &["data", "token", "--dataset", "m.f"],
    ] {
        let msg = format!(
            "error: hindsight {} is provided by the Python package: run \
             `python -m hindsight {} ...` (or the `hindsight` command installed by pip)\n",
            args[0], args[0]
        );
        assert_eq!(p.hs(args), expect(2, "", &msg), "{args:?}");
    }
}

#[test]
fn every_commands_help_comes_from_the_one_grammar() {
    let p = Project::empty();
    let commands: &[&[&str]] = &[
        &[],
        &["ls"],
        &["runs"],
        &["logs"],
        &["show"],
        &["consolidate"],
        &["verify"],
        &["rm"],
        &["gc"],
        &["du"],
        &["where"],
        &["settings"],
        &["repair"],
        &["run"],
        &["replay"],
        &["plot"],
        &["export"],
        &["record"],
        &["data"],
        &["data", "dispatcher"],
        &["data", "worker"],
        &["data", "token"],
    ];
    for command in commands {
        let args: Vec<&str> = command.iter().copied().chain(["--help"]).collect();
        let o = p.hs(&args);
        assert_eq!((o.code, o.stderr.as_str()), (0, ""), "{args:?}");
        let name = if command.is_empty() {
            "help".to_string()
        } else {
            format!("help_{}", command.join("_"))
        };
        insta::assert_snapshot!(name, o.stdout);
    }
}

#[test]
fn usage_errors_of_the_python_commands_exit_2_naming_the_argument() {
    let p = Project::empty();
    let cases: &[(&str, &[&str])] = &[
        ("replay_without_script", &["replay"]),
        ("replay_no_workers", &["replay", "t.py", "-j", "0"]),
        (
            "replay_unknown_launcher",
            &["replay", "t.py", "--launcher", "k8s"],
        ),
        ("plot_without_output", &["plot", "loss"]),
        (
            "export_with_plots_option",
            &["export", "loss", "-o", "x.png"],
        ),
        ("record_without_script", &["record"]),
        ("data_without_command", &["data"]),
        (
            "worker_without_dispatcher",
            &["data", "worker", "--dataset", "m:f"],
        ),
        (
            "dispatcher_bad_port",
            &["data", "dispatcher", "--journal", "j", "--port", "70000"],
        ),
    ];
    for (name, args) in cases {
        let o = p.hs(args);
        assert_eq!((o.code, o.stdout.as_str()), (2, ""), "{args:?}");
        insta::assert_snapshot!(format!("usage_{name}"), o.stderr);
    }
}

// ---------------------------------------------------------------------------
// Project home resolution

/// A run in a fresh database at `db`; returns its id.
fn one_run(db: &Path, script: &str) -> String {
    let db = LogDb::open(db).unwrap();
    db.create_run(&new_run(script, T0, "{}")).unwrap()
}

/// `hindsight runs` in `cwd` without `$HINDSIGHT_HOME`.
fn runs_in(p: &Project, cwd: &Path, extra: &[&str]) -> Output {
    p.output(
        p.command()
            .arg("runs")
            .args(extra)
            .env_remove("HINDSIGHT_HOME")
            .current_dir(cwd),
    )
}

#[test]
fn home_is_found_from_the_git_work_tree() {
    let mut p = Project::empty();
    let repo = p.root.join("repo");
    let cwd = repo.join("src/models");
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::create_dir(repo.join(".git")).unwrap();
    let id = one_run(&repo.join(".hindsight/logs.db"), "repo.py");
    p.ids.push(id);
    let o = runs_in(&p, &cwd, &[]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    assert!(o.stdout.contains("<run1>  running  "), "{}", o.stdout);
    assert!(o.stdout.contains("repo.py"), "{}", o.stdout);

    // A `.git` file (a worktree, a submodule) marks a work tree too.
    let sub = repo.join("vendor/sub");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::write(sub.join(".git"), "gitdir: ../../.git/modules/sub\n").unwrap();
    assert_eq!(
        runs_in(&p, &sub, &[]),
        expect(
            1,
            "",
            "error: no hindsight project at <TMP>/repo/vendor/sub/.hindsight (no logs.db): \
             run a script that uses hindsight first\n"
        )
    );
    p.ids
        .push(one_run(&sub.join(".hindsight/logs.db"), "sub.py"));
    let o = runs_in(&p, &sub, &[]);
    assert!(
        o.stdout.contains("<run2>") && o.stdout.contains("sub.py"),
        "{}",
        o.stdout
    );
    assert!(!o.stdout.contains("<run1>"), "{}", o.stdout);

    // --home wins over the work tree, $HINDSIGHT_HOME too.
    let home = repo.join(".hindsight");
    let o = runs_in(&p, &sub, &["--home", home.to_str().unwrap()]);
    assert!(o.stdout.contains("<run1>"), "{}", o.stdout);
    let o = p.output(
        p.command()
            .arg("runs")
            .env("HINDSIGHT_HOME", &home)
            .current_dir(&sub),
    );
    assert!(o.stdout.contains("<run1>"), "{}", o.stdout);
    let o = p.output(
        p.command()
            .args(["runs", "--home", sub.join(".hindsight").to_str().unwrap()])
            .env("HINDSIGHT_HOME", &home)
            .current_dir(&repo),
    );
    assert!(o.stdout.contains("<run2>"), "{}", o.stdout);
    // An empty $HINDSIGHT_HOME counts as unset.
    let o = p.output(
        p.command()
            .arg("runs")
            .env("HINDSIGHT_HOME", "")
            .current_dir(&cwd),
    );
    assert!(o.stdout.contains("<run1>"), "{}", o.stdout);
}

#[test]
fn home_without_git_is_in_the_current_directory() {
    let mut p = Project::empty();
    let cwd = p.root.join("plain/dir");
    std::fs::create_dir_all(&cwd).unwrap();
    if cwd.ancestors().any(|d| d.join(".git").exists()) {
        eprintln!("skipped: the temporary directory is inside a git work tree");
        return;
    }
    assert_eq!(
        runs_in(&p, &cwd, &[]),
        expect(
            1,
            "",
            "error: no hindsight project at <TMP>/plain/dir/.hindsight (no logs.db): \
             run a script that uses hindsight first\n"
        )
    );
    p.ids
        .push(one_run(&cwd.join(".hindsight/logs.db"), "plain.py"));
    let o = runs_in(&p, &cwd, &[]);
    assert_eq!((o.code, o.stderr.as_str()), (0, ""));
    assert!(o.stdout.contains("<run1>"), "{}", o.stdout);
    // Not from a subdirectory: without git, the project is where you are.
    let below = cwd.join("below");
    std::fs::create_dir(&below).unwrap();
    assert_eq!(runs_in(&p, &below, &[]).code, 1);
}
