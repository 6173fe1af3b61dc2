//! `hindsight repair`: rebuild a damaged run database from what can still be
//! read. A damaged `logs.db` refuses every recording and every answer (a
//! wrong value is worse than none); this keeps every run, iteration and
//! value whose row reads back intact, moves the damaged file aside (never
//! deleted) and puts the rebuilt one in its place.
//!
//! Rows are read one by one by rowid, so a malformed page loses the rows on
//! it, not the rest of the table. A value row whose checksum fails is
//! dropped, and so is a row whose run was lost. A replay's staged values are
//! not carried over: they were never judged.

use std::path::{Path, PathBuf};

use rusqlite::types::Value;
use rusqlite::{Connection, OpenFlags};

use super::{register_row_sum, DbResult, LogDb};
use crate::error::{Error, Result};

/// The tables carried over, parents first (foreign keys), and whether their
/// rows have a rowid to read them one by one by.
const TABLES: &[(&str, bool)] = &[
    ("runs", true),
    ("sources", true),
    ("iterations", true),
    ("batches", false),
    ("logs", true),
];

/// What [`repair`] did to one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableRepair {
    pub table: String,
    /// Rows carried over.
    pub kept: u64,
    /// Rows that could not be read (a malformed page).
    pub unreadable: u64,
    /// Value rows whose checksum failed.
    pub bad_sum: u64,
    /// Rows whose run was lost (or that no run ever owned).
    pub orphaned: u64,
}

/// What [`repair`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// The database passed every check ([`LogDb::verify`]): left as it is.
    Intact,
    /// Rebuilt: the damaged file now lives at `damaged`.
    Rebuilt {
        damaged: PathBuf,
        tables: Vec<TableRepair>,
    },
}

/// Check the run database at `path` and, if it fails, rebuild it from its
/// readable rows. Run it while no recording or replay uses the database.
pub fn repair(path: &Path) -> Result<Repair> {
    if !path.is_file() {
        return Err(Error::NotFound {
            what: "run database",
            name: path.display().to_string(),
            location: path
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        });
    }
    if LogDb::open(path).and_then(|db| db.verify()).is_ok() {
        return Ok(Repair::Intact);
    }
    let fresh = sibling(path, "repairing");
    for p in [
        fresh.clone(),
        sibling(&fresh, "wal"),
        sibling(&fresh, "shm"),
    ] {
        crate::durable::remove_durable(&p)?;
    }
    let tables = {
        let src = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .db(path)?;
        register_row_sum(&src).db(path)?;
        let dest = LogDb::open(&fresh)?;
        let mut tables = Vec::new();
        for &(table, by_rowid) in TABLES {
            tables.push(copy_table(&src, path, &dest, table, by_rowid)?);
        }
        dest.verify()?;
        tables
    };
    let stamp = crate::runs::dates::now_ms();
    let damaged = sibling(path, &format!("damaged-{stamp}"));
    std::fs::rename(path, &damaged).map_err(|e| Error::io(path, e))?;
    for ext in ["wal", "shm"] {
        let side = sibling(path, ext);
        if side.exists() {
            std::fs::rename(&side, sibling(&damaged, ext)).map_err(|e| Error::io(&side, e))?;
        }
    }
    std::fs::rename(&fresh, path).map_err(|e| Error::io(&fresh, e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::durable::sync_dir(dir)?;
    }
    Ok(Repair::Rebuilt { damaged, tables })
}

/// `logs.db` -> `logs.db-<ext>` (SQLite's own naming for its side files).
fn sibling(path: &Path, ext: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!("-{ext}"));
    PathBuf::from(s)
}

fn columns(conn: &Connection, table: &str) -> rusqlite::Result<Vec<String>> {
    let mut st = conn.prepare(&format!("PRAGMA table_info({table})"))?;
    let rows = st.query_map([], |r| r.get::<_, String>(1))?;
    rows.collect()
}

fn copy_table(
    src: &Connection,
    src_path: &Path,
    dest: &LogDb,
    table: &str,
    by_rowid: bool,
) -> Result<TableRepair> {
    let mut report = TableRepair {
        table: table.to_string(),
        ..TableRepair::default()
    };
    let theirs = columns(src, table).map_err(|e| {
        Error::corrupt(
            src_path,
            format!("the schema of table {table} cannot be read ({e}): nothing of it can be kept"),
        )
    })?;
    // Columns both have (an older database lacks the newer ones).
    let ours = columns(&dest.conn, table).db(&dest.path)?;
    let cols: Vec<&String> = ours.iter().filter(|c| theirs.contains(c)).collect();
    if cols.is_empty() {
        return Ok(report);
    }
    let list = cols
        .iter()
        .map(|c| c.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    // A value row is read together with whether its checksum holds.
    let check = if table == "logs" && theirs.iter().any(|c| c == "sum") {
        format!(", sum IS {}", super::logs_sum(""))
    } else {
        ", 1".to_string()
    };
    let marks = vec!["?"; cols.len()].join(", ");
    let insert = format!("INSERT OR IGNORE INTO {table} ({list}) VALUES ({marks})");
    let put = |row: Vec<Value>, intact: bool, report: &mut TableRepair| -> Result<()> {
        if !intact {
            report.bad_sum += 1;
            return Ok(());
        }
        match dest
            .conn
            .execute(&insert, rusqlite::params_from_iter(row.iter()))
        {
            Ok(_) => report.kept += 1,
            Err(rusqlite::Error::SqliteFailure(f, _))
                if f.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                report.orphaned += 1
            }
            Err(e) => return Err(super::db_err(&dest.path, e)),
        }
        Ok(())
    };
    let read_row = |r: &rusqlite::Row<'_>| -> rusqlite::Result<(Vec<Value>, bool)> {
        let mut row = Vec::with_capacity(cols.len());
        for i in 0..cols.len() {
            row.push(r.get::<_, Value>(i)?);
        }
        Ok((row, r.get::<_, bool>(cols.len())?))
    };
    dest.conn.execute_batch("BEGIN IMMEDIATE").db(&dest.path)?;
    if by_rowid {
        let bounds: rusqlite::Result<(Option<i64>, Option<i64>)> = src.query_row(
            &format!("SELECT min(rowid), max(rowid) FROM {table}"),
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        );
        if let Ok((Some(lo), Some(hi))) = bounds {
            let one = format!("SELECT {list}{check} FROM {table} WHERE rowid = ?1");
            let mut st = src.prepare(&one).db(src_path)?;
            for rowid in lo..=hi {
                match st.query_row([rowid], read_row) {
                    Ok((row, intact)) => put(row, intact, &mut report)?,
                    Err(rusqlite::Error::QueryReturnedNoRows) => {}
                    Err(_) => report.unreadable += 1,
                }
            }
        } else if bounds.is_err() {
            report.unreadable += 1;
        }
    } else {
        // No rowid: one scan, which ends at the first unreadable page.
        let all = format!("SELECT {list}{check} FROM {table}");
        let scanned = src.prepare(&all).and_then(|mut st| {
            let rows = st.query_map([], read_row)?;
            let mut got = Vec::new();
            for r in rows {
                match r {
                    Ok(row) => got.push(row),
                    Err(_) => {
                        got.push((Vec::new(), false));
                        break;
                    }
                }
            }
            Ok(got)
        });
        match scanned {
            Ok(rows) => {
                for (row, intact) in rows {
                    if row.is_empty() {
                        report.unreadable += 1;
                    } else {
                        put(row, intact, &mut report)?;
                    }
                }
            }
            Err(_) => report.unreadable += 1,
        }
    }
    // Rows of an older database that had no checksum yet: trusted as the
    // schema upgrade trusts them.
    if table == "logs" {
        dest.conn
            .execute(
                &format!(
                    "UPDATE logs SET sum = {} WHERE sum IS NULL",
                    super::logs_sum("")
                ),
                [],
            )
            .db(&dest.path)?;
    }
    dest.conn.execute_batch("COMMIT").db(&dest.path)?;
    Ok(report)
}
