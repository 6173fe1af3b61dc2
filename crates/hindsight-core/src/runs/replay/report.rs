//! What `hindsight replay` says of one run's replay once its workers ended:
//! the verdict ([`verdict`]) in words, the same from every launcher. Its
//! stdout agrees with its exit status: a replay that failed or diverged
//! prints no success line.

use super::driver::{time_breakdown, verdict, Progress, Verdict};

/// One worker, as it ended.
#[derive(Clone, Debug, Default)]
pub struct WorkerEnd {
    pub index: usize,
    /// The first and last iteration it visited (None: none).
    pub iterations: Option<(u64, u64)>,
    /// None: never started.
    pub returncode: Option<i32>,
    /// The end of its standard error, as the launcher kept it.
    pub stderr_tail: String,
    pub progress: Progress,
}

/// The first value the replay computed differently from the recording.
#[derive(Clone, Debug, Default)]
pub struct Differs {
    pub name: String,
    /// Its loop context, outermost first.
    pub ctx: Vec<(String, i64)>,
    pub recorded: String,
    pub replayed: String,
}

/// What to say, and what the replay is worth.
#[derive(Clone, Debug)]
pub struct Report {
    /// Standard error, before the values are kept or discarded: failed
    /// workers, the others' own messages, a divergence. Each ends in a newline.
    pub warnings: Vec<String>,
    /// Standard output, once they are: the outcome and where the time went.
    pub summary: Vec<String>,
    pub verdict: Verdict,
}

/// The report of run `run_id`'s replay, which computed `names` over `total`
/// iterations in `wall_secs`: its `workers` as they ended, how many staged
/// values differ (`divergences`, the first of them `first`), whether
/// `--allow-divergence` keeps them, and whether the workers ran exactly as
/// recorded.
#[allow(clippy::too_many_arguments)]
pub fn report(
    run_id: &str,
    names: &[String],
    total: u64,
    workers: &[WorkerEnd],
    divergences: usize,
    first: Option<&Differs>,
    allow_divergence: bool,
    exact: bool,
    wall_secs: f64,
) -> Report {
    let codes: Vec<Option<i32>> = workers.iter().map(|w| w.returncode).collect();
    let v = verdict(&codes, divergences, allow_divergence, exact);
    let names = names.join(", ");
    let mut warnings = Vec::new();
    for &i in &v.failed {
        let w = &workers[i];
        let at = match w.iterations {
            Some((a, b)) => format!(" (iterations {a}..{b})"),
            None => String::new(),
        };
        let code = w
            .returncode
            .map_or_else(|| "none (never started)".to_string(), |c| c.to_string());
        warnings.push(format!(
            "run {run_id}: worker {}{at} failed with exit code {code}; the values of finished \
             iterations are kept:\n{}\n",
            w.index, w.stderr_tail
        ));
    }
    for (i, w) in workers.iter().enumerate() {
        if !v.failed.contains(&i) && !w.stderr_tail.trim().is_empty() {
            let mut tail = w.stderr_tail.clone();
            if !tail.ends_with('\n') {
                tail.push('\n');
            }
            warnings.push(tail);
        }
    }
    if let Some(d) = first.filter(|_| divergences > 0) {
        let at = d
            .ctx
            .iter()
            .map(|(k, i)| format!("{k}={i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let at = if at.is_empty() {
            "top level".to_string()
        } else {
            at
        };
        let (kept, how) = if v.keep.is_some() {
            ("kept, marked 'diverged'", "")
        } else {
            ("discarded", " (--allow-divergence keeps them, marked)")
        };
        warnings.push(format!(
            "DIVERGENCE in run {run_id}: {divergences} value(s) differ between record and replay; \
             first: {} at {at}: recorded {}, replayed {}. The replay's values were {kept}{how}\n",
            d.name, d.recorded, d.replayed
        ));
    }
    let sum = |f: fn(&Progress) -> u64| workers.iter().map(|w| f(&w.progress)).sum::<u64>();
    let (steps, bodies, restored) = (sum(|p| p.steps), sum(|p| p.bodies), sum(|p| p.restored));
    let one_step = if bodies > 0 {
        format!(", {bodies} iteration(s) without an inner loop executed")
    } else {
        String::new()
    };
    let work = format!(
        "{restored} restored from checkpoints, {steps} inner-loop steps executed{one_step}"
    );
    let outcome = if !v.failed.is_empty() || v.diverged {
        let what = if v.diverged {
            "diverged".to_string()
        } else {
            format!("{} of {} worker(s) failed", v.failed.len(), workers.len())
        };
        let done = sum(|p| p.done).min(total);
        format!(
            "replay of run {run_id} FAILED ({what}) after {wall_secs:.1}s: its workers reached {done} \
             of {total} iteration(s), {work}; values of {names}: {}",
            if v.keep.is_some() { "kept" } else { "discarded" }
        )
    } else {
        format!("replayed {total} iteration(s) in {wall_secs:.1}s: {work}; new values: {names}")
    };
    let progress: Vec<Progress> = workers.iter().map(|w| w.progress).collect();
    Report {
        warnings,
        summary: vec![outcome, time_breakdown(wall_secs, &progress)],
        verdict: v,
    }
}

/// After a replay that succeeded: a note for each of `names` that has no
/// value in the run (`have`): its line never ran in the replayed
/// iterations. Nothing is no wrong value, but it must not pass unnoticed.
pub fn unproduced(run_id: &str, names: &[String], have: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !n.is_empty() && !have.contains(n))
        .map(|n| {
            format!(
                "note: run {run_id}: the replay produced no value of '{n}': its line did not run in \
                 the replayed iterations (a condition that never held, or --where left them out)"
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runs::replay::driver::EXIT_DIVERGED;

    fn worker(index: usize, rc: Option<i32>, tail: &str, done: u64, restored: u64) -> WorkerEnd {
        WorkerEnd {
            index,
            iterations: Some((index as u64 * 5, index as u64 * 5 + 4)),
            returncode: rc,
            stderr_tail: tail.into(),
            progress: Progress {
                done,
                steps: 10,
                restored,
                ..Progress::default()
            },
        }
    }

    fn names() -> Vec<String> {
        vec!["grad_norm".into(), "lr".into()]
    }

    #[test]
    fn a_replay_that_succeeded_says_what_it_restored_and_executed() {
        let r = report(
            "r1",
            &names(),
            10,
            &[
                worker(0, Some(0), "", 5, 1),
                worker(1, Some(0), "a warning", 5, 2),
            ],
            0,
            None,
            false,
            true,
            3.25,
        );
        assert_eq!(r.verdict.exit, 0);
        assert_eq!(r.warnings, ["a warning\n"]);
        assert_eq!(
            r.summary[0],
            "replayed 10 iteration(s) in 3.2s: 3 restored from checkpoints, 20 inner-loop steps \
             executed; new values: grad_norm, lr"
        );
        assert!(r.summary[1].starts_with("time: "), "{}", r.summary[1]);
    }

    #[test]
    fn a_failed_worker_is_named_with_its_iterations_and_no_success_is_claimed() {
        let r = report(
            "r1",
            &names(),
            10,
            &[
                worker(0, Some(0), "", 5, 1),
                worker(1, Some(-9), "Killed", 2, 0),
            ],
            0,
            None,
            false,
            true,
            1.0,
        );
        assert_eq!(r.verdict.exit, 1);
        assert_eq!(
            r.warnings,
            ["run r1: worker 1 (iterations 5..9) failed with exit code -9; the values of finished \
              iterations are kept:\nKilled\n"]
        );
        assert!(r.summary[0].starts_with(
            "replay of run r1 FAILED (1 of 2 worker(s) failed) after 1.0s: its workers reached 7 of 10 \
             iteration(s), 1 restored from checkpoints, 20 inner-loop steps executed; values of \
             grad_norm, lr: kept"
        ));
    }

    #[test]
    fn a_divergence_names_the_first_value_and_discards_unless_asked() {
        let first = Differs {
            name: "loss".into(),
            ctx: vec![("epoch".into(), 3), ("step".into(), 7)],
            recorded: "0.5".into(),
            replayed: "0.25".into(),
        };
        let ws = [worker(0, Some(EXIT_DIVERGED), "", 3, 1)];
        let r = report("r1", &names(), 10, &ws, 2, Some(&first), false, true, 1.0);
        assert_eq!((r.verdict.exit, r.verdict.keep), (EXIT_DIVERGED, None));
        assert_eq!(
            r.warnings,
            ["DIVERGENCE in run r1: 2 value(s) differ between record and replay; first: loss at \
              epoch=3, step=7: recorded 0.5, replayed 0.25. The replay's values were discarded \
              (--allow-divergence keeps them, marked)\n"]
        );
        assert!(
            r.summary[0].contains("FAILED (diverged)") && r.summary[0].ends_with(": discarded")
        );
        let r = report("r1", &names(), 10, &ws, 2, Some(&first), true, true, 1.0);
        assert!(
            r.warnings[0].ends_with("were kept, marked 'diverged'\n"),
            "{:?}",
            r.warnings
        );
        assert!(r.summary[0].ends_with(": kept"), "{}", r.summary[0]);
    }

    #[test]
    fn a_name_without_values_is_noted() {
        let have = vec!["lr".to_string()];
        let notes = unproduced("r1", &names(), &have);
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("note: run r1: the replay produced no value of 'grad_norm'"));
    }
}
