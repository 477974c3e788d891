//! Strata's end-to-end tests: real clients (qemu-io, qemu-img, nbdcopy, nbdinfo, fio,
//! nbdfuse, a browser) against live daemons started by the tests, one module per subject.
//! They are one test binary, not one per file: each binary linked the shared code again, and
//! two dozen links were about two minutes of every clean build. A subject's tests run with
//! `cargo test --release -p strata --test e2e e2e_qemu::` (or nextest's
//! `-E 'binary(e2e) & test(/^e2e_qemu::/)'`).

mod common;
mod lifecycle;
mod snapshot;

mod e2e_api_contract;
mod e2e_bench;
mod e2e_cli;
mod e2e_crash;
mod e2e_crash_meta;
mod e2e_dashboard;
mod e2e_fio;
mod e2e_fs;
mod e2e_full;
mod e2e_libnbd;
mod e2e_lifecycle;
mod e2e_nbd_model;
mod e2e_observe;
mod e2e_protocol;
mod e2e_qemu;
mod e2e_reconnect;
mod e2e_scrub;
mod e2e_serve;
mod e2e_size;
mod e2e_snapshot;
mod e2e_snapshot_data;
mod e2e_snapshot_writes;
mod e2e_tiering;
mod e2e_token;
mod e2e_wear;
