//! The calling thread's CPU priority, for background work that should give way to the I/O
//! path when both want a CPU.
//!
//! Linux keeps a nice value per thread. Any thread may raise its own (lower its priority);
//! taking it back down needs CAP_SYS_NICE or an RLIMIT_NICE that allows it. So a thread that
//! must sometimes work at full priority (the destager when the log needs room) lowers its
//! priority only when it can take it back.

use std::io;

/// The nice value of background work: the lowest priority short of SCHED_IDLE, which a
/// thread cannot leave without privilege either.
pub const BACKGROUND_NICE: i32 = 19;

/// CAP_SYS_NICE's bit in the capability sets (linux/capability.h).
const CAP_SYS_NICE: u32 = 23;

/// Moves the thread that made it between its nice value at creation and [`BACKGROUND_NICE`].
#[derive(Debug)]
pub struct ThreadPriority {
    tid: libc::pid_t,
    base_nice: i32,
    nice: i32,
    can_return: bool,
}

impl ThreadPriority {
    /// The calling thread's priority as it is now. Only that thread should change it.
    pub fn of_current_thread() -> ThreadPriority {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let base_nice = thread_nice(tid).unwrap_or(0);
        ThreadPriority {
            tid,
            base_nice,
            nice: base_nice,
            can_return: may_lower_nice_to(base_nice),
        }
    }

    /// Whether the thread may go to the background and come back (see the module's note).
    pub fn can_return(&self) -> bool {
        self.can_return
    }

    /// The nice value now in effect, as last set or read.
    pub fn nice(&self) -> i32 {
        self.nice
    }

    /// Background (nice 19) or the thread's own priority. A thread that could not come back
    /// stays where it is. Returns the nice value in effect afterwards, read back from the
    /// kernel.
    pub fn set_background(&mut self, background: bool) -> io::Result<i32> {
        let want = if background && self.can_return {
            BACKGROUND_NICE.max(self.base_nice)
        } else {
            self.base_nice
        };
        if want != self.nice {
            set_thread_nice(self.tid, want)?;
            self.nice = thread_nice(self.tid)?;
        }
        Ok(self.nice)
    }
}

/// A thread's nice value.
pub fn thread_nice(tid: libc::pid_t) -> io::Result<i32> {
    // getpriority returns -1 both for nice -1 and for an error; errno tells them apart.
    // SAFETY: __errno_location points at the calling thread's errno; getpriority only reads
    // its arguments.
    unsafe {
        *libc::__errno_location() = 0;
        let v = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        if v == -1 && *libc::__errno_location() != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(v)
    }
}

fn set_thread_nice(tid: libc::pid_t, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority only reads its arguments.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this thread may set its nice value as low as `nice` again after raising it.
fn may_lower_nice_to(nice: i32) -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut lim) } == 0;
    // RLIMIT_NICE r allows nice values down to 20 - r.
    let by_limit = got
        && (lim.rlim_cur == libc::RLIM_INFINITY || 20 - (lim.rlim_cur as i64) <= i64::from(nice));
    by_limit || has_effective_capability(CAP_SYS_NICE)
}

fn has_effective_capability(bit: u32) -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/thread-self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1u64 << bit) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_goes_to_the_background_and_back_when_it_may() {
        std::thread::spawn(|| {
            let mut p = ThreadPriority::of_current_thread();
            let base = p.nice();
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() };
            let bg = p.set_background(true).unwrap();
            if p.can_return() {
                assert_eq!(bg, BACKGROUND_NICE.max(base));
                assert_eq!(thread_nice(tid).unwrap(), bg, "the kernel's value");
                assert_eq!(p.set_background(false).unwrap(), base);
                assert_eq!(thread_nice(tid).unwrap(), base);
            } else {
                // Without the right to come back, the thread never leaves.
                assert_eq!(bg, base);
                assert_eq!(thread_nice(tid).unwrap(), base);
            }
        })
        .join()
        .unwrap();
    }
}
