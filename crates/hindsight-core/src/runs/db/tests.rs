use super::*;
use crate::error::ErrorKind;
use crate::runs::dates::now_ms;
use crate::runs::ids::{new_run_id, source_hash};
use crate::runs::json;
use std::collections::BTreeMap;
use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

fn new_run(script: &str) -> NewRun {
    NewRun {
        script: script.into(),
        script_abs: format!("/proj/{script}"),
        project_root: "/proj".into(),
        source_hash: "abc".into(),
        args_json: r#"{"lr": 0.1, "epochs": 3}"#.into(),
        host: "host1".into(),
        versions_json: r#"{"python": "3.12"}"#.into(),
        pid: 42,
        ..NewRun::default()
    }
}

fn row(name: &str, ctx: &[(&str, i64)], value: &str) -> LogRow {
    LogRow {
        name: name.into(),
        ctx: ctx.iter().map(|(n, i)| (n.to_string(), *i)).collect(),
        rep: 0,
        value_json: value.into(),
    }
}

fn temp_db() -> (tempfile::TempDir, LogDb) {
    let dir = tempfile::tempdir().unwrap();
    let db = LogDb::open(&dir.path().join("sub/dir/hindsight.db")).unwrap();
    (dir, db)
}

#[test]
fn log_db_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<LogDb>();
}

#[test]
fn run_ids_start_with_the_utc_date() {
    // 2024-02-29 23:59:59.999 UTC (leap day).
    assert!(new_run_id(1_709_251_199_999).starts_with("20240229-235959-"));
    assert!(new_run_id(978_266_096_000).starts_with("20001231-123456-"));
}

#[test]
fn run_ids_are_unique_in_the_same_millisecond() {
    let ms = 1_700_000_000_123;
    let ids: HashSet<String> = (0..200_000).map(|_| new_run_id(ms)).collect();
    assert_eq!(ids.len(), 200_000);
    let id = ids.iter().next().unwrap();
    assert_eq!(id.len(), "YYYYMMDD-HHMMSS-xxxxxx".len());
    assert!(id.starts_with("20231114-221320-"), "{id}");
    assert!(id[16..].bytes().all(|b| b.is_ascii_hexdigit()));
}

#[test]
fn create_list_and_status() {
    let (_dir, db) = temp_db();
    assert!(db.runs(None).unwrap().is_empty());
    assert_eq!(db.latest_run().unwrap(), None);

    let mut a = new_run("train.py");
    a.started_ms = Some(1_000);
    a.git_commit = Some("deadbeef".into());
    a.git_dirty = Some(true);
    a.resume_key = Some("k1".into());
    let id_a = db.create_run(&a).unwrap();
    let mut b = new_run("eval.py");
    b.started_ms = Some(2_000);
    b.args_json = String::new(); // empty means {}
    let id_b = db.create_run(&b).unwrap();
    let mut c = new_run("train.py");
    c.started_ms = Some(2_000); // same start as b: both kept, newest inserted first
    let id_c = db.create_run(&c).unwrap();
    assert_ne!(id_b, id_c);

    let ra = db.run(&id_a).unwrap();
    assert_eq!(ra.script, "train.py");
    assert_eq!(ra.script_abs, "/proj/train.py");
    assert_eq!(ra.status, RunStatus::Running);
    assert_eq!(ra.started_ms, 1_000);
    assert_eq!(ra.ended_ms, None);
    assert_eq!(ra.git_commit.as_deref(), Some("deadbeef"));
    assert_eq!(ra.git_dirty, Some(true));
    assert_eq!(ra.args_json, r#"{"lr": 0.1, "epochs": 3}"#);
    assert_eq!(ra.versions_json, r#"{"python": "3.12"}"#);
    assert_eq!((ra.pid, ra.host.as_str()), (42, "host1"));
    assert_eq!(ra.resume_key.as_deref(), Some("k1"));
    assert_eq!(db.run(&id_b).unwrap().args_json, "{}");
    assert_eq!(db.run(&id_b).unwrap().git_dirty, None);

    let ids: Vec<String> = db.runs(None).unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![id_c.clone(), id_b.clone(), id_a.clone()]);
    assert_eq!(db.runs(Some(1)).unwrap().len(), 1);
    assert_eq!(db.latest_run().unwrap().unwrap().id, id_c);
    let of = |script: &str, root: &str| -> Vec<String> {
        db.runs_of(Path::new(script), Path::new(root))
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    assert_eq!(of("/proj/eval.py", "/proj"), vec![id_b.clone()]);
    assert_eq!(
        of("/proj/train.py", "/proj"),
        vec![id_c.clone(), id_a.clone()]
    );
    assert!(of("/nope.py", "/").is_empty());
    // The project moved: its runs are found, with their paths where it is now.
    assert_eq!(
        of("/moved/train.py", "/moved"),
        vec![id_c.clone(), id_a.clone()]
    );
    let moved = db
        .runs_of(Path::new("/moved/eval.py"), Path::new("/moved"))
        .unwrap();
    assert_eq!(moved[0].script_abs, "/moved/eval.py");

    db.set_status(&id_a, RunStatus::Completed, Some(5_000))
        .unwrap();
    let ra = db.run(&id_a).unwrap();
    assert_eq!(
        (ra.status, ra.ended_ms),
        (RunStatus::Completed, Some(5_000))
    );
    assert_eq!(
        "interrupted".parse::<RunStatus>().unwrap(),
        RunStatus::Interrupted
    );
    assert!("done".parse::<RunStatus>().is_err());
    assert_eq!(RunStatus::Failed.to_string(), "failed");
    assert_eq!("replay".parse::<Phase>().unwrap(), Phase::Replay);

    // Default start time is now.
    let before = now_ms();
    let id_d = db.create_run(&new_run("x.py")).unwrap();
    assert!(db.run(&id_d).unwrap().started_ms >= before);
}

#[test]
fn invalid_run_arguments() {
    let (_dir, db) = temp_db();
    let mut r = new_run("train.py");
    r.args_json = "[1, 2]".into();
    let e = db.create_run(&r).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("train.py"), "{e}");
    r.args_json = "{oops".into();
    assert!(db.create_run(&r).is_err());
    r.args_json = "{}".into();
    r.versions_json = "not json".into();
    assert!(db.create_run(&r).is_err());
}

#[test]
fn resumable_runs() {
    let (_dir, db) = temp_db();
    let mk = |ms: u64, key: &str| {
        let mut r = new_run("train.py");
        r.started_ms = Some(ms);
        r.resume_key = Some(key.into());
        db.create_run(&r).unwrap()
    };
    let old = mk(1, "k");
    let newer = mk(2, "k");
    let other = mk(3, "other");
    db.set_status(&old, RunStatus::Interrupted, Some(10))
        .unwrap();
    db.set_status(&newer, RunStatus::Completed, Some(20))
        .unwrap();
    assert_eq!(db.find_resumable("k", false).unwrap().unwrap().id, old);
    // A run that died without updating its status is still `running`.
    assert_eq!(
        db.find_resumable("other", false).unwrap().unwrap().id,
        other
    );
    db.set_status(&other, RunStatus::Failed, Some(30)).unwrap();
    assert_eq!(db.find_resumable("other", false).unwrap(), None);
    assert_eq!(db.find_resumable("none", false).unwrap(), None);
    // Resuming: back to running, end time cleared.
    db.set_status(&old, RunStatus::Running, None).unwrap();
    let r = db.run(&old).unwrap();
    assert_eq!((r.status, r.ended_ms), (RunStatus::Running, None));
}

#[test]
fn unknown_run_id_errors_name_it() {
    let (_dir, db) = temp_db();
    let check = |e: Error| {
        assert!(matches!(e, Error::NotFound { what: "run", .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("20990101-000000-abcdef"), "{msg}");
        assert!(msg.contains("hindsight.db"), "{msg}");
    };
    let id = "20990101-000000-abcdef";
    check(db.run(id).unwrap_err());
    check(db.set_status(id, RunStatus::Failed, None).unwrap_err());
    check(
        db.append_logs(id, Phase::Record, &[row("loss", &[], "1")])
            .unwrap_err(),
    );
    check(db.logs(id, &[]).unwrap_err());
    check(db.log_names(id).unwrap_err());
    check(db.divergences(id).unwrap_err());
    check(db.iterations(id, "epoch").unwrap_err());
    let it = IterationRow {
        value: None,
        loop_name: "epoch".into(),
        idx: 0,
        seconds: 1.0,
        checkpoint: None,
        materialize_seconds: None,
        restore_seconds: None,
    };
    check(db.record_iteration(id, &it).unwrap_err());
    check(db.set_restore_seconds(id, "epoch", 0, 1.0).unwrap_err());
}

#[test]
fn sources_are_content_addressed() {
    let (_dir, db) = temp_db();
    let mut files = BTreeMap::new();
    files.insert("train.py".to_string(), "print('hi')\n".to_string());
    files.insert("lib/util.py".to_string(), "X = 1\n".to_string());
    let h = db.put_source(&files).unwrap();
    assert_eq!(h.len(), 64);
    assert_eq!(db.put_source(&files).unwrap(), h); // idempotent
    assert_eq!(db.get_source(&h).unwrap(), files);
    // Different content, different hash; boundaries are unambiguous.
    let mut a = BTreeMap::new();
    a.insert("ab".to_string(), "c".to_string());
    let mut b = BTreeMap::new();
    b.insert("a".to_string(), "bc".to_string());
    assert_ne!(source_hash(&a), source_hash(&b));
    assert_ne!(source_hash(&BTreeMap::new()), source_hash(&a));
    let e = db.get_source("feedface").unwrap_err();
    assert!(
        matches!(e, Error::NotFound { .. }) && e.to_string().contains("feedface"),
        "{e}"
    );
    // Tampered content is detected.
    db.conn
        .execute(
            "UPDATE sources SET files = '{\"train.py\":\"evil\"}' WHERE hash = ?1",
            [&h],
        )
        .unwrap();
    assert!(matches!(
        db.get_source(&h).unwrap_err(),
        Error::Corrupt { .. }
    ));
}

#[test]
fn logs_upsert_and_order() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    db.append_logs(
        &id,
        Phase::Record,
        &[
            row("lr", &[], "0.1"),
            row("loss", &[("epoch", 0), ("step", 0)], "2.5"),
            row("loss", &[("epoch", 0), ("step", 1)], "2.0"),
            row("acc", &[("epoch", 0)], "0.5"),
        ],
    )
    .unwrap();
    // A resumed iteration re-logs step 1: replaced, not duplicated.
    db.append_logs(
        &id,
        Phase::Record,
        &[row("loss", &[("epoch", 0), ("step", 1)], "1.9")],
    )
    .unwrap();
    // The replay phase keeps its own rows.
    db.append_logs(
        &id,
        Phase::Replay,
        &[row("loss", &[("epoch", 0), ("step", 1)], "1.9")],
    )
    .unwrap();
    db.append_logs(&id, Phase::Record, &[]).unwrap();

    let all = db.logs(&id, &[]).unwrap();
    let summary: Vec<(&str, &str, &str, Phase)> = all
        .iter()
        .map(|r| {
            (
                r.name.as_str(),
                r.ctx_json.as_str(),
                r.value_json.as_str(),
                r.phase,
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("lr", "{}", "0.1", Phase::Record),
            ("loss", r#"{"epoch":0,"step":0}"#, "2.5", Phase::Record),
            ("acc", r#"{"epoch":0}"#, "0.5", Phase::Record),
            ("loss", r#"{"epoch":0,"step":1}"#, "1.9", Phase::Record),
            ("loss", r#"{"epoch":0,"step":1}"#, "1.9", Phase::Replay),
        ]
    );
    assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
    assert_eq!(
        all[1].ctx,
        vec![("epoch".to_string(), 0), ("step".to_string(), 0)]
    );
    assert!(all[0].ctx.is_empty());
    assert!(all[0].created_ms > 0);

    let loss = db
        .logs(&id, &["loss".to_string(), "missing".to_string()])
        .unwrap();
    assert_eq!(loss.len(), 3);
    assert!(loss.iter().all(|r| r.name == "loss"));
    assert_eq!(db.log_names(&id).unwrap(), vec!["lr", "loss", "acc"]);
    // A name none of the runs logged is an error that names what they did.
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let ids = [id.clone()];
    assert_eq!(
        db.require_logged(&ids, &names(&["loss", "acc"])).unwrap(),
        vec!["lr", "loss", "acc"]
    );
    let err = db
        .require_logged(&ids, &names(&["los", "loss", "los"]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert_eq!(
        err.to_string(),
        format!("run {id} never logged 'los' (it logged: lr, loss, acc)")
    );

    // Keys are kept in nesting order (not sorted) and escaped.
    let odd = [("z\"q", 1), ("a", -2)];
    db.append_logs(
        &id,
        Phase::Record,
        &[row("x", &odd, "{\"k\": [1, NaN, \"s\"]}")],
    )
    .unwrap();
    let x = db.logs(&id, &["x".to_string()]).unwrap();
    assert_eq!(x[0].ctx_json, r#"{"z\"q":1,"a":-2}"#);
    assert_eq!(
        x[0].ctx,
        vec![("z\"q".to_string(), 1), ("a".to_string(), -2)]
    );
}

#[test]
fn invalid_log_rows_are_rejected_whole_batch() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    for bad in [
        row("", &[], "1"),
        row("loss", &[("", 1)], "1"),
        row("loss", &[("epoch", 1), ("epoch", 2)], "1"),
        row("loss", &[], "{not json"),
        row("loss", &[], ""),
    ] {
        let e = db
            .append_logs(&id, Phase::Record, &[row("ok", &[], "1"), bad])
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains(&id), "{e}");
    }
    assert!(db.logs(&id, &[]).unwrap().is_empty());
}

#[test]
fn json_value_comparison() {
    for (a, b) in [
        ("1", "1.0"),
        ("1e3", "1000"),
        ("NaN", "NaN"),
        (" 2.50 ", "2.5"),
        ("Infinity", "Infinity"),
        ("[1, 2.0, NaN]", "[1.0,2,NaN]"),
        (
            r#"{"a": 1, "b": [true, null]}"#,
            r#"{"b":[true,null],"a":1.0}"#,
        ),
        (r#""x""#, r#""x""#),
        (r#""\u00e9""#, r#""é""#),
        ("-0.0", "0"),
    ] {
        assert!(json::values_equal(a, b), "{a} vs {b}");
    }
    for (a, b) in [
        ("1", "1.0000001"),
        ("NaN", "1"),
        ("Infinity", "-Infinity"),
        ("9007199254740993", "9007199254740992"), // exact integers
        ("[1, 2]", "[1, 2, 3]"),
        (r#"{"a": 1}"#, r#"{"b": 1}"#),
        (r#""1""#, "1"),
        ("true", "1"),
        ("null", "0"),
        ("oops", "oops2"),
    ] {
        assert!(!json::values_equal(a, b), "{a} vs {b}");
    }
    assert!(json::values_equal("oops", " oops"));
    // Deep nesting does not overflow the stack.
    let deep = "[".repeat(100_000);
    assert!(!json::values_equal(&deep, "[]"));
}

#[test]
fn divergence_detection() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let rec = [
        row("loss", &[("epoch", 0)], "1.0"),
        row("loss", &[("epoch", 1)], "0.5"),
        row("loss", &[("epoch", 2)], "NaN"),
        row("acc", &[("epoch", 2)], "[0.1, 0.2]"),
        row("loss", &[("epoch", 3)], "NaN"),
        row("tag", &[], "\"a\""),
        row("only_record", &[], "1"),
    ];
    db.append_logs(&id, Phase::Record, &rec).unwrap();
    // Replay in a different order (parallel workers), different formatting.
    let rep = [
        row("tag", &[], "\"b\""),
        row("loss", &[("epoch", 3)], "0.25"),
        row("acc", &[("epoch", 2)], "[0.1,0.2]"),
        row("loss", &[("epoch", 2)], "NaN"),
        row("loss", &[("epoch", 1)], "0.50000001"),
        row("loss", &[("epoch", 0)], "1"),
        row("only_replay", &[], "2"),
    ];
    db.append_logs(&id, Phase::Replay, &rep).unwrap();
    let d = db.divergences(&id).unwrap();
    let summary: Vec<(&str, &str, &str, &str)> = d
        .iter()
        .map(|x| {
            (
                x.name.as_str(),
                x.ctx_json.as_str(),
                x.record_value.as_str(),
                x.replay_value.as_str(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("loss", r#"{"epoch":1}"#, "0.5", "0.50000001"),
            ("loss", r#"{"epoch":3}"#, "NaN", "0.25"),
            ("tag", "{}", "\"a\"", "\"b\""),
        ]
    );
    assert_eq!(d[0].ctx, vec![("epoch".to_string(), 1)]);
    assert!(d[0].record_seq < d[1].record_seq);
    // Fixing the replay value removes the divergence (upsert).
    db.append_logs(&id, Phase::Replay, &[row("tag", &[], "\"a\"")])
        .unwrap();
    assert_eq!(db.divergences(&id).unwrap().len(), 2);
}

#[test]
fn divergences_since_judge_only_the_latest_replay() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let rec = [
        row("loss", &[("epoch", 0)], "1.0"),
        row("loss", &[("epoch", 1)], "0.5"),
    ];
    db.append_logs(&id, Phase::Record, &rec).unwrap();
    // An earlier (forced) replay disagreed everywhere.
    let bad = [
        row("loss", &[("epoch", 0)], "9"),
        row("loss", &[("epoch", 1)], "9"),
    ];
    db.append_logs(&id, Phase::Replay, &bad).unwrap();
    assert_eq!(db.divergences(&id).unwrap().len(), 2);
    // A later exact replay of epoch 0 only.
    let start = db.last_seq(&id).unwrap();
    db.append_logs(&id, Phase::Replay, &[row("loss", &[("epoch", 0)], "1.0")])
        .unwrap();
    assert!(db.divergences_since(&id, Some(start)).unwrap().is_empty());
    // The stale row of epoch 1 is still there for whoever asks about all.
    assert_eq!(db.divergences(&id).unwrap().len(), 1);
}

#[test]
fn values_merge_phases_and_prefer_the_recorded_value() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let rec = [
        row("loss", &[("epoch", 0)], "1.0"),
        row("loss", &[("epoch", 1)], "0.5"),
    ];
    db.append_logs(&id, Phase::Record, &rec).unwrap();
    let rep = [
        row("loss", &[("epoch", 1)], "0.75"),
        row("loss", &[("epoch", 0)], "1"),
        row("grad", &[("epoch", 0)], "3"),
    ];
    db.append_logs(&id, Phase::Replay, &rep).unwrap();
    let v = db.values(&id, &[]).unwrap();
    let shown: Vec<(&str, &str, &str, bool)> = v
        .iter()
        .map(|x| {
            (
                x.name.as_str(),
                x.ctx_json.as_str(),
                x.value(),
                x.diverged(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        vec![
            ("loss", r#"{"epoch":0}"#, "1.0", false),
            ("loss", r#"{"epoch":1}"#, "0.5", true),
            ("grad", r#"{"epoch":0}"#, "3", false),
        ]
    );
    assert_eq!(v[1].replayed.as_deref(), Some("0.75"));
    assert_eq!(v[2].recorded, None);
    // A name filter keeps only those names.
    let only = db.values(&id, &["grad".to_string()]).unwrap();
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].name, "grad");
}

#[test]
fn iterations_upsert() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let it = |idx: u64, secs: f64, ck: Option<&str>| IterationRow {
        value: None,
        loop_name: "epoch".into(),
        idx,
        seconds: secs,
        checkpoint: ck.map(String::from),
        materialize_seconds: ck.map(|_| 0.5),
        restore_seconds: None,
    };
    db.record_iteration(&id, &it(1, 2.0, None)).unwrap();
    db.record_iterations(&id, &[it(0, 1.0, Some("ck-0")), it(2, 3.0, Some("ck-2"))])
        .unwrap();
    // Re-executed iteration replaces its row.
    db.record_iteration(&id, &it(1, 2.5, Some("ck-1"))).unwrap();
    db.set_restore_seconds(&id, "epoch", 1, 0.7).unwrap();
    let e = db.set_restore_seconds(&id, "epoch", 9, 0.7).unwrap_err();
    assert!(
        matches!(e, Error::NotFound { .. }) && e.to_string().contains("epoch[9]"),
        "{e}"
    );
    let rows = db.iterations(&id, "epoch").unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(
        rows.iter().map(|r| r.idx).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert_eq!(rows[1].seconds, 2.5);
    assert_eq!(rows[1].checkpoint.as_deref(), Some("ck-1"));
    assert_eq!(rows[1].restore_seconds, Some(0.7));
    assert_eq!(rows[0].materialize_seconds, Some(0.5));
    assert!(db.iterations(&id, "step").unwrap().is_empty());
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let e = db.record_iteration(&id, &it(5, bad, None)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("epoch[5]"), "{e}");
    }
}

#[test]
fn reopen_persists_everything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hindsight.db");
    let (id, hash) = {
        let db = LogDb::open(&path).unwrap();
        let mut files = BTreeMap::new();
        files.insert("train.py".to_string(), "pass\n".to_string());
        let hash = db.put_source(&files).unwrap();
        let mut r = new_run("train.py");
        r.source_hash = hash.clone();
        let id = db.create_run(&r).unwrap();
        db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 0)], "1.5")])
            .unwrap();
        db.record_iteration(
            &id,
            &IterationRow {
                value: None,
                loop_name: "epoch".into(),
                idx: 0,
                seconds: 1.0,
                checkpoint: Some("c0".into()),
                materialize_seconds: Some(0.1),
                restore_seconds: None,
            },
        )
        .unwrap();
        db.set_status(&id, RunStatus::Completed, Some(99)).unwrap();
        (id, hash)
    };
    let db = LogDb::open(&path).unwrap();
    assert_eq!(db.path(), path);
    let r = db.run(&id).unwrap();
    assert_eq!(
        (r.status, r.source_hash.as_str()),
        (RunStatus::Completed, hash.as_str())
    );
    assert_eq!(db.get_source(&hash).unwrap()["train.py"], "pass\n");
    assert_eq!(db.logs(&id, &[]).unwrap()[0].value_json, "1.5");
    assert_eq!(
        db.iterations(&id, "epoch").unwrap()[0]
            .checkpoint
            .as_deref(),
        Some("c0")
    );
    let mode: String = db
        .conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let v: i64 = db
        .conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, SCHEMA_VERSION);
}

#[test]
fn a_name_logged_repeatedly_in_one_context_keeps_every_value_in_order() {
    let (_d, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let ctx = [("epoch", 0), ("step", 3)];
    let rep = |k: u32, v: &str| LogRow {
        rep: k,
        ..row("val_loss", &ctx, v)
    };
    db.append_logs(
        &id,
        Phase::Record,
        &[rep(0, "1.5"), rep(1, "1.25"), rep(2, "1.0")],
    )
    .unwrap();
    // A re-executed iteration rewrites the same occurrences, never adds more.
    db.append_logs(&id, Phase::Record, &[rep(1, "1.25")])
        .unwrap();
    let vals = db.values(&id, &[]).unwrap();
    let got: Vec<(u32, &str)> = vals.iter().map(|v| (v.rep, v.value())).collect();
    assert_eq!(got, vec![(0, "1.5"), (1, "1.25"), (2, "1.0")]);
    // Replayed values are compared occurrence by occurrence.
    db.append_logs(&id, Phase::Replay, &[rep(0, "1.5"), rep(2, "9.0")])
        .unwrap();
    let d = db.divergences(&id).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].rep, d[0].replay_value.as_str()), (2, "9.0"));
}

/// A database as release `version` wrote it, holding one completed run 'r1'.
fn old_database(path: &std::path::Path, version: i64) -> Connection {
    let conn = Connection::open(path).unwrap();
    conn.execute_batch(SCHEMA_V1).unwrap();
    if version >= 2 {
        conn.execute_batch(SCHEMA_V2).unwrap();
    }
    conn.pragma_update(None, "user_version", version).unwrap();
    conn.execute(
        "INSERT INTO runs (id, script, script_abs, project_root, source_hash, args, \
             status, started_ms, host, versions, pid) VALUES ('r1', 't.py', '/p/t.py', '/p', \
             'h', '{}', 'completed', 5, 'host', '{}', 7)",
        [],
    )
    .unwrap();
    conn
}

#[test]
fn version_2_logs_survive_the_upgrade_as_first_occurrences() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.db");
    {
        let conn = old_database(&path, 2);
        conn.execute(
            "INSERT INTO logs (run_id, name, ctx, value, phase, seq, created_ms) \
             VALUES ('r1', 'loss', '{\"epoch\":1}', '0.5', 'record', 1, 9)",
            [],
        )
        .unwrap();
    }
    let db = LogDb::open(&path).unwrap();
    let v = db.values("r1", &[]).unwrap();
    assert_eq!(v.len(), 1);
    assert_eq!(
        (v[0].rep, v[0].value(), v[0].ctx_json.as_str()),
        (0, "0.5", "{\"epoch\":1}")
    );
    // The new occurrence column is usable at once.
    db.append_logs(
        "r1",
        Phase::Record,
        &[LogRow {
            rep: 1,
            ..row("loss", &[("epoch", 1)], "0.25")
        }],
    )
    .unwrap();
    assert_eq!(db.values("r1", &[]).unwrap().len(), 2);
}

#[test]
fn version_1_database_is_upgraded_in_place_and_keeps_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        // A database as the first release wrote it.
        old_database(&path, 1);
    }
    let db = LogDb::open(&path).unwrap();
    let r = db.run("r1").unwrap();
    assert_eq!((r.status, r.store), (RunStatus::Completed, None));
    db.set_store("r1", "s3://bucket/ckpts").unwrap();
    assert_eq!(
        db.run("r1").unwrap().store.as_deref(),
        Some("s3://bucket/ckpts")
    );
    assert!(matches!(
        db.set_store("nope", "/x"),
        Err(Error::NotFound { .. })
    ));
    drop(db);
    // Opening again does not try to add the column twice.
    assert_eq!(
        LogDb::open(&path)
            .unwrap()
            .run("r1")
            .unwrap()
            .store
            .as_deref(),
        Some("s3://bucket/ckpts")
    );
}

#[test]
fn version_6_fingerprints_become_rank_0s() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v6.db");
    {
        let conn = old_database(&path, 2);
        register_row_sum(&conn).unwrap();
        for schema in [SCHEMA_V3, SCHEMA_V4, SCHEMA_V5, SCHEMA_V6] {
            conn.execute_batch(schema).unwrap();
        }
        conn.pragma_update(None, "user_version", 6).unwrap();
        conn.execute(
            "INSERT INTO batches (run_id, outer, step, digest) VALUES ('r1', 1, 0, 'old')",
            [],
        )
        .unwrap();
    }
    let db = LogDb::open(&path).unwrap();
    assert_eq!(
        db.batch_digests("r1", 1, 0, PrintKind::Batch).unwrap(),
        [(0, "old".to_string())]
    );
    db.record_batches("r1", 1, 1, PrintKind::Batch, &[(0, "new".into())])
        .unwrap();
    assert_eq!(db.batch_ranks("r1").unwrap(), [0, 1]);
    db.verify().unwrap();
}

#[test]
fn newer_schema_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("future.db");
    drop(LogDb::open(&path).unwrap());
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let e = LogDb::open(&path).unwrap_err();
    assert!(matches!(e, Error::Database { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("future.db")
            && msg.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
        "{msg}"
    );
}

#[test]
fn not_a_database_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.db");
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let e = LogDb::open(&path).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("garbage.db"), "{e}");
}

#[test]
fn open_fails_cleanly_when_parent_is_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = LogDb::open(&file.join("db.sqlite")).unwrap_err();
    assert!(e.to_string().contains("file"), "{e}");
}

fn append_many(db: &LogDb, run_id: &str, tag: &str, n: usize, batch: usize) {
    let rows: Vec<LogRow> = (0..n)
        .map(|i| row(&format!("v_{tag}"), &[("step", i as i64)], &i.to_string()))
        .collect();
    for chunk in rows.chunks(batch) {
        db.append_logs(run_id, Phase::Record, chunk).unwrap();
    }
}

fn check_concurrent_result(db: &LogDb, run_id: &str, tags: &[&str], n: usize) {
    let all = db.logs(run_id, &[]).unwrap();
    assert_eq!(all.len(), tags.len() * n);
    let seqs: HashSet<i64> = all.iter().map(|r| r.seq).collect();
    assert_eq!(seqs.len(), all.len(), "sequence numbers must be unique");
    for tag in tags {
        let mine: Vec<&LogRecord> = all
            .iter()
            .filter(|r| r.name == format!("v_{tag}"))
            .collect();
        assert_eq!(mine.len(), n, "rows of {tag}");
        // Each writer's rows keep their order.
        for (i, r) in mine.iter().enumerate() {
            assert_eq!(r.ctx, vec![("step".to_string(), i as i64)]);
            assert_eq!(r.value_json, i.to_string());
        }
    }
}

#[test]
fn two_threads_with_separate_connections() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.db");
    let id = LogDb::open(&path)
        .unwrap()
        .create_run(&new_run("train.py"))
        .unwrap();
    std::thread::scope(|s| {
        for (tag, batch) in [("a", 1), ("b", 100)] {
            let (path, id) = (&path, &id);
            s.spawn(move || {
                let db = LogDb::open(path).unwrap();
                append_many(&db, id, tag, 2000, batch);
            });
        }
    });
    check_concurrent_result(&LogDb::open(&path).unwrap(), &id, &["a", "b"], 2000);
}

#[test]
fn concurrent_first_open_and_run_creation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fresh.db");
    let ids: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let path = &path;
                s.spawn(move || {
                    let db = LogDb::open(path).unwrap();
                    let mut r = new_run("train.py");
                    r.started_ms = Some(1_700_000_000_000); // all in the same millisecond
                    (0..50)
                        .map(|_| db.create_run(&r).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), 200);
    assert_eq!(LogDb::open(&path).unwrap().runs(None).unwrap().len(), 200);
}

const CHILD_ENV: &str = "HINDSIGHT_LOGDB_TEST_CHILD";

/// Body of the child processes of `two_processes_append_concurrently`;
/// a no-op in a normal test run.
#[test]
fn child_process_appender() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '|');
    let (Some(path), Some(run_id), Some(tag)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("bad {CHILD_ENV}: {spec}");
    };
    let db = LogDb::open(Path::new(path)).unwrap();
    let mut r = new_run("child.py");
    r.started_ms = Some(1_700_000_000_000);
    for i in 0..2000 {
        db.append_logs(
            run_id,
            Phase::Record,
            &[row(&format!("v_{tag}"), &[("step", i)], &i.to_string())],
        )
        .unwrap();
        if i % 40 == 0 {
            db.create_run(&r).unwrap();
        }
    }
}

#[test]
fn two_processes_append_concurrently() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("procs.db");
    let id = LogDb::open(&path)
        .unwrap()
        .create_run(&new_run("train.py"))
        .unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = ["p", "q"]
        .iter()
        .map(|tag| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "runs::db::tests::child_process_appender",
                    "--test-threads=1",
                    "--nocapture",
                ])
                .env(CHILD_ENV, format!("{}|{id}|{tag}", path.display()))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "child failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The filter matched the child test (not zero tests).
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
    }
    let db = LogDb::open(&path).unwrap();
    check_concurrent_result(&db, &id, &["p", "q"], 2000);
    // 2 x 50 runs created in the same millisecond from two processes, none lost.
    assert_eq!(db.runs(None).unwrap().len(), 101);
}

#[test]
fn integrity_check_finds_damage_and_orphan_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs.db");
    let db = LogDb::open(&path).unwrap();
    let id = db.create_run(&new_run("train.py")).unwrap();
    db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 0)], "1.0")])
        .unwrap();
    db.check_integrity().unwrap();
    drop(db);
    // A row whose run is gone (written by something that bypassed the
    // foreign keys, or left by damage) makes the answers wrong: reported.
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute_batch("PRAGMA foreign_keys = OFF;").unwrap();
    raw.execute(
        "INSERT INTO logs (run_id, name, ctx, value, phase, seq, created_ms) \
         VALUES ('no-such-run', 'x', '{}', '1', 'record', 99, 0)",
        [],
    )
    .unwrap();
    drop(raw);
    let e = LogDb::open(&path).unwrap().check_integrity().unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
    assert!(e.to_string().contains("belong to no run"), "{e}");
}

#[test]
fn integrity_check_catches_a_damaged_page() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs.db");
    let db = LogDb::open(&path).unwrap();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let rows: Vec<LogRow> = (0..2000)
        .map(|i| row("loss", &[("step", i)], "0.5"))
        .collect();
    db.append_logs(&id, Phase::Record, &rows).unwrap();
    drop(db); // the last connection checkpoints the WAL into the file
    let mut bytes = std::fs::read(&path).unwrap();
    let page = 4096;
    assert!(bytes.len() > 8 * page);
    // A torn write in a b-tree page in the middle of the file.
    for b in &mut bytes[5 * page..5 * page + 64] {
        *b = 0xA5;
    }
    std::fs::write(&path, bytes).unwrap();
    let e = LogDb::open(&path)
        .and_then(|db| db.check_integrity())
        .unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
}

#[test]
fn a_worker_database_round_trips_replay_values_through_the_same_rules() {
    let (dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    db.set_store(&id, "/shared/store").unwrap();
    let it = |idx: u64| IterationRow {
        loop_name: "epoch".into(),
        idx,
        value: Some(idx as i64 + 1),
        seconds: 1.5,
        checkpoint: Some(format!("ck{idx}")),
        materialize_seconds: Some(0.1),
        restore_seconds: None,
    };
    db.record_iterations(&id, &[it(0), it(1)]).unwrap();
    db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 0)], "1.0")])
        .unwrap();
    db.record_batches(
        &id,
        1,
        0,
        PrintKind::Batch,
        &[(0, "d0".into()), (1, "d1".into())],
    )
    .unwrap();
    db.record_batches(&id, 1, 1, PrintKind::Batch, &[(0, "e0".into())])
        .unwrap();
    db.record_batches(&id, 1, 1, PrintKind::Order, &[(0, "o0".into())])
        .unwrap();
    let replay = db.begin_replay(&id, true).unwrap();

    let spool_path = dir.path().join("task-0.db");
    db.export_run(&id, &spool_path).unwrap();
    // Exported twice into one file would mix two replays: refused.
    let again = db.export_run(&id, &spool_path).unwrap_err();
    assert!(again.to_string().contains("task-0.db"), "{again}");
    {
        let spool = LogDb::open(&spool_path).unwrap();
        let copy = spool.run(&id).unwrap();
        assert_eq!(copy, db.run(&id).unwrap());
        assert_eq!(
            spool.iterations(&id, "epoch").unwrap(),
            db.iterations(&id, "epoch").unwrap()
        );
        assert!(
            spool.logs(&id, &[]).unwrap().is_empty(),
            "record values stay home"
        );
        // The worker judges its staged values against the recording.
        assert!(spool
            .replay_divergences(replay, 0)
            .unwrap()
            .divergences
            .is_empty());
        // The worker checks its data against the recorded fingerprints.
        for rank in [0, 1] {
            for kind in [PrintKind::Batch, PrintKind::Order] {
                assert_eq!(
                    spool.batch_digests(&id, 1, rank, kind).unwrap(),
                    db.batch_digests(&id, 1, rank, kind).unwrap()
                );
            }
        }
        // The worker: two values, one logged twice in one context, and a restore time.
        spool
            .append_replay_logs(
                replay,
                &id,
                &[
                    row("loss", &[("epoch", 0)], "1.5"),
                    row("grad", &[("epoch", 1)], "2"),
                    LogRow {
                        rep: 1,
                        ..row("grad", &[("epoch", 1)], "3")
                    },
                ],
            )
            .unwrap();
        spool.set_restore_seconds(&id, "epoch", 1, 0.25).unwrap();
    }
    assert_eq!(db.import_replay(&id, &spool_path, replay).unwrap(), 3);
    // Staged, not yet results.
    assert!(db
        .logs(&id, &[])
        .unwrap()
        .iter()
        .all(|r| r.phase == Phase::Record));
    // Merged values are judged like a local worker's: 1.0 recorded, 1.5 replayed.
    assert_eq!(
        db.replay_divergences(replay, 0).unwrap().divergences.len(),
        1
    );
    // Merging again replaces, never duplicates.
    db.import_replay(&id, &spool_path, replay).unwrap();
    assert_eq!(db.finish_replay(replay, Some(Trust::Diverged)).unwrap(), 3);
    let logs = db.logs(&id, &[]).unwrap();
    let replayed: Vec<(String, u32, String, Option<String>)> = logs
        .iter()
        .filter(|r| r.phase == Phase::Replay)
        .map(|r| (r.name.clone(), r.rep, r.value_json.clone(), r.flag.clone()))
        .collect();
    let d = Some("diverged".to_string());
    assert_eq!(
        replayed,
        [
            ("loss".to_string(), 0, "1.5".to_string(), d.clone()),
            ("grad".to_string(), 0, "2".to_string(), d.clone()),
            ("grad".to_string(), 1, "3".to_string(), d)
        ]
    );
    assert_eq!(
        db.iterations(&id, "epoch").unwrap()[1].restore_seconds,
        Some(0.25)
    );
    let missing = db
        .import_replay(&id, &dir.path().join("nope.db"), replay)
        .unwrap_err();
    assert!(missing.to_string().contains("nope.db"), "{missing}");
    assert!(!dir.path().join("nope.db").exists());
}

fn staged(db: &LogDb, id: &str, exact: bool, rows: &[LogRow]) -> i64 {
    let replay = db.begin_replay(id, exact).unwrap();
    db.append_replay_logs(replay, id, rows).unwrap();
    replay
}

fn replayed_values(db: &LogDb, id: &str) -> Vec<(String, String, Option<String>)> {
    db.values(id, &[])
        .unwrap()
        .into_iter()
        .filter_map(|v| Some((v.name, v.replayed?, v.replay_flag)))
        .collect()
}

#[test]
fn a_replays_values_are_staged_until_judged_and_a_discarded_replay_leaves_nothing() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 0)], "1.0")])
        .unwrap();
    let replay = staged(
        &db,
        &id,
        true,
        &[
            row("loss", &[("epoch", 0)], "1.25"),
            row("probe", &[("epoch", 0)], "7"),
        ],
    );
    // Nothing of it is a result yet.
    assert!(replayed_values(&db, &id).is_empty());
    let check = db.replay_divergences(replay, 0).unwrap();
    assert_eq!(check.divergences.len(), 1);
    assert_eq!(check.divergences[0].replay_value, "1.25");
    assert_eq!(check.last_seq, 2);
    // Checked after its last position: nothing new.
    assert!(db
        .replay_divergences(replay, check.last_seq)
        .unwrap()
        .divergences
        .is_empty());
    assert_eq!(db.finish_replay(replay, None).unwrap(), 0);
    assert!(replayed_values(&db, &id).is_empty());
    assert!(db
        .replay_divergences(replay, 0)
        .unwrap()
        .divergences
        .is_empty());
    let unknown = db.replay_divergences(replay + 100, 0).unwrap_err();
    assert!(unknown.to_string().contains("replay"), "{unknown}");
}

#[test]
fn a_less_trusted_replay_never_overwrites_a_more_trusted_value() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let exact = staged(&db, &id, true, &[row("probe", &[("epoch", 0)], "1.0")]);
    db.finish_replay(exact, Some(Trust::Exact)).unwrap();
    // Another thread count: its value stays out where an exact one exists,
    // and comes in where none does.
    let inexact = staged(
        &db,
        &id,
        false,
        &[
            row("probe", &[("epoch", 0)], "1.0000001"),
            row("probe", &[("epoch", 1)], "2.0"),
        ],
    );
    assert_eq!(db.finish_replay(inexact, Some(Trust::Inexact)).unwrap(), 1);
    assert_eq!(
        replayed_values(&db, &id),
        [
            ("probe".into(), "1.0".into(), None),
            ("probe".into(), "2.0".into(), Some("inexact".into()))
        ]
    );
    // An exact replay replaces the inexact value; a diverged one replaces neither.
    let again = staged(&db, &id, true, &[row("probe", &[("epoch", 1)], "2.5")]);
    db.finish_replay(again, Some(Trust::Exact)).unwrap();
    let bad = staged(&db, &id, true, &[row("probe", &[("epoch", 1)], "9")]);
    assert_eq!(db.finish_replay(bad, Some(Trust::Diverged)).unwrap(), 0);
    assert_eq!(
        replayed_values(&db, &id),
        [
            ("probe".into(), "1.0".into(), None),
            ("probe".into(), "2.5".into(), None)
        ]
    );
}

#[test]
fn an_inexact_replay_is_compared_within_a_tolerance_and_an_exact_one_bit_for_bit() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    db.append_logs(
        &id,
        Phase::Record,
        &[row("loss", &[("epoch", 0)], "4.16459")],
    )
    .unwrap();
    let last_bits = [row("loss", &[("epoch", 0)], "4.164590001")];
    let exact = staged(&db, &id, true, &last_bits);
    assert_eq!(
        db.replay_divergences(exact, 0).unwrap().divergences.len(),
        1
    );
    let inexact = staged(&db, &id, false, &last_bits);
    assert!(db
        .replay_divergences(inexact, 0)
        .unwrap()
        .divergences
        .is_empty());
    // Beyond the tolerance (the issue's 4.16459 against 4.16539): a divergence either way.
    let far = staged(&db, &id, false, &[row("loss", &[("epoch", 0)], "4.16539")]);
    assert_eq!(db.replay_divergences(far, 0).unwrap().divergences.len(), 1);
}

#[test]
fn batch_fingerprints_are_kept_per_step_and_replaced_by_a_resumed_run() {
    let (_dir, db) = temp_db();
    let id = db.create_run(&new_run("train.py")).unwrap();
    assert!(!db.has_batch_digests(&id).unwrap());
    db.record_batches(
        &id,
        2,
        0,
        PrintKind::Batch,
        &[(0, "a".into()), (1, "b".into())],
    )
    .unwrap();
    db.record_batches(&id, 2, 0, PrintKind::Batch, &[(1, "c".into())])
        .unwrap();
    db.record_batches(&id, 3, 0, PrintKind::Batch, &[(0, "d".into())])
        .unwrap();
    assert!(db.has_batch_digests(&id).unwrap());
    assert_eq!(
        db.batch_digests(&id, 2, 0, PrintKind::Batch).unwrap(),
        [(0, "a".to_string()), (1, "c".to_string())]
    );
    assert!(db
        .batch_digests(&id, 9, 0, PrintKind::Batch)
        .unwrap()
        .is_empty());
    // Each rank keeps its own batches, at the same steps as the others'.
    db.record_batches(&id, 2, 3, PrintKind::Batch, &[(1, "r3".into())])
        .unwrap();
    assert_eq!(
        db.batch_digests(&id, 2, 3, PrintKind::Batch).unwrap(),
        [(1, "r3".to_string())]
    );
    assert_eq!(
        db.batch_digests(&id, 2, 0, PrintKind::Batch).unwrap()[1].1,
        "c"
    );
    assert!(db
        .batch_digests(&id, 2, 1, PrintKind::Batch)
        .unwrap()
        .is_empty());
    assert_eq!(db.batch_ranks(&id).unwrap(), [0, 3]);
    // A step's sampler indices are kept beside its batch, apart.
    db.record_batches(&id, 2, 0, PrintKind::Order, &[(1, "i1".into())])
        .unwrap();
    assert_eq!(
        db.batch_digests(&id, 2, 0, PrintKind::Order).unwrap(),
        [(1, "i1".to_string())]
    );
    assert_eq!(
        db.batch_digests(&id, 2, 0, PrintKind::Batch).unwrap()[1].1,
        "c"
    );
    assert!(PrintKind::parse("orders")
        .unwrap_err()
        .to_string()
        .contains("\"orders\""));
    // Parts are delimited: the same bytes split differently differ.
    let digest = |parts: &[&[u8]]| {
        let mut d = BatchDigest::new();
        for p in parts {
            d.part(p);
        }
        d.finish()
    };
    assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
    assert_eq!(digest(&[b"ab", b"c"]), digest(&[b"ab", b"c"]));
    assert_eq!(digest(&[]).len(), 32);
    // Parts framed into one buffer hash as the same parts added one by one
    // (the binding frames a sampler's indices so): recordings made either
    // way compare equal.
    let mut framed = Vec::new();
    BatchDigest::frame(&mut framed, b"list 2");
    BatchDigest::frame(&mut framed, b"int 7");
    let mut d = BatchDigest::new();
    d.framed(&framed);
    d.part(&[1u8; 300]);
    d.framed(&[]);
    assert_eq!(d.finish(), digest(&[b"list 2", b"int 7", &[1u8; 300]]));
    assert_ne!(d.finish(), digest(&[b"list 2int 7", &[1u8; 300]]));
}

/// Issue 22: a changed digit inside a value is invisible to SQLite's own
/// checks; every value row carries a checksum, checked where values are read.
#[test]
fn a_value_changed_outside_hindsight_fails_its_checksum_wherever_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs.db");
    let db = LogDb::open(&path).unwrap();
    let id = db.create_run(&new_run("train.py")).unwrap();
    let rows = [
        row("loss", &[("epoch", 0)], "0.5"),
        row("loss", &[("epoch", 1)], "0.25"),
    ];
    db.append_logs(&id, Phase::Record, &rows).unwrap();
    // Rewritten by hindsight itself (an upsert): still intact.
    db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 1)], "0.125")])
        .unwrap();
    let replay = db.begin_replay(&id, true).unwrap();
    db.append_replay_logs(replay, &id, &[row("loss", &[("epoch", 0)], "0.5")])
        .unwrap();
    db.verify().unwrap();
    assert_eq!(db.values(&id, &[]).unwrap().len(), 2);
    assert!(db
        .replay_divergences(replay, 0)
        .unwrap()
        .divergences
        .is_empty());

    // A staged replay value changed: judging or keeping the replay fails.
    let raw = Connection::open(&path).unwrap();
    raw.execute("UPDATE replay_logs SET value = '0.6'", [])
        .unwrap();
    let e = db.replay_divergences(replay, 0).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    let e = db.finish_replay(replay, Some(Trust::Exact)).unwrap_err();
    assert!(e.to_string().contains("fails its checksum"), "{e}");
    raw.execute("DELETE FROM replay_logs", []).unwrap();

    // One digit of a recorded value: every read path names the row.
    raw.execute(
        "UPDATE logs SET value = '0.3' WHERE ctx = '{\"epoch\":1}'",
        [],
    )
    .unwrap();
    for e in [
        db.values(&id, &[]).unwrap_err(),
        db.logs(&id, &["loss".to_string()]).unwrap_err(),
        db.verify().unwrap_err(),
    ] {
        let msg = e.to_string();
        assert!(matches!(e, Error::Corrupt { .. }), "{msg}");
        assert!(msg.contains("logs.db") && msg.contains("checksum"), "{msg}");
        assert!(msg.contains("loss") && msg.contains("epoch"), "{msg}");
    }
    // A flag flipped (a diverged replay value shown as exact) is caught too.
    raw.execute(
        "UPDATE logs SET value = '0.125' WHERE ctx = '{\"epoch\":1}'",
        [],
    )
    .unwrap();
    db.verify().unwrap();
    db.append_logs(&id, Phase::Replay, &[row("loss", &[("epoch", 1)], "0.2")])
        .unwrap();
    raw.execute(
        "UPDATE logs SET flag = 'diverged' WHERE phase = 'replay'",
        [],
    )
    .unwrap();
    assert!(db.divergences(&id).is_err());
    assert!(db.check_row_sums().is_err());
}

#[test]
fn row_sums_tell_fields_apart() {
    let a = row_sum("r", "loss", "{}", 0, "1", "record", None);
    assert_ne!(a, row_sum("r", "loss", "{}", 0, "1", "replay", None));
    assert_ne!(a, row_sum("r", "los", "s{}", 0, "1", "record", None));
    assert_ne!(a, row_sum("r", "loss", "{}", 1, "1", "record", None));
    assert_ne!(a, row_sum("r", "loss", "{}", 0, "1", "record", Some("")));
    assert!(a >= 0);
}

/// Issue 22: a damaged database refused every recording with no way
/// forward; `repair` keeps every row that still reads back intact.
#[test]
fn repair_keeps_every_intact_row_and_the_damaged_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs.db");
    let id;
    {
        let db = LogDb::open(&path).unwrap();
        id = db.create_run(&new_run("train.py")).unwrap();
        let rows: Vec<LogRow> = (0..2000)
            .map(|i| row("loss", &[("step", i)], &format!("{}.5", i)))
            .collect();
        db.append_logs(&id, Phase::Record, &rows).unwrap();
    }
    assert_eq!(repair(&path).unwrap(), Repair::Intact);
    // One value changed outside hindsight, one row of no run.
    {
        let raw = Connection::open(&path).unwrap();
        raw.execute(
            "UPDATE logs SET value = '7.5' WHERE ctx = '{\"step\":3}'",
            [],
        )
        .unwrap();
        raw.execute_batch("PRAGMA foreign_keys = OFF").unwrap();
        raw.execute(
            "INSERT INTO logs (run_id, name, ctx, rep, value, phase, seq, created_ms, sum) \
             VALUES ('gone', 'loss', '{}', 0, '1', 'record', 9999, 0, ?1)",
            [row_sum("gone", "loss", "{}", 0, "1", "record", None)],
        )
        .unwrap();
    }
    assert!(LogDb::open_checked(&path).is_err());
    let Repair::Rebuilt { damaged, tables } = repair(&path).unwrap() else {
        panic!("not rebuilt")
    };
    assert!(damaged.is_file(), "the damaged file is kept");
    let logs = tables.iter().find(|t| t.table == "logs").unwrap();
    assert_eq!(
        (logs.kept, logs.bad_sum, logs.orphaned, logs.unreadable),
        (1999, 1, 1, 0)
    );
    let db = LogDb::open_checked(&path).unwrap();
    db.verify().unwrap();
    let values = db.values(&id, &[]).unwrap();
    assert_eq!(values.len(), 1999);
    assert!(values.iter().all(|v| v.ctx_json != "{\"step\":3}"));
    assert_eq!(db.run(&id).unwrap().script, "train.py");
    // The rebuilt database takes new values.
    db.append_logs(&id, Phase::Record, &[row("loss", &[("step", 3)], "3.5")])
        .unwrap();
}

#[test]
fn repair_of_a_damaged_page_loses_only_that_page() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("logs.db");
    let id;
    {
        let db = LogDb::open(&path).unwrap();
        id = db.create_run(&new_run("train.py")).unwrap();
        let rows: Vec<LogRow> = (0..5000)
            .map(|i| row("loss", &[("step", i)], &format!("{}.25", i)))
            .collect();
        db.append_logs(&id, Phase::Record, &rows).unwrap();
    }
    // Garbage over one page in the middle of the file (pages are 4 KiB).
    let mut bytes = std::fs::read(&path).unwrap();
    let pages = bytes.len() / 4096;
    let victim = pages / 2;
    for b in &mut bytes[victim * 4096..(victim + 1) * 4096] {
        *b = 0xa5;
    }
    std::fs::write(&path, bytes).unwrap();
    let e = LogDb::open_checked(&path).unwrap_err();
    assert!(e.to_string().contains("hindsight repair"), "{e}");
    let Repair::Rebuilt { tables, .. } = repair(&path).unwrap() else {
        panic!("not rebuilt")
    };
    let logs = tables.iter().find(|t| t.table == "logs").unwrap();
    let db = LogDb::open_checked(&path).unwrap();
    let kept = db.values(&id, &[]).unwrap();
    assert_eq!(kept.len() as u64, logs.kept);
    // One page holds at most a few hundred of these rows.
    assert!(logs.kept >= 4000, "{logs:?}");
    assert!(logs.kept < 5000 || logs.unreadable == 0, "{logs:?}");
    for v in &kept {
        let step = v.ctx[0].1;
        assert_eq!(
            v.value(),
            format!("{step}.25"),
            "a kept value is the one written"
        );
    }
}
