//! Which rank of how many this process is, as launchers say it: `torchrun`
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`) and Slurm's `srun` (`SLURM_PROCID`,
//! `SLURM_NTASKS`), and the rules of a run that spans ranks.
//!
//! An `hs.loop` recording under several ranks is one run: rank 0 owns it
//! (creates or resumes it, writes its rows and logs, applies retention and
//! decides the adaptive checkpoints); the other ranks join it when the
//! outer loop starts and follow rank 0's decisions, so every rank saves the
//! same checkpoint, as one sharded commit. Per-rank state (RNG streams, a
//! `DistributedSampler`'s place) resumes only on the world size that saved
//! it, and a replay re-executes one process: both refuse what they cannot
//! do exactly. A framework's recording (Lightning) does not span ranks yet
//! and is refused under several.

use std::ffi::OsString;

use crate::checkpoint::naming::{CheckpointId, Kind};
use crate::error::{Error, Result};

/// This process's place in a multi-process launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    pub rank: u64,
    pub size: u64,
    /// The variables it was read from, for messages.
    pub source: &'static str,
    /// The launcher that set them ("torchrun" or "srun"): a recording
    /// notes it, so that its replay relaunches the script the same way.
    pub launcher: &'static str,
}

impl World {
    /// From the process's environment.
    pub fn from_env() -> Result<Option<World>> {
        World::from_vars(|k| std::env::var_os(k))
    }

    /// From `get` (a variable's value): `torchrun`'s variables first, then
    /// `srun`'s. `None` when no launcher set them.
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Option<World>> {
        for (rank, size, source, launcher) in [
            (
                "RANK",
                "WORLD_SIZE",
                "RANK/WORLD_SIZE (torchrun)",
                "torchrun",
            ),
            (
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_PROCID/SLURM_NTASKS (srun)",
                "srun",
            ),
        ] {
            let (Some(r), Some(n)) = (get(rank), get(size)) else {
                continue;
            };
            let num = |name: &str, v: &OsString| -> Result<u64> {
                v.to_str()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .ok_or_else(|| Error::invalid(name, format!("{v:?} is not a whole number")))
            };
            let (rank_v, size_v) = (num(rank, &r)?, num(size, &n)?);
            if size_v == 0 || rank_v >= size_v {
                return Err(Error::invalid(
                    rank,
                    format!("{rank}={rank_v} is not a rank of {size}={size_v}"),
                ));
            }
            return Ok(Some(World {
                rank: rank_v,
                size: size_v,
                source,
                launcher,
            }));
        }
        Ok(None)
    }

    /// Whether this rank owns the run (rank 0): the others follow it.
    pub fn leads(&self) -> bool {
        self.rank == 0
    }

    /// Refuse `what` (a framework's recording) under several ranks.
    pub fn refuse_several(&self, what: &str) -> Result<()> {
        if self.size <= 1 {
            return Ok(());
        }
        Err(Error::invalid(
            "launch",
            format!(
                "{what} under {} ranks ({} = {}/{}) is not supported yet: every rank would record its own \
                 run of this script, and a rerun would resume them all from one rank's run. Record with \
                 hs.loop (one run per job), run it as one process, or keep hindsight.dist for multi-rank \
                 checkpoints",
                self.size, self.source, self.rank, self.size
            ),
        ))
    }
}

/// How a job of `now` ranks may resume from a checkpoint saved by another
/// number ([`resume_fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorldFit {
    /// The world size that saved it: every rank continues its own state.
    Same,
    /// Another size, opted into ([`crate::settings::RESHARD`]): the objects
    /// are resharded onto this job's ranks; ranks the checkpoint has
    /// continue their RNG streams, new ranks keep the ones the script
    /// seeded; the loop variables are rank 0's.
    Reshard,
    /// Another size, opted into, but a checkpoint inside an iteration: its
    /// data position is each saved rank's share of the epoch, which no
    /// other world size has. An older one, between iterations, is used.
    Skip,
}

/// A resume from `checkpoint`, saved by `saved` ranks (`None`: one
/// process's checkpoint), by a job of `now` ranks. Only the same world size
/// resumes exactly (each rank's RNG streams and data position are its own),
/// so another is refused, naming both sizes, unless `reshard` opts into
/// resuming from the objects ([`WorldFit::Reshard`]).
pub fn resume_fit(
    checkpoint: &str,
    saved: Option<u64>,
    now: u64,
    reshard: bool,
) -> Result<WorldFit> {
    let saved = saved.unwrap_or(1);
    if saved == now {
        return Ok(WorldFit::Same);
    }
    if reshard {
        let inside =
            CheckpointId::parse(checkpoint).is_some_and(|c| matches!(c.kind, Kind::Step(_)));
        return Ok(if inside {
            WorldFit::Skip
        } else {
            WorldFit::Reshard
        });
    }
    let who = |n: u64| {
        if n == 1 {
            "one process".to_string()
        } else {
            format!("{n} ranks")
        }
    };
    Err(Error::invalid(
        "launch",
        format!(
            "checkpoint {checkpoint} was saved by {} and this launch has {}: a resume continues every rank's \
             RNG streams and data position exactly only on the world size that saved them. Relaunch with \
             {} (torchrun --nproc_per_node={saved}); or set {}=1 to resume from the newest checkpoint between \
             iterations with the model and optimizer resharded onto this launch (new ranks keep the RNG \
             streams the script seeds, and the data order of what follows is this world size's)",
            who(saved),
            who(now),
            who(saved),
            crate::settings::RESHARD.name,
        ),
    ))
}

/// The world size a run was recorded with (its `versions` JSON says
/// `world_size`; runs recorded before ranks were known were one process).
pub fn recorded_world(versions_json: &str) -> u64 {
    serde_json::from_str::<serde_json::Value>(versions_json)
        .ok()
        .and_then(|v| v.get("world_size").and_then(|w| w.as_u64()))
        .unwrap_or(1)
}

/// Whether a run's replay workers run the script under hindsight's
/// `torchrun`: a run of several ranks, and one recorded under `torchrun`
/// with one rank (a one-GPU job launched as multi-GPU ones are: its script
/// reads `LOCAL_RANK` and sets up a process group, and would fail as a plain
/// process).
pub fn replays_under_torchrun(versions_json: &str) -> bool {
    recorded_world(versions_json) > 1
        || serde_json::from_str::<serde_json::Value>(versions_json)
            .ok()
            .is_some_and(|v| v.get("launcher").and_then(|l| l.as_str()) == Some("torchrun"))
}

/// A replay re-executes a run on the world size that recorded it: each
/// rank's RNG streams, data share and collectives are those of that size,
/// and nothing else replays them exactly. A worker launched on another
/// size is refused, naming both.
pub fn check_replay_world(
    run_id: &str,
    versions_json: &str,
    now: u64,
    restores_only: bool,
) -> Result<ReplayWorld> {
    let recorded = recorded_world(versions_json);
    if recorded == now {
        return Ok(ReplayWorld::Recorded);
    }
    if now == replay_world(recorded, restores_only) {
        return Ok(ReplayWorld::OneProcess);
    }
    Err(Error::invalid(
        "replay",
        format!(
            "run {run_id} was recorded by {recorded} rank(s) and this replay worker is one of {now}: a \
             replay re-executes every rank on the recorded world size (hindsight replay launches its workers \
             so; run it rather than the script)"
        ),
    ))
}

/// The world a replay worker runs on: the recorded one where it executes
/// training steps (every rank computes its share), one process where it
/// only restores checkpoints (the outer loop's probes), resharded onto it.
pub fn replay_world(recorded: u64, restores_only: bool) -> u64 {
    if restores_only {
        1
    } else {
        recorded.max(1)
    }
}

/// How a replay worker stands to its run's recorded world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayWorld {
    /// The recorded world size.
    Recorded,
    /// One process restoring a multi-rank run's checkpoints, resharded: it
    /// must never execute training (no cost rule turning a restore into an
    /// execution), and values logged with `rank="all"` come from rank 0 only.
    OneProcess,
}

/// Refuse `what` when this process is one of several ranks (see the module
/// header); a bad launcher variable is an error naming it.
pub fn refuse_several_ranks(what: &str) -> Result<()> {
    match World::from_env()? {
        Some(world) => world.refuse_several(what),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>> {
        let m: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        World::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn launchers_are_read_and_several_ranks_are_refused() {
        assert_eq!(world(&[]).unwrap(), None);
        let one = world(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap()
            .unwrap();
        assert!(one.refuse_several("recording").is_ok());
        let two = world(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((two.rank, two.size), (1, 2));
        assert!(!two.leads() && one.leads());
        let e = two.refuse_several("a recording").unwrap_err().to_string();
        assert!(
            e.contains("a recording under 2 ranks (RANK/WORLD_SIZE (torchrun) = 1/2)"),
            "{e}"
        );
        let srun = world(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (srun.rank, srun.size, srun.source, srun.launcher),
            (3, 4, "SLURM_PROCID/SLURM_NTASKS (srun)", "srun")
        );
        assert_eq!(one.launcher, "torchrun");
        for bad in [
            [("RANK", "x"), ("WORLD_SIZE", "2")],
            [("RANK", "2"), ("WORLD_SIZE", "2")],
        ] {
            let e = world(&bad).unwrap_err().to_string();
            assert!(e.contains("RANK"), "{e}");
        }
    }

    #[test]
    fn a_resume_needs_the_world_size_that_saved_unless_it_reshards_between_iterations() {
        assert_eq!(
            resume_fit("r.epoch-000001", None, 1, false).unwrap(),
            WorldFit::Same
        );
        assert_eq!(
            resume_fit("r.epoch-000001", Some(2), 2, true).unwrap(),
            WorldFit::Same
        );
        let e = resume_fit("r.epoch-000001", Some(2), 1, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("r.epoch-000001 was saved by 2 ranks and this launch has one process")
                && e.contains("HINDSIGHT_RESHARD=1"),
            "{e}"
        );
        let e = resume_fit("r.epoch-000001", None, 4, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("saved by one process and this launch has 4 ranks"),
            "{e}"
        );
        // Opted in: between iterations the objects reshard; inside one, the
        // data position is per rank: skipped for an older checkpoint.
        assert_eq!(
            resume_fit("r.epoch-000001", Some(2), 4, true).unwrap(),
            WorldFit::Reshard
        );
        assert_eq!(
            resume_fit("r.epoch-000001.end", Some(2), 1, true).unwrap(),
            WorldFit::Reshard
        );
        assert_eq!(
            resume_fit("r.epoch-000001.step-000000003", Some(2), 1, true).unwrap(),
            WorldFit::Skip
        );
        assert_eq!(recorded_world(r#"{"argv": []}"#), 1);
        assert_eq!(recorded_world("not json"), 1);
        let two = r#"{"world_size": 2}"#;
        assert_eq!(
            check_replay_world("r", two, 2, false).unwrap(),
            ReplayWorld::Recorded
        );
        assert_eq!(
            check_replay_world("r", "{}", 1, false).unwrap(),
            ReplayWorld::Recorded
        );
        // A worker that only restores replays a multi-rank run on one process.
        assert_eq!(
            check_replay_world("r", two, 1, true).unwrap(),
            ReplayWorld::OneProcess
        );
        assert_eq!((replay_world(2, true), replay_world(2, false)), (1, 2));
        for (now, restores_only) in [(1, false), (4, true), (4, false)] {
            let e = check_replay_world("r", two, now, restores_only)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!(
                    "run r was recorded by 2 rank(s) and this replay worker is one of {now}"
                )),
                "{e}"
            );
        }
    }
}
