//! Child processes for the tests: run with a timeout, killed with their helpers, never left
//! behind.
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

pub const SIGHUP: i32 = 1;
pub const SIGINT: i32 = 2;
pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

mod sys {
    use std::os::raw::{c_int, c_ulong};
    extern "C" {
        pub fn kill(pid: c_int, sig: c_int) -> c_int;
        pub fn prctl(option: c_int, arg2: c_ulong, ...) -> c_int;
        pub fn geteuid() -> u32;
    }
    pub const SIGKILL: c_int = 9;
    pub const SIGTERM: c_int = 15;
    pub const PR_SET_PDEATHSIG: c_int = 1;
}

/// Makes the kernel SIGKILL the child if the spawning thread dies before it, so even a test
/// process killed by the harness leaves nothing running. Spawn from the thread that owns
/// the child for its whole life.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            sys::prctl(sys::PR_SET_PDEATHSIG, sys::SIGKILL as std::os::raw::c_ulong);
            Ok(())
        })
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { sys::geteuid() == 0 }
}

/// SIGKILL to every process in the group led by `pid` (spawned with process_group(0)).
pub fn kill_group(pid: u32) {
    // SAFETY: plain syscall; a negative pid addresses the process group.
    unsafe { sys::kill(-(pid as i32), sys::SIGKILL) };
}

pub fn send_signal(pid: u32, sig: i32) {
    // SAFETY: plain syscall on a pid we own.
    let rc = unsafe { sys::kill(pid as i32, sig) };
    assert_eq!(
        rc,
        0,
        "kill({pid}, {sig}) failed: {}",
        std::io::Error::last_os_error()
    );
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

pub fn output_report(cmd: &str, out: &Output) -> String {
    format!(
        "command: {cmd}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn drain<R: Read + Send + 'static>(reader: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = reader {
            let _ = r.read_to_end(&mut buf);
        }
        buf
    })
}

/// Runs `cmd` to completion with stdin closed, killing it and panicking (with its output)
/// if it takes longer than `timeout`.
pub fn run_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    run_with_stdin(cmd, None, timeout)
}

pub fn run_with_stdin(cmd: &mut Command, stdin: Option<Vec<u8>>, timeout: Duration) -> Output {
    let line = describe(cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    // Own process group, so a timeout kills helpers it forked too (fio runs jobs as processes).
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = die_with_parent(cmd)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn `{line}`: {e}"));
    if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
        thread::spawn(move || {
            let _ = pipe.write_all(&data);
        });
    }
    let out_reader = drain(child.stdout.take());
    let err_reader = drain(child.stderr.take());
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            kill_group(child.id());
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(5));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(status) => Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "timed out after {timeout:?}: {line}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Runs `cmd` and asserts it exits 0, printing its output otherwise.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> Output {
    let line = describe(cmd);
    let out = run_timeout(cmd, timeout);
    assert!(
        out.status.success(),
        "command failed\n{}",
        output_report(&line, &out)
    );
    out
}

/// Runs `cmd` and asserts it exits non-zero.
pub fn run_fails(cmd: &mut Command, timeout: Duration) -> Output {
    let line = describe(cmd);
    let out = run_timeout(cmd, timeout);
    assert!(
        !out.status.success(),
        "command unexpectedly succeeded\n{}",
        output_report(&line, &out)
    );
    out
}

pub fn cmd(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// A background child process killed (SIGKILL) and reaped on drop.
pub struct ChildGuard {
    pub child: Option<Child>,
    pub what: String,
}

impl ChildGuard {
    pub fn spawn(cmd: &mut Command) -> ChildGuard {
        let what = describe(cmd);
        let child = die_with_parent(cmd.process_group(0))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn `{what}`: {e}"));
        ChildGuard {
            child: Some(child),
            what,
        }
    }

    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("child already reaped")
    }

    /// Waits up to `timeout` for the child to exit on its own.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child().try_wait().expect("try_wait") {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }
}

/// Polls `cond` every 20 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}
