//! A device served over NBD with no tier in front of it: the "capacity device alone" side of
//! bench/tier-vs-capacity.sh. The device is a file opened with O_DIRECT by the device layer and,
//! with `--emulate SPEC`, slowed down by the same device model as `strata serve
//! --capacity-emulate SPEC`, behind the same NBD server code Strata uses. A write is answered
//! once it reached the device (not flushed); FLUSH flushes it.
//!
//! Usage: raw_nbd --device PATH --size SIZE_MIB --listen ADDR [--emulate SPEC]
//! Prints `raw_nbd: ready nbd://ADDR/raw` when it accepts connections; stops on SIGTERM/SIGINT.
use std::path::PathBuf;
use std::sync::Arc;

use strata_device::{AlignedBuf, Device, IoBackend, OpenOptions, Throttled};
use strata_nbd::{Backend, BlockStatus, Errno, Export, ExportInfo};

struct DeviceExport(Arc<dyn Device>);

const BLOCK: u64 = 4096;

fn aligned(offset: u64, len: usize) -> Result<(), Errno> {
    if !offset.is_multiple_of(BLOCK) || !(len as u64).is_multiple_of(BLOCK) {
        return Err(Errno::Inval);
    }
    Ok(())
}

impl Export for DeviceExport {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        aligned(offset, buf.len())?;
        let mut b = AlignedBuf::new_zeroed(buf.len());
        self.0.read_at(&mut b, offset).map_err(|_| Errno::Io)?;
        buf.copy_from_slice(&b);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        aligned(offset, data.len())?;
        let b = AlignedBuf::from_slice(data);
        let r = if fua {
            self.0.write_durable_at(&b, offset)
        } else {
            self.0.write_at(&b, offset)
        };
        r.map_err(|_| Errno::Io)
    }
    fn flush(&self) -> Result<(), Errno> {
        self.0.flush().map_err(|_| Errno::Io)
    }
    fn trim(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Err(Errno::NotSup)
    }
    fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }
    fn block_status(&self, _: u64, len: u64) -> Result<Vec<BlockStatus>, Errno> {
        Ok(vec![BlockStatus {
            len: len.min(u64::from(u32::MAX)) as u32,
            flags: 0,
        }])
    }
}

struct OneExport(Arc<DeviceExport>);

impl Backend for OneExport {
    fn list(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "raw".into(),
            description: self.0 .0.name().to_string(),
        }]
    }
    fn open(&self, name: &str) -> Option<Arc<dyn Export>> {
        (name == "raw").then(|| self.0.clone() as Arc<dyn Export>)
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn main() {
    if let Err(e) = run() {
        eprintln!("raw_nbd: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: raw_nbd --device PATH --size SIZE_MIB --listen ADDR [--emulate SPEC]";
    let path = PathBuf::from(flag(&args, "--device").ok_or(usage)?);
    let size_mib: u64 = flag(&args, "--size")
        .ok_or(usage)?
        .parse()
        .map_err(|_| usage)?;
    let listen = flag(&args, "--listen").ok_or(usage)?;
    let options = OpenOptions {
        create_size_bytes: Some(size_mib << 20),
        preallocate: false,
        backend: IoBackend::Auto,
        ..OpenOptions::default()
    };
    let mut device = strata_device::open_with(&path, &options).map_err(|e| e.to_string())?;
    if let Some(spec) = flag(&args, "--emulate") {
        let spec = strata_device::parse_emulation(&spec).map_err(|e| e.to_string())?;
        device = Arc::new(Throttled::new(device, spec.config).with_label(&spec.label));
    }
    eprintln!("raw_nbd: device {}", device.name());
    let backend: Arc<dyn Backend> = Arc::new(OneExport(Arc::new(DeviceExport(device))));
    let rt = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .map_err(|e| format!("listen {listen}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("raw_nbd: ready nbd://{addr}/raw");
        let stop = async {
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(mut t), Ok(mut i)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                tokio::select! { _ = t.recv() => {}, _ = i.recv() => {} }
            }
        };
        strata_nbd::serve(listener, backend, strata_nbd::ServerConfig::default(), stop)
            .await
            .map_err(|e| e.to_string())
    })
}
