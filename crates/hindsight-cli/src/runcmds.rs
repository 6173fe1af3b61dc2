//! The commands over the run database: `runs`, `logs` and `show RUN`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use hindsight_core::runs::resume::{status_now, Here};
use hindsight_core::{Error, LogDb, LogValue, Phase, RunRow, RunStatus};
use serde_json::json;

use crate::{format_iso8601, format_utc, plural, table, Align, Failure, EXIT_OK};
use hindsight_core::runs::json::{self as jsontext, Object};

/// Which phase's values `logs` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PhaseFilter {
    /// Values written while the run was recorded
    Record,
    /// Values written by replays
    Replay,
    /// Both: the recorded value, marked where a replay disagrees
    All,
}

impl PhaseFilter {
    /// `value` with what this filter hides removed; None when nothing is left.
    fn apply(self, mut value: LogValue) -> Option<LogValue> {
        match self {
            PhaseFilter::All => {}
            PhaseFilter::Record => value.replayed = None,
            PhaseFilter::Replay => value.recorded = None,
        }
        (value.recorded.is_some() || value.replayed.is_some()).then_some(value)
    }
}

/// Whether `s` has the shape of a run id, `YYYYMMDD-HHMMSS-xxxxxx`.
pub(crate) fn looks_like_run_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 22
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 15 => c == b'-',
            0..=14 => c.is_ascii_digit(),
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

/// `h:mm:ss` of a number of milliseconds (rounded down to whole seconds).
pub(crate) fn format_duration(ms: u64) -> String {
    let s = ms / 1000;
    format!("{}:{:02}:{:02}", s / 3600, s % 3600 / 60, s % 60)
}

/// How long a run took: `h:mm:ss`, `running`, or `-` without an end time.
fn run_duration(run: &RunRow) -> String {
    match (run.status, run.ended_ms) {
        (RunStatus::Running, _) => "running".into(),
        (_, Some(end)) => format_duration(end.saturating_sub(run.started_ms)),
        (_, None) => "-".into(),
    }
}

/// At most `max` characters of `s`, ending in `...` when shortened.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(3)).collect();
        t.push_str("...");
        t
    }
}

// ---------------------------------------------------------------------------
// runs

/// (argument, compact JSON value) pairs of a run, in recorded order.
fn arg_pairs(r: &RunRow) -> Vec<(String, String)> {
    jsontext::members(&jsontext::compact(&r.args_json)).unwrap_or_default()
}

/// Per script: the arguments whose values differ between its listed runs
/// (a missing argument counts as a value; all of them when the script has
/// one run), so runs that differ in `--lr` do not look alike.
fn differing_args(runs: &[RunRow]) -> HashMap<String, HashSet<String>> {
    let mut by_script: HashMap<String, Vec<HashMap<String, String>>> = HashMap::new();
    for r in runs {
        by_script
            .entry(r.script.clone())
            .or_default()
            .push(arg_pairs(r).into_iter().collect());
    }
    by_script
        .into_iter()
        .map(|(script, maps)| {
            let keys: HashSet<String> = maps.iter().flat_map(|m| m.keys().cloned()).collect();
            let differ = keys
                .into_iter()
                .filter(|k| maps.len() == 1 || maps.iter().any(|m| m.get(k) != maps[0].get(k)))
                .collect();
            (script, differ)
        })
        .collect()
}

fn args_cell(r: &RunRow, differing: &HashMap<String, HashSet<String>>) -> String {
    let keys = differing.get(&r.script);
    let shown: Vec<String> = arg_pairs(r)
        .into_iter()
        .filter(|(k, _)| keys.is_some_and(|ks| ks.contains(k)))
        .map(|(k, v)| format!("{k}={}", truncate(&v, 24)))
        .collect();
    if shown.is_empty() {
        "-".to_string()
    } else {
        shown.join(" ")
    }
}

pub(crate) fn cmd_runs(
    db: &LogDb,
    limit: Option<usize>,
    json: bool,
    out: &mut String,
) -> Result<i32, Failure> {
    let runs = db.runs(limit)?;
    if json {
        let items: Vec<String> = runs.iter().map(run_json).collect();
        outln!(out, "{}", jsontext::pretty(&jsontext::array(&items)));
        return Ok(EXIT_OK);
    }
    let differing = differing_args(&runs);
    let here = Here::current();
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.id.clone(),
                status_now(r, &here).to_string(),
                format_utc(r.started_ms),
                run_duration(r),
                r.script.clone(),
                args_cell(r, &differing),
            ]
        })
        .collect();
    table(
        &[
            ("RUN", Align::Left),
            ("STATUS", Align::Left),
            ("STARTED", Align::Left),
            ("DURATION", Align::Right),
            ("SCRIPT", Align::Left),
            ("ARGS", Align::Left),
        ],
        &rows,
        out,
    );
    Ok(EXIT_OK)
}

fn run_json(r: &RunRow) -> String {
    let duration = match (r.status, r.ended_ms) {
        (RunStatus::Running, _) | (_, None) => serde_json::Value::Null,
        (_, Some(end)) => json!(end.saturating_sub(r.started_ms) as f64 / 1000.0),
    };
    Object::new()
        .value("id", &json!(r.id))
        .value("status", &json!(status_now(r, &Here::current()).as_str()))
        .value("script", &json!(r.script))
        .value("script_abs", &json!(r.script_abs))
        .value("project_root", &json!(r.project_root))
        .value("started", &json!(format_iso8601(r.started_ms)))
        .value("started_ms", &json!(r.started_ms))
        .value("ended", &json!(r.ended_ms.map(format_iso8601)))
        .value("ended_ms", &json!(r.ended_ms))
        .value("duration_seconds", &duration)
        .value("host", &json!(r.host))
        .value("pid", &json!(r.pid))
        .value("git_commit", &json!(r.git_commit))
        .value("git_dirty", &json!(r.git_dirty))
        .value("source_hash", &json!(r.source_hash))
        .value("resume_key", &json!(r.resume_key))
        .raw("args", &jsontext::compact(&r.args_json))
        .raw("versions", &jsontext::compact(&r.versions_json))
        .finish()
}

// ---------------------------------------------------------------------------
// logs

/// The newest run; an error when there is none.
fn latest_run(db: &LogDb) -> Result<RunRow, Failure> {
    db.latest_run()?.ok_or_else(|| {
        Failure::Failed(format!(
            "no runs recorded in {}: run a script that uses hindsight first",
            db.path().display()
        ))
    })
}

/// One row of the `logs` table: the values at one loop context.
#[derive(Debug, Default)]
struct CtxRow {
    ctx: Vec<(String, i64)>,
    ctx_json: String,
    /// The occurrence within the context (a name logged there repeatedly).
    rep: u32,
    /// Name -> what each phase logged there.
    cells: HashMap<String, LogValue>,
}

pub(crate) fn cmd_logs(
    db: &LogDb,
    run: Option<String>,
    mut names: Vec<String>,
    phase: PhaseFilter,
    json: bool,
    out: &mut String,
) -> Result<i32, Failure> {
    // The first positional is a run id if the database knows it; otherwise
    // (unless it looks like one) it is the first name, of the latest run.
    let run = match run {
        None => latest_run(db)?,
        Some(first) => match db.run(&first) {
            Ok(run) => run,
            Err(Error::NotFound { .. }) if !looks_like_run_id(&first) => {
                names.insert(0, first);
                latest_run(db)?
            }
            Err(e) => return Err(e.into()),
        },
    };
    let mut seen = HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    let logged = db.require_logged(std::slice::from_ref(&run.id), &names)?;
    if names.is_empty() {
        names = logged;
    }

    // Rows by context: the integer tuple in nesting order (a context sorts
    // before the contexts nested in it), then the loop names, then the
    // occurrence of values logged repeatedly in one context.
    let mut rows: BTreeMap<(Vec<i64>, String, u32), CtxRow> = BTreeMap::new();
    for value in db.values(&run.id, &names)? {
        let Some(value) = phase.apply(value) else {
            continue;
        };
        let key = (
            value.ctx.iter().map(|(_, i)| *i).collect::<Vec<_>>(),
            value.ctx_json.clone(),
            value.rep,
        );
        let row = rows.entry(key).or_insert_with(|| CtxRow {
            ctx: value.ctx.clone(),
            ctx_json: value.ctx_json.clone(),
            rep: value.rep,
            cells: HashMap::new(),
        });
        row.cells.insert(value.name.clone(), value);
    }

    if json {
        let items: Vec<String> = rows.values().map(|r| ctx_row_json(r, &names)).collect();
        outln!(out, "{}", jsontext::pretty(&jsontext::array(&items)));
        return Ok(EXIT_OK);
    }

    // Columns: the loop names (in order of first appearance), then the values.
    let mut loops: Vec<&str> = Vec::new();
    for row in rows.values() {
        for (name, _) in &row.ctx {
            if !loops.contains(&name.as_str()) {
                loops.push(name);
            }
        }
    }
    let repeated = rows.values().any(|r| r.rep > 0);
    let mut columns: Vec<(&str, Align)> = loops.iter().map(|l| (*l, Align::Right)).collect();
    if repeated {
        columns.push(("rep", Align::Right));
    }
    columns.extend(names.iter().map(|n| (n.as_str(), Align::Right)));
    let cells: Vec<Vec<String>> = rows
        .values()
        .map(|row| {
            let mut line: Vec<String> = loops
                .iter()
                .map(|l| {
                    row.ctx
                        .iter()
                        .find(|(n, _)| n == l)
                        .map(|(_, i)| i.to_string())
                        .unwrap_or_default()
                })
                .collect();
            if repeated {
                line.push(row.rep.to_string());
            }
            line.extend(names.iter().map(|n| match row.cells.get(n) {
                Some(v) if v.diverged() => format!(
                    "{} (replay: {})",
                    jsontext::compact(v.value()),
                    jsontext::compact(v.replayed.as_deref().unwrap_or_default())
                ),
                // A replayed value that is not exact says so beside it.
                Some(v) => match (&v.recorded, &v.replay_flag) {
                    (None, Some(flag)) => format!("{} [{flag}]", jsontext::compact(v.value())),
                    _ => jsontext::compact(v.value()),
                },
                None => String::new(),
            }));
            line
        })
        .collect();
    table(&columns, &cells, out);
    Ok(EXIT_OK)
}

/// `{"ctx": {...}, "rep": k, "values": {...}, "replayed": {...}, "diverged": {...}, "flags": {...}}`:
/// the occurrence in the context, the value of each name (the recorded one
/// if there is one), whether a replay wrote one too, and the replayed values
/// that differ.
fn ctx_row_json(row: &CtxRow, names: &[String]) -> String {
    let (mut values, mut replayed, mut diverged) = (Object::new(), Object::new(), Object::new());
    let mut flags = Object::new();
    for name in names {
        let Some(v) = row.cells.get(name) else {
            continue;
        };
        values.raw(name, &jsontext::compact(v.value()));
        if let Some(flag) = &v.replay_flag {
            flags.value(name, &json!(flag));
        }
        replayed.value(name, &json!(v.replayed.is_some()));
        if let (true, Some(b)) = (v.diverged(), &v.replayed) {
            diverged.raw(name, &jsontext::compact(b));
        }
    }
    Object::new()
        .raw("ctx", &row.ctx_json)
        .value("rep", &json!(row.rep))
        .raw("values", &values.finish())
        .raw("replayed", &replayed.finish())
        .raw("diverged", &diverged.finish())
        .raw("flags", &flags.finish())
        .finish()
}

// ---------------------------------------------------------------------------
// show RUN

/// Continuation lines of a multi-line value, aligned under its first line.
fn indent_rest(text: &str, by: usize) -> String {
    text.replace('\n', &format!("\n{}", " ".repeat(by)))
}

pub(crate) fn cmd_show_run(db: &LogDb, run: &RunRow, out: &mut String) -> Result<i32, Failure> {
    outln!(out, "run         {}", run.id);
    outln!(out, "status      {}", status_now(run, &Here::current()));
    outln!(out, "script      {}", run.script);
    if run.script_abs != run.script && !run.script_abs.is_empty() {
        outln!(out, "script path {}", run.script_abs);
    }
    if !run.project_root.is_empty() {
        outln!(out, "project     {}", run.project_root);
    }
    outln!(out, "started     {} UTC", format_utc(run.started_ms));
    match run.ended_ms {
        Some(end) => outln!(out, "ended       {} UTC", format_utc(end)),
        None => outln!(out, "ended       -"),
    }
    outln!(out, "duration    {}", run_duration(run));
    outln!(out, "host        {} (pid {})", run.host, run.pid);
    let git = match (&run.git_commit, run.git_dirty) {
        (None, _) => "-".to_string(),
        (Some(c), Some(true)) => format!("{c} (dirty)"),
        (Some(c), Some(false)) => format!("{c} (clean)"),
        (Some(c), None) => c.clone(),
    };
    outln!(out, "git         {git}");
    match db.get_source(&run.source_hash) {
        Ok(files) => outln!(
            out,
            "source      {} ({})",
            run.source_hash,
            plural(files.len() as u64, "file")
        ),
        // A missing snapshot is possible (a run created without one); an
        // unreadable one is damage and must not look fine.
        Err(Error::NotFound { .. }) => {
            outln!(out, "source      {} (snapshot missing)", run.source_hash)
        }
        Err(e) => outln!(out, "source      {} (unreadable: {e})", run.source_hash),
    }
    if let Some(key) = &run.resume_key {
        outln!(out, "resume key  {key}");
    }
    outln!(
        out,
        "args        {}",
        indent_rest(&jsontext::pretty(&run.args_json), 12)
    );
    let versions = jsontext::compact(&run.versions_json);
    match jsontext::members(&versions) {
        Some(members) => {
            // One line per entry, in the stored order; strings unquoted.
            for (k, v) in members {
                let v = serde_json::from_str::<String>(&v).unwrap_or(v);
                outln!(out, "version     {k}={v}");
            }
        }
        None => outln!(out, "versions    {versions}"),
    }

    // Log names with their counts per phase.
    let records = db.logs(&run.id, &[])?;
    let names = db.log_names(&run.id)?;
    let mut counts: HashMap<&str, (u64, u64)> = HashMap::new();
    let mut loops: Vec<&str> = Vec::new();
    for rec in &records {
        let c = counts.entry(rec.name.as_str()).or_default();
        match rec.phase {
            Phase::Record => c.0 += 1,
            Phase::Replay => c.1 += 1,
        }
        for (l, _) in &rec.ctx {
            if !loops.contains(&l.as_str()) {
                loops.push(l);
            }
        }
    }
    let mut diverged: HashMap<String, u64> = HashMap::new();
    for d in db.divergences(&run.id)? {
        *diverged.entry(d.name).or_default() += 1;
    }
    outln!(out);
    if names.is_empty() {
        outln!(out, "no logs");
    } else {
        let rows: Vec<Vec<String>> = names
            .iter()
            .map(|n| {
                let (rec, rep) = counts.get(n.as_str()).copied().unwrap_or_default();
                vec![
                    n.clone(),
                    rec.to_string(),
                    rep.to_string(),
                    diverged.get(n).copied().unwrap_or(0).to_string(),
                ]
            })
            .collect();
        table(
            &[
                ("LOG", Align::Left),
                ("RECORD", Align::Right),
                ("REPLAY", Align::Right),
                ("DIVERGED", Align::Right),
            ],
            &rows,
            out,
        );
    }

    // Iterations of the loops the logs name.
    let mut rows = Vec::new();
    for l in loops {
        let its = db.iterations(&run.id, l)?;
        if its.is_empty() {
            continue;
        }
        let checkpoints = its.iter().filter(|i| i.checkpoint.is_some()).count();
        let seconds: f64 = its.iter().map(|i| i.seconds).sum();
        rows.push(vec![
            l.to_string(),
            its.len().to_string(),
            checkpoints.to_string(),
            format!("{seconds:.2}"),
        ]);
    }
    outln!(out);
    if rows.is_empty() {
        outln!(out, "no loop iterations recorded");
    } else {
        table(
            &[
                ("LOOP", Align::Left),
                ("ITERATIONS", Align::Right),
                ("CHECKPOINTS", Align::Right),
                ("SECONDS", Align::Right),
            ],
            &rows,
            out,
        );
    }
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_recognized() {
        assert!(looks_like_run_id("20240301-120000-0a1b2c"));
        for s in [
            "loss",
            "20240301-120000-0a1b2",
            "20240301-120000-0a1b2C",
            "20240301_120000-0a1b2c",
            "2024030a-120000-0a1b2c",
            "20240301-120000-0a1b2c0",
        ] {
            assert!(!looks_like_run_id(s), "{s}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(format_duration(0), "0:00:00");
        assert_eq!(format_duration(59_999), "0:00:59");
        assert_eq!(format_duration(3_600_000), "1:00:00");
        assert_eq!(format_duration(3_723_000), "1:02:03");
        assert_eq!(format_duration(100 * 3_600_000 + 61_000), "100:01:01");
    }

    #[test]
    fn truncation() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcde", 5), "abcde");
        assert_eq!(truncate("abcdef", 5), "ab...");
    }
}
