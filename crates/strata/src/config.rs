//! Configuration of `strata serve`: embedded defaults, overridden by a TOML file, overridden by
//! flags. Sizes take binary units (512K, 64M, 1G, 1GiB, 16T); fill marks take a ratio (0.3) or a
//! percentage ("30%").
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use strata_engine::EngineConfig;

use crate::ServeArgs;

pub const DEFAULT_DATA_DIR: &str = "./strata-data";
pub const DEFAULT_FAST_SIZE_BYTES: u64 = 1 << 30;
pub const DEFAULT_CAPACITY_SIZE_BYTES: u64 = 16 << 30;
pub const DEFAULT_NBD_LISTEN: &str = "127.0.0.1:10809";
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:9090";
pub const DEFAULT_VOLUME_NAME: &str = "vol0";
pub const DEFAULT_VOLUME_SIZE_BYTES: u64 = 8 << 30;
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Bounds a flag or file cannot exceed, so a typo cannot ask for absurd resources.
const MAX_CONNECTIONS_LIMIT: usize = 4096;
const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;
const ALIGN_BYTES: u64 = 4096;
/// The least index cache the engine runs with: it keeps at least 16 index nodes in memory
/// (docs/FORMAT.md §3.6.3) and raises a smaller budget to that without a word; so a smaller
/// one is refused here, saying so.
pub use strata_engine::MIN_INDEX_CACHE_BYTES;

/// Which device I/O implementation to ask the device layer for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackendChoice {
    Auto,
    IoUring,
    Threads,
}

/// Why `--nbd-stall-timeout off` is refused: without it nothing bounds a client that stops.
const STALL_TIMEOUT_OFF: &str = "nbd-stall-timeout cannot be off: it is what drops an NBD client that stops in the middle of a request or stops reading replies, which would otherwise hold its buffers and the daemon's shutdown for as long as it likes; give a duration such as 2m";
/// The same for the config file's key.
const STALL_TIMEOUT_OFF_IN_FILE: &str = "nbd_stall_timeout in the config file cannot be off: it is what drops an NBD client that stops in the middle of a request or stops reading replies, which would otherwise hold its buffers and the daemon's shutdown for as long as it likes; give a duration such as \"2m\"";

/// Everything `strata serve` needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub data_dir: PathBuf,
    pub fast_device: PathBuf,
    pub fast_size_bytes: u64,
    pub capacity_devices: Vec<PathBuf>,
    pub capacity_size_bytes: u64,
    /// Whether the sizes were asked for (flag or file) rather than defaults: an existing file
    /// of another size is then worth a warning, as it is never resized.
    pub fast_size_given: bool,
    pub capacity_size_given: bool,
    /// Likewise for the segment size, which only a group's first start applies.
    pub segment_size_given: bool,
    pub nbd_listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub engine: EngineConfig,
    pub max_connections: usize,
    /// An NBD connection with nothing in flight that sends nothing for this long is closed
    /// (None: never, the default).
    pub nbd_idle_timeout: Option<Duration>,
    /// An NBD client stuck in the middle of a message for this long is dropped. Never off.
    pub nbd_stall_timeout: Duration,
    pub default_volume_size_bytes: u64,
    pub io_backend: IoBackendChoice,
    /// How the log's writes are made durable (see `strata_device::DurableWrite`).
    pub durable_write: strata_device::DurableWrite,
    /// Bearer token every mutating admin request must carry; required off loopback.
    pub http_token: Option<Token>,
    /// Catalog entries naming the devices, for endurance accounting.
    pub fast_device_model: Option<String>,
    pub capacity_device_model: Option<String>,
    /// History a device needs before its wear-out date is projected and warned about (None:
    /// never, `off`; zero: at once).
    pub wear_projection_after: Option<std::time::Duration>,
    /// Extra device catalog files (TOML) beside the built-in catalog.
    pub catalog_files: Vec<PathBuf>,
    /// Benchmarking aids: device models the fast / capacity devices are slowed down to.
    pub emulation: Emulation,
    /// The read cache's share of the write log, or auto (decided once the devices are open).
    pub read_cache: crate::read_cache::ReadCacheSetting,
}

impl ServeConfig {
    /// The NBD server's limits: ours where we have a setting, the server's defaults for the rest.
    pub fn nbd_server(&self) -> strata_nbd::ServerConfig {
        strata_nbd::ServerConfig {
            max_connections: self.max_connections,
            idle_timeout: self.nbd_idle_timeout.unwrap_or(Duration::ZERO),
            stall_timeout: self.nbd_stall_timeout,
            ..Default::default()
        }
    }
}

/// `--fast-emulate` / `--capacity-emulate` (TOML `fast_emulate` / `capacity_emulate`), parsed.
#[derive(Debug, Clone, Default)]
pub struct Emulation {
    pub fast: Option<strata_device::EmulationSpec>,
    pub capacity: Option<strata_device::EmulationSpec>,
}

fn resolve_emulation(args: &ServeArgs, file: &FileConfig) -> Result<Emulation> {
    let parse = |flag: &Option<String>, key: &Option<String>, name: &str| {
        flag.as_ref()
            .or(key.as_ref())
            .map(|spec| strata_device::parse_emulation(spec).map_err(|e| anyhow!("{name}: {e}")))
            .transpose()
    };
    Ok(Emulation {
        fast: parse(&args.fast_emulate, &file.fast_emulate, "fast-emulate")?,
        capacity: parse(&args.capacity_emulate, &file.capacity_emulate, "capacity-emulate")?,
    })
}

/// The admin API token. Its Debug form never shows the secret, so it cannot reach a log.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn new(secret: &str) -> Result<Token> {
        let secret = secret.trim();
        if secret.len() < MIN_TOKEN_LEN {
            bail!("the HTTP API token must be at least {MIN_TOKEN_LEN} characters");
        }
        if !secret.chars().all(|c| c.is_ascii_graphic()) {
            bail!("the HTTP API token must be printable ASCII without spaces");
        }
        Ok(Token(secret.to_string()))
    }

    /// Compares in time independent of where the first difference is.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        let mut diff = a.len() ^ b.len();
        for i in 0..a.len().max(b.len()) {
            let x = a.get(i).copied().unwrap_or(0);
            let y = b.get(i).copied().unwrap_or(0);
            diff |= usize::from(x ^ y);
        }
        diff == 0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Shortest admin token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// The TOML file: the same settings as the flags, in snake_case.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub fast_device: Option<PathBuf>,
    pub fast_size: Option<SizeValue>,
    #[serde(alias = "capacity_device")]
    pub capacity_devices: Option<Vec<PathBuf>>,
    pub capacity_size: Option<SizeValue>,
    pub nbd_listen: Option<String>,
    pub http_listen: Option<String>,
    pub segment_size: Option<SizeValue>,
    pub fill_low: Option<RatioValue>,
    pub fill_high: Option<RatioValue>,
    pub max_batch_size: Option<SizeValue>,
    pub max_connections: Option<usize>,
    pub nbd_idle_timeout: Option<String>,
    pub nbd_stall_timeout: Option<String>,
    pub default_volume_size: Option<SizeValue>,
    pub index_cache: Option<SizeValue>,
    pub scrub_interval: Option<String>,
    pub scrub_rate: Option<SizeValue>,
    pub idle_destage_after: Option<String>,
    pub io_backend: Option<String>,
    pub durable_write: Option<String>,
    pub log_runs: Option<bool>,
    /// Bearer token for mutating admin requests; required when http_listen is not loopback.
    pub http_token: Option<String>,
    /// A file holding the token (first line), instead of `http_token`.
    pub http_token_file: Option<PathBuf>,
    pub fast_device_model: Option<String>,
    pub capacity_device_model: Option<String>,
    pub wear_projection_after: Option<String>,
    #[serde(alias = "catalog")]
    pub catalog_files: Option<Vec<PathBuf>>,
    /// Benchmarking aids (see docs/BENCH.md).
    pub fast_emulate: Option<String>,
    pub capacity_emulate: Option<String>,
    /// `"auto"`, a ratio (0.7) or a percentage ("70%").
    pub read_cache: Option<crate::read_cache::ReadCacheValue>,
}

/// A size in a file: a byte count (4096) or a string with a unit ("64M"), checked as the
/// file is read, so a bad one is reported with the file's name and line.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "RawSize")]
pub struct SizeValue(u64);

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a size: a byte count (4096) or a string with a unit (\"64M\", \"1.5G\")"
)]
enum RawSize {
    Bytes(u64),
    Text(String),
}

impl TryFrom<RawSize> for SizeValue {
    type Error = String;
    fn try_from(raw: RawSize) -> std::result::Result<SizeValue, String> {
        match raw {
            RawSize::Bytes(n) => Ok(SizeValue(n)),
            RawSize::Text(s) => parse_size(&s).map(SizeValue),
        }
    }
}

/// A fill mark in a file: 0.3, 0, 1 or "30%", checked as the file is read.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "RawRatio")]
pub struct RatioValue(f64);

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a ratio from 0 to 1 (0.3) or a percentage (\"30%\")"
)]
enum RawRatio {
    Int(i64),
    Float(f64),
    Text(String),
}

impl TryFrom<RawRatio> for RatioValue {
    type Error = String;
    fn try_from(raw: RawRatio) -> std::result::Result<RatioValue, String> {
        match raw {
            RawRatio::Int(n) => check_ratio(n as f64, &n.to_string()),
            RawRatio::Float(x) => check_ratio(x, &x.to_string()),
            RawRatio::Text(s) => parse_ratio(&s),
        }
        .map(RatioValue)
    }
}

/// Parses "4096", "512K", "64M", "1G", "1.5G", "1GiB", "16T" (the grammar is
/// `strata_units`'). A fraction is taken only when it makes a whole number of bytes: the
/// daemon's sizes are exact.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    strata_units::parse_size(text).map_err(|e| e.to_string())
}

/// "8 GiB", "1.5 GiB", "512 B".
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let scale = 1u64 << (10 * unit);
    if bytes.is_multiple_of(scale) {
        return format!("{} {}", bytes / scale, UNITS[unit]);
    }
    let tenths = (bytes as f64 / scale as f64 * 10.0).round();
    // Rounding may reach the next unit: a byte short of 1 MiB is "1.0 MiB", not "1024.0 KiB".
    if tenths >= 10_240.0 && unit + 1 < UNITS.len() {
        return format!("1.0 {}", UNITS[unit + 1]);
    }
    format!("{:.1} {}", tenths / 10.0, UNITS[unit])
}

/// Clap value parser for sizes.
pub fn parse_size_arg(text: &str) -> std::result::Result<u64, String> {
    parse_size(text)
}

/// Clap value parser for an on/off setting given a value (`--log-runs false`): true or false,
/// or on or off as the durations' `off` reads.
pub fn parse_switch_arg() -> impl clap::builder::TypedValueParser<Value = bool> {
    use clap::builder::{PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(["true", "false", "on", "off"]).map(|v| v == "true" || v == "on")
}

/// Longest duration taken, ten years: a longer one is a typo (or a way of saying `off`), and
/// added to the clock by whatever waits for it, it would overflow (the scrub thread panicked).
const MAX_DURATION_SECS: u64 = 3650 * 86_400;

/// Parses a duration: a number with a unit (`90s`, `15m`, `24h`, `7d`), or `0`/`off` for none.
pub fn parse_duration(text: &str) -> std::result::Result<Option<std::time::Duration>, String> {
    let t = text.trim();
    if t == "0" || t.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (like 90s, 15m, 24h, 7d, or off)"))?;
    let secs = match unit {
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        "d" => n.saturating_mul(86_400),
        _ => {
            return Err(format!(
                "{text:?} is not a duration (like 90s, 15m, 24h, 7d, or off)"
            ))
        }
    };
    if n == 0 {
        return Ok(None);
    }
    if secs > MAX_DURATION_SECS {
        return Err(format!(
            "duration {text:?} is too long: at most 3650d (ten years)"
        ));
    }
    Ok(Some(std::time::Duration::from_secs(secs)))
}

/// Clap value parser for durations (`off` as None).
pub fn parse_duration_arg(text: &str) -> std::result::Result<DurationValue, String> {
    parse_duration(text).map(DurationValue)
}

/// Parses `--wear-projection-after`: a duration, `0` for at once, or `off` for never. Here,
/// unlike the other durations, 0 and `off` differ: an administrator reads `off` as "never
/// project", and it was taken as 0, so a device was warned about after a second of writes.
pub fn parse_projection_wait(text: &str) -> std::result::Result<Option<Duration>, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    Ok(Some(parse_duration(text)?.unwrap_or(Duration::ZERO)))
}

/// Clap value parser for `--wear-projection-after` (`off` as None, `0` as zero).
pub fn parse_projection_wait_arg(text: &str) -> std::result::Result<DurationValue, String> {
    parse_projection_wait(text).map(DurationValue)
}

/// A parsed duration flag (None: off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationValue(pub Option<std::time::Duration>);

/// Default gap between background scrubs.
pub const DEFAULT_SCRUB_INTERVAL: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);
/// Default read rate of the background scrub.
pub const DEFAULT_SCRUB_RATE: u64 = 64 << 20;

/// Parses a ratio in 0..=1 ("0.3") or a percentage ("30%").
pub fn parse_ratio(text: &str) -> std::result::Result<f64, String> {
    let s = text.trim();
    let (number, scale) = match s.strip_suffix('%') {
        Some(p) => (p.trim(), 100.0),
        None => (s, 1.0),
    };
    let value: f64 = number.parse().map_err(|_| {
        format!("invalid fill mark {text:?}: expected a ratio like 0.3 or a percentage like 30%")
    })?;
    check_ratio(value / scale, text)
}

fn check_ratio(value: f64, text: &str) -> std::result::Result<f64, String> {
    if !(0.0..=1.0).contains(&value) {
        return Err(format!(
            "fill mark {text} is out of range: use a ratio in 0..1 or a percentage like 30%"
        ));
    }
    Ok(value)
}

/// Clap value parser for fill marks.
pub fn parse_ratio_arg(text: &str) -> std::result::Result<f64, String> {
    parse_ratio(text)
}

/// Parses "HOST:PORT" (an IP, or a name that resolves; port 0 lets the OS pick).
pub fn parse_listen(text: &str, what: &str) -> Result<SocketAddr> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let mut addrs = text.to_socket_addrs().map_err(|_| {
        // The example is the address this listener has by default.
        let example = match what {
            "NBD" => "127.0.0.1:10809",
            _ => "127.0.0.1:9090",
        };
        anyhow!("invalid {what} listen address {text:?}: expected HOST:PORT such as {example}")
    })?;
    addrs
        .next()
        .ok_or_else(|| anyhow!("{what} listen address {text:?} resolves to nothing"))
}

fn parse_io_backend(text: &str) -> Result<IoBackendChoice> {
    match text {
        "auto" => Ok(IoBackendChoice::Auto),
        "io_uring" | "io-uring" | "uring" => Ok(IoBackendChoice::IoUring),
        "threads" => Ok(IoBackendChoice::Threads),
        _ => bail!("unknown I/O backend {text:?} (use auto, io_uring or threads)"),
    }
}

fn parse_durable_write(text: &str) -> Result<strata_device::DurableWrite> {
    use strata_device::DurableWrite;
    [DurableWrite::WriteThenSync, DurableWrite::Dsync]
        .into_iter()
        .find(|m| m.name() == text)
        .ok_or_else(|| {
            anyhow!("unknown durable write mode {text:?} (use write-then-sync or dsync)")
        })
}

/// A file the settings name that cannot be read (the config file, the token file): the start
/// fails, exit 1, as when a device cannot be opened; it is not a refused setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(String);

/// Reads a TOML config file; errors fit on one line and name the file and line.
pub fn load_file(path: &Path) -> Result<FileConfig> {
    let unreadable = |e: std::io::Error| {
        let reason = crate::io_reason(&e);
        Unreadable(format!("cannot read config {}: {reason}", path.display()))
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if meta.len() > MAX_CONFIG_FILE_BYTES {
        bail!(
            "config {} is larger than {} bytes",
            path.display(),
            MAX_CONFIG_FILE_BYTES
        );
    }
    let text = std::fs::read_to_string(path).map_err(unreadable)?;
    parse_file(&text).with_context(|| format!("config {}", path.display()))
}

/// Keys of the config file that name one setting: the second spelling is an alias.
const SAME_SETTING: [(&str, &str); 2] = [
    ("capacity_devices", "capacity_device"),
    ("catalog_files", "catalog"),
];

pub fn parse_file(text: &str) -> Result<FileConfig> {
    toml::from_str::<FileConfig>(text).map_err(|e| {
        if let Some(both) = spelled_twice(text, e.message()) {
            return anyhow!("{both}");
        }
        let line = e.span().map(|s| {
            text.as_bytes()[..s.start.min(text.len())]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1
        });
        // serde names the field's Rust type ("expected usize"): said in words.
        let msg = crate::one_line(e.message());
        let msg = ["usize", "u64", "u32", "u16", "u8"]
            .iter()
            .fold(msg, |m, t| {
                m.replace(
                    &format!("expected {t}"),
                    "expected a whole number, 0 or more",
                )
            });
        match line {
            Some(n) => anyhow!("line {n}: {msg}"),
            None => anyhow!("{msg}"),
        }
    })
}

/// For toml's "duplicate field" error when a setting is given under both its spellings
/// (`capacity_device` and `capacity_devices`): which lines give it. toml reports the table's
/// first line and the canonical name, which is neither line a reader needs.
fn spelled_twice(text: &str, message: &str) -> Option<String> {
    let field = message
        .strip_prefix("duplicate field `")?
        .split('`')
        .next()?;
    let (name, alias) = SAME_SETTING.iter().find(|(n, _)| *n == field)?;
    let line_of = |key: &str| {
        text.lines().position(|l| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        })
    };
    let (a, b) = (line_of(name)?, line_of(alias)?);
    let ((first, k1), (second, k2)) = match a < b {
        true => ((a, name), (b, alias)),
        false => ((b, alias), (a, name)),
    };
    Some(format!(
        "line {}: `{k2}` sets what `{k1}` on line {} already sets: give one of them",
        second + 1,
        first + 1
    ))
}

/// Merges flags over the file over the defaults, then validates the result. A refused value,
/// of a flag or of the file, is a usage error (exit 2, [`crate::UsageError`]); a file that
/// cannot be read is not ([`Unreadable`], exit 1).
pub fn resolve(args: &ServeArgs) -> Result<ServeConfig> {
    let file = match &args.config {
        Some(path) => {
            let dir = path.parent().unwrap_or(Path::new(""));
            load_file(path)
                .map_err(as_usage_error)?
                .with_paths_from(dir)
        }
        None => FileConfig::default(),
    };
    merge(args, file).map_err(as_usage_error)
}

/// Every refusal of the settings as a usage error, but for a file that cannot be read.
fn as_usage_error(e: anyhow::Error) -> anyhow::Error {
    if e.is::<Unreadable>() {
        return e;
    }
    crate::UsageError(format!("{e:#}")).into()
}

impl FileConfig {
    /// A relative path in a config file names a place beside the file, not in whatever
    /// directory the daemon was started from (a service manager's is `/`). Flags keep theirs.
    pub fn with_paths_from(mut self, dir: &Path) -> FileConfig {
        let rebase = |p: &mut PathBuf| {
            // An empty path stays empty, so that validation refuses it.
            if p.is_relative() && !p.as_os_str().is_empty() {
                *p = dir.join(&*p);
            }
        };
        let singles = [
            &mut self.data_dir,
            &mut self.fast_device,
            &mut self.http_token_file,
        ];
        singles.into_iter().flatten().for_each(rebase);
        let lists = [&mut self.capacity_devices, &mut self.catalog_files];
        lists.into_iter().flatten().flatten().for_each(rebase);
        self
    }
}

/// The file in the data directory that keeps the last scrub's report across restarts.
pub const SCRUB_RECORD: &str = "scrub-last.json";

pub fn merge(args: &ServeArgs, file: FileConfig) -> Result<ServeConfig> {
    check_file_values(&file)?;
    let http_token = resolve_token(args, &file)?;
    let emulation = resolve_emulation(args, &file)?;
    let data_dir = pick(
        args.data_dir.clone(),
        file.data_dir,
        PathBuf::from(DEFAULT_DATA_DIR),
    );
    let fast_device = pick(
        args.fast_device.clone(),
        file.fast_device,
        data_dir.join("fast.img"),
    );
    let capacity_devices = if !args.capacity_devices.is_empty() {
        args.capacity_devices.clone()
    } else {
        file.capacity_devices
            .unwrap_or_else(|| vec![data_dir.join("capacity-0.img")])
    };
    let fast_size_bytes = size(args.fast_size, &file.fast_size, DEFAULT_FAST_SIZE_BYTES);
    let capacity_size_bytes = size(
        args.capacity_size,
        &file.capacity_size,
        DEFAULT_CAPACITY_SIZE_BYTES,
    );
    let nbd_text = pick(
        args.nbd_listen.clone(),
        file.nbd_listen,
        DEFAULT_NBD_LISTEN.into(),
    );
    let http_text = pick(
        args.http_listen.clone(),
        file.http_listen,
        DEFAULT_HTTP_LISTEN.into(),
    );
    let defaults = EngineConfig::default();
    let nbd_defaults = strata_nbd::ServerConfig::default();
    let engine = EngineConfig {
        segment_size_bytes: size(
            args.segment_size,
            &file.segment_size,
            defaults.segment_size_bytes,
        ),
        fill_ratio_low: ratio(args.fill_low, &file.fill_low, defaults.fill_ratio_low),
        fill_ratio_high: ratio(args.fill_high, &file.fill_high, defaults.fill_ratio_high),
        max_batch_bytes: usize::try_from(size(
            args.max_batch_size,
            &file.max_batch_size,
            defaults.max_batch_bytes as u64,
        ))
        .context("max_batch_size is too large")?,
        index_cache_bytes: size(
            args.index_cache,
            &file.index_cache,
            defaults.index_cache_bytes,
        ),
        scrub_interval: duration(
            args.scrub_interval,
            &file.scrub_interval,
            "scrub_interval",
            Some(DEFAULT_SCRUB_INTERVAL),
        )?,
        scrub_rate_bytes_per_s: size(args.scrub_rate, &file.scrub_rate, DEFAULT_SCRUB_RATE),
        scrub_record: Some(data_dir.join(SCRUB_RECORD)),
        idle_destage_after: duration(
            args.idle_destage_after,
            &file.idle_destage_after,
            "idle_destage_after",
            defaults.idle_destage_after,
        )?,
        log_runs: args.log_runs.or(file.log_runs).unwrap_or(defaults.log_runs),
        // A flag only, not a config setting: it gives up writes, and must not stay on for
        // every later start unnoticed.
        skip_damaged_log_batches: args.skip_damaged_log_batches,
        // Unless set: a small capacity tier gets smaller segments (at least 1024 of them, 1 MiB
        // at least) when it is formatted, and the batch fits the group's segments and log.
        auto_segment_size: args.segment_size.is_none() && file.segment_size.is_none(),
        auto_max_batch: args.max_batch_size.is_none() && file.max_batch_size.is_none(),
        ..defaults
    };
    let config = ServeConfig {
        data_dir,
        fast_device,
        fast_size_bytes,
        capacity_devices,
        capacity_size_bytes,
        fast_size_given: args.fast_size.is_some() || file.fast_size.is_some(),
        capacity_size_given: args.capacity_size.is_some() || file.capacity_size.is_some(),
        segment_size_given: args.segment_size.is_some() || file.segment_size.is_some(),
        nbd_listen: parse_listen(&nbd_text, "NBD")?,
        http_listen: parse_listen(&http_text, "HTTP")?,
        engine,
        max_connections: pick(
            args.max_connections,
            file.max_connections,
            DEFAULT_MAX_CONNECTIONS,
        ),
        nbd_idle_timeout: duration(
            args.nbd_idle_timeout,
            &file.nbd_idle_timeout,
            "nbd_idle_timeout",
            Some(nbd_defaults.idle_timeout).filter(|t| !t.is_zero()),
        )?,
        nbd_stall_timeout: duration(
            args.nbd_stall_timeout,
            &file.nbd_stall_timeout,
            "nbd_stall_timeout",
            Some(nbd_defaults.stall_timeout),
        )?
        .ok_or_else(|| anyhow!(STALL_TIMEOUT_OFF))?,
        default_volume_size_bytes: size(
            args.default_volume_size,
            &file.default_volume_size,
            DEFAULT_VOLUME_SIZE_BYTES,
        ),
        io_backend: parse_io_backend(&pick(
            args.io_backend.clone(),
            file.io_backend,
            "auto".into(),
        ))?,
        durable_write: parse_durable_write(&pick(
            args.durable_write.clone(),
            file.durable_write,
            strata_device::DurableWrite::default().name().into(),
        ))?,
        http_token,
        fast_device_model: args.fast_device_model.clone().or(file.fast_device_model),
        capacity_device_model: args
            .capacity_device_model
            .clone()
            .or(file.capacity_device_model),
        wear_projection_after: duration_with(
            args.wear_projection_after,
            &file.wear_projection_after,
            "wear_projection_after",
            Some(crate::wear::PROJECTION_AFTER),
            parse_projection_wait,
        )?,
        catalog_files: if args.catalog_files.is_empty() {
            file.catalog_files.unwrap_or_default()
        } else {
            args.catalog_files.clone()
        },
        emulation,
        read_cache: match (&args.read_cache, &file.read_cache) {
            (Some(text), _) => crate::read_cache::parse_setting(text).map_err(|e| anyhow!("{e}"))?,
            (None, Some(v)) => v.resolve().map_err(|e| anyhow!("read_cache in the config file: {e}"))?,
            (None, None) => crate::read_cache::ReadCacheSetting::Auto,
        },
    };
    validate(&config)?;
    Ok(config)
}

/// Checks every value the file sets whose check is not part of reading it (sizes and ratios
/// are checked then), also those a flag overrides this time: a mistake in the file is
/// reported at the start that reads it, not at the first start without the flag.
fn check_file_values(file: &FileConfig) -> Result<()> {
    let in_file = |key: &str, e: &dyn std::fmt::Display| anyhow!("{key} in the config file: {e}");
    let listens = [
        ("nbd_listen", &file.nbd_listen, "NBD"),
        ("http_listen", &file.http_listen, "HTTP"),
    ];
    for (key, text, what) in listens {
        if let Some(text) = text {
            parse_listen(text, what).map_err(|e| in_file(key, &e))?;
        }
    }
    let durations = [
        ("nbd_idle_timeout", &file.nbd_idle_timeout),
        ("nbd_stall_timeout", &file.nbd_stall_timeout),
        ("scrub_interval", &file.scrub_interval),
        ("idle_destage_after", &file.idle_destage_after),
        ("wear_projection_after", &file.wear_projection_after),
    ];
    for (key, text) in durations {
        if let Some(text) = text {
            parse_duration(text).map_err(|e| in_file(key, &e))?;
        }
    }
    let stall = file.nbd_stall_timeout.as_deref();
    if stall.and_then(|t| parse_duration(t).ok()) == Some(None) {
        bail!(STALL_TIMEOUT_OFF_IN_FILE);
    }
    if let Some(text) = &file.io_backend {
        parse_io_backend(text).map_err(|e| in_file("io_backend", &e))?;
    }
    if let Some(text) = &file.durable_write {
        parse_durable_write(text).map_err(|e| in_file("durable_write", &e))?;
    }
    let emulations = [
        ("fast_emulate", &file.fast_emulate),
        ("capacity_emulate", &file.capacity_emulate),
    ];
    for (key, spec) in emulations {
        if let Some(spec) = spec {
            strata_device::parse_emulation(spec).map_err(|e| in_file(key, &e))?;
        }
    }
    if let Some(value) = &file.read_cache {
        value.resolve().map_err(|e| in_file("read_cache", &e))?;
    }
    if let Some(secret) = &file.http_token {
        Token::new(secret).map_err(|e| in_file("http_token", &e))?;
    }
    Ok(())
}

/// The token from `--http-token-file`, else the file's `http_token_file`, else `http_token`.
/// A file that sets both keys is refused: which one it meant cannot be told.
fn resolve_token(args: &ServeArgs, file: &FileConfig) -> Result<Option<Token>> {
    if file.http_token.is_some() && file.http_token_file.is_some() {
        bail!("the config file sets both http_token and http_token_file: keep one of them");
    }
    let path = args
        .http_token_file
        .clone()
        .or_else(|| file.http_token_file.clone());
    if let Some(path) = path {
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Unreadable(format!(
                "cannot read the HTTP token file {}: {}",
                path.display(),
                crate::io_reason(&e)
            ))
        })?;
        let first = text.lines().next().unwrap_or("");
        return Token::new(first)
            .map(Some)
            .with_context(|| format!("in {}", path.display()));
    }
    file.http_token.as_deref().map(Token::new).transpose()
}

fn pick<T>(flag: Option<T>, file: Option<T>, default: T) -> T {
    flag.or(file).unwrap_or(default)
}

fn size(flag: Option<u64>, file: &Option<SizeValue>, default: u64) -> u64 {
    flag.or(file.map(|v| v.0)).unwrap_or(default)
}

fn ratio(flag: Option<f64>, file: &Option<RatioValue>, default: f64) -> f64 {
    flag.or(file.map(|v| v.0)).unwrap_or(default)
}

/// A duration from the flag, else the file (`off` is None), else the default.
fn duration(
    flag: Option<DurationValue>,
    file: &Option<String>,
    key: &str,
    default: Option<std::time::Duration>,
) -> Result<Option<std::time::Duration>> {
    duration_with(flag, file, key, default, parse_duration)
}

/// [`duration`] with the file's text read by `parse`, the flag's parser.
fn duration_with(
    flag: Option<DurationValue>,
    file: &Option<String>,
    key: &str,
    default: Option<std::time::Duration>,
    parse: fn(&str) -> std::result::Result<Option<Duration>, String>,
) -> Result<Option<std::time::Duration>> {
    match (flag, file) {
        (Some(v), _) => Ok(v.0),
        (None, Some(text)) => parse(text).map_err(|e| anyhow!("{key} in the config file: {e}")),
        (None, None) => Ok(default),
    }
}

fn validate(c: &ServeConfig) -> Result<()> {
    if c.engine.fill_ratio_low >= c.engine.fill_ratio_high {
        bail!(
            "fill-low ({}) must be below fill-high ({})",
            c.engine.fill_ratio_low,
            c.engine.fill_ratio_high
        );
    }
    for (key, value) in [
        ("fast-size", c.fast_size_bytes),
        ("capacity-size", c.capacity_size_bytes),
        ("segment-size", c.engine.segment_size_bytes),
        ("max-batch-size", c.engine.max_batch_bytes as u64),
        ("default-volume-size", c.default_volume_size_bytes),
    ] {
        if value % ALIGN_BYTES != 0 {
            bail!("{key} ({value} bytes) must be a multiple of 4 KiB");
        }
    }
    for (key, value) in [
        ("fast-size", c.fast_size_bytes),
        ("capacity-size", c.capacity_size_bytes),
        ("segment-size", c.engine.segment_size_bytes),
        ("max-batch-size", c.engine.max_batch_bytes as u64),
    ] {
        if value == 0 {
            bail!("{key} must not be zero");
        }
    }
    if c.engine.index_cache_bytes < MIN_INDEX_CACHE_BYTES {
        bail!(
            "index-cache ({}) must be at least {}: the capacity index keeps at least 16 of its nodes in memory",
            format_size(c.engine.index_cache_bytes),
            format_size(MIN_INDEX_CACHE_BYTES)
        );
    }
    // Checked here, not only by the engine when it creates the volume: by then a first start
    // has formatted the devices, and fails leaving them behind.
    if c.default_volume_size_bytes > strata_engine::MAX_VOLUME_BYTES {
        bail!(
            "default-volume-size ({}) is larger than a volume may be ({})",
            format_size(c.default_volume_size_bytes),
            format_size(strata_engine::MAX_VOLUME_BYTES)
        );
    }
    // The engine's own limits (segment size, batch size), checked before a first start
    // writes a new fast-tier file full of zeros only to be refused when the group opens.
    c.engine.validate().map_err(|e| anyhow!("{e}"))?;
    // A group that exists keeps the geometry it was made with, which the engine checks when it
    // opens it; a first start is refused here, in the flags' words.
    // (A fast tier below the engine's least is refused by the engine, saying so.)
    // (A batch size not set is fitted to the group by the engine.)
    let batch_set = !c.engine.auto_max_batch;
    if batch_set && !c.fast_device.exists() && c.fast_size_bytes >= strata_engine::MIN_FAST_BYTES {
        batch_fits_new_group(c)?;
    }
    if c.max_connections == 0 || c.max_connections > MAX_CONNECTIONS_LIMIT {
        bail!("max-connections must be between 1 and {MAX_CONNECTIONS_LIMIT}");
    }
    if c.capacity_devices.is_empty() {
        bail!("at least one capacity device is needed");
    }
    // An empty path (a template's unset variable) would put the devices in the working
    // directory, or name no file at all.
    let named = [("data_dir", &c.data_dir), ("fast_device", &c.fast_device)];
    let capacity = c.capacity_devices.iter().map(|p| ("capacity_devices", p));
    if let Some((key, _)) = named
        .into_iter()
        .chain(capacity)
        .find(|(_, p)| p.as_os_str().is_empty())
    {
        bail!("{key} is empty: give a path");
    }
    if !c.http_listen.ip().is_loopback() && c.http_token.is_none() {
        bail!(
            "the admin API may listen on {} (not loopback) only with an access token: pass --http-token-file FILE, or set http_token or http_token_file in the config file",
            c.http_listen
        );
    }
    let mut all: Vec<&PathBuf> = c.capacity_devices.iter().collect();
    all.push(&c.fast_device);
    all.sort();
    if let Some(w) = all.windows(2).find(|w| w[0] == w[1]) {
        bail!("device {} is named twice", w[0].display());
    }
    Ok(())
}

/// A first start's write batches (`max-batch-size`) must fit half a segment's data area
/// (`segment-size`) and a quarter of the write log (`fast-size`, less 4 MiB of metadata). The
/// engine refuses a group that breaks either once the new fast-tier file has been written full
/// of zeros, in its own words; this says which flags to change and to what.
fn batch_fits_new_group(c: &ServeConfig) -> Result<()> {
    use strata_engine::BatchLimits;
    let (batch, version) = (c.engine.max_batch_bytes as u64, c.engine.format_version);
    let limits_with = |segment, fast| BatchLimits::for_new_group(segment, version, fast);
    let limits = limits_with(c.engine.segment_size_bytes, c.fast_size_bytes);
    if batch > limits.segment_bytes {
        let fitting_segment = (1..=1024u64)
            .map(|mib| mib << 20)
            .find(|&segment| limits_with(segment, c.fast_size_bytes).segment_bytes >= batch);
        let larger = fitting_segment.map_or(String::new(), |s| {
            format!("--segment-size {} or more, or ", flag_size(s))
        });
        bail!(
            "segment-size {} is too small for the max batch size ({}): a write batch must fit in half a segment's data area, {} with segments of {}; use {larger}--max-batch-size {} or less",
            format_size(c.engine.segment_size_bytes),
            format_size(batch),
            format_size(limits.segment_bytes),
            format_size(c.engine.segment_size_bytes),
            flag_size(limits.segment_bytes)
        );
    }
    if batch > limits.log_bytes {
        let fitting_fast = (strata_engine::MIN_FAST_BYTES >> 20..=4096u64)
            .map(|mib| mib << 20)
            .find(|&fast| limits_with(c.engine.segment_size_bytes, fast).log_bytes >= batch);
        let larger = fitting_fast.map_or(String::new(), |f| {
            format!("--fast-size {} or more, or ", flag_size(f))
        });
        bail!(
            "fast-size {} is too small for the max batch size ({}): a write batch must fit in a quarter of the write log, {} with a fast tier of {}; use {larger}--max-batch-size {} or less",
            format_size(c.fast_size_bytes),
            format_size(batch),
            format_size(limits.log_bytes),
            format_size(c.fast_size_bytes),
            flag_size(limits.log_bytes)
        );
    }
    Ok(())
}

/// A size as a flag takes it, exactly: `24M`, or `504K` (sizes here are whole 4 KiB blocks).
fn flag_size(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{}M", bytes >> 20)
    } else {
        format!("{}K", bytes >> 10)
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
