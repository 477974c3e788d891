//! Watching and stopping an open from another thread (`DiskGroup::open_with`): how far it is,
//! for a daemon that answers while it starts, and a flag that stops it at its next safe point.
//!
//! An open may be stopped only while what is on the devices is a state the next open recovers
//! from as it would have from this one: until the log's replay has ended, recovery writes
//! nothing but a finished format or a checkpoint repair (docs/FORMAT.md §5.1). Past that point
//! it writes (the log's end cleared, a new epoch, the index, stamps) and is let finish.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::error::EngineError;

/// How an open is watched and stopped. `Default`: never stopped, watched by nobody.
#[derive(Clone, Default)]
pub struct OpenControl {
    /// Set (from any thread) to stop the open at its next safe point; it then fails with
    /// `EngineError::Cancelled`, having left the devices as a later open recovers them.
    pub abandon: Arc<AtomicBool>,
    /// Where the open is.
    pub progress: Arc<OpenProgress>,
    /// Called after each batch replayed, and on reaching the probe past the log's end, with
    /// the step and how many batches were replayed (tests stop opens with it).
    #[cfg(test)]
    pub(crate) hook: Option<Arc<dyn Fn(OpenStep, usize) + Send + Sync>>,
    /// The group opens with its destager held (`Shared::destager_held`): tests see the state
    /// open leaves before any destager step.
    #[cfg(test)]
    pub(crate) hold_destager: bool,
}

/// What the open is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenStep {
    /// Identifying the devices (or formatting them), reading the checkpoint, the segment
    /// table, the index's inner pages and the recent segments' summaries.
    Reading = 0,
    /// Replaying the write log (`OpenProgress::log_replayed_bytes`).
    Replaying = 1,
    /// Reading past the replayed log's end, for a later batch that would prove it damaged.
    CheckingEnd = 2,
    /// Writing: the log's end cleared, the new epoch's index and checkpoint, the stamps. No
    /// longer stopped by `OpenControl::abandon`.
    Writing = 3,
}

/// Where an open is; cheap to read at any time from any thread.
#[derive(Debug, Default)]
pub struct OpenProgress {
    step: AtomicU8,
    log_replayed_bytes: AtomicU64,
    log_area_bytes: AtomicU64,
}

impl OpenProgress {
    pub fn step(&self) -> OpenStep {
        match self.step.load(Ordering::Relaxed) {
            0 => OpenStep::Reading,
            1 => OpenStep::Replaying,
            2 => OpenStep::CheckingEnd,
            _ => OpenStep::Writing,
        }
    }

    /// The span of the log replayed so far, from the checkpoint's tail: what replay has read
    /// of it (a batch wrapped to the log's start counts the blocks it skipped at the end).
    pub fn log_replayed_bytes(&self) -> u64 {
        self.log_replayed_bytes.load(Ordering::Relaxed)
    }

    /// The log area's size, the most replay can read (0 until the layout is known). Nothing
    /// on the devices says how much of it the log fills before replay has read it.
    pub fn log_area_bytes(&self) -> u64 {
        self.log_area_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn enter(&self, step: OpenStep) {
        self.step.store(step as u8, Ordering::Relaxed);
    }

    pub(crate) fn set_log_area_bytes(&self, bytes: u64) {
        self.log_area_bytes.store(bytes, Ordering::Relaxed);
    }

    pub(crate) fn set_log_replayed_bytes(&self, bytes: u64) {
        self.log_replayed_bytes.store(bytes, Ordering::Relaxed);
    }
}

impl OpenControl {
    /// Ok unless the open was asked to stop. Call only where the devices hold a state the next
    /// open recovers from (module comment).
    pub(crate) fn check(&self) -> Result<(), EngineError> {
        match self.abandon.load(Ordering::Relaxed) {
            true => Err(EngineError::Cancelled("opening the disk group")),
            false => Ok(()),
        }
    }

    /// The replay is at `step`, `batches` replayed (for `OpenControl::hook`).
    #[cfg(test)]
    pub(crate) fn reached(&self, step: OpenStep, batches: usize) {
        if let Some(hook) = &self.hook {
            hook(step, batches);
        }
    }

    #[cfg(not(test))]
    pub(crate) fn reached(&self, _step: OpenStep, _batches: usize) {}
}
