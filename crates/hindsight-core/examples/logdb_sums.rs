//! What the per-row checksums of `logs.db` cost (issue 22): appends, a full
//! read of a run's values, and the whole-database check, timed on 200,000
//! values (100 per transaction, as a training loop flushes them).
//!
//! `cargo run --release -p hindsight-core --example logdb_sums`

use std::time::Instant;

use hindsight_core::runs::db::{LogDb, LogRow, NewRun, Phase};

fn main() -> hindsight_core::Result<()> {
    let dir = std::env::temp_dir().join(format!("hs-logdb-sums-{}", std::process::id()));
    let db = LogDb::open(&dir.join("logs.db"))?;
    let run = db.create_run(&NewRun {
        script: "train.py".into(),
        script_abs: "/p/train.py".into(),
        project_root: "/p".into(),
        source_hash: "h".into(),
        args_json: "{}".into(),
        host: "h".into(),
        versions_json: "{}".into(),
        ..NewRun::default()
    })?;
    let n = 200_000;
    let t = Instant::now();
    for batch in 0..n / 100 {
        let rows: Vec<LogRow> = (0..100)
            .map(|i| LogRow {
                name: "loss".into(),
                ctx: vec![("epoch".into(), batch), ("step".into(), i)],
                rep: 0,
                value_json: format!("{}", 1.0 / (1.0 + (batch * 100 + i) as f64)),
            })
            .collect();
        db.append_logs(&run, Phase::Record, &rows)?;
    }
    let append = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let values = db.values(&run, &[])?;
    let read = t.elapsed().as_secs_f64();
    let t = Instant::now();
    db.check_integrity()?;
    let check = t.elapsed().as_secs_f64();
    let t = Instant::now();
    db.verify()?;
    let verify = t.elapsed().as_secs_f64();
    let t = Instant::now();
    db.check_row_sums()?;
    let sums = t.elapsed().as_secs_f64();
    println!("{} values in {}", values.len(), dir.display());
    println!(
        "append (row sums computed in SQL): {:.2} us/value",
        append / n as f64 * 1e6
    );
    println!(
        "values() (each row's sum checked):  {:.2} us/value",
        read / n as f64 * 1e6
    );
    println!(
        "check_integrity (every open for an answer): {:.0} ms",
        check * 1e3
    );
    println!(
        "verify: {:.0} ms, of which the row sums {:.0} ms ({:.2} us/row)",
        verify * 1e3,
        sums * 1e3,
        sums / n as f64 * 1e6
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
