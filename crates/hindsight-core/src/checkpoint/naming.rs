//! Checkpoint names: the one rule shared by the training API
//! (`hs.checkpointing`) and the Lightning callback.
//!
//! `<prefix>.<loop>-<index:06>` is the checkpoint of outer iteration `index`
//! once its training steps are done (an epoch checkpoint); a suffix marks the
//! interim ones a preemption or a safety timer takes: `.step-<step:09>`
//! inside the iteration, `.end` after everything of the iteration ran. The
//! prefix is a run id or a user's prefix (it may contain dots; the loop name
//! cannot). Names written by earlier versions (8-digit steps) still parse.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// Which point of an outer iteration a checkpoint holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Inside the iteration, before training step `step` (a global or
    /// per-iteration step count, as the writer chose).
    Step(u64),
    /// After the iteration's training steps: the checkpoint retention keeps.
    Block,
    /// After the whole iteration (evaluation included).
    End,
}

impl Kind {
    fn rank(self) -> (u8, u64) {
        match self {
            Kind::Step(s) => (0, s),
            Kind::Block => (1, 0),
            Kind::End => (2, 0),
        }
    }

    /// Block checkpoints are the ones a retention policy chooses among;
    /// the others are interim and superseded by any newer block.
    pub fn is_interim(self) -> bool {
        !matches!(self, Kind::Block)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CheckpointId {
    pub prefix: String,
    /// The outer loop's name, as sanitized by [`CheckpointId::new`].
    pub loop_name: String,
    pub index: u64,
    pub kind: Kind,
}

const STEP: &str = ".step-";
const END: &str = ".end";

/// Characters a loop name keeps; others become `_` (no dots: they separate fields).
fn loop_char_ok(c: char) -> bool {
    c.is_ascii_alphanumeric() || "_=+@,-".contains(c)
}

impl CheckpointId {
    /// The id of a new checkpoint. The loop name is sanitized so that the
    /// name parses back; the prefix must be a valid name start.
    pub fn new(prefix: &str, loop_name: &str, index: u64, kind: Kind) -> Result<CheckpointId> {
        if prefix.is_empty() || prefix.starts_with('.') || prefix.contains('/') {
            return Err(Error::invalid(
                "checkpoint prefix",
                format!("{prefix:?} must be non-empty, without '/', and not start with '.'"),
            ));
        }
        let mut loop_name: String = loop_name
            .chars()
            .map(|c| if loop_char_ok(c) { c } else { '_' })
            .collect();
        if loop_name.is_empty() {
            loop_name = "loop".into();
        }
        let id = CheckpointId {
            prefix: prefix.into(),
            loop_name,
            index,
            kind,
        };
        crate::checkpoint::format::validate_name(&id.name())?;
        Ok(id)
    }

    pub fn name(&self) -> String {
        let base = format!("{}.{}-{:06}", self.prefix, self.loop_name, self.index);
        match self.kind {
            Kind::Block => base,
            Kind::End => base + END,
            Kind::Step(s) => format!("{base}{STEP}{s:09}"),
        }
    }

    /// Parse a name written by [`CheckpointId::name`]; None for other names.
    pub fn parse(name: &str) -> Option<CheckpointId> {
        let (rest, kind) = if let Some(r) = name.strip_suffix(END) {
            (r, Kind::End)
        } else if let Some((r, step)) = name
            .rfind(STEP)
            .and_then(|pos| Some((&name[..pos], parse_digits(&name[pos + STEP.len()..], 8)?)))
        {
            (r, Kind::Step(step))
        } else {
            (name, Kind::Block)
        };
        let dot = rest.rfind('.')?;
        let (prefix, tail) = (&rest[..dot], &rest[dot + 1..]);
        let dash = tail.rfind('-')?;
        let (loop_name, index) = (&tail[..dash], parse_digits(&tail[dash + 1..], 6)?);
        if prefix.is_empty() || loop_name.is_empty() || !loop_name.chars().all(loop_char_ok) {
            return None;
        }
        Some(CheckpointId {
            prefix: prefix.into(),
            loop_name: loop_name.into(),
            index,
            kind,
        })
    }

    /// Resume order: later points of the run sort later.
    pub fn order(&self) -> (u64, u8, u64) {
        let (rank, step) = self.kind.rank();
        (self.index, rank, step)
    }

    /// The manifest metadata that describes this id (beside the caller's own).
    pub fn meta(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert("prefix".into(), self.prefix.clone());
        m.insert("loop".into(), self.loop_name.clone());
        m.insert("index".into(), self.index.to_string());
        let kind = match self.kind {
            Kind::Block => "block".to_string(),
            Kind::End => "end".to_string(),
            Kind::Step(s) => {
                m.insert("step".into(), s.to_string());
                "step".to_string()
            }
        };
        m.insert("kind".into(), kind);
        m
    }
}

impl PartialOrd for CheckpointId {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for CheckpointId {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.order(), &self.prefix, &self.loop_name).cmp(&(
            other.order(),
            &other.prefix,
            &other.loop_name,
        ))
    }
}

/// At least `min` ASCII digits, nothing else.
fn parse_digits(s: &str, min: usize) -> Option<u64> {
    if s.len() < min || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The checkpoints among `names` that carry `prefix`, oldest first.
pub fn with_prefix<'a>(
    names: impl IntoIterator<Item = &'a String>,
    prefix: &str,
) -> Vec<CheckpointId> {
    let mut ids: Vec<CheckpointId> = names
        .into_iter()
        .filter_map(|n| CheckpointId::parse(n))
        .filter(|id| id.prefix == prefix)
        .collect();
    ids.sort();
    ids
}

/// Fits (Lightning's `Trainer.fit`) sharing one store and prefix: the first
/// writes under `<base>`, each later fresh fit under `<base>.fit<N>` (N = 2,
/// 3, ...), so that a new fit never resumes, nor mixes its checkpoints with,
/// a finished one. A fit that returned writes an `End` checkpoint of its last
/// epoch (`<prefix>.epoch-<n>.end`): its mark of being finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitChoice {
    /// The newest checkpoint of the newest fit when that fit did not finish:
    /// where `fit` resumes. None: start a fresh fit.
    pub resume: Option<CheckpointId>,
    /// The newest checkpoint with trainer state of the newest fit, finished
    /// or not: what loading "the latest model" means.
    pub latest: Option<CheckpointId>,
    /// The prefix a fit started afresh writes under: `<base>` in a store
    /// without fits, else the generation after the newest.
    pub fresh_prefix: String,
}

/// The generation of a fit prefix under `base`: 1 for `base`, N for `base.fitN`.
pub fn fit_generation(base: &str, prefix: &str) -> Option<u32> {
    if prefix == base {
        return Some(1);
    }
    let n: u32 = prefix
        .strip_prefix(base)?
        .strip_prefix(".fit")?
        .parse()
        .ok()?;
    (n >= 2 && prefix == fit_prefix(base, n)).then_some(n)
}

/// The prefix of fit generation `n` under `base`.
pub fn fit_prefix(base: &str, n: u32) -> String {
    if n <= 1 {
        base.to_string()
    } else {
        format!("{base}.fit{n}")
    }
}

/// Which fit a `Trainer.fit` started with no checkpoint path continues,
/// given the names in the store.
pub fn choose_fit<'a>(names: impl IntoIterator<Item = &'a String>, base: &str) -> FitChoice {
    let mut newest: Option<(u32, CheckpointId)> = None;
    let mut latest: Option<(u32, CheckpointId)> = None;
    let mut last_generation = 0;
    for id in names.into_iter().filter_map(|n| CheckpointId::parse(n)) {
        let Some(generation) = fit_generation(base, &id.prefix) else {
            continue;
        };
        last_generation = last_generation.max(generation);
        let later = |best: &Option<(u32, CheckpointId)>| match best {
            None => true,
            Some((g, b)) => (generation, id.order()) > (*g, b.order()),
        };
        if id.kind != Kind::End && later(&latest) {
            latest = Some((generation, id.clone()));
        }
        if later(&newest) {
            newest = Some((generation, id));
        }
    }
    FitChoice {
        resume: newest.map(|(_, id)| id).filter(|id| id.kind != Kind::End),
        latest: latest.map(|(_, id)| id),
        fresh_prefix: fit_prefix(base, last_generation + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_finished_fit_is_never_resumed_and_the_next_one_gets_its_own_prefix() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let empty = choose_fit(&names(&[]), "lightning");
        assert_eq!(
            (empty.resume, empty.fresh_prefix.as_str()),
            (None, "lightning")
        );
        // Interrupted in epoch 1: resume its newest checkpoint; a fit started
        // afresh anyway gets a prefix of its own.
        let running = names(&[
            "lightning.epoch-000000",
            "lightning.epoch-000001.step-000000012",
            "other.epoch-000005",
        ]);
        let c = choose_fit(&running, "lightning");
        assert_eq!(
            c.resume.unwrap().name(),
            "lightning.epoch-000001.step-000000012"
        );
        assert_eq!(c.fresh_prefix, "lightning.fit2");
        // Finished: nothing to resume.
        let mut done = running.clone();
        done.push("lightning.epoch-000002.end".into());
        let c = choose_fit(&done, "lightning");
        assert_eq!(
            (c.resume, c.fresh_prefix.as_str()),
            (None, "lightning.fit2")
        );
        assert_eq!(
            c.latest.unwrap().name(),
            "lightning.epoch-000001.step-000000012"
        );
        // That second fit interrupted at epoch 0: resumed, even though the
        // first fit's epochs are numbered higher.
        done.push("lightning.fit2.epoch-000000".into());
        let c = choose_fit(&done, "lightning");
        assert_eq!(c.resume.unwrap().name(), "lightning.fit2.epoch-000000");
        assert_eq!(c.fresh_prefix, "lightning.fit3");
        done.push("lightning.fit2.epoch-000000.end".into());
        assert_eq!(choose_fit(&done, "lightning").resume, None);
        // Look-alikes are not generations.
        for p in [
            "lightning.fit1",
            "lightning.fit02",
            "lightning.fitx",
            "lightningfit2",
            "lightning.fit2.x",
        ] {
            assert_eq!(fit_generation("lightning", p), None, "{p}");
        }
        assert_eq!(fit_generation("my.model", "my.model.fit12"), Some(12));
    }

    #[test]
    fn names_of_both_front_ends() {
        let id = CheckpointId::new("run42", "epoch", 3, Kind::Step(420)).unwrap();
        assert_eq!(id.name(), "run42.epoch-000003.step-000000420");
        let block = CheckpointId::new("my.model", "epoch", 3, Kind::Block).unwrap();
        assert_eq!(block.name(), "my.model.epoch-000003");
        assert_eq!(CheckpointId::parse("my.model.epoch-000003"), Some(block));
        let end = CheckpointId::parse("r.round-000012.end").unwrap();
        assert_eq!((end.index, end.kind), (12, Kind::End));
        // Names of earlier versions (8-digit steps) still parse.
        let old = CheckpointId::parse("r.epoch-000001.step-00000007").unwrap();
        assert_eq!(old.kind, Kind::Step(7));
    }

    #[test]
    fn loop_names_are_sanitized_to_parse_back() {
        let id = CheckpointId::new("r", "my loop.v2/x", 0, Kind::Block).unwrap();
        assert_eq!(id.loop_name, "my_loop_v2_x");
        assert_eq!(CheckpointId::parse(&id.name()), Some(id));
        assert!(CheckpointId::new(".hidden", "e", 0, Kind::Block).is_err());
        assert!(CheckpointId::new("", "e", 0, Kind::Block).is_err());
    }

    #[test]
    fn foreign_names_do_not_parse() {
        for n in [
            "best",
            "run.epoch-12",
            "run.epoch-00000a",
            ".epoch-000001",
            "run.-000001",
            "run.epoch-000001.step-12",
            "run.epoch-000001.stepx",
        ] {
            assert_eq!(CheckpointId::parse(n), None, "{n}");
        }
    }

    #[test]
    fn resume_order() {
        let k = |i, kind| CheckpointId::new("r", "epoch", i, kind).unwrap();
        let mut ids = [
            k(2, Kind::Block),
            k(1, Kind::End),
            k(2, Kind::Step(5)),
            k(1, Kind::Block),
            k(2, Kind::Step(40)),
            k(10, Kind::Step(0)),
        ];
        ids.sort();
        let names: Vec<String> = ids.iter().map(|i| i.name()).collect();
        assert_eq!(
            names,
            [
                "r.epoch-000001",
                "r.epoch-000001.end",
                "r.epoch-000002.step-000000005",
                "r.epoch-000002.step-000000040",
                "r.epoch-000002",
                "r.epoch-000010.step-000000000",
            ]
        );
        let names: Vec<String> = names
            .into_iter()
            .chain(["other.epoch-000009".into()])
            .collect();
        assert_eq!(with_prefix(&names, "r").len(), 6);
        assert_eq!(with_prefix(&names, "other").len(), 1);
    }

    proptest! {
        #[test]
        fn round_trip(prefix in "[a-z0-9][a-z0-9._-]{0,20}(\\.step-x)?", lp in "[ -~]{0,12}",
                      index in 0u64..10_000_000, step in proptest::option::of(0u64..100_000_000_000), end in any::<bool>()) {
            let kind = match (step, end) { (Some(s), _) => Kind::Step(s), (None, true) => Kind::End, _ => Kind::Block };
            let id = CheckpointId::new(&prefix, &lp, index, kind).unwrap();
            prop_assert_eq!(CheckpointId::parse(&id.name()), Some(id));
        }
    }
}
