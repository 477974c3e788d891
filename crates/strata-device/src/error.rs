use std::io;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{device}: I/O error at offset {offset}: {source}")]
    Io { device: String, offset: u64, source: io::Error },
    #[error("{device}: I/O of {len} bytes at offset {offset} is not 4 KiB aligned (offset, length and buffer address)")]
    Misaligned { device: String, offset: u64, len: usize },
    #[error("{device}: I/O at {offset}+{len} is beyond the end of the device ({size_bytes} bytes)")]
    OutOfRange { device: String, offset: u64, len: u64, size_bytes: u64 },
    #[error("{0}")]
    Open(String),
    /// The creation of a device file was abandoned on request
    /// ([`OpenOptions::abandon_creation`](crate::OpenOptions)); nothing of it is left.
    #[error("{0}: creation abandoned")]
    Abandoned(String),
}

impl DeviceError {
    /// The device has no room for the write: the file system under a sparse device file is
    /// full (ENOSPC) or its quota is used up (EDQUOT). Unlike a media error, nothing is wrong
    /// with the place written: the same write succeeds once the file system has room again.
    pub fn is_out_of_room(&self) -> bool {
        match self {
            DeviceError::Io { source, .. } => matches!(
                source.raw_os_error(),
                Some(libc::ENOSPC) | Some(libc::EDQUOT)
            ),
            _ => false,
        }
    }
}
