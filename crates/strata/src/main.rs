//! `strata`: the daemon (`strata serve`) and the CLI that talks to its admin HTTP API.
//!
//! Every failure ends the process with a non-zero exit code and one line on stderr,
//! `strata: <reason>`, the last; only `strata serve` writes logs (to stderr, filtered by
//! RUST_LOG). The one other line a command may write there says, once, that it is waiting for
//! a daemon that is still starting (client.rs).
mod adapter;
mod api;
mod api_body;
mod api_observe;
mod api_origin;
mod api_scrub;
mod api_policy;
mod api_snapshots;
mod client;
mod config;
mod devices;
mod history;
mod http_server;
mod metrics;
mod metrics_page;
mod metrics_tiering;
mod notify;
mod policy_args;
mod read_cache;
mod prom;
mod registry;
mod routes;
mod serve;
mod space_cache;
mod startup;
mod status_text;
mod wear;
#[cfg(test)]
mod testutil;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "strata",
    version,
    about = "Strata: a tiered block store served over NBD"
)]
pub struct Cli {
    /// Admin API of the daemon that volume, snapshot, status and scrub talk to.
    #[arg(
        long,
        global = true,
        env = "STRATA_SERVER",
        default_value = "http://127.0.0.1:9090",
        help_heading = GLOBAL_HEADING
    )]
    pub server: String,
    /// Machine output of volume, snapshot, status, scrub and size: print JSON.
    #[arg(long, global = true, help_heading = GLOBAL_HEADING)]
    pub json: bool,
    /// File whose first line is the daemon's admin token, sent with every request (mutating
    /// requests need it when the daemon has one). Without it, the STRATA_TOKEN variable.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "STRATA_TOKEN_FILE",
        help_heading = GLOBAL_HEADING
    )]
    pub token_file: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node: open the devices, serve volumes over NBD and the admin API over HTTP.
    Serve(Box<ServeArgs>),
    /// Manage volumes on a running daemon.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Manage snapshots on a running daemon.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Show the node summary of a running daemon.
    Status,
    /// Check every stored block against its checksum and both copies of all metadata, repair
    /// a bad metadata copy from the good one, and list what is damaged.
    ///
    /// Reads everything stored on both tiers (only VOLUME and its snapshots when given), which
    /// can take long on a large disk group: this waits until the scrub ends, showing progress
    /// when stderr is a terminal. One scrub runs at a time, the background one included.
    #[command(
        after_help = "Exit status: 0 when nothing was wrong; 3 when the scrub found damage (bad data blocks, or metadata copies it repaired or could not repair); 1 when it could not run.\nWith --detach: 0 once the scrub has begun. With --last: as for the scrub it reports, 1 when none ended yet.\nWith --cancel: 0 once the running scrub stopped, 1 when none was running."
    )]
    Scrub {
        /// Only this volume and its snapshots [default: everything].
        volume: Option<String>,
        /// Read rate limit, bytes per second (e.g. 200M; 0 for no limit) [default: the daemon's --scrub-rate].
        #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
        rate: Option<u64>,
        /// Start the scrub and return at once: it runs on the daemon to its end, whatever
        /// happens to this terminal (see `strata status`, `--last`, `--cancel`).
        #[arg(long)]
        detach: bool,
        /// Print the last finished scrub's report instead (kept in the data directory across
        /// restarts).
        #[arg(long, conflicts_with_all = ["volume", "rate", "detach"])]
        last: bool,
        /// Stop the running scrub instead, whoever started it (the background one included).
        #[arg(long, conflicts_with_all = ["volume", "rate", "detach", "last"])]
        cancel: bool,
    },
    /// Size a cluster for a workload: performance, endurance and capacity (no daemon needed).
    Size(Box<strata_sizing::SizeArgs>),
    /// Benchmark NBD exports HCIBench-style: max, ramp-up curve, VM scaling.
    Bench(Box<strata_bench::BenchArgs>),
}

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a thin-provisioned volume.
    Create {
        /// Name of the new volume: 1 to 64 letters, digits, '-', '_' or '.', starting with a
        /// letter or a digit.
        name: String,
        /// Size, e.g. 8G, 1.5G, 512M or a byte count, a multiple of 4 KiB; units are binary
        /// (G and GB mean GiB).
        #[arg(long, value_parser = config::parse_size_arg)]
        size: u64,
        #[command(flatten)]
        policy: policy_args::PolicyArgs,
    },
    /// Change a volume's tiering policy; options not given keep their current values.
    SetPolicy {
        name: String,
        #[command(flatten)]
        policy: policy_args::PolicyArgs,
    },
    /// List volumes.
    List,
    /// Show one volume.
    Info { name: String },
    /// Grow a volume (shrinking is refused).
    Resize {
        name: String,
        /// The new size, larger than the current one (binary units, a multiple of 4 KiB, as
        /// for create).
        #[arg(long, value_parser = config::parse_size_arg)]
        size: u64,
    },
    /// Delete a volume (refused while an NBD client has it open, unless --force).
    Delete {
        name: String,
        /// Delete even while clients are connected; their later I/O fails.
        #[arg(long)]
        force: bool,
        /// Delete the volume's snapshots too (a volume with snapshots is refused without it).
        #[arg(long)]
        with_snapshots: bool,
    },
    /// Make a new writable volume from a snapshot; it shares the snapshot's blocks.
    Clone {
        /// The snapshot to clone, as VOLUME@SNAPSHOT.
        #[arg(value_name = "VOLUME@SNAPSHOT", value_parser = client::parse_snapshot_source)]
        source: String,
        /// Name of the new volume.
        #[arg(value_name = "NEWVOLUME")]
        name: String,
    },
    /// Return a volume to a snapshot's image and size; what was written since is lost
    /// (refused while an NBD client has the volume open, unless --force).
    Rollback {
        name: String,
        snapshot: String,
        /// Roll back even while clients are connected; they are cut off (their later I/O fails).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Take a snapshot of a volume: a read-only image exported over NBD as VOLUME@NAME.
    Create {
        volume: String,
        /// Name of the snapshot, named as a volume is (1 to 64 letters, digits, '-', '_' or
        /// '.', starting with a letter or a digit).
        name: String,
    },
    /// List snapshots, of one volume or of all.
    List {
        /// Only this volume's snapshots [default: every volume's].
        volume: Option<String>,
    },
    /// Show one snapshot.
    Info { volume: String, name: String },
    /// Delete a snapshot (refused while an NBD client has VOLUME@NAME open, unless --force).
    Delete {
        volume: String,
        name: String,
        /// Delete even while clients are connected; their later I/O fails.
        #[arg(long)]
        force: bool,
    },
}

/// Flags of `strata serve`. Every one is optional so that a config file can supply it;
/// flags override the file, the file overrides the embedded defaults.
#[derive(Debug, Default, Args)]
pub struct ServeArgs {
    /// TOML config file (unknown keys are an error).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the default device files [default: ./strata-data].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Fast-tier device: a file (created when missing) or a block device [default: DATA_DIR/fast.img].
    #[arg(long, value_name = "PATH")]
    pub fast_device: Option<PathBuf>,
    /// Size of a fast-tier file created on first start (allocated and written with zeros once) [default: 1G].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub fast_size: Option<u64>,
    /// Capacity-tier device; repeat for several [default: DATA_DIR/capacity-0.img].
    #[arg(long = "capacity-device", value_name = "PATH")]
    pub capacity_devices: Vec<PathBuf>,
    /// Size of each capacity file created on first start (sparse) [default: 16G].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub capacity_size: Option<u64>,
    /// NBD listen address; port 0 lets the OS pick [default: 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR")]
    pub nbd_listen: Option<String>,
    /// Admin HTTP API listen address [default: 127.0.0.1:9090].
    #[arg(long, value_name = "ADDR")]
    pub http_listen: Option<String>,
    /// Size of a capacity-tier segment, applied when the disk group is made [default: 8M,
    /// halved down to 1M while the capacity tier would hold fewer than 1024 segments and half
    /// a segment's data area still holds a --max-batch-size given].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub segment_size: Option<u64>,
    /// Log fill below which destaging idles: a ratio (0.3) or a percentage (30%) [default: 30%].
    #[arg(long, value_name = "RATIO", value_parser = config::parse_ratio_arg)]
    pub fill_low: Option<f64>,
    /// Log fill above which destaging runs at full speed [default: 70%].
    #[arg(long, value_name = "RATIO", value_parser = config::parse_ratio_arg)]
    pub fill_high: Option<f64>,
    /// Largest group-commit batch written to the fast tier [default: 2M, or less where half
    /// a segment's data area or a quarter of the write log is less].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub max_batch_size: Option<u64>,
    /// Most NBD connections served at once [default: 64].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Close an NBD connection with nothing in flight that has sent nothing for this long
    /// (`30m`, `off`). Off by default: a VM whose disk sits idle keeps its connection [default: off].
    #[arg(long, value_name = "DURATION", value_parser = config::parse_duration_arg)]
    pub nbd_idle_timeout: Option<config::DurationValue>,
    /// Drop an NBD client that stops in the middle of a request or stops reading replies for
    /// this long (`30s`, `5m`; never off) [default: 2m].
    #[arg(long, value_name = "DURATION", value_parser = config::parse_duration_arg)]
    pub nbd_stall_timeout: Option<config::DurationValue>,
    /// Size of the volume `vol0` created when the disk group has never had a volume; 0 creates none [default: 8G].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub default_volume_size: Option<u64>,
    /// Memory for index pages of data on the capacity tier (the capacity index's RAM bound; at
    /// least 110K) [default: 64M].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub index_cache: Option<u64>,
    /// Time between background scrubs of every stored block (`7d`, `24h`, `off`) [default: 7d].
    #[arg(long, value_name = "DURATION", value_parser = config::parse_duration_arg)]
    pub scrub_interval: Option<config::DurationValue>,
    /// Read rate of the background scrub, bytes per second [default: 64M].
    #[arg(long, value_name = "SIZE", value_parser = config::parse_size_arg)]
    pub scrub_rate: Option<u64>,
    /// Once no volume has been read or written for this long, destage down to the low fill
    /// mark, data still being rewritten included (`5s`, `off`) [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = config::parse_duration_arg)]
    pub idle_destage_after: Option<config::DurationValue>,
    /// Device I/O backend: auto, io_uring or threads [default: auto].
    #[arg(long, value_name = "NAME")]
    pub io_backend: Option<String>,
    /// How log writes are made durable: write-then-sync (the write, then fdatasync from the
    /// writing thread) or dsync (one O_DSYNC write, a FUA write where the device has FUA) [default: write-then-sync].
    #[arg(long, value_name = "MODE")]
    pub durable_write: Option<String>,
    /// Let writes made one at a time extend a run of the write log (a data block and a
    /// rewritten header copy, written together): half the log space for queue-depth-one
    /// writes, two device writes each instead of one (`--log-runs` alone means true)
    /// [default: false].
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        default_missing_value = "true",
        value_parser = config::parse_switch_arg()
    )]
    pub log_runs: Option<bool>,
    /// File whose first line is the admin API token; required when --http-listen is not loopback.
    #[arg(long, value_name = "FILE")]
    pub http_token_file: Option<PathBuf>,
    /// Device catalog entry of the fast device (see `strata size --list-devices`), for wear accounting.
    #[arg(long, value_name = "ID")]
    pub fast_device_model: Option<String>,
    /// Device catalog entry of the capacity devices, for wear accounting.
    #[arg(long, value_name = "ID")]
    pub capacity_device_model: Option<String>,
    /// History a rated device needs before its wear-out date is projected from its average
    /// write rate and warned about (`1d`, `12h`, `0` for at once, `off` for never) [default: 1d].
    #[arg(long, value_name = "DURATION", value_parser = config::parse_projection_wait_arg)]
    pub wear_projection_after: Option<config::DurationValue>,
    /// Extra device catalog file (TOML); repeatable.
    #[arg(long = "catalog", value_name = "FILE")]
    pub catalog_files: Vec<PathBuf>,
    /// Benchmarking aid: slow the fast device down to a device model, e.g. `nand-a,scale=0.02`
    /// or `bw=40MB,mixed_bw=15MB` (see docs/BENCH.md). The device's name then says "emulated".
    #[arg(long, value_name = "SPEC")]
    pub fast_emulate: Option<String>,
    /// Share of the write log's area the read cache may hold (0 to 0.9, or a percentage), or
    /// `auto`: 0.7 when every capacity device is rotational and on a disk other than the fast
    /// device's, else 0 [default: auto].
    #[arg(long, value_name = "RATIO|auto")]
    pub read_cache: Option<String>,
    /// Benchmarking aid: slow every capacity device down to a device model, e.g. `bw=20MB`.
    #[arg(long, value_name = "SPEC")]
    pub capacity_emulate: Option<String>,
    /// Recovery, for one start: when the write log holds batches that cannot be read though
    /// later ones record them as written (a start refuses to open then), skip them. The writes
    /// they held are lost and their blocks read as older data: check the file systems on the
    /// volumes afterwards (README, "A damaged write log"). Not a config file setting.
    #[arg(long)]
    pub skip_damaged_log_batches: bool,
}

/// What a command was asked is refused before it does anything: a flag's or a config file's
/// value out of range, settings that contradict each other, a device id no catalog holds. It
/// exits 2, as the usage errors clap finds do (`--fill-high 150%`): which part of the program
/// finds a bad value is no concern of the administrator's.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit status of a usage error, clap's or a [`UsageError`].
const EXIT_USAGE: u8 = 2;

/// Where `--help` lists the options every command takes (`--server`, `--json`, ...), apart
/// from the command's own.
const GLOBAL_HEADING: &str = "Global options";

/// The global options, by id.
const GLOBAL_IDS: [&str; 3] = ["server", "json", "token_file"];

/// What to use instead of a global option `command` has no use for; None where it has one.
/// Such an option is hidden from the command's `--help`, and refused when given after the
/// command's name (before it, and in its variable, it is ignored).
fn unused_global(command: &str, id: &str) -> Option<&'static str> {
    Some(match (command, id) {
        ("serve", "server") => "it listens where --http-listen says",
        ("serve", "token_file") => "its own token comes from --http-token-file",
        ("serve", "json") => "it prints its ready lines on stdout and logs to stderr",
        ("bench", "server") => "name the daemon's admin API with --strata-api",
        ("bench", "token_file") => "it only reads from the daemon's admin API",
        ("bench", "json") => "its report is report.json in the --output directory",
        ("size", "server") => "it talks to no daemon; --from-metrics reads a daemon's write rate",
        ("size", "token_file") => "--from-metrics reads a daemon's /metrics, which needs no token",
        _ => return None,
    })
}

/// The command line's grammar: the derived one, where a command that has no use for a global
/// option gets a hidden option of its own in its place (clap propagates a global option only
/// to commands without one of that name), so that its help does not list it.
fn cli_command() -> clap::Command {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    let commands: Vec<String> = cmd
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    for command in &commands {
        for id in GLOBAL_IDS
            .into_iter()
            .filter(|id| unused_global(command, id).is_some())
        {
            let global = cmd.get_arguments().find(|a| a.get_id() == id);
            let local = global.expect("a global option").clone();
            cmd = cmd.mut_subcommand(command, |sub| sub.arg(local.global(false).hide(true)));
        }
    }
    values_may_start_with_a_hyphen(cmd)
}

/// An option that always takes one value takes the next word as it, as getopt does, even
/// when it starts with `-`: `--size -4K` or `--iops-limit -1` then meet the value's own parser
/// and its reason ("invalid size"), instead of clap's "unexpected argument '-4'", whose tip
/// (`-- -4`) does not work for an option's value. An option whose value is optional
/// (`--log-runs [BOOL]`) still stops at the next option, and so does one whose value is a
/// path: `--data-dir --fast-size=64M` (a directory forgotten) is "a value is required", not a
/// directory named `--fast-size=64M` (a name starting with `-` is given as `./-name` or
/// `--data-dir=-name`).
fn values_may_start_with_a_hyphen(cmd: clap::Command) -> clap::Command {
    use clap::ValueHint;
    let one_value = |a: &clap::Arg| {
        !a.is_positional()
            && a.get_action().takes_values()
            && a.get_num_args()
                .is_none_or(|n| n.min_values() == 1 && n.max_values() == 1)
    };
    let path = |a: &clap::Arg| {
        matches!(
            a.get_value_hint(),
            ValueHint::AnyPath | ValueHint::FilePath | ValueHint::DirPath
        )
    };
    cmd.mut_args(|a| {
        let one = one_value(&a) && !path(&a);
        a.allow_hyphen_values(one)
    })
    .mut_subcommands(values_may_start_with_a_hyphen)
}

/// Parses the command line, refusing a global option given after a command that has no use
/// for it (`strata serve --server URL` would otherwise be taken and ignored). Given before
/// the command, it is taken and ignored there, as an alias or a wrapper may put it before
/// every command (`alias strata='strata --server http://storage1:9090'`).
fn parse_cli(args: impl IntoIterator<Item = std::ffi::OsString>) -> Result<Cli, clap::Error> {
    use clap::FromArgMatches;
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let mut cmd = cli_command();
    let matches = cmd.try_get_matches_from_mut(&args)?;
    if let (Some((command, _)), Some(at)) = (matches.subcommand(), command_position(&args)) {
        for id in GLOBAL_IDS {
            let Some(instead) = unused_global(command, id) else {
                continue;
            };
            let flag = format!("--{}", id.replace('_', "-"));
            // Parsed, so a token that spells the option is the option (or the value of an
            // option before it, `--data-dir --server`: a value no one means).
            let after = args[at + 1..].iter().take_while(|a| *a != "--");
            let spelled = |a: &str| match a.strip_prefix(flag.as_str()) {
                Some(rest) => rest.is_empty() || rest.starts_with('='),
                None => false,
            };
            let given = after.filter_map(|a| a.to_str()).any(spelled);
            if given {
                return Err(cmd.error(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!("`strata {command}` takes no {flag}: {instead}"),
                ));
            }
        }
    }
    let cli = Cli::from_arg_matches(&matches)?;
    if let Command::Volume(VolumeCommand::SetPolicy { policy, .. }) = &cli.command {
        if policy.patch().is_empty() {
            // A usage error like a missing argument (exit 2), caught before the daemon is asked.
            return Err(cmd.error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "nothing to change: give at least one policy option",
            ));
        }
    }
    Ok(cli)
}

/// Where the command's name is in `args`: the first argument that is not a global option or
/// the value of one (the only options before a command).
fn command_position(args: &[std::ffi::OsString]) -> Option<usize> {
    let mut at = 1;
    while at < args.len() {
        let arg = args[at].to_str()?;
        at += match arg {
            "--server" | "--token-file" => 2,
            "--json" => 1,
            _ if arg.starts_with("--server=") || arg.starts_with("--token-file=") => 1,
            _ => return Some(at),
        };
    }
    None
}

fn main() -> ExitCode {
    let cli = match parse_cli(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => return clap_failure(e, json_asked(std::env::args_os())),
    };
    if !matches!(cli.command, Command::Serve(_) | Command::Bench(_)) {
        end_quietly_when_stdout_closes();
    }
    // `serve` and `bench` print no JSON, not even a failure's (a --json before them, from an
    // alias, is ignored there).
    let json_failure = cli.json && !matches!(cli.command, Command::Serve(_) | Command::Bench(_));
    let result = match cli.command {
        Command::Serve(args) => serve::run(&args),
        Command::Volume(cmd) => api_client(&cli.server, cli.json, cli.token_file.as_deref())
            .and_then(|c| c.volume(cmd)),
        Command::Snapshot(cmd) => api_client(&cli.server, cli.json, cli.token_file.as_deref())
            .and_then(|c| c.snapshot(cmd)),
        Command::Status => api_client(&cli.server, cli.json, cli.token_file.as_deref())
            .and_then(|c| c.status()),
        Command::Scrub { volume, rate, detach, last, cancel } => {
            api_client(&cli.server, cli.json, cli.token_file.as_deref()).and_then(|c| {
                if cancel {
                    c.cancel_scrub()
                } else if last {
                    c.last_scrub()
                } else {
                    c.scrub(volume.as_deref(), rate, detach)
                }
            })
        }
        Command::Size(args) => match strata_sizing::run(&args, cli.json) {
            Ok(outcome) => {
                print!("{}", outcome.text);
                // The report is printed either way; a failing check is the exit status.
                if !outcome.checks_passed {
                    return ExitCode::from(strata_sizing::EXIT_CHECK_FAILED);
                }
                Ok(())
            }
            // An unknown device id on the command line, or flags that do not go together.
            Err(e) if e.is_usage_error() => Err(UsageError(e.to_string()).into()),
            Err(e) => Err(anyhow::Error::from(e)),
        },
        Command::Bench(args) => strata_bench::run(&args).map_err(anyhow::Error::from),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let reason = one_line(&format!("{e:#}"));
            // A scrub that found damage has printed its report already.
            if json_failure && !e.is::<client::DamageFound>() {
                // Machine output on failure too: the reason, and the daemon's HTTP status
                // when it answered (404 unknown, 409 in use or already there, ...).
                let status = e.downcast_ref::<client::Refused>().map(|r| r.status);
                println!("{}", serde_json::json!({ "error": reason, "status": status }));
            }
            // Not eprintln!: a benchmark stopped by SIGHUP has no terminal left to write to,
            // and its exit status must still be 129.
            let _ = writeln!(std::io::stderr(), "strata: {reason}");
            let bench_status = e
                .downcast_ref::<strata_bench::BenchError>()
                .and_then(strata_bench::BenchError::exit_status);
            if e.is::<client::DamageFound>() {
                ExitCode::from(client::EXIT_DAMAGE_FOUND)
            } else if let Some(status) = bench_status {
                // A benchmark a signal stopped, its report written: 128 + the signal's number.
                ExitCode::from(status)
            } else if e.is::<UsageError>() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// `strata volume list | head -1`: a reader that stops early ends the command quietly, as it
/// ends other Unix tools, instead of a panic in `println!` (the Rust runtime ignores SIGPIPE,
/// so the write fails with EPIPE). Only for the commands that print and exit: `serve` and
/// `bench` keep SIGPIPE ignored, as their sockets need; the admin API client's socket writes
/// use MSG_NOSIGNAL, so a daemon closing the connection is still an error line.
fn end_quietly_when_stdout_closes() {
    // SAFETY: called from main before any other thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// A client of the daemon named by --server, with the token from --token-file or STRATA_TOKEN.
fn api_client(
    server: &str,
    json: bool,
    token_file: Option<&std::path::Path>,
) -> anyhow::Result<client::Client> {
    let env_token = std::env::var("STRATA_TOKEN").ok();
    let token = client::load_token(token_file, env_token.as_deref())?;
    Ok(client::Client::new(server, json)?.with_token(token))
}

/// Help and version go out as clap writes them; a usage error becomes one line.
fn clap_failure(e: clap::Error, json: bool) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        _ => {
            let reason = format!("{} (see --help)", usage_error_line(&e.to_string()));
            if json {
                // As for any other failure: the reason, and no HTTP status (nothing was sent).
                println!("{}", serde_json::json!({ "error": reason, "status": null }));
            }
            eprintln!("strata: {reason}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// Whether the command line asks for `--json`, for a usage error clap could not parse: any
/// `--json` before a `--`, unless the command is `serve` or `bench`, which print no JSON.
fn json_asked(args: impl IntoIterator<Item = std::ffi::OsString>) -> bool {
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let command = command_position(&args).and_then(|at| args[at].to_str());
    if matches!(command, Some("serve" | "bench")) {
        return false;
    }
    args.iter()
        .skip(1)
        .take_while(|a| *a != "--")
        .any(|a| a == "--json")
}

/// clap's usage error as one line: the error and its details (which argument is missing, a
/// similar one that exists), without the usage summary that follows them.
fn usage_error_line(text: &str) -> String {
    let text = text.trim_start().strip_prefix("error: ").unwrap_or(text);
    let parts: Vec<String> = text
        .split("\n\n")
        .map(one_line)
        .take_while(|p| !p.starts_with("Usage:") && !p.starts_with("For more information"))
        .filter(|p| !p.is_empty())
        .collect();
    if parts.is_empty() {
        "invalid arguments".to_string()
    } else {
        parts.join("; ")
    }
}

/// Joins a possibly multi-line message into one line.
pub fn one_line(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// An OS error as a short lower-case reason: "connection refused", not
/// "Connection refused (os error 111)".
pub fn io_reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    let known = match e.kind() {
        K::ConnectionRefused => "connection refused",
        K::AddrInUse => "address in use",
        K::AddrNotAvailable => "address not available on this host",
        K::PermissionDenied => "permission denied",
        K::NotFound => "no such file or directory",
        K::TimedOut => "timed out",
        K::ConnectionReset => "connection reset",
        _ => "",
    };
    if !known.is_empty() {
        return known.to_string();
    }
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(i) => text[..i].to_string(),
        None => text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The help of `strata COMMAND`, as `--help` prints it.
    fn help_of(command: &str) -> String {
        let mut cmd = cli_command();
        cmd.build();
        cmd.find_subcommand_mut(command)
            .unwrap()
            .render_long_help()
            .to_string()
    }

    #[test]
    fn global_options_show_only_where_they_mean_something() {
        for command in ["serve", "bench"] {
            let help = help_of(command);
            for flag in ["--server", "--json", "--token-file"] {
                assert!(
                    !help.contains(flag),
                    "`strata {command} --help` lists {flag}:\n{help}"
                );
            }
        }
        let size = help_of("size");
        let only_json = !size.contains("--server") && !size.contains("--token-file");
        assert!(size.contains("--json") && only_json, "{size}");
        let volume = help_of("volume");
        assert!(volume.contains("Global options:"), "{volume}");
        for flag in ["--server", "--json", "--token-file"] {
            assert!(
                volume.contains(flag),
                "`strata volume --help` lacks {flag}:\n{volume}"
            );
        }
    }

    #[test]
    fn a_global_option_a_command_has_no_use_for_is_refused() {
        let parse = |line: &str| parse_cli(line.split_whitespace().map(std::ffi::OsString::from));
        for line in [
            "strata serve --server http://x:1",
            "strata --server=http://x:1 serve --server=http://x:2",
            "strata serve --data-dir d --json",
            "strata --json size --server http://x:1 --list-devices",
            "strata bench --target nbd://h/e --token-file t",
        ] {
            let e = parse(line).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{line}: {e}"
            );
            let reason = usage_error_line(&e.to_string());
            assert!(reason.contains("takes no --"), "{line}: {reason}");
        }
        let e = parse("strata serve --token-file t").unwrap_err();
        assert!(e.to_string().contains("--http-token-file"), "{e}");
        // Where they mean something they are taken, before or after the command.
        let cli = parse("strata size --list-devices --json").unwrap();
        assert!(cli.json);
        let cli = parse("strata volume list --server http://x:1").unwrap();
        assert_eq!(cli.server, "http://x:1");
        assert!(parse("strata serve --data-dir d").is_ok());
        // Before the command, as an alias puts them: taken, and ignored where they mean nothing.
        let before = "strata --server http://x:1 --json --token-file t";
        assert!(parse(&format!("{before} serve --data-dir d")).is_ok());
        assert!(parse(&format!("{before} size --list-devices")).is_ok());
    }

    #[test]
    fn a_usage_error_sees_json_anywhere_before_a_double_dash() {
        let asked = |args: &[&str]| json_asked(args.iter().map(std::ffi::OsString::from));
        assert!(asked(&["strata", "--json", "volume", "create", "x", "--size", "12Q"]));
        assert!(asked(&["strata", "volume", "create", "x", "--size", "12Q", "--json"]));
        assert!(!asked(&["strata", "volume", "create", "x", "--size", "12Q"]));
        assert!(!asked(&["strata", "volume", "create", "--", "--json"]));
        assert!(!asked(&["--json"]), "the program name is not an argument");
        // `serve` and `bench` print no JSON: their usage errors are text alone.
        assert!(!asked(&["strata", "serve", "--json"]));
        assert!(!asked(&["strata", "--json", "serve", "--fast-size", "1K"]));
        assert!(!asked(&["strata", "--server", "http://x:1", "--json", "bench", "--x"]));
    }

    #[test]
    fn cli_parses_volume_commands() {
        let cli =
            Cli::try_parse_from(["strata", "--json", "volume", "create", "a", "--size", "1G"])
                .unwrap();
        assert!(cli.json);
        match cli.command {
            Command::Volume(VolumeCommand::Create { name, size, .. }) => {
                assert_eq!(name, "a");
                assert_eq!(size, 1 << 30);
            }
            other => panic!("{other:?}"),
        }
        let cli = Cli::try_parse_from([
            "strata",
            "volume",
            "delete",
            "a",
            "--force",
            "--server",
            "http://x:1",
        ])
        .unwrap();
        assert_eq!(cli.server, "http://x:1");
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::Delete { force: true, .. })
        ));
    }

    #[test]
    fn cli_parses_snapshot_commands() {
        let cli = Cli::try_parse_from(["strata", "snapshot", "create", "db", "nightly"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Snapshot(SnapshotCommand::Create { ref volume, ref name }) if volume == "db" && name == "nightly"
        ));
        let cli = Cli::try_parse_from(["strata", "snapshot", "list"]).unwrap();
        assert!(matches!(cli.command, Command::Snapshot(SnapshotCommand::List { volume: None })));
        let cli = Cli::try_parse_from(["strata", "snapshot", "delete", "db", "s", "--force"]).unwrap();
        assert!(matches!(cli.command, Command::Snapshot(SnapshotCommand::Delete { force: true, .. })));
        let cli = Cli::try_parse_from(["strata", "volume", "clone", "db@s", "db2"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::Clone { ref source, ref name }) if source == "db@s" && name == "db2"
        ));
        for bad in ["db", "db@", "@s"] {
            let e = Cli::try_parse_from(["strata", "volume", "clone", bad, "db2"]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}: {e}");
            assert!(e.to_string().contains("VOLUME@SNAPSHOT"), "{bad}: {e}");
        }
        let cli = Cli::try_parse_from(["strata", "volume", "rollback", "db", "s"]).unwrap();
        assert!(matches!(cli.command, Command::Volume(VolumeCommand::Rollback { force: false, .. })));
        let cli = Cli::try_parse_from(["strata", "volume", "delete", "db", "--with-snapshots"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Volume(VolumeCommand::Delete { force: false, with_snapshots: true, .. })
        ));
        assert!(Cli::try_parse_from(["strata", "snapshot", "create", "db"]).is_err());
    }

    #[test]
    fn cli_parses_scrub() {
        let cli = Cli::try_parse_from(["strata", "scrub"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Scrub { volume: None, rate: None, detach: false, last: false, cancel: false }
        ));
        let cli = Cli::try_parse_from(["strata", "--json", "scrub", "db", "--rate", "200M"]).unwrap();
        assert!(cli.json);
        assert!(matches!(
            cli.command,
            Command::Scrub { volume: Some(ref v), rate: Some(r), cancel: false, .. } if v == "db" && r == 200 << 20
        ));
        let cli = Cli::try_parse_from(["strata", "scrub", "--rate", "0"]).unwrap();
        assert!(matches!(cli.command, Command::Scrub { rate: Some(0), .. }));
        assert!(Cli::try_parse_from(["strata", "scrub", "--rate", "fast"]).is_err());
        assert!(Cli::try_parse_from(["strata", "scrub", "a", "b"]).is_err());
        let cli = Cli::try_parse_from(["strata", "scrub", "--cancel"]).unwrap();
        assert!(matches!(cli.command, Command::Scrub { cancel: true, .. }));
        let cli = Cli::try_parse_from(["strata", "scrub", "db", "--detach"]).unwrap();
        assert!(matches!(cli.command, Command::Scrub { detach: true, last: false, .. }));
        let cli = Cli::try_parse_from(["strata", "scrub", "--last"]).unwrap();
        assert!(matches!(cli.command, Command::Scrub { last: true, detach: false, .. }));
        for other in [["db", "--cancel"], ["--rate", "1M"]] {
            let mut args = vec!["strata", "scrub", "--cancel"];
            args.extend(other.iter().filter(|a| **a != "--cancel"));
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
        }
        for args in [["--last", "db"], ["--last", "--detach"], ["--cancel", "--detach"]] {
            let e = Cli::try_parse_from(["strata", "scrub", args[0], args[1]]).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
        }
    }

    #[test]
    fn cli_rejects_bad_size_with_reason() {
        let e =
            Cli::try_parse_from(["strata", "volume", "create", "a", "--size", "12Q"]).unwrap_err();
        assert!(e.to_string().contains("unknown unit"), "{e}");
    }

    #[test]
    fn serve_flags_parse() {
        let cli = Cli::try_parse_from([
            "strata",
            "serve",
            "--capacity-device",
            "/a",
            "--capacity-device",
            "/b",
            "--fill-low",
            "20%",
            "--nbd-listen",
            "127.0.0.1:0",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!()
        };
        assert_eq!(args.capacity_devices.len(), 2);
        assert_eq!(args.fill_low, Some(0.2));
    }

    #[test]
    fn log_runs_takes_a_value_as_the_other_flags_do() {
        let log_runs = |args: &[&str]| {
            let all = [&["strata", "serve"][..], args, &["--data-dir", "d"]].concat();
            match Cli::try_parse_from(all).map(|c| c.command) {
                Ok(Command::Serve(a)) => Ok(a.log_runs),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(log_runs(&[]), Ok(None));
        assert_eq!(log_runs(&["--log-runs"]), Ok(Some(true)));
        for (value, on) in [
            ("true", true),
            ("false", false),
            ("on", true),
            ("off", false),
        ] {
            assert_eq!(log_runs(&["--log-runs", value]), Ok(Some(on)), "{value}");
            assert_eq!(
                log_runs(&[&format!("--log-runs={value}")]),
                Ok(Some(on)),
                "{value}"
            );
        }
        let e = log_runs(&["--log-runs", "maybe"]).unwrap_err();
        assert!(e.contains("possible values: true, false, on, off"), "{e}");
    }

    #[test]
    fn a_negative_value_meets_the_options_own_parser() {
        let parse = |line: &str| parse_cli(line.split_whitespace().map(std::ffi::OsString::from));
        for (line, reason) in [
            ("strata volume create db --size -4K", "invalid size \"-4K\""),
            ("strata volume resize db --size -1", "invalid size \"-1\""),
            (
                "strata volume set-policy db --iops-limit -1",
                "'-1' for '--iops-limit <N>'",
            ),
            ("strata serve --fast-size -1G", "invalid size \"-1G\""),
            ("strata size --vms -3", "'-3' for '--vms <N>'"),
        ] {
            let e = parse(line).unwrap_err();
            let text = usage_error_line(&e.to_string());
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{line}: {text}"
            );
            assert!(
                text.contains(reason) && !text.contains("tip"),
                "{line}: {text}"
            );
        }
        // An optional value still stops at the next option.
        let cli = parse("strata serve --log-runs --data-dir d").unwrap();
        assert!(matches!(cli.command, Command::Serve(ref a) if a.log_runs == Some(true)));
        // So does a path: a forgotten directory is not taken from the next option.
        for line in [
            "strata serve --data-dir --fast-size=64M",
            "strata serve --fast-device --fast-size 64M",
            "strata serve --capacity-device --data-dir d",
            "strata serve --config --data-dir d",
            "strata --token-file --server http://h:9090 volume list",
        ] {
            let e = parse(line).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::InvalidValue,
                "{line}: {}",
                usage_error_line(&e.to_string())
            );
        }
        let cli = parse("strata serve --data-dir=-odd").unwrap();
        let odd = |a: &ServeArgs| a.data_dir.as_deref() == Some(std::path::Path::new("-odd"));
        assert!(matches!(cli.command, Command::Serve(ref a) if odd(a)));
        let e = parse("strata volume list -x").unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument, "{e}");
    }

    #[test]
    fn set_policy_without_an_option_is_a_usage_error() {
        let parse = |line: &str| parse_cli(line.split_whitespace().map(std::ffi::OsString::from));
        // Refused before the daemon is asked, so the exit status is 2, as for a missing argument.
        let e = parse("strata volume set-policy db").unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(
            usage_error_line(&e.to_string()).starts_with("nothing to change"),
            "{e}"
        );
        assert!(parse("strata volume set-policy db --iops-limit 0").is_ok());
    }

    #[test]
    fn io_reasons_are_short() {
        let e = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(io_reason(&e), "connection refused");
        // ENOSPC: no short form of its own, so the OS text is trimmed and lower-cased.
        let e = std::io::Error::from_raw_os_error(28);
        assert_eq!(io_reason(&e), "no space left on device");
    }

    #[test]
    fn one_line_joins() {
        assert_eq!(one_line("a\n  b\n\nc"), "a b c");
    }
}
