//! Which checkpoints a retention policy keeps. Pure: the caller lists the
//! complete checkpoints and removes the others (durably, then gc).
//!
//! Policies combine as a union: a checkpoint is kept when any policy keeps
//! it. The newest checkpoint is always kept, whatever the policy says, so a
//! resume always has somewhere to start.

use crate::checkpoint::naming::CheckpointId;
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BestMode {
    Min,
    Max,
}

impl std::str::FromStr for BestMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "min" => Ok(BestMode::Min),
            "max" => Ok(BestMode::Max),
            other => Err(Error::invalid(
                "best mode",
                format!("{other:?} is not 'min' or 'max'"),
            )),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Retention {
    /// Keep the N newest.
    pub keep_last: Option<usize>,
    /// Keep the K best by a metric.
    pub keep_best: Option<(usize, BestMode)>,
    /// Keep every checkpoint whose index is a multiple of N.
    pub keep_every: Option<u64>,
    /// Keep at most N, spread over the run: those whose index is a multiple
    /// of the smallest power-of-two stride that leaves at most N. The stride
    /// only grows as the run does, so a checkpoint removed is never one a
    /// later pass would have kept.
    pub keep_spread: Option<usize>,
}

/// Checkpoints a long loop keeps by default ([`Retention::default_for_loop`]).
pub const DEFAULT_SPREAD: usize = 256;
/// An outer loop longer than this (or of unknown length: an iteration
/// loop over `itertools.count()`) gets the default retention.
pub const LONG_LOOP: u64 = 1000;

/// A front end's retention arguments (`hs.checkpointing`, the Lightning
/// callback), before they are checked.
#[derive(Clone, Debug, Default)]
pub struct RetentionArgs<'a> {
    pub keep_last: Option<i64>,
    pub keep_best: Option<i64>,
    /// The logged value keep-best ranks by.
    pub metric: Option<&'a str>,
    /// "min" or "max".
    pub mode: &'a str,
    pub keep_every: Option<i64>,
}

impl Retention {
    /// The policy `args` ask for, checked once for every front end: errors
    /// name the argument as the caller wrote it, `call(name=value)`, where
    /// `metric_arg` and `mode_arg` are what that call names the ranked
    /// metric and its direction.
    pub fn from_args(
        call: &str,
        [metric_arg, mode_arg]: [&str; 2],
        args: &RetentionArgs<'_>,
    ) -> Result<Retention> {
        let count = |name: &str, v: Option<i64>| -> Result<Option<u64>> {
            match v {
                Some(n) if n < 1 => Err(Error::invalid(
                    format!("{call}({name}={n})"),
                    "must be at least 1",
                )),
                v => Ok(v.map(|n| n as u64)),
            }
        };
        let keep_last = count("keep_last", args.keep_last)?;
        let keep_best = count("keep_best", args.keep_best)?;
        let keep_every = count("keep_every", args.keep_every)?;
        let mode: BestMode = args.mode.parse().map_err(|_| {
            Error::invalid(
                format!("{call}({mode_arg}={:?})", args.mode),
                "use 'min' or 'max'",
            )
        })?;
        if keep_best.is_some() && args.metric.is_none_or(str::is_empty) {
            return Err(Error::invalid(
                format!("{call}(keep_best=...)"),
                format!("needs {metric_arg}='<logged metric>' to rank checkpoints by"),
            ));
        }
        Ok(Retention {
            keep_last: keep_last.map(|n| n as usize),
            keep_best: keep_best.map(|n| (n as usize, mode)),
            keep_every,
            keep_spread: None,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.keep_last.is_none()
            && self.keep_best.is_none()
            && self.keep_every.is_none()
            && self.keep_spread.is_none()
    }

    /// The retention of a recording whose user chose none, for an outer
    /// loop of `len` iterations (`None`: unknown). Epoch loops keep every
    /// checkpoint; an iteration loop (long or unbounded, where the adaptive
    /// policy may checkpoint most iterations) keeps [`DEFAULT_SPREAD`] spread
    /// over the run, so its store stays bounded and a replay still restores
    /// near every iteration.
    pub fn default_for_loop(len: Option<u64>) -> Retention {
        match len {
            Some(n) if n <= LONG_LOOP => Retention::default(),
            _ => Retention {
                keep_spread: Some(DEFAULT_SPREAD),
                ..Retention::default()
            },
        }
    }
}

/// The stride [`Retention::keep_spread`] keeps at: the smallest power of two
/// leaving at most `n` of `indices`.
fn spread_stride(indices: &[u64], n: usize) -> u64 {
    let mut stride = 1u64;
    while stride < 1 << 62 && indices.iter().filter(|&&i| i % stride == 0).count() > n {
        stride *= 2;
    }
    stride
}

/// One complete checkpoint: its position (e.g. epoch) and, if known, its metric.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub index: u64,
    pub metric: Option<f64>,
}

/// A keep flag for each candidate. With no policy, everything is kept.
pub fn select(candidates: &[Candidate], policy: &Retention) -> Vec<bool> {
    if policy.is_empty() || candidates.is_empty() {
        return vec![true; candidates.len()];
    }
    let mut keep = vec![false; candidates.len()];
    let mut by_age: Vec<usize> = (0..candidates.len()).collect();
    by_age.sort_by_key(|&i| std::cmp::Reverse(candidates[i].index));
    keep[by_age[0]] = true;
    if let Some(n) = policy.keep_last {
        by_age.iter().take(n).for_each(|&i| keep[i] = true);
    }
    if let Some(every) = policy.keep_every.filter(|&e| e > 0) {
        for (i, c) in candidates.iter().enumerate() {
            if c.index % every == 0 {
                keep[i] = true;
            }
        }
    }
    if let Some(n) = policy.keep_spread.filter(|&n| n > 0) {
        let indices: Vec<u64> = candidates.iter().map(|c| c.index).collect();
        let stride = spread_stride(&indices, n);
        for (i, c) in candidates.iter().enumerate() {
            if c.index % stride == 0 {
                keep[i] = true;
            }
        }
    }
    if let Some((k, mode)) = policy.keep_best {
        let mut scored: Vec<(usize, f64)> = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.metric.filter(|m| !m.is_nan()).map(|m| (i, m)))
            .collect();
        // Best first; among equal metrics the newer wins.
        scored.sort_by(|a, b| {
            let ord = a.1.total_cmp(&b.1);
            let ord = if mode == BestMode::Max {
                ord.reverse()
            } else {
                ord
            };
            ord.then(candidates[b.0].index.cmp(&candidates[a.0].index))
        });
        scored.iter().take(k).for_each(|&(i, _)| keep[i] = true);
    }
    keep
}

/// One checkpoint a retention pass considers, with its metric if known.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub id: CheckpointId,
    pub metric: Option<f64>,
}

/// The whole retention decision for one prefix: which checkpoints to remove.
///
/// Block checkpoints (one per outer iteration) are chosen among by
/// [`select`]. Interim ones (mid-iteration steps, iteration ends) exist to
/// resume from: one is superseded, and removed, once a block checkpoint newer
/// than it exists; of the others the newest `max(keep_last, 1)` stay. With
/// no policy nothing is removed. Entries of other prefixes are ignored.
pub fn removals(entries: &[Entry], prefix: &str, policy: &Retention) -> Vec<CheckpointId> {
    if policy.is_empty() {
        return Vec::new();
    }
    let mut mine: Vec<&Entry> = entries.iter().filter(|e| e.id.prefix == prefix).collect();
    mine.sort_by(|a, b| a.id.cmp(&b.id));
    let (interim, blocks): (Vec<&Entry>, Vec<&Entry>) =
        mine.into_iter().partition(|e| e.id.kind.is_interim());
    let candidates: Vec<Candidate> = blocks
        .iter()
        .map(|e| Candidate {
            index: e.id.index,
            metric: e.metric,
        })
        .collect();
    let keep = select(&candidates, policy);
    let mut out: Vec<CheckpointId> = blocks
        .iter()
        .zip(keep)
        .filter(|(_, k)| !k)
        .map(|(e, _)| e.id.clone())
        .collect();
    let newest_block = blocks.last().map(|e| e.id.order());
    let (superseded, live): (Vec<&Entry>, Vec<&Entry>) = interim
        .into_iter()
        .partition(|e| newest_block.is_some_and(|b| e.id.order() < b));
    out.extend(superseded.into_iter().map(|e| e.id.clone()));
    let n = policy.keep_last.unwrap_or(1).max(1);
    out.extend(live.iter().rev().skip(n).map(|e| e.id.clone()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked_naming_the_call() {
        let args = |keep_last, keep_best, metric, mode| RetentionArgs {
            keep_last,
            keep_best,
            metric,
            mode,
            keep_every: None,
        };
        let err = |a: RetentionArgs<'_>| {
            Retention::from_args("hs.checkpointing", ["best_metric", "best_mode"], &a)
                .unwrap_err()
                .to_string()
        };
        assert!(err(args(Some(0), None, None, "min"))
            .contains("hs.checkpointing(keep_last=0): must be at least 1"));
        assert!(err(args(None, Some(1), None, "min")).contains("needs best_metric="));
        assert!(err(args(None, None, None, "best"))
            .contains("hs.checkpointing(best_mode=\"best\"): use 'min' or 'max'"));
        let ok = Retention::from_args(
            "HindsightCheckpoint",
            ["monitor", "mode"],
            &args(Some(2), Some(1), Some("val"), "max"),
        )
        .unwrap();
        assert_eq!(ok.keep_last, Some(2));
        assert_eq!(ok.keep_best, Some((1, BestMode::Max)));
    }
    use crate::checkpoint::naming::Kind;
    use proptest::prelude::*;

    fn id(index: u64, kind: Kind) -> CheckpointId {
        CheckpointId::new("run", "epoch", index, kind).unwrap()
    }

    fn entries(ids: &[(u64, Kind, Option<f64>)]) -> Vec<Entry> {
        ids.iter()
            .map(|&(i, k, metric)| Entry {
                id: id(i, k),
                metric,
            })
            .collect()
    }

    fn names(ids: Vec<CheckpointId>) -> Vec<String> {
        let mut v: Vec<String> = ids.iter().map(|i| i.name()).collect();
        v.sort();
        v
    }

    #[test]
    fn keep_spread_bounds_a_long_run_and_never_wants_back_what_it_removed() {
        let p = Retention {
            keep_spread: Some(8),
            ..Default::default()
        };
        let mut alive: Vec<u64> = Vec::new();
        let mut removed = std::collections::HashSet::new();
        for i in 0..1000u64 {
            if i % 3 == 1 {
                continue; // the adaptive policy skipped this one
            }
            alive.push(i);
            let cs: Vec<Candidate> = alive
                .iter()
                .map(|&index| Candidate {
                    index,
                    metric: None,
                })
                .collect();
            let keep = select(&cs, &p);
            assert!(keep.iter().filter(|&&k| k).count() <= 8 + 1, "at {i}");
            assert!(*keep.last().unwrap(), "the newest is kept");
            let kept: Vec<u64> = alive
                .iter()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(i, _)| *i)
                .collect();
            for (idx, k) in alive.iter().zip(&keep) {
                if !k {
                    removed.insert(*idx);
                }
            }
            assert!(
                kept.iter().all(|k| !removed.contains(k)),
                "a removed one is wanted back at {i}"
            );
            alive = kept;
        }
        // Spread over the run, not bunched at its end.
        assert!(alive[0] == 0 && alive.len() >= 4, "{alive:?}");
        assert_eq!(Retention::default_for_loop(Some(100)), Retention::default());
        assert_eq!(
            Retention::default_for_loop(None).keep_spread,
            Some(DEFAULT_SPREAD)
        );
        assert_eq!(
            Retention::default_for_loop(Some(LONG_LOOP + 1)).keep_spread,
            Some(DEFAULT_SPREAD)
        );
    }

    #[test]
    fn interim_checkpoints_are_superseded_by_a_newer_block() {
        let es = entries(&[
            (0, Kind::Block, None),
            (1, Kind::Step(10), None), // superseded by block 1
            (1, Kind::Block, None),
            (1, Kind::End, None), // newer than block 1: not superseded
            (2, Kind::Step(20), None),
            (2, Kind::Step(25), None), // the newest interim: kept
        ]);
        let p = Retention {
            keep_last: Some(1),
            ..Default::default()
        };
        assert_eq!(
            names(removals(&es, "run", &p)),
            [
                "run.epoch-000000",
                "run.epoch-000001.end",
                "run.epoch-000001.step-000000010",
                "run.epoch-000002.step-000000020",
            ]
        );
        let p = Retention {
            keep_last: Some(3),
            ..Default::default()
        };
        assert_eq!(
            names(removals(&es, "run", &p)),
            ["run.epoch-000001.step-000000010"]
        );
        // Another prefix, or no policy: nothing.
        assert!(removals(&es, "other", &p).is_empty());
        assert!(removals(&es, "run", &Retention::default()).is_empty());
    }

    #[test]
    fn best_by_metric_among_blocks() {
        let es = entries(&[
            (0, Kind::Block, Some(0.3)),
            (1, Kind::Block, Some(0.1)),
            (2, Kind::Block, Some(0.5)),
            (3, Kind::Block, Some(0.4)),
        ]);
        let p = Retention {
            keep_last: Some(1),
            keep_best: Some((1, BestMode::Min)),
            keep_every: None,
            keep_spread: None,
        };
        assert_eq!(
            names(removals(&es, "run", &p)),
            ["run.epoch-000000", "run.epoch-000002"]
        );
    }

    fn c(index: u64, metric: Option<f64>) -> Candidate {
        Candidate { index, metric }
    }

    #[test]
    fn last_two_plus_best_one() {
        let cs: Vec<_> = [0.9, 0.5, 0.7, 0.8, 0.6]
            .iter()
            .enumerate()
            .map(|(i, &m)| c(i as u64, Some(m)))
            .collect();
        let p = Retention {
            keep_last: Some(2),
            keep_best: Some((1, BestMode::Min)),
            keep_every: None,
            keep_spread: None,
        };
        assert_eq!(select(&cs, &p), vec![false, true, false, true, true]);
        let p = Retention {
            keep_best: Some((2, BestMode::Max)),
            ..Default::default()
        };
        // best by max: 0 (0.9) and 3 (0.8); newest (4) always kept
        assert_eq!(select(&cs, &p), vec![true, false, false, true, true]);
    }

    #[test]
    fn keep_every_and_missing_metrics() {
        let cs = vec![
            c(0, None),
            c(1, None),
            c(2, Some(f64::NAN)),
            c(3, None),
            c(4, None),
        ];
        let p = Retention {
            keep_every: Some(2),
            keep_best: Some((3, BestMode::Min)),
            ..Default::default()
        };
        assert_eq!(select(&cs, &p), vec![true, false, true, false, true]);
    }

    #[test]
    fn no_policy_keeps_all() {
        assert_eq!(
            select(&[c(1, None), c(0, None)], &Retention::default()),
            vec![true, true]
        );
        assert!(select(
            &[],
            &Retention {
                keep_last: Some(1),
                ..Default::default()
            }
        )
        .is_empty());
    }

    proptest! {
        #[test]
        fn newest_is_always_kept_and_keep_last_counts(
            idx in prop::collection::btree_set(0u64..1000, 1..40),
            n in 0usize..5, k in 0usize..4, every in 0u64..5,
        ) {
            let cs: Vec<_> = idx.iter().map(|&i| c(i, Some((i * 7919 % 101) as f64))).collect();
            let p = Retention { keep_last: Some(n), keep_best: Some((k, BestMode::Min)), keep_every: Some(every), keep_spread: None };
            let keep = select(&cs, &p);
            let newest = cs.iter().enumerate().max_by_key(|(_, c)| c.index).map(|(i, _)| i).unwrap();
            prop_assert!(keep[newest]);
            let kept = keep.iter().filter(|&&b| b).count();
            let every_kept = if every > 0 { cs.iter().filter(|c| c.index % every == 0).count() } else { 0 };
            prop_assert!(kept <= 1 + n + k + every_kept);
            prop_assert!(kept >= n.min(cs.len()).max(1));
        }
    }
}
