//! Opening the devices of a disk group: files are created on first start (the fast tier
//! preallocated, the capacity tier sparse), block devices are used as they are.
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use strata_device::{Device, DeviceError, IoBackend, OpenOptions};

use crate::config::{IoBackendChoice, ServeConfig};

pub struct OpenedDevices {
    pub fast: Arc<dyn Device>,
    pub capacity: Vec<Arc<dyn Device>>,
    /// "io_uring" or "threads", as the device layer reports it.
    pub io_backend: String,
}

pub fn open_devices(cfg: &ServeConfig) -> Result<OpenedDevices> {
    let fast = open_one(&cfg.fast_device, cfg.fast_size_bytes, true, cfg.io_backend)?;
    let capacity = cfg
        .capacity_devices
        .iter()
        .map(|path| open_one(path, cfg.capacity_size_bytes, false, cfg.io_backend))
        .collect::<Result<Vec<_>>>()?;
    let io_backend = fast.io_backend_name().to_string();
    Ok(OpenedDevices {
        fast,
        capacity,
        io_backend,
    })
}

fn open_one(
    path: &Path,
    create_size_bytes: u64,
    preallocate: bool,
    backend: IoBackendChoice,
) -> Result<Arc<dyn Device>> {
    let fresh = !path.exists();
    if fresh {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                anyhow!(
                    "cannot create directory {}: {}",
                    parent.display(),
                    crate::io_reason(&e)
                )
            })?;
        }
        tracing::info!(path = %path.display(), size_bytes = create_size_bytes, preallocate, "creating device file");
    }
    let device = open_with(path, create_size_bytes, preallocate, backend)?;
    tracing::info!(path = %path.display(), size_bytes = device.size_bytes(), backend = device.io_backend_name(), "opened device");
    Ok(device)
}

/// The one place that knows the device layer's opening API.
fn open_with(
    path: &Path,
    create_size_bytes: u64,
    preallocate: bool,
    backend: IoBackendChoice,
) -> Result<Arc<dyn Device>> {
    let backend = match backend {
        IoBackendChoice::Auto => IoBackend::Auto,
        IoBackendChoice::IoUring => IoBackend::IoUring,
        IoBackendChoice::Threads => IoBackend::ThreadPool,
    };
    let options = OpenOptions {
        create_size_bytes: Some(create_size_bytes),
        preallocate,
        backend,
    };
    strata_device::open_with(path, &options).map_err(|e| match e {
        // Already names the path.
        DeviceError::Open(msg) => anyhow!("cannot open device {}", crate::one_line(&msg)),
        e => anyhow!(
            "cannot open device {}: {}",
            path.display(),
            crate::one_line(&e.to_string())
        ),
    })
}
