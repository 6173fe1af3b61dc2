//! Which earlier run a starting training process continues: the one rule
//! behind "run the same command again and it resumes".
//!
//! A run that was interrupted (a preemption signal, checkpointed) resumes. A
//! run still marked running resumes only when it is certainly gone: the
//! same Slurm job id (a requeued job; the earlier attempt cannot be alive),
//! or the same host with its process dead (kill -9, OOM). A live run of the
//! same command is left alone and the new process starts a new run. A run
//! that failed (crashed) resumes only when `hindsight run`, or torchrun's
//! agent, restarts it.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::runs::db::{LogDb, RunRow, RunStatus};
use crate::runs::json::{self, J};
use crate::Result;

/// Where the asking process runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Here {
    pub host: String,
    /// `$SLURM_JOB_ID` of this process, if any.
    pub slurm_job: Option<String>,
    /// Started by `hindsight run` after a crash or hang of the same command.
    pub restarted: bool,
}

impl Here {
    /// This process: its host name and `$SLURM_JOB_ID`.
    pub fn current() -> Here {
        Here {
            host: hostname(),
            slurm_job: std::env::var("SLURM_JOB_ID").ok().filter(|s| !s.is_empty()),
            restarted: restarted(|name| std::env::var(name).ok()),
        }
    }
}

/// Whether this process restarts a command that crashed or hung: started
/// again by `hindsight run` ([`RESTART_ENV`](crate::runs::supervise::RESTART_ENV)), or by
/// torchrun's own agent (`--max-restarts`, an elastic membership change:
/// `TORCHELASTIC_RESTART_COUNT`), which stops every worker first.
fn restarted(var: impl Fn(&str) -> Option<String>) -> bool {
    [
        crate::runs::supervise::RESTART_ENV,
        "TORCHELASTIC_RESTART_COUNT",
    ]
    .iter()
    .any(|name| {
        var(name)
            .and_then(|v| v.parse::<u32>().ok())
            .is_some_and(|n| n > 0)
    })
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates
    // within it on success (and we stop at the first NUL either way).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Whether process `pid` exists on this host (EPERM: it does, someone else's).
pub(crate) fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The Slurm job id the run recorded in its versions.
fn recorded_slurm_job(run: &RunRow) -> Option<String> {
    match json::parse(&run.versions_json)? {
        J::Obj(entries) => entries.into_iter().find_map(|(k, v)| match v {
            J::Str(s) if k == "slurm_job_id" => Some(s),
            _ => None,
        }),
        _ => None,
    }
}

/// The key a starting process finds the run it continues by (unless the
/// user names it): the same script with the same arguments. The script is
/// taken relative to the project root when it lies inside it, so a project
/// moved or copied elsewhere still resumes its own runs; absolute otherwise,
/// so two projects sharing one home never resume each other's.
pub fn resume_key(script_abs: &Path, root: &Path, args: &[String]) -> String {
    let script = script_abs.strip_prefix(root).unwrap_or(script_abs);
    let mut h = blake3::Hasher::new();
    h.update(b"hindsight resume key 2\0");
    h.update(script.as_os_str().as_bytes());
    for a in args {
        // Length-prefixed: ["a b"] and ["a", "b"] differ.
        h.update(&(a.len() as u64).to_le_bytes());
        h.update(a.as_bytes());
    }
    h.finalize().to_hex()[..32].to_owned()
}

/// Whether `run` may be continued by a process at `here` (see the module
/// docs). `explicit`: the user named the run to continue.
pub fn resumable(run: &RunRow, explicit: bool, here: &Here) -> bool {
    match run.status {
        RunStatus::Interrupted => return true,
        _ if explicit => return true,
        RunStatus::Running => {}
        // A crash the supervisor restarts after: its process is gone.
        RunStatus::Failed if here.restarted => return true,
        RunStatus::Completed | RunStatus::Failed => return false,
    }
    if let (Some(job), Some(recorded)) = (&here.slurm_job, recorded_slurm_job(run)) {
        if *job == recorded {
            return true; // a requeued batch job: the earlier attempt is gone
        }
    }
    run.host == here.host && !alive(run.pid)
}

/// The status to show for `run` from `here`: a run still marked running
/// whose process is certainly gone (same host, its pid dead: kill -9, OOM)
/// shows as interrupted, which is what a rerun of its command does with it.
pub fn status_now(run: &RunRow, here: &Here) -> RunStatus {
    if run.status == RunStatus::Running && run.host == here.host && !alive(run.pid) {
        RunStatus::Interrupted
    } else {
        run.status
    }
}

/// The command a run was started with: its script, relative to its project
/// root where it lies inside it, and its arguments (`argv[1:]` as recorded).
fn recorded_command(run: &RunRow) -> (String, Option<Vec<String>>) {
    let abs = Path::new(&run.script_abs);
    let script = abs.strip_prefix(&run.project_root).unwrap_or(abs);
    let argv = match json::parse(&run.versions_json) {
        Some(J::Obj(entries)) => entries.into_iter().find_map(|(k, v)| match v {
            J::Arr(items) if k == "argv" => items
                .into_iter()
                .map(|a| match a {
                    J::Str(s) => Some(s),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>(),
            _ => None,
        }),
        _ => None,
    };
    (
        script.display().to_string(),
        argv.map(|a| a.into_iter().skip(1).collect()),
    )
}

/// Why the process running `script_abs` (in project `root`) with `args`
/// may not continue `run`, found by the name the user gave it
/// (`$HINDSIGHT_RUN_NAME`): another script or other arguments would go on
/// from that run's checkpoints, with its weights, under its id. `None`: the
/// same command (a run that recorded no arguments is compared by script).
pub fn command_differs(
    run: &RunRow,
    script_abs: &Path,
    root: &Path,
    args: &[String],
) -> Option<String> {
    let (script, recorded) = recorded_command(run);
    let here = script_abs
        .strip_prefix(root)
        .unwrap_or(script_abs)
        .display()
        .to_string();
    if script != here {
        return Some(format!("it ran {script}, this process runs {here}"));
    }
    match recorded {
        Some(a) if a != args => Some(format!(
            "it ran {script} with arguments {}, this process with {}",
            json::array(&a.iter().map(|s| json::string(s)).collect::<Vec<_>>()),
            json::array(&args.iter().map(|s| json::string(s)).collect::<Vec<_>>()),
        )),
        _ => None,
    }
}

/// The command of a starting process, for [`LogDb::run_to_resume`].
#[derive(Debug)]
pub struct Command<'a> {
    pub script_abs: &'a Path,
    pub root: &'a Path,
    pub args: &'a [String],
}

impl LogDb {
    /// The run a process at `here` started with `resume_key` continues, if
    /// any. Where the user named the run (`explicit`), a run found under
    /// that name that another command started is refused, naming the
    /// difference: the name is the user's, and may be reused by mistake.
    pub fn run_to_resume(
        &self,
        resume_key: &str,
        explicit: bool,
        here: &Here,
        command: &Command<'_>,
    ) -> Result<Option<RunRow>> {
        let Some(run) = self
            .find_resumable(resume_key, here.restarted)?
            .filter(|r| resumable(r, explicit, here))
        else {
            return Ok(None);
        };
        if explicit {
            if let Some(why) = command_differs(&run, command.script_abs, command.root, command.args)
            {
                return Err(crate::Error::invalid(
                    crate::settings::RUN_NAME.name,
                    format!(
                        "{resume_key:?} names run {}, which another command started: {why}. A resume runs the \
                         same script with the same arguments; give this command another name (or rerun the \
                         original command to resume it)",
                        run.id
                    ),
                ));
            }
        }
        Ok(Some(run))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_key_survives_a_moved_project_and_tells_scripts_and_arguments_apart() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let k = resume_key(
            Path::new("/a/proj/train.py"),
            Path::new("/a/proj"),
            &args(&["--lr", "1"]),
        );
        assert_eq!(k.len(), 32);
        // Moved: the same key.
        assert_eq!(
            k,
            resume_key(
                Path::new("/b/p2/train.py"),
                Path::new("/b/p2"),
                &args(&["--lr", "1"])
            )
        );
        // Another script, other arguments, other splits of them: other keys.
        let other = [
            resume_key(
                Path::new("/a/proj/eval.py"),
                Path::new("/a/proj"),
                &args(&["--lr", "1"]),
            ),
            resume_key(
                Path::new("/a/proj/train.py"),
                Path::new("/a/proj"),
                &args(&["--lr", "2"]),
            ),
            resume_key(
                Path::new("/a/proj/train.py"),
                Path::new("/a/proj"),
                &args(&["--lr 1"]),
            ),
            // Outside the project root (a shared home): the absolute path counts.
            resume_key(
                Path::new("/a/proj/train.py"),
                Path::new("/x"),
                &args(&["--lr", "1"]),
            ),
        ];
        for o in &other {
            assert_ne!(&k, o);
        }
        assert_ne!(
            other[3],
            resume_key(
                Path::new("/b/proj/train.py"),
                Path::new("/x"),
                &args(&["--lr", "1"])
            )
        );
    }

    #[test]
    fn a_named_run_continues_only_under_its_own_script_and_arguments() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let r = row(
            RunStatus::Interrupted,
            "h",
            1,
            r#"{"argv": ["train.py", "--lr", "0.1"]}"#,
        );
        // The same command, also from the project moved elsewhere.
        let same = args(&["--lr", "0.1"]);
        assert_eq!(
            command_differs(&r, Path::new("/p/train.py"), Path::new("/p"), &same),
            None
        );
        assert_eq!(
            command_differs(&r, Path::new("/q/train.py"), Path::new("/q"), &same),
            None
        );
        // Another project's script under a shared home, or other arguments.
        let why = command_differs(&r, Path::new("/p2/train.py"), Path::new("/"), &same).unwrap();
        assert!(why.contains("p2/train.py"), "{why}");
        let why = command_differs(
            &r,
            Path::new("/p/train.py"),
            Path::new("/p"),
            &args(&["--lr", "0.5"]),
        )
        .unwrap();
        assert!(
            why.contains(r#"["--lr","0.1"]"#) && why.contains(r#"["--lr","0.5"]"#),
            "{why}"
        );
        // A run that recorded no argv is compared by its script.
        let bare = row(RunStatus::Interrupted, "h", 1, "{}");
        assert_eq!(
            command_differs(&bare, Path::new("/p/train.py"), Path::new("/p"), &same),
            None
        );
    }

    fn row(status: RunStatus, host: &str, pid: u32, versions: &str) -> RunRow {
        RunRow {
            id: "r".into(),
            script: "train.py".into(),
            script_abs: "/p/train.py".into(),
            project_root: "/p".into(),
            source_hash: "h".into(),
            git_commit: None,
            git_dirty: None,
            args_json: "{}".into(),
            status,
            started_ms: 0,
            ended_ms: None,
            host: host.into(),
            versions_json: versions.into(),
            pid,
            resume_key: Some("k".into()),
            store: None,
        }
    }

    #[test]
    fn a_running_run_whose_process_is_gone_shows_as_interrupted() {
        let here = Here {
            host: "node1".into(),
            slurm_job: None,
            restarted: false,
        };
        let gone = row(RunStatus::Running, "node1", dead_pid(), "{}");
        assert_eq!(status_now(&gone, &here), RunStatus::Interrupted);
        let live = row(RunStatus::Running, "node1", std::process::id(), "{}");
        assert_eq!(status_now(&live, &here), RunStatus::Running);
        // Another host's process cannot be checked from here.
        let elsewhere = row(RunStatus::Running, "node2", dead_pid(), "{}");
        assert_eq!(status_now(&elsewhere, &here), RunStatus::Running);
        let done = row(RunStatus::Completed, "node1", dead_pid(), "{}");
        assert_eq!(status_now(&done, &here), RunStatus::Completed);
    }

    fn dead_pid() -> u32 {
        // A child that has exited and been reaped: its pid is free.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn the_rule() {
        let here = Here {
            host: "node1".into(),
            slurm_job: None,
            restarted: false,
        };
        let me = std::process::id();
        assert!(resumable(
            &row(RunStatus::Interrupted, "x", me, "{}"),
            false,
            &here
        ));
        assert!(!resumable(
            &row(RunStatus::Completed, "node1", 1, "{}"),
            false,
            &here
        ));
        assert!(resumable(
            &row(RunStatus::Completed, "node1", 1, "{}"),
            true,
            &here
        ));
        // Running here and alive (this very process): a concurrent run, not ours.
        assert!(!resumable(
            &row(RunStatus::Running, "node1", me, "{}"),
            false,
            &here
        ));
        // Running here but dead: crashed, continue it.
        assert!(resumable(
            &row(RunStatus::Running, "node1", dead_pid(), "{}"),
            false,
            &here
        ));
        // Running on another host: cannot tell, leave it.
        assert!(!resumable(
            &row(RunStatus::Running, "node2", dead_pid(), "{}"),
            false,
            &here
        ));
        // The same Slurm job, requeued on another node: the earlier attempt is gone.
        let job = Here {
            host: "node3".into(),
            slurm_job: Some("4242".into()),
            restarted: false,
        };
        let versions = r#"{"python": "3.11", "slurm_job_id": "4242", "x": NaN}"#;
        assert!(resumable(
            &row(RunStatus::Running, "node2", me, versions),
            false,
            &job
        ));
        let other = r#"{"slurm_job_id": "7"}"#;
        assert!(!resumable(
            &row(RunStatus::Running, "node2", me, other),
            false,
            &job
        ));
    }

    #[test]
    fn a_restart_is_the_supervisors_or_torchruns() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!restarted(env(&[])));
        assert!(!restarted(env(&[
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("HINDSIGHT_RESTART", "0")
        ])));
        assert!(restarted(env(&[("TORCHELASTIC_RESTART_COUNT", "1")])));
        assert!(restarted(env(&[("HINDSIGHT_RESTART", "2")])));
        assert!(!restarted(env(&[("TORCHELASTIC_RESTART_COUNT", "x")])));
    }

    #[test]
    fn a_failed_run_resumes_only_when_the_supervisor_restarts_it() {
        let mut here = Here {
            host: "node1".into(),
            slurm_job: None,
            restarted: false,
        };
        let failed = row(RunStatus::Failed, "node1", dead_pid(), "{}");
        assert!(!resumable(&failed, false, &here));
        here.restarted = true;
        assert!(resumable(&failed, false, &here));
        assert!(!resumable(
            &row(RunStatus::Completed, "node1", 1, "{}"),
            false,
            &here
        ));
    }

    #[test]
    fn this_host_has_a_name() {
        assert!(!Here::current().host.is_empty());
    }
}
