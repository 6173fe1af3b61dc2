//! The adaptive checkpoint policy of record (Flor's joint invariant). Pure:
//! no I/O, no clocks; the caller measures times and feeds them in.

/// Default record-overhead bound ε of the adaptive policy (1/15 ≈ 6.67%, Flor).
pub const DEFAULT_EPSILON: f64 = 1.0 / 15.0;

/// The most of the budget the recording's fixed work (its loop hooks) may
/// take from checkpoints. Charged in full, hooks that alone exceed ε (a loop
/// of sub-millisecond steps) would leave a run with no checkpoint at all,
/// however cheap one is; capped, checkpoints always keep half the budget.
pub const HOOKS_SHARE: f64 = 0.5;

/// Seconds of the loop's own body lost per second of measured hook time.
/// The hooks' clocks see their own work, not what it does to the body
/// around it: caches and the allocator shared with that work, the audit
/// events of the file watch, the loop's frames between the timed hooks.
/// Measured on the zoo's minGPT (11 ms iterations, 2,000 of them, hooks
/// only, the plain script run beside it on the same core: see
/// `benches/bench_zoo.py`), the process spent 0.42 to 0.79 s more than the
/// plain script (six pairs, mean 0.60 s), 0.15 s of it the start-up,
/// against 0.16 s on the hooks' clocks: 1.8 times as much again (earlier
/// sequential runs said 1.0 to 1.6, within their noise). Charged with the
/// hooks, so ε bounds what the recording costs the process, not only what
/// it times.
pub const UNSEEN_PER_HOOK_SECOND: f64 = 1.8;

/// Adaptive checkpointing period: Flor's *Joint Invariant* (seed 001, §3.2).
///
/// A block (loop iteration) is tested after it executed and before its
/// checkpoint would be materialized; it is checkpointed only while
///
/// ```text
///     M / C  <  n / (k + 1) · min(1 / (1 + c), ε)
/// ```
///
/// where `n` counts executions so far (this one included), `k` checkpoints
/// so far (this one excluded: the `+ 1` asks whether the invariant still
/// holds once this checkpoint is written), `c` is the restore/materialize
/// time ratio and `ε` the record-overhead bound. As in the paper, `M` and
/// `C` are the block's per-execution materialization and compute times; with
/// times that vary between iterations we use their running means, `C̄ = ΣC / n`
/// over all executions and `M̄ = (ΣM + M_i) / (k + 1)` over the checkpoints
/// including the candidate. The test then reads
///
/// ```text
///     ΣM_checkpointed + M_i  <  ΣC · min(1 / (1 + c), ε)
/// ```
///
/// which gives both of the paper's invariants at every point of the run:
/// the *Record Overhead* invariant (materialization time stays below
/// `ε` × compute time so far) and the *Replay Latency* invariant
/// (`k (M̄ + R̄) < n C̄` with `R = c M`). On the first iteration (`n = 1,
/// k = 0`) it checkpoints iff `M < C · min(1/(1+c), ε)`; when `M ≪ C` every
/// iteration is checkpointed; when `M` is large the period grows until
/// enough compute has accumulated.
///
/// `M` is not known before the checkpoint is written, so the caller passes an
/// estimate (typically the previous measured materialization time, or a
/// size/bandwidth guess for the first one) and may correct it afterwards
/// with [`AdaptivePolicy::observe_materialize`].
///
/// The fields are public so a resumed run can carry the policy's state over.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptivePolicy {
    /// Record-overhead bound ε (fraction of compute time).
    pub epsilon: f64,
    /// Restore time / materialize time ratio; 1.0 until observed.
    pub c: f64,
    /// Executions observed so far.
    pub n: u64,
    /// Checkpoints decided so far.
    pub k: u64,
    /// Σ compute seconds over all `n` executions.
    pub total_compute_secs: f64,
    /// Σ materialize seconds over the `k` checkpoints (expected, or actual
    /// once corrected by [`observe_materialize`](Self::observe_materialize)).
    pub total_materialize_secs: f64,
    /// Σ seconds of the recording's own work outside checkpoints
    /// ([`observe_overhead`](Self::observe_overhead)).
    pub total_hooks_secs: f64,
    /// Σ seconds of the recording's one-time start-up on the training thread
    /// ([`observe_startup`](Self::observe_startup)).
    pub total_startup_secs: f64,
    /// Restore observations that `c` is the mean of (0: `c` is the prior).
    pub restore_observations: u64,
    /// Expected materialization of the latest checkpoint, until corrected.
    pub pending_materialize_secs: Option<f64>,
    /// What restoring one checkpoint costs, once measured
    /// ([`observe_restore_cost`](Self::observe_restore_cost)).
    pub restore_secs: Option<f64>,
    /// Σ compute seconds since the last checkpoint (all of them before the first).
    pub compute_since_checkpoint: f64,
    /// Checkpoints ε allowed that [`pays_back`](Self::pays_back) withheld.
    pub withheld: u64,
}

impl Default for AdaptivePolicy {
    fn default() -> Self {
        Self::new(DEFAULT_EPSILON)
    }
}

impl AdaptivePolicy {
    /// A fresh policy with overhead bound `epsilon` and `c = 1.0`.
    pub fn new(epsilon: f64) -> Self {
        AdaptivePolicy {
            epsilon,
            c: 1.0,
            n: 0,
            k: 0,
            total_compute_secs: 0.0,
            total_materialize_secs: 0.0,
            total_hooks_secs: 0.0,
            total_startup_secs: 0.0,
            restore_observations: 0,
            pending_materialize_secs: None,
            restore_secs: None,
            compute_since_checkpoint: 0.0,
            withheld: 0,
        }
    }

    /// `min(1 / (1 + c), ε)`: the bound on materialization / compute.
    pub fn threshold(&self) -> f64 {
        let c = if self.c.is_finite() && self.c >= 0.0 {
            self.c
        } else {
            1.0
        };
        (1.0 / (1.0 + c)).min(self.epsilon)
    }

    /// Everything the recording cost (its start-up, checkpoints and hooks) /
    /// compute seconds so far (0 before any compute).
    pub fn overhead(&self) -> f64 {
        self.startup_share() + self.checkpoint_share() + self.hooks_share()
    }

    /// Some compute was observed (the shares are then meaningful).
    pub fn has_compute(&self) -> bool {
        self.total_compute_secs > 0.0
    }

    /// Checkpoints' seconds / compute seconds so far.
    pub fn checkpoint_share(&self) -> f64 {
        Self::share(self.total_materialize_secs, self.total_compute_secs)
    }

    /// The hooks' seconds / compute seconds so far.
    pub fn hooks_share(&self) -> f64 {
        Self::share(self.total_hooks_secs, self.total_compute_secs)
    }

    /// The start-up's seconds / compute seconds so far.
    pub fn startup_share(&self) -> f64 {
        Self::share(self.total_startup_secs, self.total_compute_secs)
    }

    fn share(secs: f64, compute: f64) -> f64 {
        if compute > 0.0 {
            secs / compute
        } else {
            0.0
        }
    }

    /// One iteration finished after `compute_secs` of compute; decide whether
    /// to checkpoint it, expecting `expected_materialize_secs` to write it.
    /// Increments `n`, and `k` when it answers `true`. An invalid compute
    /// time counts as 0; an unknown (NaN/infinite) materialization time
    /// never checkpoints; a negative one counts as 0.
    pub fn observe_iteration(&mut self, compute_secs: f64, expected_materialize_secs: f64) -> bool {
        self.observe_compute(compute_secs);
        if !expected_materialize_secs.is_finite() {
            return false;
        }
        let m = expected_materialize_secs.max(0.0);
        // (ΣM + M) / (k + 1)  /  (ΣC / n)  <  n / (k + 1) · threshold, multiplied
        // out, with the hooks' time charged up to their share of the budget.
        let budget = self.total_compute_secs * self.threshold();
        // The first checkpoint is priced by ε alone: a run has one as soon
        // as one fits ε of its compute, however dear its start-up and hooks
        // (a 1.8 s epoch's 120 ms cannot also pay a 0.3 s start-up); the
        // checkpoints after it pay for everything, the first included.
        let fixed = if self.k == 0 {
            0.0
        } else {
            self.charged_hooks(budget)
        };
        let fits = self.total_materialize_secs + m + fixed < budget;
        let checkpoint = fits && self.pays_back();
        if fits && !checkpoint {
            self.withheld += 1;
        }
        if checkpoint {
            self.commit(m);
        }
        checkpoint
    }

    /// One iteration whose checkpoint was chosen by a fixed period
    /// (`checkpoint`), not by this policy: its totals are kept all the same,
    /// so what the recording cost can be stated.
    pub fn observe_chosen(
        &mut self,
        compute_secs: f64,
        checkpoint: bool,
        expected_materialize_secs: f64,
    ) {
        self.observe_compute(compute_secs);
        if checkpoint {
            let m = expected_materialize_secs;
            self.commit(if m.is_finite() { m.max(0.0) } else { 0.0 });
        }
    }

    fn observe_compute(&mut self, compute_secs: f64) {
        self.n += 1;
        if compute_secs.is_finite() && compute_secs > 0.0 {
            self.total_compute_secs += compute_secs;
            self.compute_since_checkpoint += compute_secs;
        }
    }

    fn commit(&mut self, m: f64) {
        self.k += 1;
        self.total_materialize_secs += m;
        self.pending_materialize_secs = Some(m);
        self.compute_since_checkpoint = 0.0;
    }

    /// What the recording's fixed work takes from a `budget` of seconds: its
    /// start-up, the hooks' measured time and the body's time they cost
    /// beside it ([`UNSEEN_PER_HOOK_SECOND`]), at most [`HOOKS_SHARE`] of it.
    pub fn charged_hooks(&self, budget: f64) -> f64 {
        (self.total_startup_secs + self.total_hooks_secs * (1.0 + UNSEEN_PER_HOOK_SECOND))
            .min(budget * HOOKS_SHARE)
    }

    /// Whether a checkpoint now would ever be restored: a replay restores
    /// one only where that is cheaper than executing from the one before
    /// (`runs::replay`), so a checkpoint less compute after the previous one
    /// than a restore costs would be written, stored and never used. Where
    /// restoring costs about as much as an iteration's compute, checkpoints
    /// come every k-th iteration, k = ⌈R / C⌉. Always true until the first
    /// restore cost is measured.
    pub fn pays_back(&self) -> bool {
        match self.restore_secs {
            Some(r) if self.k > 0 => self.compute_since_checkpoint >= r,
            _ => true,
        }
    }

    /// Restoring a checkpoint was measured to cost `restore_secs`: the
    /// spacing rule of [`pays_back`](Self::pays_back) uses the latest
    /// measure. That rule keeps the replay-latency half of Flor's invariant
    /// (`k R < n C`) checkpoint by checkpoint, so `c` keeps its prior here:
    /// folded into the threshold as well, a dear restore would thin the
    /// checkpoints twice, and could leave a run with none. Ignored unless
    /// finite and non-negative.
    pub fn observe_restore_cost(&mut self, restore_secs: f64) {
        if restore_secs.is_finite() && restore_secs >= 0.0 {
            self.restore_secs = Some(restore_secs);
        }
    }

    /// The checkpoint last decided took `actual_secs` to materialize: replace
    /// its estimate in the running total. Later decisions compensate for an
    /// underestimate. Ignored without a pending checkpoint or for an invalid time.
    pub fn observe_materialize(&mut self, actual_secs: f64) {
        if !(actual_secs.is_finite() && actual_secs >= 0.0) {
            return;
        }
        if let Some(expected) = self.pending_materialize_secs.take() {
            self.total_materialize_secs =
                (self.total_materialize_secs - expected + actual_secs).max(0.0);
        }
    }

    /// The recording's own work outside checkpoints (its loop hooks: RNG
    /// states, loop variables, batch fingerprints, log hand-offs) took `secs`
    /// more: it comes out of the same ε budget, so the bound holds for
    /// everything recording adds, up to [`HOOKS_SHARE`] of it (beyond that
    /// the hooks alone are over ε, and checkpoints keep the rest). Ignored
    /// unless finite and positive.
    pub fn observe_overhead(&mut self, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.total_hooks_secs += secs;
        }
    }

    /// The recording's one-time start-up on the training thread (importing
    /// hindsight, opening the session, analysing the script) took `secs`:
    /// the plain script spends none of it, so it comes out of the budget
    /// with the hooks (a 2,000-iteration minGPT run: 0.15 s of 24, 0.6%).
    /// Ignored unless finite and positive.
    pub fn observe_startup(&mut self, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.total_startup_secs += secs;
        }
    }

    /// Checkpoints already decided cost `secs` more than their time on the
    /// training thread: CPU the background threads spent hashing and writing
    /// them, measured as it is spent. Added to ΣM, so the record-overhead
    /// bound holds for the machine's CPU, not only for the training thread.
    /// Ignored unless finite and positive.
    pub fn observe_background(&mut self, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.total_materialize_secs += secs;
        }
    }

    /// A checkpoint that took `materialize_secs` to write took `restore_secs`
    /// to restore: refine `c` as the running mean of the observed ratios (the
    /// first observation replaces the 1.0 prior). Invalid pairs are ignored.
    pub fn observe_restore(&mut self, restore_secs: f64, materialize_secs: f64) {
        let valid = restore_secs.is_finite()
            && restore_secs >= 0.0
            && materialize_secs.is_finite()
            && materialize_secs > 0.0;
        if !valid {
            return;
        }
        let ratio = restore_secs / materialize_secs;
        if !ratio.is_finite() {
            return;
        }
        self.restore_observations += 1;
        if self.restore_observations == 1 {
            self.c = ratio;
        } else {
            self.c += (ratio - self.c) / self.restore_observations as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // ---------- AdaptivePolicy ----------

    #[test]
    fn first_iteration_follows_formula() {
        let mut p = AdaptivePolicy::default();
        // min(1/2, 1/15) = 1/15: M/C must be < 1/15 on the first iteration.
        assert!(p.observe_iteration(100.0, 6.0));
        assert_eq!((p.n, p.k), (1, 1));
        let mut p = AdaptivePolicy::default();
        assert!(!p.observe_iteration(100.0, 7.0));
        assert_eq!((p.n, p.k), (1, 0));
        // c dominates when 1/(1+c) < ε.
        let mut p = AdaptivePolicy::new(0.9);
        assert!((p.threshold() - 0.5).abs() < 1e-12);
        assert!(p.observe_iteration(10.0, 4.9));
        let mut p = AdaptivePolicy::new(0.9);
        assert!(!p.observe_iteration(10.0, 5.0));
    }

    #[test]
    fn large_checkpoints_get_a_longer_period() {
        // M/C = 0.2 = 3 ε: one checkpoint per ~3 iterations at most, never above ε.
        let mut p = AdaptivePolicy::default();
        let decisions: Vec<bool> = (0..30).map(|_| p.observe_iteration(1.0, 0.2)).collect();
        let k = decisions.iter().filter(|&&d| d).count();
        assert!((8..=10).contains(&k), "{k} checkpoints: {decisions:?}");
        assert!(!decisions[0] && !decisions[1]);
        assert!(p.overhead() <= DEFAULT_EPSILON + 1e-12);
        assert_eq!(p.k as usize, k);
        assert_eq!(p.n, 30);
    }

    #[test]
    fn unknown_or_invalid_inputs() {
        let mut p = AdaptivePolicy::default();
        assert!(!p.observe_iteration(10.0, f64::NAN));
        assert!(!p.observe_iteration(10.0, f64::INFINITY));
        assert!(p.observe_iteration(f64::NAN, 0.0)); // compute ignored; M = 0 fits
        assert_eq!(p.total_compute_secs, 20.0);
        assert!(p.observe_iteration(10.0, -1.0)); // counts as 0
        let mut p = AdaptivePolicy::default();
        assert!(!p.observe_iteration(0.0, 0.0)); // no compute: nothing to amortize
        assert_eq!(p.overhead(), 0.0);
    }

    #[test]
    fn materialize_correction_is_compensated() {
        let mut p = AdaptivePolicy::default();
        assert!(p.observe_iteration(100.0, 1.0));
        // It really took 7: the next checkpoint must wait until ΣM stays < ΣC/15.
        p.observe_materialize(7.0);
        assert_eq!(p.total_materialize_secs, 7.0);
        assert!(!p.observe_iteration(10.0, 1.0)); // 8 vs 110/15 = 7.33
        assert!(!p.observe_iteration(10.0, 1.0)); // 8 vs 8.0 (strict)
        assert!(p.observe_iteration(10.0, 1.0)); // 8 vs 8.67
        assert_eq!((p.n, p.k), (4, 2));
        p.observe_materialize(1.0);
        p.observe_materialize(100.0); // no pending checkpoint: ignored
        assert_eq!(p.total_materialize_secs, 8.0);
    }

    #[test]
    fn background_cpu_counts_against_the_overhead_bound() {
        // 1 s iterations, checkpoints costing 0.01 s on the training thread:
        // every iteration fits under ε = 1/15 ...
        let mut cheap = AdaptivePolicy::new(1.0 / 15.0);
        let mut priced = AdaptivePolicy::new(1.0 / 15.0);
        let (mut k_cheap, mut k_priced) = (0, 0);
        for _ in 0..100 {
            k_cheap += u32::from(cheap.observe_iteration(1.0, 0.01));
            cheap.observe_materialize(0.01);
            if priced.observe_iteration(1.0, 0.01 + 0.3) {
                k_priced += 1;
                priced.observe_materialize(0.01);
                // ... but each also took 0.3 s of background CPU.
                priced.observe_background(0.3);
            }
        }
        assert_eq!(k_cheap, 100);
        // Priced fully, they stay within ε of the compute: 100 / 15 / 0.31.
        assert!((20..=22).contains(&k_priced), "{k_priced}");
        assert!(priced.total_materialize_secs <= priced.total_compute_secs / 15.0);
        priced.observe_background(f64::NAN);
        priced.observe_background(-1.0);
        assert!(priced.total_materialize_secs <= priced.total_compute_secs / 15.0);
    }

    #[test]
    fn restore_ratio_running_mean() {
        let mut p = AdaptivePolicy::default();
        assert_eq!(p.c, 1.0);
        p.observe_restore(2.0, 1.0);
        assert_eq!(p.c, 2.0); // first observation replaces the prior
        p.observe_restore(1.0, 1.0);
        assert_eq!(p.c, 1.5);
        p.observe_restore(3.0, 2.0);
        assert!((p.c - 1.5).abs() < 1e-12);
        p.observe_restore(1.0, 0.0); // invalid: ignored
        p.observe_restore(f64::NAN, 1.0);
        assert_eq!(p.restore_observations, 3);
        // Larger c lowers the threshold once 1/(1+c) < ε.
        let mut p = AdaptivePolicy::new(0.5);
        p.observe_restore(3.0, 1.0);
        assert!((p.threshold() - 0.25).abs() < 1e-12);
    }

    #[test]
    fn a_restore_as_dear_as_the_compute_it_skips_spaces_checkpoints_every_kth_iteration() {
        // 1 s iterations, checkpoints of 10 ms: every iteration fits in ε.
        let mut cheap = AdaptivePolicy::default();
        assert!(cheap.observe_iteration(1.0, 0.01));
        cheap.observe_restore_cost(0.05);
        let taken = (0..20)
            .filter(|_| cheap.observe_iteration(1.0, 0.01))
            .count();
        assert_eq!(
            taken, 20,
            "a restore far cheaper than an iteration: every one"
        );
        // Restoring one costs 1.5 iterations of compute: a checkpoint next to
        // the previous one would never be restored (executing from the
        // previous one is cheaper), so they come every second iteration.
        let mut dear = AdaptivePolicy::default();
        assert!(dear.observe_iteration(1.0, 0.01));
        dear.observe_restore_cost(1.5);
        let got: Vec<bool> = (0..20).map(|_| dear.observe_iteration(1.0, 0.01)).collect();
        assert_eq!(got.iter().filter(|&&d| d).count(), 10, "{got:?}");
        assert!(got.windows(2).all(|w| !(w[0] && w[1])), "{got:?}");
        assert_eq!(dear.withheld, 10);
        // Never a run without a checkpoint: the first is priced by ε alone,
        // however dear a restore.
        let mut first = AdaptivePolicy::default();
        first.observe_restore_cost(100.0);
        assert!(first.observe_iteration(1.0, 0.01));
        assert!(!first.observe_iteration(1.0, 0.01));
        // An invalid measure changes nothing.
        let mut p = AdaptivePolicy::default();
        p.observe_restore_cost(f64::NAN);
        p.observe_restore_cost(-1.0);
        assert_eq!(p.restore_secs, None);
    }

    #[test]
    fn hooks_over_epsilon_leave_checkpoints_half_the_budget() {
        // 25 ms iterations whose hooks alone cost 10% (over ε = 6.7%), and a
        // 0.5 ms checkpoint (2% of an iteration): charged in full, the hooks
        // starved every checkpoint.
        let mut p = AdaptivePolicy::default();
        let mut k = 0;
        for _ in 0..100 {
            p.observe_overhead(0.0025);
            if p.observe_iteration(0.025, 0.0005) {
                k += 1;
                p.observe_materialize(0.0005);
            }
        }
        assert!(k > 0);
        // The checkpoints stay within the half of ε the hooks leave them.
        assert!(p.checkpoint_share() <= DEFAULT_EPSILON * HOOKS_SHARE + 1e-12);
        assert!((p.hooks_share() - 0.1).abs() < 1e-9);
        // Hooks under their share are charged in full: the total stays within ε.
        let mut q = AdaptivePolicy::default();
        for _ in 0..100 {
            q.observe_overhead(0.0005);
            if q.observe_iteration(0.025, 0.0005) {
                q.observe_materialize(0.0005);
            }
        }
        assert!(q.overhead() <= DEFAULT_EPSILON + 1e-12, "{}", q.overhead());
        assert!(q.k > 50, "{}", q.k);
    }

    #[test]
    fn the_start_up_comes_out_of_the_budget_and_never_starves_checkpoints() {
        // 1 s iterations, 50 ms checkpoints, a 2 s start-up (hindsight's
        // import and the session's set-up, which the plain script skips).
        let run = |startup: f64| {
            let mut p = AdaptivePolicy::default();
            p.observe_startup(startup);
            let taken: Vec<bool> = (0..300)
                .map(|_| {
                    let t = p.observe_iteration(1.0, 0.05);
                    if t {
                        p.observe_materialize(0.05);
                    }
                    t
                })
                .collect();
            (p, taken)
        };
        let (free, all) = run(0.0);
        let (charged, some) = run(2.0);
        let k = |t: &[bool]| t.iter().filter(|&&d| d).count();
        // The first is taken at once, priced by ε alone; the next wait
        // until the start-up is paid off (checkpoints keep half the budget
        // meanwhile).
        assert!(some[0], "{some:?}");
        assert!(some[1..4].contains(&false), "{some:?}");
        assert!(k(&some) < k(&all), "{} vs {}", k(&some), k(&all));
        // Everything, start-up included, stays within ε.
        assert!(
            charged.overhead() <= DEFAULT_EPSILON + 1e-12,
            "{}",
            charged.overhead()
        );
        assert!((charged.startup_share() - 2.0 / 300.0).abs() < 1e-12);
        assert!(free.overhead() <= DEFAULT_EPSILON + 1e-12);
        // Invalid measures change nothing.
        let mut p = AdaptivePolicy::default();
        p.observe_startup(f64::NAN);
        p.observe_startup(-1.0);
        assert_eq!(p.total_startup_secs, 0.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Never zero checkpoints where one fits: whatever the hooks cost,
        /// a checkpoint costing at most ε/2 of an iteration's compute is
        /// taken within the first two iterations, and checkpoints with the
        /// hooks (up to their share) stay within ε.
        #[test]
        fn a_checkpoint_that_fits_is_taken_whatever_the_hooks_cost(
            compute in 0.001f64..10.0,
            frac in 0.0f64..0.99,
            hooks in 0.0f64..5.0,
            startup in 0.0f64..100.0,
            n in 2usize..50,
        ) {
            let mut p = AdaptivePolicy::default();
            p.observe_startup(compute * startup);
            let m = compute * DEFAULT_EPSILON * HOOKS_SHARE * frac;
            let mut first = None;
            for i in 0..n {
                p.observe_overhead(compute * hooks);
                if p.observe_iteration(compute, m) {
                    first.get_or_insert(i);
                    p.observe_materialize(m);
                }
                let charged = p.charged_hooks(p.total_compute_secs * DEFAULT_EPSILON);
                prop_assert!(p.total_materialize_secs + charged <= p.total_compute_secs * DEFAULT_EPSILON * (1.0 + 1e-12));
            }
            prop_assert!(matches!(first, Some(0 | 1)), "{first:?}");
        }

        /// The Record Overhead invariant: Σ M(checkpointed) / Σ C never exceeds ε,
        /// after every iteration, for arbitrary (known) M and C.
        #[test]
        fn overhead_never_exceeds_epsilon(
            iters in prop::collection::vec((0.0f64..100.0, 0.0f64..50.0), 1..200),
            eps in 0.001f64..0.9,
            c in 0.0f64..5.0,
        ) {
            let mut p = AdaptivePolicy::new(eps);
            p.c = c;
            let (mut sum_m, mut sum_c) = (0.0, 0.0);
            for &(compute, m) in &iters {
                sum_c += compute;
                if p.observe_iteration(compute, m) {
                    sum_m += m;
                }
                prop_assert!(sum_m <= eps * sum_c * (1.0 + 1e-12), "{sum_m} > {eps} * {sum_c}");
                // Replay latency invariant: k (M̄ + c M̄) <= n C̄, i.e. ΣM (1 + c) <= ΣC.
                prop_assert!(sum_m * (1.0 + c) <= sum_c * (1.0 + 1e-12));
            }
            prop_assert_eq!(p.n as usize, iters.len());
        }

        /// When M is well below ε C every iteration is checkpointed.
        #[test]
        fn cheap_checkpoints_always_taken(
            iters in prop::collection::vec((0.001f64..100.0, 0.0f64..0.99), 1..200),
        ) {
            let mut p = AdaptivePolicy::default();
            for &(compute, frac) in &iters {
                let m = compute * p.threshold() * frac;
                prop_assert!(p.observe_iteration(compute, m));
            }
            prop_assert_eq!(p.k, p.n);
        }
    }
}
