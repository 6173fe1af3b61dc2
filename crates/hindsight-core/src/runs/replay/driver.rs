//! The replay driver's rules above one worker: which recorded runs a
//! `hindsight replay` replays. One owner for "the runs of this script"
//! (the binding's `LogDb.select_runs`, the CLI's `replay`).

use std::path::Path;

use crate::error::{Error, Result};
use crate::runs::dates;
use crate::runs::db::{LogDb, RunRow, RunStatus};

/// Which runs, as `hindsight replay` is asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Which {
    /// The newest run of the script (no option given).
    Latest,
    /// `--run ID...`: these, in the order given.
    Given(Vec<String>),
    /// `--runs ID...`: these, oldest first.
    Listed(Vec<String>),
    /// `--runs all`: every finished run of the script, oldest first.
    All,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub which: Which,
    /// `--since DATE`: only runs started then or later.
    pub since_ms: Option<u64>,
}

impl Selection {
    /// From the command line's `--runs`, `--run` and `--since` (a date
    /// `runs::dates::parse_utc` reads). `--since` alone means `--runs all`.
    pub fn from_args(
        runs: Option<Vec<String>>,
        run: Option<Vec<String>>,
        since: Option<&str>,
    ) -> Result<Selection> {
        let since_ms = since
            .map(|s| dates::parse_utc(s).map_err(|e| Error::invalid("--since", e.to_string())))
            .transpose()?;
        let which = match (runs, run) {
            (Some(r), _) if r.iter().any(|id| id == "all") => Which::All,
            (Some(r), _) if !r.is_empty() => Which::Listed(r),
            (_, _) if since_ms.is_some() => Which::All,
            (_, Some(r)) if !r.is_empty() => Which::Given(r),
            _ => Which::Latest,
        };
        Ok(Selection { which, since_ms })
    }

    fn describe(&self) -> String {
        let mut s = match &self.which {
            Which::Latest => String::new(),
            Which::All => "--runs all".into(),
            Which::Given(ids) => format!("--run {}", ids.join(" ")),
            Which::Listed(ids) => format!("--runs {}", ids.join(" ")),
        };
        if let Some(ms) = self.since_ms {
            s += &format!(" --since {}", dates::format_utc(ms));
        }
        s.trim().to_string()
    }
}

/// The runs `sel` names of the script now at `script_abs`, in the project
/// rooted at `root_now` (its home `home`, for messages), with their paths
/// where they are now. Runs named by id are looked up whatever script they
/// recorded; none found is an error naming the script and the selection.
pub fn select_runs(
    db: &LogDb,
    script_abs: &Path,
    root_now: &Path,
    home: &Path,
    sel: &Selection,
) -> Result<Vec<RunRow>> {
    let by_id = |ids: &[String]| -> Result<Vec<RunRow>> {
        ids.iter()
            .map(|id| Ok(db.run(id)?.relocated(root_now)))
            .collect()
    };
    let mut runs = match &sel.which {
        Which::Latest => db
            .runs_of(script_abs, root_now)?
            .into_iter()
            .take(1)
            .collect(),
        Which::Given(ids) | Which::Listed(ids) => by_id(ids)?,
        // A run still running has nothing final to replay.
        Which::All => db
            .runs_of(script_abs, root_now)?
            .into_iter()
            .filter(|r| r.status != RunStatus::Running)
            .collect(),
    };
    if let Some(after) = sel.since_ms {
        runs.retain(|r| r.started_ms >= after);
    }
    if runs.is_empty() {
        let matching = sel.describe();
        return Err(Error::NotFound {
            what: "recorded run",
            name: if matching.is_empty() {
                format!("of {}", script_abs.display())
            } else {
                format!("of {} matching {matching}", script_abs.display())
            },
            location: home.display().to_string(),
        });
    }
    if !matches!(sel.which, Which::Given(_) | Which::Latest) {
        runs.sort_by_key(|r| r.started_ms);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_names_a_selection() {
        let ids = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let sel = |runs, run, since| Selection::from_args(runs, run, since).unwrap().which;
        assert_eq!(sel(None, None, None), Which::Latest);
        assert_eq!(sel(ids(&["all"]), None, None), Which::All);
        assert_eq!(sel(None, None, Some("2026-01-01")), Which::All);
        assert_eq!(
            sel(ids(&["b", "a"]), None, None),
            Which::Listed(vec!["b".into(), "a".into()])
        );
        assert_eq!(
            sel(None, ids(&["b", "a"]), None),
            Which::Given(vec!["b".into(), "a".into()])
        );
        let e = Selection::from_args(None, None, Some("yesterday")).unwrap_err();
        assert_eq!(e.arg(), Some("--since"));
    }
}
