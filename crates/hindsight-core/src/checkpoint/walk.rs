//! The resume walk: which checkpoints a process that continues training
//! tries, in which order, and what it does with one that does not read back.
//! One rule for an `hs.loop` run and for a framework's fit (Lightning, the
//! Trainer and Keras callbacks).
//!
//! Candidates come newest first, in resume order ([`CheckpointId::order`]).
//! A candidate found damaged when it is read (or verified) is passed over for
//! the one before it, with a warning naming it and why: never a silent
//! fallback, never a damaged state resumed. One that cannot be resumed here
//! (a checkpoint inside an iteration, on another world size) is passed over
//! without a warning; the caller says what that costs.
//!
//! The two kinds differ only in what a name means:
//! - a run's `End` checkpoint is an iteration finished before a stop signal
//!   took effect, a resume point like any other;
//! - a fit's `End` checkpoint marks the fit finished: it is never resumed
//!   (the next fit starts afresh under a prefix of its own, [`choose_fit`]).

use super::naming::{choose_fit, with_prefix, CheckpointId, Kind};

/// The candidates of one resume, newest first; [`next`](Self::next) hands
/// them out one at a time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResumeWalk {
    order: Vec<String>,
    next: usize,
}

impl ResumeWalk {
    /// The checkpoints of run `run_id` (named `<run_id>.<loop>-<i>...`).
    pub fn run(names: &[String], run_id: &str) -> ResumeWalk {
        Self::newest_first(with_prefix(names, run_id))
    }

    /// The checkpoints of loop `loop_name` of the newest fit under `base`
    /// (`<base>`, `<base>.fit2`, ...), none if that fit finished.
    pub fn fit(names: &[String], base: &str, loop_name: &str) -> ResumeWalk {
        let Some(resume) = choose_fit(names, base).resume else {
            return ResumeWalk::default();
        };
        let ids = with_prefix(names, &resume.prefix)
            .into_iter()
            .filter(|id| id.loop_name == loop_name && id.kind != Kind::End)
            .collect();
        Self::newest_first(ids)
    }

    /// An order another process chose (rank 0's, for every rank of a job:
    /// a part damaged on any rank sends them all to the same older one).
    pub fn given(order: Vec<String>) -> ResumeWalk {
        ResumeWalk { order, next: 0 }
    }

    fn newest_first(mut ids: Vec<CheckpointId>) -> ResumeWalk {
        ids.sort();
        ids.reverse();
        ResumeWalk::given(ids.into_iter().map(|id| id.name()).collect())
    }

    /// Every candidate, newest first (handed out or not).
    pub fn order(&self) -> &[String] {
        &self.order
    }

    /// The next candidate to try, None when the walk is over (start afresh).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<String> {
        let name = self.order.get(self.next).cloned();
        self.next += usize::from(name.is_some());
        name
    }

    /// Checkpoint `name` did not read back (`why`): the warning to print;
    /// the walk goes on to an older one.
    pub fn damaged(name: &str, why: &str) -> String {
        format!(
            "hindsight: WARNING: checkpoint {name} is damaged ({why}); resuming from an older one"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn all(mut w: ResumeWalk) -> Vec<String> {
        std::iter::from_fn(|| w.next()).collect()
    }

    #[test]
    fn a_run_resumes_its_newest_checkpoint_an_iterations_end_included() {
        let store = names(&[
            "r1.epoch-000000",
            "r1.epoch-000001.step-000000004",
            "r1.epoch-000001.step-000000012",
            "r1.epoch-000001.end",
            "r10.epoch-000009",
            "other.epoch-000005",
        ]);
        assert_eq!(
            all(ResumeWalk::run(&store, "r1")),
            [
                "r1.epoch-000001.end",
                "r1.epoch-000001.step-000000012",
                "r1.epoch-000001.step-000000004",
                "r1.epoch-000000",
            ]
        );
        assert_eq!(all(ResumeWalk::run(&store, "r2")), Vec::<String>::new());
    }

    #[test]
    fn a_fit_resumes_its_newest_unfinished_fit_and_never_a_finished_one() {
        let mut store = names(&[
            "lightning.epoch-000000",
            "lightning.epoch-000001.step-000000012",
            "lightning.epoch-000001",
            "lightning.fit2.epoch-000000",
            "lightning.fit2.epoch-000000.step-000000003",
            "trainer.epoch-000000",
        ]);
        // fit2 is the newest fit: its checkpoints only, newest first.
        assert_eq!(
            all(ResumeWalk::fit(&store, "lightning", "epoch")),
            [
                "lightning.fit2.epoch-000000",
                "lightning.fit2.epoch-000000.step-000000003"
            ]
        );
        // Finished: nothing to resume, though its checkpoints stay.
        store.push("lightning.fit2.epoch-000001.end".into());
        assert_eq!(ResumeWalk::fit(&store, "lightning", "epoch").next(), None);
        assert_eq!(ResumeWalk::fit(&store, "lightning", "step").next(), None);
    }

    #[test]
    fn each_candidate_is_handed_out_once_and_a_given_order_is_kept() {
        let mut w = ResumeWalk::given(names(&["b", "a"]));
        assert_eq!(
            (w.next(), w.next(), w.next()),
            (Some("b".into()), Some("a".into()), None)
        );
        assert_eq!(w.order(), ["b", "a"]);
        assert_eq!(
            ResumeWalk::damaged("r1.epoch-000002", "checksum mismatch in model/w"),
            "hindsight: WARNING: checkpoint r1.epoch-000002 is damaged (checksum mismatch in model/w); \
             resuming from an older one"
        );
    }
}
