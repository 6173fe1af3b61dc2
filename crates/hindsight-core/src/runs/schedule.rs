//! When a recording checkpoints: every N outer iterations, or when the
//! adaptive policy says it is worth it, with a checkpoint priced in full.
//! The front ends (the Python run, and later other integrations) report
//! what they measured and ask; the rule, its settings and its prices live
//! here.

use std::ffi::OsString;

use crate::error::{Error, Result};
use crate::runs::adaptive::{AdaptivePolicy, DEFAULT_EPSILON};
use crate::runs::cpu::{contention, CpuSample};

/// The environment variable fixing the period (in outer iterations).
pub const EVERY_ENV: &str = crate::settings::CHECKPOINT_EVERY.name;
/// The environment variable setting the adaptive policy's overhead bound ε.
pub const EPSILON_ENV: &str = crate::settings::EPSILON.name;

/// A front end's checkpoint period argument (`hs.checkpointing(every=)`,
/// the Lightning and Trainer callbacks' `every_n_epochs` and
/// `every_n_train_steps`): a whole number of at least 1. `value` is `None`
/// where the argument is no whole number (a bool, a float, a string),
/// `shown` how the caller wrote it; the error names `call` and `arg`.
pub fn checked_every(call: &str, arg: &str, shown: &str, value: Option<i64>) -> Result<u64> {
    match value
        .and_then(|v| u64::try_from(v).ok())
        .filter(|&v| v >= 1)
    {
        Some(v) => Ok(v),
        None => Err(invalid(
            &format!("{call}({arg}={shown})"),
            "give a whole number of at least 1".into(),
        )),
    }
}

/// The checkpoint decisions of one recording.
#[derive(Debug, Clone)]
pub struct CheckpointSchedule {
    every: Option<u64>,
    policy: AdaptivePolicy,
    /// The training thread's steady-state price of the last checkpoint
    /// handed over (capture and save call), once one was.
    last_blocked: Option<f64>,
    /// The writer's running total of background CPU, as last read.
    background_seen: f64,
    /// Its mean charged per checkpoint, over the checkpoints priced at the last read.
    background_per_checkpoint: f64,
    /// The machine's CPU totals where the last contention estimate started.
    cpu_seen: Option<CpuSample>,
    /// The writer's CPU since `cpu_seen` (an interval spans block ends
    /// until it is long enough to measure).
    background_since_cpu: f64,
    /// The share of the writer's CPU that displaces other work (1: all of
    /// it, until measured).
    contention: f64,
    /// Checkpoints handed over since the last read.
    unpriced: u32,
    /// The recording's own work outside checkpoints, as last read.
    overhead_seen: f64,
    /// The writer's CPU that contention left uncharged (spent on cores the
    /// training left idle): CPU all the same, which the run's account states.
    background_uncharged: f64,
}

fn invalid(what: &str, detail: String) -> Error {
    Error::invalid(what, detail)
}

impl CheckpointSchedule {
    /// `every`: a fixed period (at least 1); `None`: adaptive, with overhead
    /// bound `epsilon` (in (0, 1]).
    pub fn new(every: Option<u64>, epsilon: f64) -> Result<Self> {
        if every == Some(0) {
            return Err(invalid(
                "checkpoint period",
                "every must be at least 1".into(),
            ));
        }
        if !(epsilon > 0.0 && epsilon <= 1.0) {
            return Err(invalid(
                "adaptive checkpoint bound",
                format!(
                    "epsilon {epsilon}: give a fraction of training time in (0, 1], e.g. 0.0667"
                ),
            ));
        }
        Ok(CheckpointSchedule {
            every,
            policy: AdaptivePolicy::new(epsilon),
            last_blocked: None,
            background_seen: 0.0,
            background_per_checkpoint: 0.0,
            cpu_seen: None,
            background_since_cpu: 0.0,
            contention: 1.0,
            unpriced: 0,
            overhead_seen: 0.0,
            background_uncharged: 0.0,
        })
    }

    /// From `$HINDSIGHT_CHECKPOINT_EVERY` and `$HINDSIGHT_EPSILON` (either
    /// unset or empty: adaptive, ε = 1/15); a bad value is an error naming
    /// the variable.
    pub fn from_env() -> Result<Self> {
        Self::from_values(std::env::var_os(EVERY_ENV), std::env::var_os(EPSILON_ENV))
    }

    /// [`from_env`](Self::from_env) with the two values given.
    pub fn from_values(every: Option<OsString>, epsilon: Option<OsString>) -> Result<Self> {
        let text = |v: Option<OsString>| {
            v.map(|s| s.to_string_lossy().trim().to_owned())
                .filter(|s| !s.is_empty())
        };
        let every = match text(every) {
            None => None,
            Some(s) => match s.parse::<u64>() {
                Ok(n) if n >= 1 => Some(n),
                _ => {
                    return Err(invalid(
                        EVERY_ENV,
                        format!("{s:?}: give a whole number of outer iterations, at least 1"),
                    ))
                }
            },
        };
        let epsilon = match text(epsilon) {
            None => DEFAULT_EPSILON,
            Some(s) => match s.parse::<f64>() {
                Ok(e) if e > 0.0 && e <= 1.0 => e,
                _ => {
                    return Err(invalid(
                        EPSILON_ENV,
                        format!("{s:?}: give a fraction of training time in (0, 1], e.g. 0.0667"),
                    ))
                }
            },
        };
        Self::new(every, epsilon)
    }

    /// Fix the period (`hs.checkpointing(every=N)`), overriding the environment.
    pub fn set_every(&mut self, every: u64) -> Result<()> {
        if every == 0 {
            return Err(invalid("every", "0: must be at least 1".into()));
        }
        self.every = Some(every);
        Ok(())
    }

    pub fn every(&self) -> Option<u64> {
        self.every
    }

    /// The steps of outer iteration `i` ended after `compute_secs`; decide
    /// whether to checkpoint now. `background_total`: the store writer's
    /// running total of background CPU seconds (`None`: no store yet);
    /// `cpu`: the machine's CPU totals now (`None`: unknown);
    /// `first_estimate`: the price to assume before any checkpoint was
    /// measured (e.g. the state's bytes over a copy bandwidth).
    ///
    /// A checkpoint's price is what it costs the training: the training
    /// thread's time to capture and hand it over, plus the CPU the writer's
    /// threads then spend hashing and writing it, as far as that CPU was
    /// taken from work that wanted it (`runs::cpu`; in full while unknown).
    pub fn block_ended(
        &mut self,
        i: u64,
        compute_secs: f64,
        background_total: Option<f64>,
        cpu: Option<CpuSample>,
        first_estimate: f64,
    ) -> bool {
        if let Some(total) = background_total {
            let spent = total - self.background_seen;
            self.background_seen = total;
            let spent = if spent > 0.0 { spent } else { 0.0 };
            self.measure_contention(cpu, spent);
            if spent > 0.0 {
                let charged = spent * self.contention;
                self.policy.observe_background(charged);
                self.background_uncharged += spent - charged;
                if self.unpriced > 0 {
                    self.background_per_checkpoint = charged / f64::from(self.unpriced);
                }
            }
            self.unpriced = 0;
        }
        let expected = self.last_blocked.unwrap_or(first_estimate) + self.background_per_checkpoint;
        if let Some(n) = self.every {
            let due = i.is_multiple_of(n);
            self.policy.observe_chosen(compute_secs, due, expected);
            return due;
        }
        self.policy.observe_iteration(compute_secs, expected)
    }

    /// Update the contention estimate from the interval since the last
    /// sample, in which the writer spent `spent` seconds.
    fn measure_contention(&mut self, cpu: Option<CpuSample>, spent: f64) {
        self.background_since_cpu += spent;
        let Some(now) = cpu else { return };
        match self.cpu_seen {
            None => {
                self.cpu_seen = Some(now);
                self.background_since_cpu = 0.0;
            }
            Some(before) => {
                if let Some(share) = contention(&before, &now, self.background_since_cpu) {
                    self.contention = share;
                    self.cpu_seen = Some(now);
                    self.background_since_cpu = 0.0;
                }
            }
        }
    }

    /// The recording's one-time start-up on the training thread took `secs`
    /// (charged to the ε budget with the hooks).
    pub fn started(&mut self, secs: f64) {
        self.policy.observe_startup(secs);
    }

    /// Seconds of the writer's CPU not charged to ε: spent while the
    /// training left cores idle, so it cost the training no time.
    pub fn background_uncharged(&self) -> f64 {
        self.background_uncharged
    }

    /// The share of background CPU currently charged (1.0 until measured).
    pub fn contention(&self) -> f64 {
        self.contention
    }

    /// The running total of the training thread's time in the recording's
    /// own work outside checkpoints (`total_secs`): what it grew by since
    /// the last call is charged to the ε budget, so recording as a whole
    /// stays within it (zoo nanoGPT: 2.4% of its CPU, before any checkpoint).
    pub fn overhead(&mut self, total_secs: f64) {
        if total_secs.is_finite() && total_secs > self.overhead_seen {
            self.policy
                .observe_overhead(total_secs - self.overhead_seen);
            self.overhead_seen = total_secs;
        }
    }

    /// A checkpoint was handed to the writer; it held the training thread
    /// for `blocked_secs` (steady state: one-time set-up excluded).
    pub fn saved(&mut self, blocked_secs: f64) {
        let blocked = if blocked_secs.is_finite() {
            blocked_secs.max(0.0)
        } else {
            0.0
        };
        self.last_blocked = Some(blocked);
        self.unpriced = self.unpriced.saturating_add(1);
        self.policy.observe_materialize(blocked);
    }

    /// Reading back and verifying a checkpoint of this run took `read_secs`
    /// (measured off the training thread): most of what a restore costs
    /// (copying the state into the live tensors is a fraction of it; the
    /// first save's time on the training thread, one-time set-up included,
    /// is no measure of that). Checkpoints are then spaced so that each
    /// skips more compute than restoring it costs
    /// ([`AdaptivePolicy::pays_back`]).
    pub fn restore_measured(&mut self, read_secs: f64) {
        self.policy.observe_restore_cost(read_secs);
    }

    /// The policy's state (its totals), for reports and tests.
    pub fn policy(&self) -> &AdaptivePolicy {
        &self.policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(s.into())
    }

    #[test]
    fn settings_come_from_the_environment_and_bad_ones_are_named() {
        let s = CheckpointSchedule::from_values(None, None).unwrap();
        assert_eq!(s.every(), None);
        assert_eq!(s.policy().epsilon, DEFAULT_EPSILON);
        let s = CheckpointSchedule::from_values(os("3"), os("0.1")).unwrap();
        assert_eq!(s.every(), Some(3));
        assert_eq!(s.policy().epsilon, 0.1);
        assert_eq!(
            CheckpointSchedule::from_values(os(""), os(" "))
                .unwrap()
                .every(),
            None
        );
        for (every, eps, named) in [
            (os("0"), None, EVERY_ENV),
            (os("two"), None, EVERY_ENV),
            (os("-1"), None, EVERY_ENV),
            (None, os("0"), EPSILON_ENV),
            (None, os("1.5"), EPSILON_ENV),
            (None, os("nan"), EPSILON_ENV),
        ] {
            let e = CheckpointSchedule::from_values(every, eps).unwrap_err();
            assert!(e.to_string().contains(named), "{e}");
        }
    }

    #[test]
    fn a_period_argument_is_a_whole_number_of_at_least_1_named_by_its_call() {
        assert_eq!(
            checked_every("hs.checkpointing", "every", "3", Some(3)).unwrap(),
            3
        );
        for (shown, value) in [
            ("0", Some(0)),
            ("-2", Some(-2)),
            ("True", None),
            ("1.5", None),
        ] {
            let e =
                checked_every("HindsightCheckpoint", "every_n_epochs", shown, value).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("HindsightCheckpoint(every_n_epochs={shown})"))
                    && e.to_string().contains("at least 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_fixed_period_checkpoints_every_nth_iteration() {
        let mut s = CheckpointSchedule::new(None, DEFAULT_EPSILON).unwrap();
        s.set_every(3).unwrap();
        let got: Vec<bool> = (0..7)
            .map(|i| s.block_ended(i, 1.0, None, None, 0.0))
            .collect();
        assert_eq!(got, [true, false, false, true, false, false, true]);
        assert!(s.set_every(0).is_err());
    }

    #[test]
    fn the_writers_background_cpu_is_part_of_the_price() {
        // 1 s iterations; each checkpoint holds the training thread 10 ms and
        // then costs the writer 300 ms of CPU.
        let mut s = CheckpointSchedule::new(None, 1.0 / 15.0).unwrap();
        let mut background = 0.0;
        let mut taken = 0;
        for i in 0..300 {
            if s.block_ended(i, 1.0, Some(background), None, 0.01) {
                taken += 1;
                s.saved(0.01);
                background += 0.3;
            }
        }
        // Within ε of the compute, all of it counted: about 300 / 15 / 0.31.
        let p = s.policy();
        assert!(
            p.total_materialize_secs <= p.total_compute_secs / 15.0 + 0.31,
            "{p:?}"
        );
        assert!((55..=70).contains(&taken), "{taken}");
        // Priced on the training thread only, every iteration would have fit.
        let mut blind = CheckpointSchedule::new(None, 1.0 / 15.0).unwrap();
        let blind_taken = (0..300)
            .filter(|&i| {
                let t = blind.block_ended(i, 1.0, None, None, 0.01);
                if t {
                    blind.saved(0.01);
                }
                t
            })
            .count();
        assert_eq!(blind_taken, 300);
    }

    /// 1.24 s epochs of a GPU job; each checkpoint holds the training
    /// thread 5 ms and costs the writer 0.4 s of CPU; the training keeps
    /// `training_cores` of the machine's `cpus` busy.
    fn gpu_like(cpus: u32, training_cores: f64) -> (usize, f64) {
        let (taken, s) = gpu_like_schedule(cpus, training_cores);
        (taken, s.contention())
    }

    fn gpu_like_schedule(cpus: u32, training_cores: f64) -> (usize, CheckpointSchedule) {
        let mut s = CheckpointSchedule::new(None, 1.0 / 15.0).unwrap();
        let (mut background, mut wall, mut taken) = (0.0, 0.0, 0);
        for i in 0..40 {
            wall += 1.24;
            let cpu = CpuSample {
                busy: wall * training_cores + background,
                total: wall * f64::from(cpus),
                cpus,
                usable: cpus,
            };
            if s.block_ended(i, 1.24, Some(background), Some(cpu), 0.005) {
                taken += 1;
                s.saved(0.005);
                background += 0.4;
            }
        }
        (taken, s)
    }

    #[test]
    fn an_interval_spanning_short_block_ends_charges_the_writers_cpu_of_all_of_them() {
        // 0.1 s blocks (too short to measure alone) on 16 idle cores but the
        // training's one; the writer spends 0.05 s in each. The contention
        // of the 1 s interval is the training's 1 core-second over the 15.5
        // the writer left, not the training's plus 9 blocks of the writer's.
        let mut s = CheckpointSchedule::new(None, 1.0 / 15.0).unwrap();
        let (mut background, mut wall) = (0.0, 0.0);
        for i in 0..=10 {
            let cpu = CpuSample {
                busy: wall + background,
                total: wall * 16.0,
                cpus: 16,
                usable: 16,
            };
            s.block_ended(i, 0.1, Some(background), Some(cpu), 0.005);
            wall += 0.1;
            background += 0.05;
        }
        let share = s.contention();
        assert!((share - 1.0 / 15.5).abs() < 1e-6, "{share}");
    }

    #[test]
    fn background_cpu_on_idle_cores_costs_little_and_on_busy_ones_in_full() {
        // One busy core of 16: a checkpoint every epoch fits the budget.
        let (taken, share) = gpu_like(16, 1.0);
        assert_eq!(taken, 40);
        assert!(share > 0.06 && share < 0.07, "{share}");
        // Every core busy: the writer's CPU is the training's, priced in full.
        let (taken, share) = gpu_like(2, 2.0);
        assert_eq!(share, 1.0);
        assert!((4..=8).contains(&taken), "{taken}");
    }

    #[test]
    fn the_writers_cpu_that_idle_cores_absorbed_is_still_counted() {
        // The policy is charged a fraction of the writer's CPU on idle cores,
        // but the run's account states all of it: what was charged plus
        // what was not is what the writer spent.
        let (taken, s) = gpu_like_schedule(16, 1.0);
        let spent = 0.4 * (taken as f64 - 1.0); // the last one's is not read yet
        let p = s.policy();
        let charged = p.total_materialize_secs - 0.005 * taken as f64;
        assert!(
            s.background_uncharged() > 0.9 * spent,
            "{}",
            s.background_uncharged()
        );
        assert!(
            (charged + s.background_uncharged() - spent).abs() < 1e-9,
            "{charged} + {} != {spent}",
            s.background_uncharged()
        );
        // All cores busy: nothing goes uncharged.
        let (_, s) = gpu_like_schedule(2, 2.0);
        assert_eq!(s.background_uncharged(), 0.0);
    }

    #[test]
    fn the_recordings_own_work_comes_out_of_the_same_budget() {
        // 1 s iterations, checkpoints of 50 ms. Hooks of 10 ms an iteration
        // are charged with the body's time they cost beside them, 28 ms
        // (under half the 67 ms budget): ~39 ms are left for checkpoints.
        // Hooks of 55 ms (over half) are charged as 33 ms: checkpoints keep
        // half the budget.
        for (hooks, want) in [(0.010, 232), (0.055, 200)] {
            let mut s = CheckpointSchedule::new(None, 1.0 / 15.0).unwrap();
            let mut own = 0.0;
            let mut taken = 0;
            for i in 0..300 {
                own += hooks;
                s.overhead(own);
                if s.block_ended(i, 1.0, None, None, 0.05) {
                    taken += 1;
                    s.saved(0.05);
                }
            }
            let p = s.policy();
            let charged = p.charged_hooks(p.total_compute_secs / 15.0);
            assert!(charged <= p.total_compute_secs / 30.0 + 1e-9);
            assert!(
                p.total_materialize_secs + charged <= p.total_compute_secs / 15.0 + 0.05,
                "{p:?}"
            );
            // Without the hooks: all 300.
            assert!((want - 15..=want + 15).contains(&taken), "{hooks}: {taken}");
            // A total that does not grow (or is not a number) charges nothing.
            let before = s.policy().total_hooks_secs;
            s.overhead(own);
            s.overhead(f64::NAN);
            assert_eq!(s.policy().total_hooks_secs, before);
        }
    }
}
