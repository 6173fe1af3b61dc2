//! The exit code that tells a batch system "checkpointed, reschedule me":
//! one rule for `hs.checkpointing`, the Lightning callback and `hindsight run`.

use crate::error::{Error, Result};
use crate::settings;

/// When nothing else says which code to use.
pub const DEFAULT_EXIT_CODE: i32 = 85;

/// `explicit`, else HTCondor's `CheckpointExitCode` from the job ad
/// (`$_CONDOR_JOB_AD`), else `$HINDSIGHT_EXIT_CODE`, else 85. A variable
/// that is not an exit code (1 to 255) is an error naming it: a batch
/// system keyed on the code would not reschedule the job.
pub fn exit_code(explicit: Option<i32>) -> Result<i32> {
    if let Some(c) = explicit {
        return Ok(c);
    }
    if let Some(ad) = std::env::var_os("_CONDOR_JOB_AD") {
        if let Ok(text) = std::fs::read_to_string(&ad) {
            if let Some(c) = condor_checkpoint_code(&text) {
                return Ok(c);
            }
        }
    }
    match settings::EXIT_CODE.int()? {
        None => Ok(DEFAULT_EXIT_CODE),
        Some(c) => i32::try_from(c)
            .ok()
            .filter(|c| (1..=255).contains(c))
            .ok_or_else(|| {
                Error::invalid(
                    format!("${}", settings::EXIT_CODE.name),
                    format!("{c} is not an exit code (1 to 255)"),
                )
            }),
    }
}

/// `CheckpointExitCode = N` in an HTCondor job ad.
fn condor_checkpoint_code(ad: &str) -> Option<i32> {
    ad.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        (k.trim() == "CheckpointExitCode")
            .then(|| v.trim().parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condor_ads_name_the_code() {
        let ad = "JobUniverse = 5\nCheckpointExitCode = 77\nOwner = \"me\"\n";
        assert_eq!(condor_checkpoint_code(ad), Some(77));
        assert_eq!(condor_checkpoint_code("Owner = \"me\"\n"), None);
        assert_eq!(exit_code(Some(3)).unwrap(), 3);
    }
}
