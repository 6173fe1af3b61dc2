//! How busy the machine's CPUs are, to price the writer's background CPU.
//!
//! A writer thread hashing on a core the training leaves idle (a GPU job
//! feeding one launch thread on a 16-core host) costs the training nothing;
//! on a core the training wanted (CPU training with a thread per core) it
//! costs in full. [`contention`] estimates, between two samples, the share
//! of the usable cores that everything but our writer kept busy: the
//! fraction of the writer's CPU that displaced other work. Busy time is read
//! machine-wide (other processes, e.g. DataLoader workers, count), and the
//! capacity is what this process may use (affinity and cgroup quota), so a
//! container on a busy host is charged in full, never less.

/// Running totals of the kernel's CPU accounting (Linux `/proc/stat`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuSample {
    /// Seconds all CPUs spent busy (user, nice, system, irq, softirq, steal).
    pub busy: f64,
    /// Seconds all CPUs were counted (busy, idle and iowait).
    pub total: f64,
    /// CPUs in the accounting.
    pub cpus: u32,
    /// CPUs this process may use (affinity, cgroup quota).
    pub usable: u32,
}

/// The calling thread's time spent ready to run but waiting for a CPU
/// (Linux `/proc/thread-self/schedstat`, its second field): time the
/// machine gave to other work. An iteration's wall time less that wait is
/// what the training itself took; on an oversubscribed machine (DataLoader
/// workers on every core, a shared node, a process sharing its core) the
/// wall time alone would count the others' work as compute, and let the
/// recording spend ε of it. One `pread` of a file kept open (about a
/// microsecond); reopened when the thread or the process is another (a
/// fork, a call from a new thread).
#[derive(Debug, Default)]
pub struct RunQueue {
    open: Option<(i32, i32, std::fs::File)>,
    unavailable: bool,
}

/// A clone opens a file of its own at its first reading.
impl Clone for RunQueue {
    fn clone(&self) -> Self {
        RunQueue {
            open: None,
            unavailable: self.unavailable,
        }
    }
}

impl RunQueue {
    /// Seconds this thread has waited for a CPU so far; `None` where the
    /// kernel does not say (not Linux, or schedstats compiled out).
    pub fn waited_secs(&mut self) -> Option<f64> {
        if self.unavailable {
            return None;
        }
        // SAFETY: getpid and gettid have no preconditions.
        let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
        if !matches!(&self.open, Some((p, t, _)) if *p == pid && *t == tid) {
            match std::fs::File::open("/proc/thread-self/schedstat") {
                Ok(f) => self.open = Some((pid, tid, f)),
                Err(_) => {
                    self.unavailable = true;
                    return None;
                }
            }
        }
        let (_, _, f) = self.open.as_ref()?;
        let mut buf = [0u8; 96];
        let n = std::os::unix::fs::FileExt::read_at(f, &mut buf, 0).ok()?;
        parse_schedstat(&buf[..n])
    }
}

/// The run-queue wait, in seconds, of a `schedstat` line
/// (`<on-cpu ns> <waiting ns> <timeslices>`).
fn parse_schedstat(line: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(line).ok()?;
    let ns: u64 = text.split_ascii_whitespace().nth(1)?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

/// Below this much wall time between samples, the tick counts (10 ms) are
/// too coarse to say anything: keep the last estimate.
const MIN_INTERVAL_SECS: f64 = 0.5;

/// Reads the machine's totals at most once per [`MIN_INTERVAL_SECS`]:
/// a read (`/proc/stat`, the cgroup quota) costs tens of microseconds, too
/// much for every block end of a loop of millisecond steps, and a shorter
/// interval says nothing anyway.
#[derive(Debug, Default)]
pub struct Sampler {
    last: Option<std::time::Instant>,
}

impl Sampler {
    /// A sample when the last one is at least the minimum interval old (or
    /// there was none); `None` otherwise, or where the kernel gives none.
    pub fn sample_if_due(&mut self) -> Option<CpuSample> {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t).as_secs_f64() < MIN_INTERVAL_SECS)
        {
            return None;
        }
        self.last = Some(now);
        CpuSample::now()
    }
}

impl CpuSample {
    /// The machine's totals now; `None` where the kernel does not provide them.
    pub fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        Self::parse(&stat, hz as f64, usable)
    }

    /// Read `/proc/stat`'s text (`ticks_per_sec`: `sysconf(_SC_CLK_TCK)`).
    pub fn parse(stat: &str, ticks_per_sec: f64, usable: u32) -> Option<Self> {
        if ticks_per_sec.is_nan() || ticks_per_sec <= 0.0 {
            return None;
        }
        let mut lines = stat.lines();
        let first = lines.next()?;
        let mut fields = first.split_ascii_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let t: Vec<f64> = fields.map_while(|f| f.parse::<f64>().ok()).collect();
        // user nice system idle iowait irq softirq steal (guest time is in user).
        if t.len() < 8 {
            return None;
        }
        let busy = t[0] + t[1] + t[2] + t[5] + t[6] + t[7];
        let total = busy + t[3] + t[4];
        let cpus = lines
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count() as u32;
        if cpus == 0 {
            return None;
        }
        Some(CpuSample {
            busy: busy / ticks_per_sec,
            total: total / ticks_per_sec,
            cpus,
            usable: usable.clamp(1, cpus),
        })
    }
}

/// The share (0..=1) of the usable cores' time our writer left that the
/// rest kept busy between `before` and `after`, the writer having spent
/// `background` seconds. `None` when the interval is too short to tell.
pub fn contention(before: &CpuSample, after: &CpuSample, background: f64) -> Option<f64> {
    let cpus = f64::from(after.cpus.max(1));
    let wall = (after.total - before.total) / cpus;
    if wall.is_nan() || wall < MIN_INTERVAL_SECS {
        return None;
    }
    let background = background.max(0.0);
    let others = (after.busy - before.busy - background).max(0.0);
    // What the writer left of the usable cores, and how much of it the
    // rest kept busy: all of it means the writer displaced work.
    let left = wall * f64::from(after.usable.max(1)) - background;
    if left <= 0.0 {
        return Some(1.0);
    }
    Some((others / left).clamp(0.0, 1.0))
}

/// Runs `f` on a thread pinned to one CPU that two spinning threads share
/// with it (tests of what a thread waiting for a CPU is told).
#[cfg(test)]
pub(crate) fn on_a_crowded_core<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    // SAFETY: plain libc calls on zeroed, correctly sized cpu sets.
    let core = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .unwrap()
    };
    let pin = move || unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    };
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                pin();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        let r = s
            .spawn(|| {
                pin();
                f()
            })
            .join();
        stop.store(true, Ordering::Relaxed);
        r.unwrap()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  100 0 50 800 50 0 0 0 0 0\n\
                        cpu0 50 0 25 400 25 0 0 0 0 0\n\
                        cpu1 50 0 25 400 25 0 0 0 0 0\n\
                        intr 123\nctxt 456\n";

    #[test]
    fn a_thread_that_waits_for_a_cpu_is_told_how_long() {
        assert_eq!(parse_schedstat(b"374079 233089000 3\n"), Some(0.233089));
        assert_eq!(parse_schedstat(b"374079\n"), None);
        assert_eq!(parse_schedstat(b""), None);
        let mut q = RunQueue::default();
        let Some(before) = q.waited_secs() else {
            return; // a kernel without schedstats: nothing to measure
        };
        let waited = on_a_crowded_core(|| {
            let mut own = RunQueue::default();
            let w0 = own.waited_secs().unwrap();
            let t0 = std::time::Instant::now();
            while t0.elapsed().as_secs_f64() < 0.3 {
                std::hint::spin_loop();
            }
            own.waited_secs().unwrap() - w0
        });
        // Three threads on one CPU for 0.3 s: this one ran about a third of
        // it and waited the rest.
        assert!(waited > 0.1, "waited {waited} s");
        // The test's own thread kept its reading: it did not wait meanwhile.
        assert!(q.waited_secs().unwrap() - before < 0.1);
    }

    #[test]
    fn proc_stat_is_read_in_seconds() {
        let s = CpuSample::parse(STAT, 100.0, 8).unwrap();
        assert_eq!(s.busy, 1.5);
        assert_eq!(s.total, 10.0);
        assert_eq!(
            (s.cpus, s.usable),
            (2, 2),
            "usable never exceeds the CPUs counted"
        );
        assert_eq!(CpuSample::parse("intr 1\n", 100.0, 1), None);
        assert_eq!(CpuSample::parse(STAT, 0.0, 1), None);
        assert_eq!(CpuSample::parse("cpu 1 2 3\ncpu0 1 2 3\n", 100.0, 1), None);
    }

    #[test]
    fn the_sampler_reads_at_most_once_per_interval() {
        let mut s = Sampler::default();
        if s.sample_if_due().is_none() {
            return; // not Linux
        }
        assert_eq!(
            s.sample_if_due(),
            None,
            "a second read right away is skipped"
        );
        s.last = Some(std::time::Instant::now() - std::time::Duration::from_secs(1));
        assert!(
            s.sample_if_due().is_some(),
            "an interval later it reads again"
        );
    }

    #[test]
    fn this_machine_has_a_sample_that_advances() {
        let Some(a) = CpuSample::now() else {
            return; // not Linux
        };
        let spin = std::time::Instant::now();
        while spin.elapsed().as_millis() < 50 {}
        let b = CpuSample::now().unwrap();
        assert!(b.total >= a.total && b.busy >= a.busy && b.cpus >= 1);
    }

    fn sample(busy: f64, wall: f64, cpus: u32, usable: u32) -> CpuSample {
        CpuSample {
            busy,
            total: wall * f64::from(cpus),
            cpus,
            usable,
        }
    }

    #[test]
    fn idle_cores_make_background_cpu_cheap_and_busy_ones_dear() {
        let start = sample(0.0, 0.0, 16, 16);
        // 10 s: the training kept one core busy, our writer used 3 s.
        let gpu_job = sample(10.0 + 3.0, 10.0, 16, 16);
        let share = contention(&start, &gpu_job, 3.0).unwrap();
        assert!((share - 10.0 / 157.0).abs() < 1e-9, "{share}");
        // CPU training with a thread per core: every writer second displaced work.
        let cpu_job = sample(2.0 * 10.0, 10.0, 2, 2);
        assert_eq!(
            contention(&sample(0.0, 0.0, 2, 2), &cpu_job, 3.0),
            Some(1.0)
        );
        // A container allowed 2 cores of a busy 16-core host: charged in full.
        let boxed = sample(16.0 * 10.0, 10.0, 16, 2);
        assert_eq!(contention(&start, &boxed, 3.0), Some(1.0));
        // Too short to tell.
        assert_eq!(contention(&start, &sample(0.1, 0.1, 16, 16), 0.0), None);
    }
}
