use strata_device::DeviceError;

/// Everything the engine can refuse or fail with. Each variant maps onto one NBD/HTTP error.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A volume's name, or `VOLUME@SNAPSHOT` for a snapshot.
    #[error("{} {:?} not found", kind_of(.0), .0)]
    NotFound(String),
    #[error("{} {:?} already exists", kind_of(.0), .0)]
    AlreadyExists(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("range {offset}+{len} is beyond the end of the volume ({size_bytes} bytes)")]
    OutOfRange {
        offset: u64,
        len: u64,
        size_bytes: u64,
    },
    #[error("no space left: the capacity tier is full and the write log cannot take more")]
    NoSpace,
    #[error("checksum mismatch: {0}")]
    Corrupt(String),
    #[error("device error: {0}")]
    Device(#[from] DeviceError),
    #[error("{0} is read-only")]
    ReadOnly(String),
    #[error("{0}")]
    InUse(String),
    #[error("the disk group is shutting down")]
    ShuttingDown,
    /// A long task (a scrub, an open) stopped because its caller asked it to.
    #[error("{0} was cancelled")]
    Cancelled(&'static str),
    #[error("the disk group is offline: {0}")]
    Failed(String),
    #[error("{0}")]
    Format(String),
}

/// What a name in an error is: volume names never hold `@`, snapshots are `VOLUME@SNAPSHOT`.
fn kind_of(name: &str) -> &'static str {
    if name.contains('@') {
        "snapshot"
    } else {
        "volume"
    }
}
