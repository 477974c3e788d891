//! The argument checks every device runs before touching data, so a caller bug surfaces as the
//! same typed error on `MemDevice` in a unit test as on an O_DIRECT file in production.

use crate::{DeviceError, BLOCK_SIZE};

const ALIGN: u64 = BLOCK_SIZE as u64;

/// True when `value` is a multiple of [`BLOCK_SIZE`] (a power of two, hence the mask).
pub(crate) fn is_block_aligned(value: u64) -> bool {
    value & (ALIGN - 1) == 0
}

/// Checks a read or write: offset, length and buffer address 4 KiB aligned, range on the device.
pub(crate) fn check_io(
    name: &str,
    size_bytes: u64,
    buf_addr: usize,
    len: usize,
    offset: u64,
) -> Result<(), DeviceError> {
    let aligned = [buf_addr as u64, len as u64, offset]
        .into_iter()
        .all(is_block_aligned);
    if !aligned {
        return Err(DeviceError::Misaligned {
            device: name.to_string(),
            offset,
            len,
        });
    }
    check_in_range(name, size_bytes, offset, len as u64)
}

/// Checks a discard: offset and length 4 KiB aligned, range on the device.
pub(crate) fn check_range(
    name: &str,
    size_bytes: u64,
    offset: u64,
    len: u64,
) -> Result<(), DeviceError> {
    if !is_block_aligned(len) || !is_block_aligned(offset) {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        return Err(DeviceError::Misaligned {
            device: name.to_string(),
            offset,
            len,
        });
    }
    check_in_range(name, size_bytes, offset, len)
}

fn check_in_range(name: &str, size_bytes: u64, offset: u64, len: u64) -> Result<(), DeviceError> {
    match offset.checked_add(len) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(DeviceError::OutOfRange {
            device: name.to_string(),
            offset,
            len,
            size_bytes,
        }),
    }
}

/// Wraps an OS error with the device name and offset.
pub(crate) fn io_error(name: &str, offset: u64, source: std::io::Error) -> DeviceError {
    DeviceError::Io {
        device: name.to_string(),
        offset,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_range() {
        let size = 1 << 20;
        assert!(check_io("d", size, 4096, 4096, 0).is_ok());
        assert!(check_io("d", size, 8192, 0, size).is_ok());
        let misaligned = [(4097, 4096, 0), (4096, 4095, 0), (4096, 4096, 512)];
        for (addr, len, offset) in misaligned {
            let result = check_io("d", size, addr, len, offset);
            assert!(
                matches!(result, Err(DeviceError::Misaligned { .. })),
                "{addr} {len} {offset}"
            );
        }
        let beyond = check_io("d", size, 4096, 8192, size - 4096);
        assert!(matches!(beyond, Err(DeviceError::OutOfRange { .. })));
        let overflow = check_range("d", size, u64::MAX - 4095, 8192);
        assert!(matches!(overflow, Err(DeviceError::OutOfRange { .. })));
        assert!(matches!(
            check_range("d", size, 0, 100),
            Err(DeviceError::Misaligned { .. })
        ));
    }
}
