//! Replay planning: which iterations to restore, pseudo-resume or execute,
//! and how to split them across workers. Pure functions: no I/O, no clocks.
//!
//! Vocabulary (as in the Flor papers): a *loop iteration* `i` may have an
//! *end-of-iteration checkpoint* (the loop's side effects after `i`).
//! *Restoring* checkpoint `r` puts the program in the state "just after
//! iteration `r`"; iterations after `r` that must run again only to rebuild
//! state are *pseudo-resumed*. Times are seconds of compute per iteration;
//! invalid times (negative, NaN, infinite, or missing) are replaced by the
//! mean of the valid ones (1.0 when there is none) so a plan always exists.

use std::ops::Range;

/// Per-iteration times with invalid or missing entries (index `>= times.len()`)
/// replaced by the mean of the valid ones (1.0 when none is valid).
fn sanitize_times(times: &[f64], n: usize) -> Vec<f64> {
    let valid = |x: f64| x.is_finite() && x >= 0.0;
    let (sum, count) = times
        .iter()
        .take(n)
        .filter(|&&x| valid(x))
        .fold((0.0, 0usize), |(s, c), &x| (s + x, c + 1));
    let fill = if count > 0 { sum / count as f64 } else { 1.0 };
    (0..n)
        .map(|i| match times.get(i) {
            // `+ 0.0` turns -0.0 into 0.0 so bit patterns order like values.
            Some(&x) if valid(x) => x + 0.0,
            _ => fill,
        })
        .collect()
}

/// Smallest feasible value, by binary search over the bit
/// patterns of non-negative floats (which order like the floats themselves).
/// `hi` must be feasible; returns the smallest feasible value in `[lo, hi]`.
fn min_feasible(lo: f64, hi: f64, feasible: impl Fn(f64) -> bool) -> f64 {
    let (mut lo, mut hi) = (lo.min(hi).to_bits(), hi.to_bits());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(f64::from_bits(mid)) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    f64::from_bits(hi)
}

/// Greedy split of `t` into segments whose sequential sums stay `<= bound`;
/// returns the segment starts.
fn greedy_starts(t: &[f64], bound: f64, limit: usize) -> Option<Vec<usize>> {
    let mut starts = vec![0];
    let mut acc = 0.0;
    for (i, &x) in t.iter().enumerate() {
        let next = acc + x;
        if next > bound && i > *starts.last().unwrap_or(&0) {
            if starts.len() == limit {
                return None;
            }
            starts.push(i);
            acc = x;
        } else {
            acc = next;
        }
    }
    Some(starts)
}

fn starts_to_ranges(starts: &[usize], end: usize) -> Vec<Range<usize>> {
    starts
        .iter()
        .enumerate()
        .map(|(j, &s)| s..starts.get(j + 1).copied().unwrap_or(end))
        .collect()
}

/// Split iterations `0..times.len()` into at most `workers` contiguous,
/// non-empty ranges minimizing the largest range's total time (the replay's
/// wall time when each worker runs one range). Exact: a binary search over
/// the bottleneck value with a greedy feasibility test, O(n · 64). A range's
/// total is the left-to-right floating-point sum of its times. Among optimal
/// splits it returns one with the fewest ranges (fewest restores).
/// `workers == 0` counts as 1; no iterations give no ranges.
pub fn partition(times: &[f64], workers: usize) -> Vec<Range<usize>> {
    let n = times.len();
    if n == 0 {
        return Vec::new();
    }
    let t = sanitize_times(times, n);
    let workers = workers.clamp(1, n);
    let max = t.iter().copied().fold(0.0, f64::max);
    let total = t.iter().fold(0.0, |acc, &x| acc + x);
    let bound = min_feasible(max, total, |b| greedy_starts(&t, b, workers).is_some());
    // `total` is always feasible, so the greedy at the optimum succeeds.
    let starts = greedy_starts(&t, bound, workers).unwrap_or_else(|| vec![0]);
    starts_to_ranges(&starts, n)
}

/// One unit of parallel replay work for a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Iterations to execute for real (probes active). Starts and ends at a
    /// selected iteration; unselected iterations inside it run too because
    /// no checkpoint lets the worker skip them.
    pub range: Range<usize>,
    /// Iteration whose end-of-iteration checkpoint to restore first; `None`:
    /// start from the program's initial state (iteration 0).
    pub restore_from: Option<usize>,
    /// Iterations between the restore point and `range.start` that have to be
    /// re-executed only to rebuild state (no checkpoint covers them); empty
    /// when `restore_from == Some(range.start - 1)`. Always ends at `range.start`.
    pub pseudo_resume: Range<usize>,
    /// Worker (0-based) that runs this segment. A worker runs its segments in
    /// order, restoring before each.
    pub worker: usize,
    /// Estimated seconds: times of `pseudo_resume` plus `range` (restore time
    /// not included).
    pub est_seconds: f64,
}

/// Plan a parallel replay where only the `selected` iterations (`--where`)
/// need their probes to run.
///
/// Each segment restores the nearest checkpoint at or before `range.start - 1`
/// and pseudo-resumes the un-checkpointed gap up to `range.start`. Two
/// consecutive selected iterations `a < b` share a segment unless a
/// checkpoint after `a` and before `b` lets the worker skip part of the
/// iterations in between. Workers get contiguous runs of the selected
/// iterations (in iteration order); the split minimizes the largest
/// worker's total time of (gap + segment), exactly for that model (binary
/// search on the bottleneck with a greedy test), using as few workers as
/// that optimum needs. Restore time is not modelled.
///
/// `checkpoints[i]` / `selected[i]`: iteration `i` has an end-of-iteration
/// checkpoint / is selected; missing entries count as `false`, entries at
/// or beyond `n_iters` are ignored. `workers == 0` counts as 1. Segments
/// come sorted by `range.start` (and so by worker).
pub fn plan_segments(
    n_iters: usize,
    times: &[f64],
    checkpoints: &[bool],
    selected: &[bool],
    workers: usize,
) -> Vec<Segment> {
    let sel: Vec<usize> = (0..n_iters)
        .filter(|&i| selected.get(i).copied().unwrap_or(false))
        .collect();
    if sel.is_empty() {
        return Vec::new();
    }
    let t = sanitize_times(times, n_iters);
    let mut prefix = Vec::with_capacity(n_iters + 1);
    prefix.push(0.0);
    for &x in &t {
        prefix.push(prefix.last().copied().unwrap_or(0.0) + x);
    }
    let sum = |r: Range<usize>| (prefix[r.end] - prefix[r.start]).max(0.0);
    let prev_ck = previous_checkpoints(n_iters, checkpoints);
    let exec_from = |s: usize| prev_ck[s].map_or(0, |r| r + 1);

    // Cost to start fresh at selected iteration j (restore + gap + itself),
    // and to go on from selected j-1 to j within one worker.
    let start_cost: Vec<f64> = sel.iter().map(|&s| sum(exec_from(s)..s + 1)).collect();
    // breaks[j]: going from sel[j-1] to sel[j] restores a later checkpoint.
    let breaks: Vec<bool> = (0..sel.len())
        .map(|j| j > 0 && exec_from(sel[j]) > sel[j - 1] + 1)
        .collect();
    let step_cost: Vec<f64> = (0..sel.len())
        .map(|j| {
            if j == 0 {
                start_cost[0]
            } else {
                sum(exec_from(sel[j]).max(sel[j - 1] + 1)..sel[j] + 1)
            }
        })
        .collect();

    let workers = workers.clamp(1, sel.len());
    // Greedy: each worker takes as many following selected iterations as fit.
    let assign = |bound: f64| -> Option<Vec<usize>> {
        let mut starts = vec![0];
        let mut load = start_cost[0];
        if load > bound {
            return None;
        }
        for j in 1..sel.len() {
            let next = load + step_cost[j];
            if next > bound {
                if starts.len() == workers || start_cost[j] > bound {
                    return None;
                }
                starts.push(j);
                load = start_cost[j];
            } else {
                load = next;
            }
        }
        Some(starts)
    };
    let lo = start_cost.iter().copied().fold(0.0, f64::max);
    let hi = step_cost.iter().fold(0.0, |acc, &x| acc + x);
    let bound = min_feasible(lo, hi, |b| assign(b).is_some());
    let starts = assign(bound)
        .or_else(|| assign(hi))
        .unwrap_or_else(|| vec![0]);

    let mut segments = Vec::new();
    for (w, block) in starts_to_ranges(&starts, sel.len()).into_iter().enumerate() {
        let mut first = block.start;
        for j in block.clone() {
            let last = j + 1 == block.end || breaks[j + 1];
            if last {
                let (a, b) = (sel[first], sel[j]);
                let from = exec_from(a);
                segments.push(Segment {
                    range: a..b + 1,
                    restore_from: prev_ck[a],
                    pseudo_resume: from..a,
                    worker: w,
                    est_seconds: sum(from..b + 1),
                });
                first = j + 1;
            }
        }
    }
    segments
}

/// `prev[i]`: the latest iteration `< i` with a checkpoint.
fn previous_checkpoints(n_iters: usize, checkpoints: &[bool]) -> Vec<Option<usize>> {
    let mut prev = Vec::with_capacity(n_iters);
    let mut last = None;
    for i in 0..n_iters {
        prev.push(last);
        if checkpoints.get(i).copied().unwrap_or(false) {
            last = Some(i);
        }
    }
    prev
}

/// What a partial replay does at one outer-loop iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartialStep {
    /// Nothing: neither probed nor needed to rebuild a later state.
    Skip,
    /// Restore this iteration's end checkpoint instead of running its inner
    /// loop, then run the outer-loop probes.
    Restore,
    /// Run the inner loop. `restore_from: Some(r)`: first restore the end
    /// checkpoint of iteration `r` (= this one − 1) because the program is not
    /// in that state yet; `None`: the state is already current (previous
    /// step executed or restored it, or this is iteration 0 from scratch).
    Execute { restore_from: Option<usize> },
}

/// Plan for replaying outer-loop-only probes (see [`plan_partial`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialPlan {
    /// One step per iteration `0..n_iters`.
    pub steps: Vec<PartialStep>,
    /// Iterations whose inner loop must actually run, ascending.
    pub run_inner: Vec<usize>,
}

impl PartialPlan {
    /// The last iteration that is not [`PartialStep::Skip`]; the replay can
    /// stop after it.
    pub fn last_needed(&self) -> Option<usize> {
        self.steps.iter().rposition(|s| *s != PartialStep::Skip)
    }
}

/// Plan a partial replay for probes in the outer loop only: a selected
/// iteration with an end checkpoint is restored (its inner loop does not
/// run); one without is recomputed from the nearest earlier checkpoint (or
/// from iteration 0). Each needed inner loop runs once even when several
/// selected iterations need it. Missing `checkpoints`/`selected` entries
/// count as `false`.
pub fn plan_partial(n_iters: usize, checkpoints: &[bool], selected: &[bool]) -> PartialPlan {
    let ck = |i: usize| checkpoints.get(i).copied().unwrap_or(false);
    let sel = |i: usize| selected.get(i).copied().unwrap_or(false);
    let prev_ck = previous_checkpoints(n_iters, checkpoints);
    let mut needed = vec![false; n_iters];
    for i in (0..n_iters).filter(|&i| sel(i) && !ck(i)) {
        let from = prev_ck[i].map_or(0, |r| r + 1);
        // Walk back until an already-marked iteration: the span below it is
        // marked too (same checkpoint-free stretch).
        for j in (from..=i).rev() {
            if needed[j] {
                break;
            }
            needed[j] = true;
        }
    }
    let mut steps = Vec::with_capacity(n_iters);
    for (i, &need) in needed.iter().enumerate() {
        let step = if need {
            let current = i == 0
                || matches!(
                    steps.last(),
                    Some(PartialStep::Restore | PartialStep::Execute { .. })
                );
            PartialStep::Execute {
                restore_from: (!current).then(|| i - 1),
            }
        } else if sel(i) && ck(i) {
            PartialStep::Restore
        } else {
            PartialStep::Skip
        };
        steps.push(step);
    }
    let run_inner = (0..n_iters).filter(|&i| needed[i]).collect();
    PartialPlan { steps, run_inner }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // ---------- partition ----------

    fn seq_sum(t: &[f64]) -> f64 {
        t.iter().fold(0.0, |a, &x| a + x)
    }

    fn bottleneck(t: &[f64], ranges: &[Range<usize>]) -> f64 {
        ranges
            .iter()
            .map(|r| seq_sum(&t[r.clone()]))
            .fold(0.0, f64::max)
    }

    /// Minimum bottleneck over all splits of `t` into at most `w` non-empty ranges.
    fn brute_partition(t: &[f64], w: usize) -> f64 {
        let n = t.len();
        let mut best = f64::INFINITY;
        // Each of the n-1 gaps is a cut or not.
        for mask in 0u32..(1 << (n - 1)) {
            if mask.count_ones() as usize + 1 > w {
                continue;
            }
            let mut starts = vec![0];
            starts.extend((1..n).filter(|i| mask & (1 << (i - 1)) != 0));
            let ranges = starts_to_ranges(&starts, n);
            best = best.min(bottleneck(t, &ranges));
        }
        best
    }

    fn check_cover(ranges: &[Range<usize>], n: usize, w: usize) {
        assert!(ranges.len() <= w.max(1));
        let mut next = 0;
        for r in ranges {
            assert_eq!(r.start, next);
            assert!(r.end > r.start);
            next = r.end;
        }
        assert_eq!(next, n);
    }

    #[test]
    fn partition_basics() {
        assert!(partition(&[], 4).is_empty());
        assert_eq!(partition(&[1.0; 8], 4), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(partition(&[1.0; 3], 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(partition(&[5.0, 1.0, 1.0, 1.0], 0), vec![0..4]);
        // One heavy iteration: the rest can share a worker.
        assert_eq!(
            partition(&[1.0, 1.0, 10.0, 1.0, 1.0], 3),
            vec![0..2, 2..3, 3..5]
        );
        assert_eq!(partition(&[0.0; 5], 3), vec![0..5]);
        // NaN / negative / infinite fall back to the mean of the valid times.
        let r = partition(&[1.0, f64::NAN, 1.0, -3.0, f64::INFINITY, 1.0], 3);
        assert_eq!(r, vec![0..2, 2..4, 4..6]);
    }

    #[test]
    fn partition_large_input_is_fast_and_balanced() {
        let n = 100_000;
        let t: Vec<f64> = (0..n).map(|i| 1.0 + (i % 7) as f64 * 0.25).collect();
        let start = std::time::Instant::now();
        let r = partition(&t, 16);
        assert!(start.elapsed().as_secs_f64() < 5.0);
        check_cover(&r, n, 16);
        let ideal = seq_sum(&t) / 16.0;
        assert!(
            bottleneck(&t, &r) <= ideal + 2.0,
            "{} vs {ideal}",
            bottleneck(&t, &r)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn partition_matches_brute_force(
            t in prop::collection::vec(prop_oneof![0.0f64..10.0, (0u32..5).prop_map(f64::from)], 1..11),
            w in 0usize..6,
        ) {
            let r = partition(&t, w);
            check_cover(&r, t.len(), w);
            let best = brute_partition(&t, w.max(1));
            prop_assert_eq!(bottleneck(&t, &r), best);
        }
    }

    // ---------- plan_segments ----------

    fn bools(n: usize, set: &[usize]) -> Vec<bool> {
        (0..n).map(|i| set.contains(&i)).collect()
    }

    /// Check the structural promises of a plan and return its makespan.
    fn check_segments(
        segs: &[Segment],
        t: &[f64],
        ck: &[bool],
        sel: &[bool],
        workers: usize,
    ) -> f64 {
        let n = t.len();
        let mut covered = vec![false; n];
        let mut loads = vec![0.0; workers.max(1)];
        let mut prev: Option<&Segment> = None;
        for s in segs {
            assert!(s.worker < workers.max(1));
            assert!(sel[s.range.start] && sel[s.range.end - 1], "{s:?}");
            assert_eq!(s.pseudo_resume.end, s.range.start);
            match s.restore_from {
                Some(r) => {
                    assert!(ck[r]);
                    assert_eq!(s.pseudo_resume.start, r + 1);
                }
                None => assert_eq!(s.pseudo_resume.start, 0),
            }
            // Nearest checkpoint: none inside the pseudo-resumed gap.
            assert!(s.pseudo_resume.clone().all(|i| !ck[i]), "{s:?}");
            for i in s.range.clone() {
                assert!(!covered[i], "iteration {i} twice");
                covered[i] = true;
            }
            if let Some(p) = prev {
                assert!(p.range.end <= s.range.start);
                assert!(p.worker <= s.worker);
            }
            let cost: f64 = t[s.pseudo_resume.start..s.range.end].iter().sum();
            assert!((cost - s.est_seconds).abs() <= 1e-9 * (1.0 + cost));
            loads[s.worker] += s.est_seconds;
            prev = Some(s);
        }
        for i in 0..n {
            if sel[i] {
                assert!(covered[i], "selected {i} not covered");
            }
        }
        loads.into_iter().fold(0.0, f64::max)
    }

    #[test]
    fn segments_without_checkpoints_use_one_worker() {
        let t = [1.0; 8];
        let segs = plan_segments(8, &t, &[false; 8], &[true; 8], 4);
        assert_eq!(
            segs,
            vec![Segment {
                range: 0..8,
                restore_from: None,
                pseudo_resume: 0..0,
                worker: 0,
                est_seconds: 8.0
            }]
        );
    }

    #[test]
    fn segments_with_all_checkpoints_split_evenly() {
        let t = [2.0; 8];
        let segs = plan_segments(8, &t, &[true; 8], &[true; 8], 4);
        let ranges: Vec<_> = segs
            .iter()
            .map(|s| (s.range.clone(), s.restore_from, s.worker))
            .collect();
        assert_eq!(
            ranges,
            vec![
                (0..2, None, 0),
                (2..4, Some(1), 1),
                (4..6, Some(3), 2),
                (6..8, Some(5), 3)
            ]
        );
        assert!(segs
            .iter()
            .all(|s| s.pseudo_resume.is_empty() && s.est_seconds == 4.0));
    }

    #[test]
    fn segments_pseudo_resume_and_skip() {
        // Checkpoint every 4th iteration (3, 7, 11); 16 iterations.
        let n = 16;
        let t = vec![1.0; n];
        let ck = bools(n, &[3, 7, 11]);
        // Only 1 and 9 selected, one worker: two segments, skipping 2..=7 via checkpoint 7.
        let segs = plan_segments(n, &t, &ck, &bools(n, &[1, 9]), 1);
        assert_eq!(
            segs,
            vec![
                Segment {
                    range: 1..2,
                    restore_from: None,
                    pseudo_resume: 0..1,
                    worker: 0,
                    est_seconds: 2.0
                },
                Segment {
                    range: 9..10,
                    restore_from: Some(7),
                    pseudo_resume: 8..9,
                    worker: 0,
                    est_seconds: 2.0
                },
            ]
        );
        // 4 and 6 selected, no checkpoint between: one segment runs 4..7 with 5 inside.
        let segs = plan_segments(n, &t, &ck, &bools(n, &[4, 6]), 2);
        assert_eq!(
            segs,
            vec![Segment {
                range: 4..7,
                restore_from: Some(3),
                pseudo_resume: 4..4,
                worker: 0,
                est_seconds: 3.0
            }]
        );
        // Everything selected on 4 workers: one checkpoint period each.
        let segs = plan_segments(n, &t, &ck, &[true; 16], 4);
        let ranges: Vec<_> = segs.iter().map(|s| s.range.clone()).collect();
        assert_eq!(ranges, vec![0..4, 4..8, 8..12, 12..16]);
        check_segments(&segs, &t, &ck, &[true; 16], 4);
        // Nothing selected: nothing to do.
        assert!(plan_segments(n, &t, &ck, &[false; 16], 4).is_empty());
        assert!(plan_segments(0, &[], &[], &[], 4).is_empty());
    }

    #[test]
    fn segments_balance_uneven_times() {
        // Sparse checkpoints: a worker starting mid-way pays the gap.
        let n = 10;
        let t = vec![1.0; n];
        let ck = bools(n, &[4]);
        let segs = plan_segments(n, &t, &ck, &[true; 10], 2);
        let makespan = check_segments(&segs, &t, &ck, &[true; 10], 2);
        assert_eq!(makespan, 5.0);
        assert_eq!(segs[1].restore_from, Some(4));
        // Short slices (missing times/flags) are tolerated.
        let segs = plan_segments(6, &[1.0, 1.0], &[true], &[true, true, true], 3);
        assert_eq!(
            segs.iter().map(|s| s.range.clone()).collect::<Vec<_>>(),
            vec![0..2, 2..3]
        );
    }

    /// Cost of a worker running selected iterations `sel[j..=l]`: the model
    /// `plan_segments` promises to optimize, computed independently by
    /// simulating the cheapest way to reach each selected iteration.
    fn block_cost(t: &[f64], ck: &[bool], sel: &[usize]) -> f64 {
        let nearest = |s: usize| (0..s).rev().find(|&r| ck[r]).map_or(0, |r| r + 1);
        let mut cost = 0.0;
        let mut pos: Option<usize> = None; // state after iteration pos
        for &s in sel {
            let restart = nearest(s);
            let cont = pos.map_or(0, |p| p + 1);
            let from = restart.max(cont);
            cost += t[from..=s].iter().sum::<f64>();
            pos = Some(s);
        }
        cost
    }

    fn brute_segments(t: &[f64], ck: &[bool], sel: &[usize], w: usize) -> f64 {
        let m = sel.len();
        let mut best = f64::INFINITY;
        for mask in 0u32..(1 << (m - 1)) {
            if mask.count_ones() as usize + 1 > w {
                continue;
            }
            let mut starts = vec![0];
            starts.extend((1..m).filter(|i| mask & (1 << (i - 1)) != 0));
            let worst = starts_to_ranges(&starts, m)
                .into_iter()
                .map(|b| block_cost(t, ck, &sel[b]))
                .fold(0.0, f64::max);
            best = best.min(worst);
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn segments_match_brute_force(
            spec in prop::collection::vec((0u32..8, any::<bool>(), prop::bool::weighted(0.6)), 1..13),
            w in 1usize..5,
        ) {
            let t: Vec<f64> = spec.iter().map(|s| f64::from(s.0) * 0.5).collect();
            let ck: Vec<bool> = spec.iter().map(|s| s.1).collect();
            let sel: Vec<bool> = spec.iter().map(|s| s.2).collect();
            let n = t.len();
            let segs = plan_segments(n, &t, &ck, &sel, w);
            let sel_idx: Vec<usize> = (0..n).filter(|&i| sel[i]).collect();
            if sel_idx.is_empty() {
                prop_assert!(segs.is_empty());
            } else {
                let makespan = check_segments(&segs, &t, &ck, &sel, w);
                let best = brute_segments(&t, &ck, &sel_idx, w);
                prop_assert!((makespan - best).abs() <= 1e-9, "plan {makespan} vs best {best}: {segs:?}");
            }
        }
    }

    // ---------- plan_partial ----------

    #[test]
    fn partial_restores_checkpointed_and_recomputes_others() {
        let n = 10;
        let ck = bools(n, &[2, 5, 8]);
        let plan = plan_partial(n, &ck, &bools(n, &[2, 5, 8]));
        assert!(plan.run_inner.is_empty());
        assert_eq!(plan.steps[5], PartialStep::Restore);
        assert_eq!(plan.last_needed(), Some(8));

        let plan = plan_partial(n, &ck, &bools(n, &[4]));
        assert_eq!(plan.run_inner, vec![3, 4]);
        use PartialStep::*;
        assert_eq!(
            plan.steps,
            vec![
                Skip,
                Skip,
                Skip,
                Execute {
                    restore_from: Some(2)
                },
                Execute { restore_from: None },
                Skip,
                Skip,
                Skip,
                Skip,
                Skip
            ]
        );
        assert_eq!(plan.last_needed(), Some(4));

        // Everything selected: checkpointed ones restored, the rest executed
        // right after (state already current).
        let plan = plan_partial(n, &ck, &[true; 10]);
        assert_eq!(plan.run_inner, vec![0, 1, 3, 4, 6, 7, 9]);
        assert_eq!(plan.steps[3], Execute { restore_from: None });
        // No checkpoints: recompute from scratch up to the last selected one.
        let plan = plan_partial(n, &[], &bools(n, &[6]));
        assert_eq!(plan.run_inner, (0..=6).collect::<Vec<_>>());
        assert_eq!(plan.steps[0], Execute { restore_from: None });
        assert!(plan_partial(0, &[], &[]).steps.is_empty());
        assert_eq!(plan_partial(5, &[], &[]).last_needed(), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Simulate the replay driver: every selected iteration ends up in its
        /// exact post-iteration state, restores only use existing checkpoints,
        /// and no inner loop runs that no selected iteration needs.
        #[test]
        fn partial_plan_simulates_correctly(
            flags in prop::collection::vec((any::<bool>(), prop::bool::weighted(0.3)), 0..40),
        ) {
            let n = flags.len();
            let ck: Vec<bool> = flags.iter().map(|f| f.0).collect();
            let sel: Vec<bool> = flags.iter().map(|f| f.1).collect();
            let plan = plan_partial(n, &ck, &sel);
            prop_assert_eq!(plan.steps.len(), n);
            // state: Some(i) = just after iteration i; None = initial state.
            let mut state: Option<usize> = None;
            let mut valid = true; // state is a real program state
            for (i, step) in plan.steps.iter().enumerate() {
                match *step {
                    PartialStep::Skip => valid = false,
                    PartialStep::Restore => {
                        prop_assert!(ck[i]);
                        state = Some(i);
                        valid = true;
                    }
                    PartialStep::Execute { restore_from } => {
                        if let Some(r) = restore_from {
                            prop_assert!(ck[r] && r + 1 == i);
                            state = Some(r);
                            valid = true;
                        }
                        prop_assert!(valid, "executing {} from a skipped state", i);
                        prop_assert_eq!(state.map_or(0, |s| s + 1), i);
                        state = Some(i);
                    }
                }
                if sel[i] {
                    prop_assert!(valid && state == Some(i));
                }
            }
            // Minimal: an executed iteration is needed by a later (or equal)
            // selected one without a checkpoint in between.
            for &i in &plan.run_inner {
                let needed = (i..n).take_while(|&j| j == i || !ck[j - 1]).any(|j| sel[j] && !ck[j])
                    && !ck[i];
                prop_assert!(needed, "iteration {} executed needlessly", i);
            }
        }
    }
}
