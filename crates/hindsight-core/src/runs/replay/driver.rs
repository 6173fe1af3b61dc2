//! The replay driver's rules above one worker: which recorded runs a
//! `hindsight replay` replays. One owner for "the runs of this script"
//! (the binding's `LogDb.select_runs`, the CLI's `replay`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::runs::dates;
use crate::runs::db::{LogDb, RunRow, RunStatus, Trust};

/// A worker's exit status when what it computed differs from the recording
/// (and the replay's, when a run's replay diverged).
pub const EXIT_DIVERGED: i32 = 3;

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
/// recorded; none found is an error naming the script and the selection,
/// and so is a run recorded by several ranks (not replayed yet).
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

/// How a replay worker of a run is started: its command line and working directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerCommand {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// Its processes: the recorded world size, or one for a worker of a
    /// multi-rank run that only restores.
    pub ranks: u64,
    /// Started by hindsight's `torchrun` (a multi-rank run's worker, on
    /// any number of ranks): a job of its own, never forked from a zygote.
    pub torchrun: bool,
}

/// The command of every worker of `run` (its paths where its project is
/// now: [`RunRow::relocated`]): `python` running `script` (the script as
/// it is now, or the recorded version with the new statements placed into
/// it) with the recorded arguments, in the recorded working directory, or,
/// where that directory is gone, the script's own. A run recorded by
/// several ranks replays under hindsight's `torchrun` (each worker its own
/// standalone rendezvous), on as many ranks, or on one where the worker
/// only restores (`restores_only`, [`crate::runs::ranks::replay_world`]).
pub fn worker_command(
    run: &RunRow,
    script: &Path,
    python: &Path,
    restores_only: bool,
) -> WorkerCommand {
    let versions: serde_json::Value = serde_json::from_str(&run.versions_json).unwrap_or_default();
    let recorded_args = versions
        .get("argv")
        .and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .skip(1)
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let cwd = versions
        .get("cwd")
        .and_then(|c| c.as_str())
        .map(PathBuf::from)
        .filter(|c| c.is_dir())
        .unwrap_or_else(|| script.parent().map(Path::to_path_buf).unwrap_or_default());
    let recorded = crate::runs::ranks::recorded_world(&run.versions_json);
    let ranks = crate::runs::ranks::replay_world(recorded, restores_only);
    let torchrun = crate::runs::ranks::replays_under_torchrun(&run.versions_json);
    let mut argv = vec![python.to_string_lossy().into_owned()];
    if torchrun {
        // The script sets up its process group even on one rank.
        argv.extend([
            "-m".into(),
            "hindsight.torchrun".into(),
            "--standalone".into(),
            format!("--nproc_per_node={ranks}"),
        ]);
    }
    argv.push(script.to_string_lossy().into_owned());
    argv.extend::<Vec<String>>(recorded_args);
    WorkerCommand {
        argv,
        cwd,
        ranks,
        torchrun,
    }
}

/// How many local workers run at once, and each run's torch thread count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Threads {
    /// Workers at once (the array's width for a batch launcher).
    pub budget: usize,
    /// `-j` was lowered to this so that workers x the recording's threads
    /// fit the cores: (the widest recording's threads, the new budget).
    pub capped: Option<(usize, usize)>,
    /// Per run: each worker's thread count, and whether that is the
    /// recording's (only then are its values compared bit for bit).
    pub runs: Vec<(usize, bool)>,
    /// CPUs a batch launcher's task asks for: the widest worker's
    /// processes (a multi-rank run's worker is a torchrun job of its ranks
    /// on the task's node) times each one's threads.
    pub task_cpus: usize,
}

/// The thread rule of a replay. Exactness needs the recording's thread
/// count (reductions round by how they are split), so by default every
/// worker runs with it and, on this machine's `cores`, `-j` is capped so
/// that workers x threads <= cores; `fast` instead gives each worker
/// `cores / workers` threads, and its values are compared within a
/// tolerance and kept marked inexact. `workers`: each run's worker count;
/// `recorded`: each run's recorded thread count, if known; `local`: the
/// workers share this machine (else `jobs` is the array's width).
pub fn threads(
    cores: usize,
    jobs: usize,
    workers: &[usize],
    recorded: &[Option<usize>],
    ranks: &[usize],
    fast: bool,
    local: bool,
) -> Threads {
    let cores = cores.max(1);
    let total: usize = workers.iter().sum();
    let mut budget = if local {
        jobs.min(total).max(1)
    } else {
        jobs.max(1)
    };
    let mut capped = None;
    // A worker of a multi-rank run is that many processes, each with the
    // recording's threads.
    let widest = recorded
        .iter()
        .zip(ranks.iter().chain(std::iter::repeat(&1)))
        .filter_map(|(t, n)| t.map(|t| t * n.max(&1)))
        .max();
    if let (false, true, Some(widest)) = (fast, local, widest) {
        let fit = (cores / widest.max(1)).max(1);
        if fit < budget {
            budget = fit;
            capped = Some((widest, fit));
        }
    }
    let fair = (cores / budget).max(1);
    let runs: Vec<(usize, bool)> = recorded
        .iter()
        .map(|want| match (want, fast) {
            (Some(w), false) => (*w, true),
            (Some(w), true) => (fair, fair == *w),
            (None, _) => (fair, true),
        })
        .collect();
    let task_cpus = runs
        .iter()
        .zip(ranks.iter().chain(std::iter::repeat(&1)))
        .map(|((t, _), n)| t * n.max(&1))
        .max()
        .unwrap_or(1);
    Threads {
        budget,
        capped,
        runs,
        task_cpus,
    }
}

impl Threads {
    /// What a replay says of its thread rule: `-j` lowered to fit the
    /// recording's threads on `cores`, and each run (`run_ids`, recorded
    /// with `recorded` threads) whose values are compared within a tolerance.
    pub fn notes(
        &self,
        jobs: usize,
        cores: usize,
        run_ids: &[String],
        recorded: &[Option<usize>],
    ) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some((widest, budget)) = self.capped {
            notes.push(format!(
                "note: -j {jobs} runs {budget} worker(s) at a time: each uses the recording's {widest} torch \
                 thread(s) (over its ranks) so that values replay exactly, and this machine has {cores} cores \
                 (--fast runs more, with values that may differ in the last bits)"
            ));
        }
        for ((id, want), (threads, exact)) in run_ids.iter().zip(recorded).zip(&self.runs) {
            if !exact {
                let want = want.map_or_else(|| "an unknown number".to_string(), |w| w.to_string());
                notes.push(format!(
                    "note: run {id}: each worker uses {threads} thread(s), the recording used {want}: values \
                     may differ in the last bits; they are compared within a tolerance and kept marked \
                     'inexact' (an exact value an earlier replay computed is never replaced)"
                ));
            }
        }
        notes
    }
}

/// Why a run's replay can restore nothing, said before it is planned: it
/// recorded `iterations` and took a checkpoint in `checkpointed` of them,
/// into the store at `location` (a local one may be gone; None: looked for
/// already, for an earlier run, and said then). None: it can.
pub fn unrestorable(
    run_id: &str,
    iterations: usize,
    checkpointed: usize,
    location: Option<&str>,
) -> Option<String> {
    if iterations > 0 && checkpointed == 0 {
        // No store was ever created: nothing was removed.
        return Some(format!(
            "note: run {run_id} took no checkpoint (no objects to save, or none fit the adaptive bound; \
             HINDSIGHT_CHECKPOINT_EVERY=N takes one every N iterations): every iteration is re-executed"
        ));
    }
    let location = location?;
    if !location.contains("://") && !std::path::Path::new(location).is_dir() {
        return Some(format!(
            "note: run {run_id}: its checkpoint store is not at {location} (removed, or a store outside a \
             project that moved): every iteration is re-executed, none restored from or checked against a \
             checkpoint"
        ));
    }
    None
}

/// Whether a run's outer loop was checkpointed at the end of iterations that
/// ran no inner loop (the manifest's `at` is `iteration`: the checkpoint holds
/// all of it), as the first of `iterations`' checkpoints in the store at
/// `location` (`in_store`) says. Unknown (an older recording, a manifest that
/// does not read): false, the plan that restores.
pub fn whole_iterations(
    location: &str,
    in_store: &std::collections::HashSet<String>,
    iterations: &[crate::runs::db::IterationRow],
) -> bool {
    let Some(name) = iterations
        .iter()
        .filter_map(|r| r.checkpoint.as_ref())
        .find(|c| in_store.contains(*c))
    else {
        return false;
    };
    crate::Store::open_url(location, false, None)
        .and_then(|store| store.manifest(name))
        .is_ok_and(|m| m.meta.get("at").map(String::as_str) == Some("iteration"))
}

/// A worker's progress, as the driver reads it from its lines (the
/// worker protocol of `runs::replay`; the worker's session writes them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// Iterations finished.
    pub done: u64,
    /// From the worker's last line: inner-loop steps executed, bodies of
    /// iterations without an inner loop executed, checkpoints restored.
    pub steps: u64,
    pub bodies: u64,
    pub restored: u64,
    /// Seconds spent restoring them, and in the outer loop as a whole.
    pub restore_secs: f64,
    pub run_secs: f64,
}

impl Progress {
    /// Read whole lines: one per finished iteration, then
    /// `steps N bodies B restored M restore_s R run_s T`.
    pub fn read(&mut self, text: &str) {
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["steps", steps, "bodies", bodies, "restored", restored, "restore_s", restore, "run_s", run] =>
                {
                    self.steps = steps.parse().unwrap_or(self.steps);
                    self.bodies = bodies.parse().unwrap_or(self.bodies);
                    self.restored = restored.parse().unwrap_or(self.restored);
                    self.restore_secs = restore.parse().unwrap_or(self.restore_secs);
                    self.run_secs = run.parse().unwrap_or(self.run_secs);
                }
                _ => self.done += 1,
            }
        }
    }
}

/// Where a replay's time went, from its workers' summaries and its wall
/// time: the line `hindsight replay` ends with.
pub fn time_breakdown(wall_secs: f64, workers: &[Progress]) -> String {
    let run = workers.iter().map(|w| w.run_secs).fold(0.0, f64::max);
    let restore = workers.iter().fold(0.0, |a, w| a + w.restore_secs);
    let restored: u64 = workers.iter().map(|w| w.restored).sum();
    let steps: u64 = workers.iter().map(|w| w.steps).sum();
    let bodies: u64 = workers.iter().map(|w| w.bodies).sum();
    let executing = if bodies > 0 {
        format!("{steps} step(s) and {bodies} iteration(s) without an inner loop")
    } else {
        format!("{steps} step(s)")
    };
    format!(
        "time: {:.1}s planning, starting and ending {} worker(s), {run:.1}s in the replayed \
         iterations{}: {restore:.2}s restoring {restored} checkpoint(s), the rest executing {executing}, \
         the probes and the code between",
        (wall_secs - run).max(0.0),
        workers.len(),
        if workers.len() > 1 {
            " (the longest worker; restores summed over all)"
        } else {
            ""
        },
    )
}

/// What a run's replay is worth, once its workers ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Workers that failed (not a divergence): the values of their finished
    /// iterations are kept.
    pub failed: Vec<usize>,
    /// A worker stopped at a difference, or a staged value differs.
    pub diverged: bool,
    /// How the staged values are kept (`LogDb::finish_replay`); None:
    /// discarded (diverged without `--allow-divergence`).
    pub keep: Option<Trust>,
    /// The replay's exit status for this run.
    pub exit: i32,
}

/// The verdict on a run's replay from its workers' exit statuses (`None`:
/// never started), the number of staged values that differ from the
/// recording, whether divergent values are kept on request, and whether the
/// workers ran exactly as recorded (the recording's thread count). A replay
/// that computed a recorded value differently computed its new ones on
/// wrong state too: they are not presented as results.
pub fn verdict(
    returncodes: &[Option<i32>],
    divergences: usize,
    allow_divergence: bool,
    exact: bool,
) -> Verdict {
    let failed: Vec<usize> = returncodes
        .iter()
        .enumerate()
        .filter(|(_, rc)| !matches!(rc, Some(0) | Some(EXIT_DIVERGED)))
        .map(|(i, _)| i)
        .collect();
    let diverged = divergences > 0 || returncodes.contains(&Some(EXIT_DIVERGED));
    let keep = match (diverged, allow_divergence) {
        (true, false) => None,
        (true, true) => Some(Trust::Diverged),
        (false, _) if exact => Some(Trust::Exact),
        (false, _) => Some(Trust::Inexact),
    };
    let exit = if diverged && !allow_divergence {
        EXIT_DIVERGED
    } else if !failed.is_empty() {
        1
    } else {
        0
    };
    Verdict {
        failed,
        diverged,
        keep,
        exit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_rule_and_an_unrestorable_run_are_said() {
        let t = threads(8, 4, &[4, 1], &[Some(4), Some(2)], &[], true, true);
        let notes = t.notes(4, 8, &["r1".into(), "r2".into()], &[Some(4), Some(2)]);
        // --fast: nothing lowered; run r1's workers get 2 threads of its 4.
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0]
            .starts_with("note: run r1: each worker uses 2 thread(s), the recording used 4:"));
        let t = threads(8, 4, &[4], &[Some(4)], &[], false, true);
        let notes = t.notes(4, 8, &["r1".into()], &[Some(4)]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with(
            "note: -j 4 runs 2 worker(s) at a time: each uses the recording's 4 torch"
        ));

        let here = std::env::temp_dir();
        let here = here.to_str().unwrap();
        let gone = Some("/nonexistent/store");
        assert!(unrestorable("r1", 5, 0, None)
            .unwrap()
            .contains("took no checkpoint"));
        assert!(unrestorable("r1", 5, 2, gone)
            .unwrap()
            .contains("is not at /nonexistent/store"));
        assert_eq!(
            unrestorable("r1", 5, 2, None),
            None,
            "said for an earlier run"
        );
        assert_eq!(unrestorable("r1", 5, 2, Some(here)), None);
        assert_eq!(unrestorable("r1", 5, 2, Some("s3://bucket/store")), None);
        assert_eq!(
            unrestorable("r1", 0, 0, Some(here)),
            None,
            "nothing recorded: nothing to say"
        );
    }

    #[test]
    fn workers_run_with_the_recordings_threads_unless_fast() {
        // 8 cores, -j 4, recorded with 4 threads: 2 workers at a time, exact.
        let t = threads(8, 4, &[4], &[Some(4)], &[], false, true);
        assert_eq!(
            (t.budget, t.capped, t.runs.clone()),
            (2, Some((4, 2)), vec![(4, true)])
        );
        // --fast: 4 at a time, 2 threads each, not the recording's: inexact.
        let t = threads(8, 4, &[4], &[Some(4)], &[], true, true);
        assert_eq!(
            (t.budget, t.capped, t.runs.clone()),
            (4, None, vec![(2, false)])
        );
        // Unknown recording threads: a fair share, nothing to compare against.
        let t = threads(8, 2, &[1, 3], &[None, Some(2)], &[], false, true);
        assert_eq!((t.budget, t.runs.clone()), (2, vec![(4, true), (2, true)]));
        // A batch launcher: -j is the array's width, never capped by this machine.
        let t = threads(2, 16, &[4], &[Some(8)], &[], false, false);
        assert_eq!((t.budget, t.capped), (16, None));
        assert_eq!(
            threads(8, 8, &[2], &[Some(1)], &[], false, true).budget,
            2,
            "no more than the workers"
        );
        // A worker of a 2-rank run is 2 processes: 8 cores hold 2 such workers of 2 threads.
        let t = threads(8, 4, &[4], &[Some(2)], &[2], false, true);
        assert_eq!(
            (t.budget, t.capped, t.runs.clone(), t.task_cpus),
            (2, Some((4, 2)), vec![(2, true)], 4)
        );
        // A batch task holds its worker's ranks, each with its threads: the
        // widest over the runs (a 4-rank run of 3 threads, a 1-process one of 8).
        let t = threads(2, 8, &[2, 1], &[Some(3), Some(8)], &[4, 1], false, false);
        assert_eq!((t.budget, t.task_cpus), (8, 12));
    }

    #[test]
    fn progress_lines_count_iterations_and_carry_the_summary() {
        let mut p = Progress::default();
        p.read("0\n1\n");
        p.read("\n2\nsteps 40 bodies 3 restored 2 restore_s 0.250000 run_s 1.500000\n");
        assert_eq!(
            p,
            Progress {
                done: 3,
                steps: 40,
                bodies: 3,
                restored: 2,
                restore_secs: 0.25,
                run_secs: 1.5,
            }
        );
        let other = Progress {
            run_secs: 2.0,
            restore_secs: 0.5,
            ..p
        };
        assert_eq!(
            time_breakdown(3.0, &[p, other]),
            "time: 1.0s planning, starting and ending 2 worker(s), 2.0s in the replayed iterations \
             (the longest worker; restores summed over all): 0.75s restoring 4 checkpoint(s), the rest \
             executing 80 step(s) and 6 iteration(s) without an inner loop, the probes and the code between"
        );
        // Without one-step iterations, only the steps are named.
        let steps_only = Progress { bodies: 0, ..p };
        assert!(time_breakdown(3.0, &[steps_only])
            .contains("the rest executing 40 step(s), the probes"));
    }

    #[test]
    fn a_replay_that_diverged_keeps_nothing_unless_asked_and_says_so_in_its_status() {
        let ok = verdict(&[Some(0), Some(0)], 0, false, true);
        assert_eq!(
            (ok.keep, ok.exit, ok.diverged),
            (Some(Trust::Exact), 0, false)
        );
        assert_eq!(
            verdict(&[Some(0)], 0, false, false).keep,
            Some(Trust::Inexact)
        );
        let failed = verdict(&[Some(0), Some(1), None], 0, false, true);
        assert_eq!((failed.failed, failed.exit), (vec![1, 2], 1));
        let stopped = verdict(&[Some(EXIT_DIVERGED), Some(1)], 0, false, true);
        assert_eq!(
            (stopped.keep, stopped.exit, stopped.failed),
            (None, EXIT_DIVERGED, vec![1])
        );
        let values = verdict(&[Some(0)], 2, false, true);
        assert_eq!((values.keep, values.exit), (None, EXIT_DIVERGED));
        let kept = verdict(&[Some(0)], 2, true, true);
        assert_eq!((kept.keep, kept.exit), (Some(Trust::Diverged), 0));
    }

    #[test]
    fn a_worker_runs_the_recorded_arguments_where_the_run_ran_or_beside_the_script() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.py");
        let mut run = RunRow {
            id: "r".into(),
            script: "train.py".into(),
            script_abs: script.display().to_string(),
            project_root: dir.path().display().to_string(),
            source_hash: String::new(),
            git_commit: None,
            git_dirty: None,
            args_json: "{}".into(),
            status: RunStatus::Completed,
            started_ms: 0,
            ended_ms: None,
            host: String::new(),
            versions_json: format!(
                r#"{{"argv": ["/old/train.py", "--lr", "0.1"], "cwd": {:?}}}"#,
                dir.path().display().to_string()
            ),
            pid: 0,
            resume_key: None,
            store: None,
        };
        let c = worker_command(&run, &script, Path::new("/usr/bin/python3"), false);
        assert_eq!(
            c.argv,
            ["/usr/bin/python3", script.to_str().unwrap(), "--lr", "0.1"]
        );
        assert_eq!(c.cwd, dir.path());
        // The directory it ran in is gone (a moved project whose cwd was elsewhere).
        run.versions_json = r#"{"argv": ["train.py"], "cwd": "/no/such/dir"}"#.into();
        let c = worker_command(&run, &script, Path::new("python"), false);
        assert_eq!((c.argv.len(), c.cwd.as_path()), (2, dir.path()));
        // A run of 2 ranks: torchrun on 2, or on 1 for a worker that only restores.
        run.versions_json = r#"{"argv": ["train.py"], "world_size": 2}"#.into();
        for (restores_only, n) in [(false, 2), (true, 1)] {
            let c = worker_command(&run, &script, Path::new("python"), restores_only);
            assert_eq!((c.ranks, c.torchrun), (n, true));
            assert_eq!(
                c.argv[..5],
                [
                    "python",
                    "-m",
                    "hindsight.torchrun",
                    "--standalone",
                    &format!("--nproc_per_node={n}")
                ]
            );
        }
        // One rank under torchrun (a one-GPU job written for several): its
        // script needs torchrun's variables and process group, so torchrun
        // of 1; one srun task, or a plain process, runs as itself.
        for (launcher, under) in [("torchrun", true), ("srun", false)] {
            run.versions_json =
                format!(r#"{{"argv": ["train.py"], "world_size": 1, "launcher": "{launcher}"}}"#);
            let c = worker_command(&run, &script, Path::new("python"), false);
            assert_eq!((c.ranks, c.torchrun), (1, under), "{launcher}");
            assert_eq!(c.argv.len(), if under { 6 } else { 2 }, "{:?}", c.argv);
        }
    }

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
