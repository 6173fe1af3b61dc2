//! `hindsight run`: keep a training command going through what signals
//! cannot cover (seed 003: restart from the last checkpoint when a health
//! check fails; seed 004: reschedule).
//!
//! The command is restarted when it crashes (any exit but success, the
//! checkpoint exit code, or a stop the user asked for) and when it hangs: a
//! process started here gets `HINDSIGHT_HEARTBEAT_FD`, and `hs.loop` writes
//! a byte there at step boundaries (at most one per second). No byte for
//! the hang timeout after the first one means hung: the supervisor sends SIGUSR2 (hindsight
//! dumps every thread's Python stack on it), waits a moment, kills the
//! process and restarts it. Each restart sets `HINDSIGHT_RESTART=<n>`, which
//! lets the run resume from its last checkpoint exactly as after a
//! preemption (see `resume`). Restarts back off (doubling from `backoff` up
//! to a minute, reset once a run stayed up for five minutes) and stop after
//! `max_restarts`. SIGTERM, SIGINT, SIGUSR1 and SIGHUP are passed to the
//! command and end supervision: a preempted run's checkpoint exit code
//! still reaches the batch system.

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::runs::preempt;

/// Environment variable naming the heartbeat pipe's write end.
pub const HEARTBEAT_ENV: &str = crate::settings::HEARTBEAT_FD.name;
/// Environment variable carrying the restart count (absent on the first start).
pub const RESTART_ENV: &str = crate::settings::RESTART.name;

#[derive(Clone, Debug)]
pub struct Policy {
    /// Restarts after a crash or hang before giving up.
    pub max_restarts: u32,
    /// No step boundary for this long means hung; None: never.
    pub hang_timeout: Option<Duration>,
    /// First wait before a restart; doubles per quick failure.
    pub backoff: Duration,
    /// A run that stayed up this long resets the backoff.
    pub healthy_after: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_restarts: 3,
            hang_timeout: None,
            backoff: Duration::from_secs(1),
            healthy_after: Duration::from_secs(300),
        }
    }
}

const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Time between SIGUSR2 (stack dump) and SIGKILL of a hung process.
const DUMP_GRACE: Duration = Duration::from_secs(3);
const FORWARDED: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1, libc::SIGHUP];

/// The last forwarded signal received (0: none). Set by the handler only.
static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_signal(sig: libc::c_int) {
    PENDING.store(sig, Ordering::SeqCst);
}

/// Our handlers for the forwarded signals while supervising; the previous
/// ones come back on drop.
struct Handlers(Vec<(libc::c_int, libc::sighandler_t)>);

impl Handlers {
    fn install() -> Handlers {
        PENDING.store(0, Ordering::SeqCst);
        let handler = note_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        Handlers(
            FORWARDED
                .iter()
                // SAFETY: the handler only stores to an atomic, which is
                // async-signal-safe.
                .map(|&s| (s, unsafe { libc::signal(s, handler) }))
                .collect(),
        )
    }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        for &(s, old) in &self.0 {
            // SAFETY: restores the disposition that was there before.
            unsafe { libc::signal(s, old) };
        }
    }
}

/// How one start of the command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Exited (or was killed) on its own; the shell-style status.
    Exited(i32),
    /// Killed by us because it hung.
    Hung,
    /// A forwarded signal stopped it; the status it ended with.
    Stopped(i32),
}

fn status_code(st: ExitStatus) -> i32 {
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

/// A pipe whose write end the child inherits (the read end does not).
fn heartbeat_pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(Error::io("heartbeat pipe", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        libc::fcntl(r.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(r.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
    }
    Ok((r, w))
}

/// Wait up to `timeout` for heartbeat bytes; true if any arrived.
fn beat(read: &OwnedFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: read.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n <= 0 || pfd.revents & libc::POLLIN == 0 {
        if pfd.revents & libc::POLLHUP != 0 {
            // The child closed its end (exiting): do not spin on it.
            std::thread::sleep(timeout);
        }
        return false;
    }
    let mut buf = [0u8; 256];
    let mut got = false;
    loop {
        // SAFETY: reads into a local buffer from a descriptor we own.
        let r = unsafe { libc::read(read.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if r <= 0 {
            return got;
        }
        got = true;
    }
}

/// Signal the command's whole process group: a wrapper (`bash train.sh`,
/// a launcher) and the trainer it started, with its data-loading workers.
fn kill(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: signals the process group led by a child we started.
        unsafe { libc::kill(-pid, sig) };
    }
}

fn run_once(cmd: &[OsString], restart: u32, policy: &Policy, log: &mut dyn Write) -> Result<End> {
    let (read, write) = heartbeat_pipe()?;
    let mut c = Command::new(&cmd[0]);
    // Its own process group: signals reach all of it through us, once (a
    // terminal's Ctrl-C no longer arrives twice), and a hang kills all of it.
    c.process_group(0);
    c.args(&cmd[1..])
        .env(HEARTBEAT_ENV, write.as_raw_fd().to_string());
    if restart > 0 {
        c.env(RESTART_ENV, restart.to_string());
    } else {
        c.env_remove(RESTART_ENV);
    }
    let mut child = c.spawn().map_err(|e| {
        Error::invalid(
            "command",
            format!("cannot start {:?}: {e}", cmd[0].to_string_lossy()),
        )
    })?;
    drop(write); // the child holds the only write end now
                 // The hang clock starts at the first step boundary: imports, data
                 // loading and compilation before it can take any time.
    let mut last_beat: Option<Instant> = None;
    let mut forwarded = false;
    loop {
        if beat(&read, Duration::from_millis(100)) {
            last_beat = Some(Instant::now());
        }
        let sig = PENDING.swap(0, Ordering::SeqCst);
        if sig != 0 {
            kill(&child, sig);
            forwarded = true;
        }
        if let Some(st) = child.try_wait().map_err(|e| Error::io("child", e))? {
            let code = status_code(st);
            return Ok(if forwarded {
                End::Stopped(code)
            } else {
                End::Exited(code)
            });
        }
        if let (Some(limit), Some(last)) = (policy.hang_timeout, last_beat) {
            if !forwarded && last.elapsed() > limit {
                let _ = writeln!(
                    log,
                    "hindsight run: no step boundary for {:.0} s: process {} hung; its Python stacks follow",
                    limit.as_secs_f64(),
                    child.id()
                );
                kill(&child, libc::SIGUSR2);
                let until = Instant::now() + DUMP_GRACE;
                while Instant::now() < until {
                    if child
                        .try_wait()
                        .map_err(|e| Error::io("child", e))?
                        .is_some()
                    {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                kill(&child, libc::SIGKILL);
                let _ = child.wait();
                return Ok(End::Hung);
            }
        }
    }
}

/// Run `cmd` under `policy` until it succeeds, is stopped by a signal, exits
/// with the checkpoint exit code, or has failed `max_restarts + 1` times.
/// Returns the exit status to leave with. Messages go to `log`.
pub fn supervise(cmd: &[OsString], policy: &Policy, log: &mut dyn Write) -> Result<i32> {
    if cmd.is_empty() {
        return Err(Error::invalid(
            "command",
            "no command given (hindsight run -- python train.py ...)",
        ));
    }
    let checkpoint_code = preempt::exit_code(None)?;
    let _handlers = Handlers::install();
    let mut restarts = 0u32;
    let mut wait = policy.backoff;
    loop {
        let started = Instant::now();
        let end = run_once(cmd, restarts, policy, log)?;
        let why = match end {
            End::Exited(0) => return Ok(0),
            End::Stopped(code) => return Ok(code),
            End::Exited(code) if code == checkpoint_code => {
                let _ = writeln!(
                    log,
                    "hindsight run: checkpointed and stopped (exit {code}); not restarting"
                );
                return Ok(code);
            }
            End::Exited(code) => format!("exited with status {code}"),
            End::Hung => "hung and was killed".to_string(),
        };
        let code = match end {
            End::Exited(c) => c,
            _ => 128 + libc::SIGKILL,
        };
        if restarts >= policy.max_restarts {
            let _ = writeln!(
                log,
                "hindsight run: the command {why}; giving up after {restarts} restart(s)"
            );
            return Ok(code);
        }
        if started.elapsed() >= policy.healthy_after {
            wait = policy.backoff;
        }
        restarts += 1;
        let _ = writeln!(
            log,
            "hindsight run: the command {why}; restart {restarts} of {} in {:.1} s (it resumes from its last checkpoint)",
            policy.max_restarts,
            wait.as_secs_f64()
        );
        let until = Instant::now() + wait;
        while Instant::now() < until {
            let sig = PENDING.swap(0, Ordering::SeqCst);
            if sig != 0 {
                return Ok(128 + sig); // asked to stop while waiting: nothing to pass on
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        wait = (wait * 2).min(MAX_BACKOFF);
    }
}
