//! Which rank of how many this process is, as launchers say it: `torchrun`
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`) and Slurm's `srun` (`SLURM_PROCID`,
//! `SLURM_NTASKS`).
//!
//! A recording and a resume are one process's today: under several ranks
//! each rank would record its own run of the same script, a rerun would
//! resume every rank from one rank's run, and their logs would mix. Until
//! runs span ranks, such a launch is refused before anything is recorded,
//! naming the launcher's variables, rather than resumed wrongly.

use std::ffi::OsString;

use crate::error::{Error, Result};

/// This process's place in a multi-process launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    pub rank: u64,
    pub size: u64,
    /// The variables it was read from, for messages.
    pub source: &'static str,
}

impl World {
    /// From the process's environment.
    pub fn from_env() -> Result<Option<World>> {
        World::from_vars(|k| std::env::var_os(k))
    }

    /// From `get` (a variable's value): `torchrun`'s variables first, then
    /// `srun`'s. `None` when no launcher set them.
    pub fn from_vars(get: impl Fn(&str) -> Option<OsString>) -> Result<Option<World>> {
        for (rank, size, source) in [
            ("RANK", "WORLD_SIZE", "RANK/WORLD_SIZE (torchrun)"),
            (
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_PROCID/SLURM_NTASKS (srun)",
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
            }));
        }
        Ok(None)
    }

    /// Refuse `what` (a recording, a resume) under several ranks.
    pub fn refuse_several(&self, what: &str) -> Result<()> {
        if self.size <= 1 {
            return Ok(());
        }
        Err(Error::invalid(
            "launch",
            format!(
                "{what} under {} ranks ({} = {}/{}) is not supported yet: every rank would record its own \
                 run of this script, and a rerun would resume them all from one rank's run. Run it as \
                 one process, or keep hindsight's Store/Checkpoint API for multi-rank jobs",
                self.size, self.source, self.rank, self.size
            ),
        ))
    }
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
        let e = two.refuse_several("a recording").unwrap_err().to_string();
        assert!(
            e.contains("a recording under 2 ranks (RANK/WORLD_SIZE (torchrun) = 1/2)"),
            "{e}"
        );
        let srun = world(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (srun.rank, srun.size, srun.source),
            (3, 4, "SLURM_PROCID/SLURM_NTASKS (srun)")
        );
        for bad in [
            [("RANK", "x"), ("WORLD_SIZE", "2")],
            [("RANK", "2"), ("WORLD_SIZE", "2")],
        ] {
            let e = world(&bad).unwrap_err().to_string();
            assert!(e.contains("RANK"), "{e}");
        }
    }
}
