//! A one-shot completion slot: the caller of a queued I/O sleeps on it until the I/O thread
//! fills it in. A `Completer` that is dropped unfilled (the I/O thread stopped, the request was
//! never accepted) fills in an error, so no caller can sleep forever on a lost request.

use std::io;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

pub(crate) struct Slot {
    result: Mutex<Option<io::Result<()>>>,
    ready: Condvar,
}

impl Slot {
    pub(crate) fn new() -> Slot {
        Slot {
            result: Mutex::new(None),
            ready: Condvar::new(),
        }
    }

    /// Blocks until the result is in.
    pub(crate) fn wait(&self) -> io::Result<()> {
        let mut result = self.result.lock();
        loop {
            if let Some(result) = result.take() {
                return result;
            }
            self.ready.wait(&mut result);
        }
    }
}

/// The I/O thread's end of a [`Slot`].
pub(crate) struct Completer {
    slot: Option<Arc<Slot>>,
}

impl Completer {
    pub(crate) fn new(slot: Arc<Slot>) -> Completer {
        Completer { slot: Some(slot) }
    }

    pub(crate) fn complete(mut self, result: io::Result<()>) {
        self.fill(result);
    }

    fn fill(&mut self, result: io::Result<()>) {
        if let Some(slot) = self.slot.take() {
            *slot.result.lock() = Some(result);
            slot.ready.notify_one();
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        self.fill(Err(io::Error::other(
            "I/O request dropped before completion",
        )));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_across_threads() {
        let slot = Arc::new(Slot::new());
        let completer = Completer::new(Arc::clone(&slot));
        let worker = std::thread::spawn(move || completer.complete(Ok(())));
        assert!(slot.wait().is_ok());
        assert!(worker.join().is_ok());
    }

    #[test]
    fn dropped_completer_reports_an_error() {
        let slot = Arc::new(Slot::new());
        drop(Completer::new(Arc::clone(&slot)));
        assert!(slot.wait().is_err());
    }
}
