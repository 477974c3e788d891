//! Shared helpers for unit tests: a disk group on in-memory devices.
use std::sync::Arc;

use strata_device::{Device, MemDevice};
use strata_engine::{DiskGroup, EngineConfig};

pub fn test_group() -> Arc<DiskGroup> {
    let fast: Arc<dyn Device> = Arc::new(MemDevice::new("fast", 64 << 20));
    let capacity: Arc<dyn Device> = Arc::new(MemDevice::new("capacity-0", 512 << 20));
    DiskGroup::open(fast, vec![capacity], EngineConfig::default(), true)
        .expect("open a test disk group")
}
