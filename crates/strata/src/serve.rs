//! `strata serve`: start-up, the two listeners, signals and an orderly shutdown.
//!
//! SIGTERM, SIGINT and SIGHUP (the terminal that started the daemon closed) all ask for the
//! same clean stop: stop accepting (NBD and HTTP), let in-flight NBD requests finish (bounded
//! by [`DRAIN_TIMEOUT`]; volumes' IOPS and bandwidth limits no longer hold them), then `DiskGroup::shutdown()` makes everything durable, and exit 0.
//!
//! The handlers are installed before anything slow. A signal while the devices are opened
//! stops the creation of a fast-tier file (its temporary file, and whatever else the start
//! created, is removed); one while the disk group opens (log replay may take seconds) stops
//! the open at its next safe point (`OpenControl::abandon`: the devices are left as the next
//! start recovers them, nothing acknowledged lost), or, once the open is past its replay and
//! writing, lets it finish and closes the group cleanly. Either way the daemon exits 0
//! without serving.
//! Meanwhile the admin port answers every request with 503 and how far the start is
//! (startup.rs), from the moment it is bound.
//!
//! Once a stop has begun, a further signal exits at once with [`EXIT_CODE_FORCED`], but only
//! when it comes [`REPEAT_WINDOW`] (1 s) or more after the first: a sooner one is taken as the
//! same request delivered twice (GNU `timeout`, like some supervisors, signals both the
//! process and its process group) and is logged and ignored. (A stop begun by a server's
//! failure has no first signal: any signal then exits at once.) Writes already acknowledged
//! are durable regardless, since the engine acknowledges only durable writes.
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use strata_engine::{DiskGroup, EngineError, OpenControl};
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::adapter::{NbdBackend, Registry};
use crate::history::{spawn_sampler, History};
use crate::wear::{self, DeviceIdentity};
use crate::api::{self, AppState};
use crate::config::{self, ServeConfig};
use crate::devices;
use crate::notify;
use crate::read_cache::ReadCacheDecision;
use crate::startup::{Stage, Startup};
use crate::ServeArgs;

/// How long in-flight requests may take to finish once shutdown has begun.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long admin connections may take to finish their requests once shutdown has begun; past
/// it they are closed (a client that sent half a request) and only engine calls are waited for.
const HTTP_DRAIN_GRACE: Duration = Duration::from_secs(2);
/// How long the runtime waits for stray blocking tasks when the process ends.
const RUNTIME_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Exit code of a second signal during shutdown (128 + SIGINT, as shells report it).
const EXIT_CODE_FORCED: i32 = 130;
/// A signal this soon after the one that began the stop repeats that request; only a later
/// one forces an immediate exit.
const REPEAT_WINDOW: Duration = Duration::from_secs(1);

pub fn run(args: &ServeArgs) -> Result<()> {
    let cfg = config::resolve(args)?;
    init_logging();
    raise_open_files_limit(open_files_needed(&cfg));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("strata")
        .build()
        .map_err(|e| anyhow!("cannot start the async runtime: {}", crate::io_reason(&e)))?;
    let result = runtime.block_on(run_node(cfg));
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN_TIMEOUT);
    result
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A second initialisation (only possible in tests) is harmless, so its error is ignored.
    // A log line that cannot be written (stderr a closed pipe, or a terminal gone with its
    // SIGHUP) is dropped: with internal errors logged, tracing reported it with eprintln!,
    // which panicked on the same stderr and took the serving thread down (exit 101).
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .log_internal_errors(false)
        .try_init();
}

async fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        anyhow!(
            "cannot listen for {what} on {addr}: {}",
            crate::io_reason(&e)
        )
    })
}

/// The disk group, the I/O backend's name and the read cache's setting.
type Opened = (Arc<DiskGroup>, String, ReadCacheDecision);

/// Opens devices and the disk group (recovery may take a while: it runs off the runtime),
/// telling `startup` how far it is. Setting `abandon` stops the creation of a fast-tier file
/// ([`devices::open_devices`]) and the group's open until its replay ends (the error then
/// satisfies [`open_stopped`]).
async fn open_group(
    cfg: &ServeConfig,
    abandon: Arc<AtomicBool>,
    startup: Arc<Startup>,
) -> Result<Opened> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || {
        if !cfg.fast_device.exists() {
            startup.enter(Stage::CreatingFastFile);
        }
        let devs = devices::open_devices(&cfg, &abandon)?;
        let fast_name = devs.fast.name().to_string();
        // After opening: a capacity file created just now has a filesystem to look at.
        let devices = crate::read_cache::Devices {
            fast: &cfg.fast_device,
            capacity: &cfg.capacity_devices,
            capacity_emulated: cfg.emulation.capacity.is_some(),
        };
        let read_cache = crate::read_cache::decide(cfg.read_cache, &devices);
        tracing::info!(ratio = read_cache.ratio, setting = %read_cache.setting, reason = %read_cache.reason, "read cache");
        let engine = strata_engine::EngineConfig {
            read_cache_ratio: read_cache.ratio,
            ..cfg.engine.clone()
        };
        let created = devs.created;
        let ctl = OpenControl {
            abandon: abandon.clone(),
            ..OpenControl::default()
        };
        startup.enter(Stage::OpeningGroup {
            progress: ctl.progress.clone(),
        });
        tracing::info!(fast = %fast_name, "opening the disk group (replaying its write log)");
        let group = DiskGroup::open_with(devs.fast, devs.capacity, engine, true, &ctl)
            .map_err(|e| {
                // The devices are closed again by now.
                created.remove();
                match e {
                    EngineError::Cancelled(_) => anyhow::Error::new(e),
                    e => open_failed(&fast_name, &e),
                }
            })?;
        let report = group.open_report();
        let formatted = report.segment_size_bytes;
        tracing::info!(
            new_group = report.formatted,
            segment_size_bytes = formatted,
            max_batch_bytes = report.max_batch_bytes,
            "capacity segments of {}, write batches up to {}",
            crate::config::format_size(formatted),
            crate::config::format_size(report.max_batch_bytes as u64)
        );
        if let Some(note) = crate::devices::unused_segment_size(&cfg, formatted) {
            tracing::warn!(asked_bytes = cfg.engine.segment_size_bytes, segment_size_bytes = formatted, "{note}");
        }
        // Only into a group that never had a volume: one whose volumes were all deleted
        // stays empty, so a client of `vol0` does not find a new blank disk under that name.
        if cfg.default_volume_size_bytes > 0 && group.volume_table_is_new() {
            startup.enter(Stage::CreatingDefaultVolume);
            let info = group
                .create_volume(config::DEFAULT_VOLUME_NAME, cfg.default_volume_size_bytes)
                .map_err(|e| anyhow!("cannot create the default volume: {e}"))?;
            tracing::info!(volume = %info.name, size_bytes = info.size_bytes, "created the default volume");
        }
        Ok((group, devs.io_backend, read_cache))
    })
    .await
    .context("start-up task failed")?
}

/// Why the group could not be opened, with what to do when a capacity file's file system has
/// no room: an open writes the index (a few pages) after replaying the log (docs/FORMAT.md §9);
/// refused, it loses nothing, and the next start with room made opens the group
/// (`tests_room::an_open_with_no_room_at_all_fails_for_room_and_loses_nothing`).
fn open_failed(fast_name: &str, e: &EngineError) -> anyhow::Error {
    match e {
        EngineError::Device(d) if d.is_out_of_room() => anyhow!(
            "cannot open the disk group on {fast_name}: {e}. The file system under a capacity \
             file has no room for the index the open writes (a few MiB are enough); nothing \
             acknowledged is lost: make room on it and start again"
        ),
        e => anyhow!("cannot open the disk group on {fast_name}: {e}"),
    }
}

/// The signals that ask for a clean stop.
struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl Signals {
    fn new() -> Result<Signals> {
        let err =
            |e: std::io::Error| anyhow!("cannot install signal handlers: {}", crate::io_reason(&e));
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(err)?,
            int: signal(SignalKind::interrupt()).map_err(err)?,
            hup: signal(SignalKind::hangup()).map_err(err)?,
        })
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
            _ = self.hup.recv() => "SIGHUP",
        }
    }

    /// Once a stop has begun (during `what`; by a signal at `first`, if it was one): a later
    /// signal exits at once, unless it comes within [`REPEAT_WINDOW`] of the first, as the
    /// same request delivered twice.
    fn force_exit_on_another(mut self, first: Option<Instant>, what: &'static str) {
        tokio::spawn(async move {
            loop {
                let name = self.next().await;
                let after = first.map(|t| t.elapsed());
                if let Some(after) = after.filter(|a| *a < REPEAT_WINDOW) {
                    tracing::info!(
                        signal = name,
                        after_ms = after.as_millis() as u64,
                        "signal ignored: within {} s of the first it repeats that request; another one later exits at once",
                        REPEAT_WINDOW.as_secs()
                    );
                    continue;
                }
                // Not eprintln!: with the terminal gone (SIGHUP) the write fails, and that
                // must not stop the exit.
                let _ = writeln!(
                    std::io::stderr(),
                    "strata: {name} during {what}, exiting at once"
                );
                std::process::exit(EXIT_CODE_FORCED);
            }
        });
    }
}

/// Whether the group's open failed because `abandon` stopped it.
fn open_stopped(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(EngineError::Cancelled(_)))
}

/// Opens the disk group, or stops cleanly if a signal comes first: the creation of a
/// fast-tier file is abandoned, an open under way is stopped (or, past its replay, let finish
/// and the group closed). None when stopped (the daemon then exits 0), else the group and the
/// signals, still armed.
async fn open_or_stop(
    cfg: &ServeConfig,
    mut signals: Signals,
    startup: &Arc<Startup>,
) -> Result<Option<(Opened, Signals)>> {
    let abandon = Arc::new(AtomicBool::new(false));
    let open = open_group(cfg, abandon.clone(), startup.clone());
    tokio::pin!(open);
    let name = tokio::select! {
        opened = &mut open => return Ok(Some((opened?, signals))),
        name = signals.next() => name,
    };
    tracing::info!(signal = name, "stopping during start-up: a fast-tier file being created is abandoned; a disk group being opened stops opening (or, past its log's replay, is closed once open)");
    startup.enter(Stage::Stopping);
    notify::stopping("stopping during start-up");
    abandon.store(true, Ordering::Relaxed);
    signals.force_exit_on_another(Some(Instant::now()), "start-up");
    match open.await {
        Ok((group, ..)) => {
            close_group(group).await?;
            tracing::info!("stopped before serving");
        }
        Err(e) if devices::is_abandoned(&e) => {
            tracing::info!(reason = %e, "stopped before serving; the files this start created were removed");
        }
        // A group this start was making: its files, new, were removed (devices.rs says so).
        Err(e) if open_stopped(&e) && !cfg.fast_device.exists() => {
            tracing::info!("stopped before serving; the files this start created were removed");
        }
        Err(e) if open_stopped(&e) => {
            tracing::info!("stopped during start-up: the disk group's open was stopped before its log's replay ended, leaving the devices as the next start recovers them (the log replayed again, nothing acknowledged lost)");
        }
        Err(e) => return Err(e),
    }
    Ok(None)
}

/// Makes everything durable and closes the group (off the runtime: it waits for the engine).
/// A capacity tier out of room cannot take the index: the group stops as after a crash, with
/// everything acknowledged in its write log (durable there before it was acknowledged), which
/// the next start replays. That is still a stop that lost nothing, so it is no error.
async fn close_group(group: Arc<DiskGroup>) -> Result<()> {
    let closed = tokio::task::spawn_blocking(move || group.shutdown())
        .await
        .context("engine shutdown task failed")?;
    match closed {
        Ok(()) => {
            tracing::info!("shut down cleanly; everything acknowledged is durable");
            Ok(())
        }
        Err(strata_engine::EngineError::Device(d)) if d.is_out_of_room() => {
            tracing::warn!(
                "stopped without writing the index: the capacity tier is out of room ({d}). \
                 Everything acknowledged is durable in the write log, which the next start \
                 replays, as after a crash; make room on that file system"
            );
            Ok(())
        }
        Err(e) => Err(anyhow!("shutting down the disk group failed: {e}")),
    }
}

/// Resolves once shutdown has been asked for.
async fn shutdown_requested(mut rx: watch::Receiver<bool>) {
    // An error means the sender is gone, which also means shutting down.
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Descriptors the daemon may hold at once, about: one per NBD and admin connection at their
/// caps, the devices (each opened once, and again for a scrub's reads), and a margin for the
/// runtime, the listeners, logs and index files.
fn open_files_needed(cfg: &ServeConfig) -> u64 {
    let devices = 1 + cfg.capacity_devices.len().max(1);
    (cfg.max_connections + crate::http_server::MAX_HTTP_CONNECTIONS + 2 * devices + 128) as u64
}

/// Raises the soft limit of open files to the hard one. A daemon started from a shell gets
/// the usual soft limit of 1024 (the hard one is often far higher), which `--max-connections`
/// may pass: the NBD listener's accepts then failed with "Too many open files". Said at start
/// when even the hard limit is under what the caps need (`open_files_needed`).
fn raise_open_files_limit(needed: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls with a pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let soft = limit.rlim_cur;
    if soft < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above; raising the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
            limit.rlim_cur = soft;
        } else {
            tracing::debug!(from = soft, to = limit.rlim_cur, "open files limit raised");
        }
    }
    if limit.rlim_cur < needed {
        tracing::warn!(
            limit = limit.rlim_cur,
            needed,
            "the open files limit (ulimit -n, LimitNOFILE= in a systemd unit) is {}, under the \
             {needed} descriptors the connection caps may take (--max-connections and the \
             admin port's {}): connections past it will fail",
            limit.rlim_cur,
            crate::http_server::MAX_HTTP_CONNECTIONS
        );
    }
}

/// The one place that knows the NBD server's entry point.
fn spawn_nbd(
    listener: TcpListener,
    registry: Arc<Registry>,
    server_cfg: strata_nbd::ServerConfig,
    stop: watch::Receiver<bool>,
) -> JoinHandle<Result<()>> {
    let backend: Arc<dyn strata_nbd::Backend> = Arc::new(NbdBackend(registry));
    tokio::spawn(async move {
        strata_nbd::serve(listener, backend, server_cfg, shutdown_requested(stop))
            .await
            .map_err(|e| anyhow!("NBD server failed: {e}"))
    })
}

/// The admin port's server, from the moment its listener is bound: `app` answers 503 until
/// the node serves, then passes every request to the admin API (startup.rs). Its connections
/// are bounded in number and in how long they may take to send a request (http_server.rs).
fn spawn_http(
    listener: TcpListener,
    app: axum::Router,
    stop: watch::Receiver<bool>,
) -> JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let limits = crate::http_server::HttpLimits::default();
        crate::http_server::serve(listener, app, limits, shutdown_requested(stop)).await;
        Ok(())
    })
}

/// Writes the lines tests and scripts wait for. A closed stdout must not kill the daemon.
fn announce(io_backend: &str, nbd_addr: SocketAddr, http_addr: SocketAddr) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "strata: I/O backend {io_backend}");
    let _ = writeln!(out, "strata: NBD listening on {nbd_addr}");
    let _ = writeln!(out, "strata: HTTP API listening on http://{http_addr}");
    let _ = writeln!(out, "strata: ready");
    let _ = out.flush();
}

async fn run_node(cfg: ServeConfig) -> Result<()> {
    let started = Instant::now();
    // Before anything that takes time: a signal from here on stops the daemon cleanly.
    let signals = Signals::new()?;
    // Bind first: a busy port is reported before any device is touched.
    let nbd_listener = bind(cfg.nbd_listen, "NBD").await?;
    let http_listener = bind(cfg.http_listen, "HTTP").await?;
    let nbd_addr = nbd_listener.local_addr().context("NBD listener address")?;
    let http_addr = http_listener
        .local_addr()
        .context("HTTP listener address")?;
    tracing::info!(data_dir = %cfg.data_dir.display(), fast = %cfg.fast_device.display(), capacity = ?cfg.capacity_devices, %nbd_addr, %http_addr, "starting");

    let ratings = device_ratings(&cfg)?;
    // The admin port answers from here on: 503 with the start's progress until the node serves.
    let (stop_tx, stop_rx) = watch::channel(false);
    let startup = Startup::new();
    let start_reporter = notify::report_while(notify::start_status(startup.clone()));
    let mut http_task = spawn_http(http_listener, startup.router(), stop_rx.clone());
    let opened = open_or_stop(&cfg, signals, &startup).await;
    notify::stop_reporting(start_reporter);
    let Ok(Some(((group, io_backend, read_cache), mut signals))) = opened else {
        let _ = stop_tx.send(true);
        if let Err(e) = drain_http(http_task).await {
            tracing::error!(error = %format!("{e:#}"), "during shutdown");
        }
        return opened.map(|_| ());
    };
    let registry = Registry::new(group.clone());
    let history = History::new();
    let sampler_stop = Arc::new(AtomicBool::new(false));
    let sampler = spawn_sampler(registry.clone(), history.clone(), sampler_stop.clone())
        .map_err(|e| anyhow!("cannot start the sampler: {}", crate::io_reason(&e)))?;
    let state = Arc::new(AppState {
        registry: registry.clone(),
        started,
        nbd_addr,
        http_addr,
        io_backend: io_backend.clone(),
        history,
        token: cfg.http_token.clone(),
        devices: device_identities(&cfg, &group, &ratings),
        scrub: crate::api_scrub::ScrubConfig {
            interval: cfg.engine.scrub_interval,
            rate_bytes_per_s: cfg.engine.scrub_rate_bytes_per_s,
        },
        stopping: stop_rx.clone(),
        read_cache,
        space: Default::default(),
    });

    let mut nbd_task = spawn_nbd(nbd_listener, registry, cfg.nbd_server(), stop_rx.clone());
    let wear_task = spawn_wear_check(state.clone(), stop_rx);
    startup.serve(api::router(state));
    tracing::info!(%nbd_addr, %http_addr, volumes = group.volumes().len(), "serving");
    announce(&io_backend, nbd_addr, http_addr);
    notify::ready(&format!(
        "serving {} volume(s): NBD on {nbd_addr}, admin API on http://{http_addr}",
        group.volumes().len()
    ));
    // From here on (systemd starts its watchdog at READY=1): the probe takes the engine's locks.
    let watchdog = notify::spawn_watchdog({
        let group = group.clone();
        move || drop(group.stats())
    });

    // Until a signal, or until a server stops on its own (which is a failure).
    let mut failure: Option<anyhow::Error> = None;
    let (mut nbd_done, mut http_done) = (false, false);
    let mut signalled = None;
    tokio::select! {
        name = signals.next() => {
            signalled = Some(Instant::now());
            tracing::info!(signal = name, "shutting down: no new connections, finishing in-flight requests");
        }
        r = &mut nbd_task => { nbd_done = true; failure = Some(task_failure(r, "NBD server")); }
        r = &mut http_task => { http_done = true; failure = Some(task_failure(r, "HTTP server")); }
    }
    let _ = stop_tx.send(true);
    // Requests taken in are answered, not each in its turn under an IOPS or bandwidth limit
    // (at 1 IOPS a queue of 64 would hold the stop past DRAIN_TIMEOUT and be refused then).
    group.lift_limits();
    wear_task.abort();
    signals.force_exit_on_another(signalled, "shutdown");
    const STOPPING: &str = "stopping: finishing in-flight requests, then making everything durable";
    notify::stopping(STOPPING);
    let stop_reporter = notify::report_while(|| STOPPING.to_string());

    let drain = async {
        let mut results = Vec::new();
        if !nbd_done {
            results.push(task_result(nbd_task.await, "NBD server"));
        }
        if !http_done {
            results.push(drain_http(http_task).await);
        }
        results
    };
    match tokio::time::timeout(DRAIN_TIMEOUT, drain).await {
        Ok(results) => {
            for r in results {
                if let Err(e) = r {
                    tracing::error!(error = %format!("{e:#}"), "during shutdown");
                }
            }
        }
        Err(_) => tracing::warn!(
            timeout_s = DRAIN_TIMEOUT.as_secs(),
            "in-flight requests did not finish in time"
        ),
    }

    sampler_stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || sampler.join()).await;
    let closed = close_group(group).await;
    notify::stop_reporting(watchdog);
    notify::stop_reporting(stop_reporter);
    closed?;
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The catalog ratings of the fast and the capacity devices, looked up before any device is
/// touched: an unknown model or a broken catalog file stops start-up and changes nothing.
struct DeviceRatings {
    fast: Option<crate::wear::Rating>,
    capacity: Option<crate::wear::Rating>,
}

fn device_ratings(cfg: &ServeConfig) -> Result<DeviceRatings> {
    let catalog = crate::wear::load_catalog(&cfg.catalog_files)?;
    Ok(DeviceRatings {
        fast: crate::wear::rating_for(&catalog, cfg.fast_device_model.as_deref(), "fast")?,
        capacity: crate::wear::rating_for(
            &catalog,
            cfg.capacity_device_model.as_deref(),
            "capacity",
        )?,
    })
}

/// Names, tiers and catalog entries of the group's devices, fast first; a device far from
/// its model's size is warned about (its wear figures are off by the ratio).
fn device_identities(
    cfg: &ServeConfig,
    group: &DiskGroup,
    ratings: &DeviceRatings,
) -> Vec<DeviceIdentity> {
    let stats = group.stats();
    let fast_model = &cfg.fast_device_model;
    let fast = std::iter::once((stats.fast_device, "fast", fast_model, ratings.fast));
    let caps = stats
        .capacity_devices
        .into_iter()
        .map(|d| (d, "capacity", &cfg.capacity_device_model, ratings.capacity));
    fast.chain(caps)
        .map(|(device, tier, model, rating)| {
            let id = DeviceIdentity {
                rating,
                model: model.clone(),
                name: device.name,
                tier,
                projection_after_s: cfg.wear_projection_after.map(|d| d.as_secs()),
            };
            if let Some(note) = crate::wear::model_size_mismatch(&id, device.size_bytes) {
                tracing::warn!(device = id.name, "{note}");
            }
            id
        })
        .collect()
}

/// Looks at every device's wear each [`wear::CHECK_INTERVAL`] and logs a warning when a device
/// would wear out before its warranty ends at its average write rate: at once, then at most
/// hourly per device while it still would.
fn spawn_wear_check(state: Arc<AppState>, stop: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut limiter = wear::WarningLimiter::default();
        let mut tick = tokio::time::interval(wear::CHECK_INTERVAL);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown_requested(stop.clone()) => return,
            }
            let s = state.clone();
            let Ok(devices) =
                tokio::task::spawn_blocking(move || crate::api_observe::device_list(&s)).await
            else {
                continue;
            };
            for d in devices {
                let w = &d.wear;
                if limiter.should_warn(&d.stats.name, w.wears_out_before_warranty, Instant::now()) {
                    tracing::warn!(
                        device = %d.stats.name,
                        tier = d.tier,
                        model = w.model.as_deref().unwrap_or("?"),
                        write_bytes_per_s_avg = w.write_bytes_per_s_avg,
                        drive_writes_per_day = w.drive_writes_per_day,
                        projected_wear_out_unix_s = w.projected_wear_out_unix_s,
                        warranty_end_unix_s = w.warranty_end_unix_s,
                        "device would wear out before its warranty ends at its average write rate"
                    );
                }
            }
        }
    })
}

/// Lets the admin server finish its requests, but not wait on a client that sent half a
/// request: after [`HTTP_DRAIN_GRACE`] its connections are closed, and only the engine calls
/// still running (which go on without their client) are waited for.
async fn drain_http(mut task: JoinHandle<Result<()>>) -> Result<()> {
    if let Ok(r) = tokio::time::timeout(HTTP_DRAIN_GRACE, &mut task).await {
        return task_result(r, "HTTP server");
    }
    task.abort();
    tracing::info!(
        grace_s = HTTP_DRAIN_GRACE.as_secs(),
        "closed admin connections still open after the grace period"
    );
    while api::engine_calls_in_flight() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

fn task_result(r: Result<Result<()>, tokio::task::JoinError>, what: &str) -> Result<()> {
    match r {
        Ok(inner) => inner,
        Err(e) => Err(anyhow!("{what} task failed: {e}")),
    }
}

/// A server task that ended before shutdown was asked for.
fn task_failure(r: Result<Result<()>, tokio::task::JoinError>, what: &str) -> anyhow::Error {
    match task_result(r, what) {
        Ok(()) => anyhow!("{what} stopped unexpectedly"),
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_refused_for_room_says_to_make_room() {
        let full = EngineError::Device(strata_device::DeviceError::Io {
            device: "capacity-0.img".into(),
            offset: 1 << 20,
            source: std::io::Error::from_raw_os_error(28),
        });
        let said = open_failed("fast.img", &full).to_string();
        assert!(said.contains("No space left on device"), "{said}");
        assert!(said.contains("make room on it and start again"), "{said}");
        let other = EngineError::Corrupt("a bad checkpoint".into());
        let said = open_failed("fast.img", &other).to_string();
        assert!(!said.contains("make room"), "{said}");
    }
}
