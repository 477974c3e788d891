//! Unit tests of size parsing, the merge of flags, file and defaults, and validation.
use super::*;

#[test]
fn sizes_parse_with_binary_units() {
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("512K"), Ok(512 << 10));
    assert_eq!(parse_size("64M"), Ok(64 << 20));
    assert_eq!(parse_size("1G"), Ok(1 << 30));
    assert_eq!(parse_size("1GiB"), Ok(1 << 30));
    assert_eq!(parse_size("1gb"), Ok(1 << 30));
    assert_eq!(parse_size("16T"), Ok(16 << 40));
    assert_eq!(parse_size(" 8 G "), Ok(8 << 30));
    assert_eq!(parse_size("0"), Ok(0));
    assert_eq!(parse_size("1.5G"), Ok(3 << 29));
    assert_eq!(parse_size("0.25M"), Ok(256 << 10));
    assert_eq!(parse_size(&format_size(3 << 29)), Ok(3 << 29));
}

#[test]
fn sizes_format_for_people() {
    assert_eq!(format_size(0), "0 B");
    assert_eq!(format_size(512), "512 B");
    assert_eq!(format_size(8 << 30), "8 GiB");
    assert_eq!(format_size(3 << 29), "1.5 GiB");
    assert_eq!(format_size(16 << 40), "16 TiB");
    assert_eq!(parse_size(&format_size(16 << 40)), Ok(16 << 40));
    // Rounded to a tenth, a size just short of a unit reads as that unit, never as 1024.0.
    assert_eq!(format_size((1 << 20) - 1), "1.0 MiB");
    assert_eq!(format_size((1 << 30) - 4096), "1.0 GiB");
    assert_eq!(format_size((1 << 20) - 60 * 1024 - 1), "964.0 KiB");
    assert_eq!(format_size(u64::MAX), "16384.0 PiB");
}

#[test]
fn garbage_sizes_are_rejected_with_a_reason() {
    for bad in ["", "G", "abc", "-1", "1.1", "1.1G", ".5G", "1.G", "1.2.3M", "12Q", "1 G B"] {
        let e = parse_size(bad).unwrap_err();
        assert!(e.starts_with("invalid size"), "{bad}: {e}");
        assert!(!e.contains('\n'));
    }
    assert!(parse_size("99999999999999999999")
        .unwrap_err()
        .contains("too large"));
    assert!(parse_size("100000P").unwrap_err().contains("too large"));
    assert!(parse_size("1.1G").unwrap_err().contains("whole number of bytes"));
}

#[test]
fn ratios_and_percentages() {
    assert_eq!(parse_ratio("0.3"), Ok(0.3));
    assert_eq!(parse_ratio("30%"), Ok(0.3));
    assert_eq!(parse_ratio("1"), Ok(1.0));
    assert!(parse_ratio("30").unwrap_err().contains("out of range"));
    assert!(parse_ratio("-0.1").is_err());
    assert!(parse_ratio("x%").is_err());
}

#[test]
fn defaults_when_nothing_is_given() {
    let c = merge(&ServeArgs::default(), FileConfig::default()).unwrap();
    assert_eq!(c.data_dir, PathBuf::from("./strata-data"));
    assert_eq!(c.fast_device, PathBuf::from("./strata-data/fast.img"));
    assert_eq!(
        c.capacity_devices,
        vec![PathBuf::from("./strata-data/capacity-0.img")]
    );
    assert_eq!(c.fast_size_bytes, 1 << 30);
    assert_eq!(c.capacity_size_bytes, 16 << 30);
    assert_eq!(c.nbd_listen.to_string(), "127.0.0.1:10809");
    assert_eq!(c.http_listen.to_string(), "127.0.0.1:9090");
    assert_eq!(c.default_volume_size_bytes, 8 << 30);
    assert_eq!(c.engine.fill_ratio_low, 0.30);
    assert_eq!(c.durable_write, strata_device::DurableWrite::WriteThenSync);
    assert!(!c.engine.log_runs, "runs of the log are off by default");
}

#[test]
fn log_runs_come_from_the_flag_over_the_file() {
    let on = || parse_file("log_runs = true").unwrap();
    assert!(merge(&ServeArgs::default(), on()).unwrap().engine.log_runs);
    let off = ServeArgs {
        log_runs: Some(false),
        ..Default::default()
    };
    let merged = merge(&off, on()).unwrap();
    assert!(!merged.engine.log_runs, "flag wins over file");
    assert!(parse_file("log_runs = \"yes\"").is_err(), "not a boolean");
}

/// Skipping unreadable log batches gives up writes: a flag for one start, never a standing
/// setting of the config file.
#[test]
fn skipping_damaged_log_batches_is_a_flag_only() {
    let skips = |args: &ServeArgs| {
        let merged = merge(args, parse_file("").unwrap()).unwrap();
        merged.engine.skip_damaged_log_batches
    };
    assert!(!skips(&ServeArgs::default()));
    let asked = ServeArgs {
        skip_damaged_log_batches: true,
        ..Default::default()
    };
    assert!(skips(&asked));
    let e = parse_file("skip_damaged_log_batches = true").unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("skip_damaged_log_batches"), "{e}");
}

#[test]
fn flags_override_file_override_defaults() {
    let file = parse_file(
        r#"
        data_dir = "/srv/strata"
        fast_size = "2G"
        capacity_size = 1073741824
        nbd_listen = "127.0.0.1:0"
        fill_low = "20%"
        fill_high = 0.9
        max_connections = 8
        durable_write = "dsync"
        "#,
    )
    .unwrap();
    let args = ServeArgs {
        fast_size: Some(4 << 30),
        fill_high: Some(0.8),
        ..Default::default()
    };
    let c = merge(&args, file).unwrap();
    assert_eq!(c.data_dir, PathBuf::from("/srv/strata"));
    assert_eq!(c.fast_device, PathBuf::from("/srv/strata/fast.img"));
    assert_eq!(c.fast_size_bytes, 4 << 30, "flag wins over file");
    assert_eq!(c.capacity_size_bytes, 1 << 30, "file wins over default");
    assert_eq!(c.nbd_listen.port(), 0);
    assert_eq!(c.http_listen.to_string(), "127.0.0.1:9090");
    assert_eq!(c.engine.fill_ratio_low, 0.2);
    assert_eq!(c.engine.fill_ratio_high, 0.8);
    assert_eq!(c.max_connections, 8);
    assert_eq!(c.durable_write, strata_device::DurableWrite::Dsync);
    let args = ServeArgs {
        durable_write: Some("write-then-sync".into()),
        ..Default::default()
    };
    let file = parse_file("durable_write = \"dsync\"").unwrap();
    assert_eq!(
        merge(&args, file).unwrap().durable_write,
        strata_device::DurableWrite::WriteThenSync,
        "flag wins over file"
    );
}

#[test]
fn idle_destage_defaults_to_a_second_and_can_be_set_or_turned_off() {
    use std::time::Duration;
    let c = merge(&ServeArgs::default(), FileConfig::default()).unwrap();
    assert_eq!(c.engine.idle_destage_after, Some(Duration::from_secs(1)));
    let file = parse_file("idle_destage_after = \"off\"").unwrap();
    let c = merge(&ServeArgs::default(), file).unwrap();
    assert_eq!(c.engine.idle_destage_after, None, "off in the file");
    let file = parse_file("idle_destage_after = \"off\"").unwrap();
    let args = ServeArgs {
        idle_destage_after: Some(parse_duration_arg("30s").unwrap()),
        ..Default::default()
    };
    let c = merge(&args, file).unwrap();
    assert_eq!(
        c.engine.idle_destage_after,
        Some(Duration::from_secs(30)),
        "flag wins over file"
    );
    let file = parse_file("idle_destage_after = \"soon\"").unwrap();
    let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
    assert!(
        e.starts_with("idle_destage_after in the config file"),
        "{e}"
    );
}

#[test]
fn nbd_timeouts_come_from_the_flag_over_the_file_and_stalls_are_always_bounded() {
    use std::time::Duration;
    let c = merge(&ServeArgs::default(), FileConfig::default()).unwrap();
    assert_eq!(
        c.nbd_idle_timeout, None,
        "idle connections are kept by default"
    );
    assert_eq!(c.nbd_stall_timeout, Duration::from_secs(120));
    let server = c.nbd_server();
    assert!(server.idle_timeout.is_zero(), "zero is off for the server");
    assert_eq!(server.stall_timeout, Duration::from_secs(120));
    assert_eq!(server.max_connections, DEFAULT_MAX_CONNECTIONS);

    let file = || parse_file("nbd_idle_timeout = \"30m\"\nnbd_stall_timeout = \"30s\"").unwrap();
    let server = merge(&ServeArgs::default(), file()).unwrap().nbd_server();
    assert_eq!(server.idle_timeout, Duration::from_secs(1800));
    assert_eq!(server.stall_timeout, Duration::from_secs(30));
    let args = ServeArgs {
        nbd_idle_timeout: Some(parse_duration_arg("off").unwrap()),
        nbd_stall_timeout: Some(parse_duration_arg("5m").unwrap()),
        ..Default::default()
    };
    let server = merge(&args, file()).unwrap().nbd_server();
    assert!(server.idle_timeout.is_zero(), "flag off wins over file");
    assert_eq!(
        server.stall_timeout,
        Duration::from_secs(300),
        "flag wins over file"
    );

    let off = ServeArgs {
        nbd_stall_timeout: Some(parse_duration_arg("off").unwrap()),
        ..Default::default()
    };
    let in_file = || parse_file("nbd_stall_timeout = \"0\"").unwrap();
    let over_it = ServeArgs {
        nbd_stall_timeout: Some(parse_duration_arg("5m").unwrap()),
        ..Default::default()
    };
    for (e, start) in [
        (
            merge(&off, FileConfig::default()),
            "nbd-stall-timeout cannot be off",
        ),
        (
            merge(&ServeArgs::default(), in_file()),
            "nbd_stall_timeout in the config file cannot be off",
        ),
        (
            merge(&over_it, in_file()),
            "nbd_stall_timeout in the config file cannot be off",
        ),
    ] {
        let e = e.unwrap_err().to_string();
        assert!(e.starts_with(start), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
    let file = parse_file("nbd_idle_timeout = \"2 s\"").unwrap();
    let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
    assert!(e.starts_with("nbd_idle_timeout in the config file"), "{e}");
}

/// A value in the file that a flag overrides is still checked: the next start without the
/// flag would take it.
#[test]
fn values_in_the_file_are_checked_also_when_a_flag_overrides_them() {
    let cases: [(&str, ServeArgs, &str); 10] = [
        (
            "nbd_listen = \"127.0.0.1\"",
            ServeArgs {
                nbd_listen: Some("127.0.0.1:0".into()),
                ..Default::default()
            },
            "nbd_listen in the config file: invalid NBD listen address",
        ),
        (
            "http_listen = \"nowhere:x\"",
            ServeArgs {
                http_listen: Some("127.0.0.1:0".into()),
                ..Default::default()
            },
            "http_listen in the config file: invalid HTTP listen address",
        ),
        (
            "nbd_idle_timeout = \"2 s\"",
            ServeArgs {
                nbd_idle_timeout: Some(parse_duration_arg("off").unwrap()),
                ..Default::default()
            },
            "nbd_idle_timeout in the config file",
        ),
        (
            "scrub_interval = \"weekly\"",
            ServeArgs {
                scrub_interval: Some(parse_duration_arg("1d").unwrap()),
                ..Default::default()
            },
            "scrub_interval in the config file",
        ),
        (
            "idle_destage_after = \"-1s\"",
            ServeArgs {
                idle_destage_after: Some(parse_duration_arg("1s").unwrap()),
                ..Default::default()
            },
            "idle_destage_after in the config file",
        ),
        (
            "wear_projection_after = \"soon\"",
            ServeArgs {
                wear_projection_after: Some(parse_projection_wait_arg("0").unwrap()),
                ..Default::default()
            },
            "wear_projection_after in the config file",
        ),
        (
            "io_backend = \"aio\"",
            ServeArgs {
                io_backend: Some("threads".into()),
                ..Default::default()
            },
            "io_backend in the config file: unknown I/O backend \"aio\"",
        ),
        (
            "durable_write = \"fua\"",
            ServeArgs {
                durable_write: Some("dsync".into()),
                ..Default::default()
            },
            "durable_write in the config file: unknown durable write mode",
        ),
        (
            "fast_emulate = \"bw=fast\"",
            ServeArgs {
                fast_emulate: Some("bw=400MB".into()),
                ..Default::default()
            },
            "fast_emulate in the config file",
        ),
        (
            "read_cache = \"95%\"",
            ServeArgs {
                read_cache: Some("auto".into()),
                ..Default::default()
            },
            "read_cache in the config file",
        ),
    ];
    for (text, args, start) in cases {
        let file = parse_file(text).unwrap();
        let e = merge(&args, file).map(drop).unwrap_err().to_string();
        assert!(e.starts_with(start), "{text}: {e}");
        assert!(!e.contains('\n'), "{text}: {e}");
        let file = parse_file(text).unwrap();
        let e = merge(&ServeArgs::default(), file).map(drop).unwrap_err();
        assert!(e.to_string().starts_with(start), "{text} alone: {e}");
    }
    // A token in the file that a token file overrides.
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "a-good-long-secret-of-enough-length\n").unwrap();
    let args = ServeArgs {
        http_token_file: Some(token_file),
        ..Default::default()
    };
    let file = parse_file("http_token = \"\"").unwrap();
    let e = merge(&args, file).map(drop).unwrap_err().to_string();
    assert!(e.starts_with("http_token in the config file"), "{e}");
}

#[test]
fn capacity_device_flags_replace_the_file_list() {
    let file = parse_file("capacity_devices = [\"/a\", \"/b\"]").unwrap();
    let c = merge(&ServeArgs::default(), file).unwrap();
    assert_eq!(c.capacity_devices.len(), 2);
    let file = parse_file("capacity_devices = [\"/a\", \"/b\"]").unwrap();
    let args = ServeArgs {
        capacity_devices: vec!["/c".into()],
        ..Default::default()
    };
    assert_eq!(
        merge(&args, file).unwrap().capacity_devices,
        vec![PathBuf::from("/c")]
    );
}

#[test]
fn unknown_keys_are_an_error_naming_key_and_line() {
    let e = parse_file("data_dir = \"/x\"\nfast_sise = \"1G\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fast_sise"), "{e}");
    assert!(e.contains("line 2"), "{e}");
    assert!(!e.contains('\n'), "{e}");
}

#[test]
fn bad_values_in_the_file_name_the_line_and_what_is_wanted() {
    for (text, wanted) in [
        ("data_dir = \"/x\"\nfast_size = \"lots\"", "invalid size"),
        ("data_dir = \"/x\"\nfast_size = \"1.1G\"", "whole number of bytes"),
        ("data_dir = \"/x\"\nfast_size = -5", "a size: a byte count"),
        ("data_dir = \"/x\"\nfill_low = 3", "out of range"),
        ("data_dir = \"/x\"\nfill_low = true", "a ratio from 0 to 1"),
    ] {
        let e = parse_file(text).unwrap_err().to_string();
        assert!(e.starts_with("line 2: "), "{text}: {e}");
        assert!(e.contains(wanted), "{text}: {e}");
        assert!(!e.contains("untagged"), "{text}: {e}");
    }
    let file = parse_file("fast_size = \"1.5G\"\nfill_low = \"20%\"").unwrap();
    let c = merge(&ServeArgs::default(), file).unwrap();
    assert_eq!(c.fast_size_bytes, 3 << 29);
    assert_eq!(c.engine.fill_ratio_low, 0.2);
}

#[test]
fn fill_marks_must_be_ordered() {
    let args = ServeArgs {
        fill_low: Some(0.7),
        fill_high: Some(0.3),
        ..Default::default()
    };
    let e = merge(&args, FileConfig::default()).unwrap_err().to_string();
    assert!(e.contains("must be below"), "{e}");
}

#[test]
fn misaligned_or_zero_sizes_are_refused() {
    let args = ServeArgs {
        fast_size: Some(1000),
        ..Default::default()
    };
    assert!(merge(&args, FileConfig::default()).is_err());
    let args = ServeArgs {
        capacity_size: Some(0),
        ..Default::default()
    };
    assert!(merge(&args, FileConfig::default()).is_err());
    let args = ServeArgs {
        default_volume_size: Some(0),
        ..Default::default()
    };
    assert!(
        merge(&args, FileConfig::default()).is_ok(),
        "0 means no default volume"
    );
}

#[test]
fn bad_addresses_and_backends_are_refused() {
    let args = ServeArgs {
        nbd_listen: Some("nonsense".into()),
        ..Default::default()
    };
    assert!(merge(&args, FileConfig::default())
        .unwrap_err()
        .to_string()
        .contains("NBD listen address"));
    let args = ServeArgs {
        io_backend: Some("aio".into()),
        ..Default::default()
    };
    assert!(merge(&args, FileConfig::default()).is_err());
    let args = ServeArgs {
        durable_write: Some("fua".into()),
        ..Default::default()
    };
    let err = merge(&args, FileConfig::default()).unwrap_err().to_string();
    assert!(err.contains("durable write mode \"fua\""), "{err}");
    assert!(err.contains("write-then-sync or dsync"), "{err}");
}

#[test]
fn the_same_device_twice_is_refused() {
    let args = ServeArgs {
        fast_device: Some("/d".into()),
        capacity_devices: vec!["/d".into()],
        ..Default::default()
    };
    assert!(merge(&args, FileConfig::default())
        .unwrap_err()
        .to_string()
        .contains("named twice"));
}

#[test]
fn tokens_are_checked_compared_in_full_and_never_printed() {
    assert!(Token::new("short").unwrap_err().to_string().contains("at least 16"));
    assert!(Token::new("has a space in it 0123").is_err());
    let t = Token::new("  s3cret-token-0123456789 \n").unwrap();
    assert!(t.matches("s3cret-token-0123456789"));
    assert!(!t.matches("s3cret-token-012345678"), "a prefix is not the token");
    assert!(!t.matches("s3cret-token-01234567890"), "nor is a longer string");
    assert!(!t.matches("S3cret-token-0123456789"));
    assert!(!t.matches(""));
    assert_eq!(format!("{t:?}"), "Token(<redacted>)");
}

#[test]
fn listening_off_loopback_needs_a_token() {
    let args = ServeArgs {
        http_listen: Some("0.0.0.0:9090".into()),
        ..Default::default()
    };
    let e = merge(&args, FileConfig::default()).unwrap_err().to_string();
    assert!(e.contains("not loopback") && e.contains("http_token"), "{e}");
    assert!(!e.contains('\n'));
    let file = parse_file("http_token = \"a-long-enough-token-0001\"\n").unwrap();
    let c = merge(&args, file).unwrap();
    assert!(c.http_token.unwrap().matches("a-long-enough-token-0001"));
    let loopback = merge(&ServeArgs::default(), FileConfig::default()).unwrap();
    assert!(loopback.http_token.is_none());
}

#[test]
fn the_token_file_wins_and_its_errors_do_not_echo_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, "file-token-abcdefghijkl\nsecond line ignored\n").unwrap();
    let args = ServeArgs {
        http_token_file: Some(path.clone()),
        ..Default::default()
    };
    let file = parse_file("http_token = \"config-token-abcdefghij\"\n").unwrap();
    let c = merge(&args, file).unwrap();
    assert!(c.http_token.unwrap().matches("file-token-abcdefghijkl"));
    std::fs::write(&path, "tooshort-secret\n").unwrap();
    let e = format!("{:#}", merge(&args, FileConfig::default()).unwrap_err());
    assert!(e.contains("at least 16") && !e.contains("tooshort-secret"), "{e}");
    let missing = ServeArgs {
        http_token_file: Some(dir.path().join("missing")),
        ..Default::default()
    };
    let e = merge(&missing, FileConfig::default()).unwrap_err().to_string();
    assert!(e.contains("cannot read the HTTP token file"), "{e}");
}

#[test]
fn a_config_file_with_both_token_keys_is_refused() {
    let both = "http_token = \"config-token-abcdefghij\"\nhttp_token_file = \"/etc/strata/token\"\n";
    let e = merge(&ServeArgs::default(), parse_file(both).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("both http_token and http_token_file"), "{e}");
    assert!(!e.contains("config-token-abcdefghij"), "{e}");
}

/// `--wear-projection-after off` (and the file's key) means never project, as an
/// administrator reads it; `0` means at once. It meant at once for both, so a rated device
/// was warned about after a second of formatting writes.
#[test]
fn a_wear_projection_off_is_never_and_zero_is_at_once() {
    use clap::Parser;
    use std::time::Duration;
    let from_flag = |value: &str| {
        let cli = crate::Cli::try_parse_from(["strata", "serve", "--wear-projection-after", value])
            .unwrap();
        let crate::Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        merge(&args, FileConfig::default())
            .unwrap()
            .wear_projection_after
    };
    let from_file = |value: &str| {
        let file = parse_file(&format!("wear_projection_after = \"{value}\"")).unwrap();
        merge(&ServeArgs::default(), file)
            .unwrap()
            .wear_projection_after
    };
    for read in [from_flag, from_file] {
        assert_eq!(read("off"), None);
        assert_eq!(read("OFF"), None);
        assert_eq!(read("0"), Some(Duration::ZERO));
        assert_eq!(read("0s"), Some(Duration::ZERO));
        assert_eq!(read("12h"), Some(Duration::from_secs(12 * 3600)));
    }
    let default = merge(&ServeArgs::default(), FileConfig::default()).unwrap();
    assert_eq!(
        default.wear_projection_after,
        Some(crate::wear::PROJECTION_AFTER)
    );
    // The other durations keep `0` and `off` as one.
    assert_eq!(parse_duration("0"), parse_duration("off"));
    let e = parse_projection_wait("soon").unwrap_err();
    assert!(e.contains("or off)"), "{e}");
}

#[test]
fn durations_longer_than_ten_years_are_refused() {
    use std::time::Duration;
    assert_eq!(
        parse_duration("3650d"),
        Ok(Some(Duration::from_secs(3650 * 86_400)))
    );
    for absurd in ["3651d", "99999999999999999d", "18446744073709551615s"] {
        let e = parse_duration(absurd).unwrap_err();
        assert!(e.contains("too long"), "{absurd}: {e}");
    }
    let file = parse_file("scrub_interval = \"99999999999999999d\"").unwrap();
    let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
    assert!(e.starts_with("scrub_interval in the config file"), "{e}");
}

#[test]
fn a_default_volume_larger_than_a_volume_may_be_is_refused() {
    let args = |bytes| ServeArgs {
        default_volume_size: Some(bytes),
        ..Default::default()
    };
    let max = strata_engine::MAX_VOLUME_BYTES;
    assert!(merge(&args(max), FileConfig::default()).is_ok());
    let e = merge(&args(max + 4096), FileConfig::default())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("default-volume-size"), "{e}");
    let file = parse_file("default_volume_size = \"300T\"").unwrap();
    assert!(merge(&ServeArgs::default(), file).is_err());
}

#[test]
fn relative_paths_in_a_config_file_are_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let etc = dir.path().join("etc");
    std::fs::create_dir(&etc).unwrap();
    std::fs::write(etc.join("token"), "file-token-abcdefghijkl\n").unwrap();
    let config = etc.join("strata.toml");
    let text = "data_dir = \"data\"\nfast_device = \"/dev/nvme0n1\"\n\
        capacity_devices = [\"disks/c0.img\", \"/dev/sdb\"]\n\
        http_token_file = \"token\"\ncatalog_files = [\"catalog.toml\"]\n";
    std::fs::write(&config, text).unwrap();
    let args = ServeArgs {
        config: Some(config),
        ..Default::default()
    };
    let c = resolve(&args).unwrap();
    assert_eq!(c.data_dir, etc.join("data"));
    assert_eq!(c.fast_device, PathBuf::from("/dev/nvme0n1"));
    assert_eq!(
        c.capacity_devices,
        vec![etc.join("disks/c0.img"), PathBuf::from("/dev/sdb")]
    );
    assert_eq!(c.catalog_files, vec![etc.join("catalog.toml")]);
    assert!(c.http_token.unwrap().matches("file-token-abcdefghijkl"));
    // A flag's relative path stays relative to the working directory.
    let flagged = ServeArgs {
        data_dir: Some(PathBuf::from("here")),
        ..args
    };
    assert_eq!(resolve(&flagged).unwrap().data_dir, PathBuf::from("here"));
}

#[test]
fn empty_paths_are_refused() {
    for text in [
        "data_dir = \"\"",
        "fast_device = \"\"",
        "capacity_devices = [\"/a\", \"\"]",
    ] {
        let file = parse_file(text).unwrap();
        let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
        assert!(e.contains("is empty"), "{text}: {e}");
    }
}

#[test]
fn engine_limits_are_refused_before_any_device_is_made() {
    for (text, wanted) in [
        ("segment_size = \"512K\"", "segment size"),
        ("segment_size = \"2G\"", "segment size"),
        ("max_batch_size = \"32K\"", "max batch size"),
    ] {
        let file = parse_file(text).unwrap();
        let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
        assert!(e.contains(wanted), "{text}: {e}");
    }
}

/// A first start whose write batches cannot fit its segments or its log is refused before
/// any device is made, naming the flags to change and values that work.
#[test]
fn a_batch_too_large_for_a_new_group_names_the_flags_and_values_that_fit() {
    let dir = tempfile::tempdir().unwrap();
    let args = |segment: u64, fast: u64, batch: Option<u64>| ServeArgs {
        data_dir: Some(dir.path().join("data")),
        segment_size: Some(segment),
        fast_size: Some(fast),
        max_batch_size: batch,
        ..Default::default()
    };
    let batch_set = args(1 << 20, 32 << 20, Some(2 << 20));
    let e = merge(&batch_set, FileConfig::default())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "segment-size 1 MiB is too small for the max batch size (2 MiB): a write batch must fit in half a segment's data area, 500 KiB with segments of 1 MiB; use --segment-size 5M or more, or --max-batch-size 500K or less"
    );
    // A batch size not set is the engine's to fit to the group (auto_max_batch).
    let fitted = merge(&args(1 << 20, 32 << 20, None), FileConfig::default()).unwrap();
    assert!(fitted.engine.auto_max_batch && !fitted.engine.auto_segment_size);
    let too_large = args(16 << 20, 16 << 20, Some(4 << 20));
    let e = merge(&too_large, FileConfig::default())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "fast-size 16 MiB is too small for the max batch size (4 MiB): a write batch must fit in a quarter of the write log, 3 MiB with a fast tier of 16 MiB; use --fast-size 20M or more, or --max-batch-size 3M or less"
    );
    // The values offered work.
    for (segment, fast, batch) in [
        (5 << 20, 32 << 20, None),
        (1 << 20, 32 << 20, Some(500 << 10)),
        (16 << 20, 20 << 20, Some(4 << 20)),
        (16 << 20, 16 << 20, Some(3 << 20)),
    ] {
        let cfg = merge(&args(segment, fast, batch), FileConfig::default()).unwrap();
        let limits = strata_engine::BatchLimits::for_new_group(
            cfg.engine.segment_size_bytes,
            cfg.engine.format_version,
            cfg.fast_size_bytes,
        );
        let batch = cfg.engine.max_batch_bytes as u64;
        assert!(batch <= limits.segment_bytes && batch <= limits.log_bytes);
    }
    // A fast device that exists keeps its group's own geometry: the engine checks it.
    std::fs::create_dir(dir.path().join("data")).unwrap();
    std::fs::write(dir.path().join("data").join("fast.img"), b"").unwrap();
    assert!(merge(&args(1 << 20, 32 << 20, None), FileConfig::default()).is_ok());
}

/// The engine keeps at least 16 index nodes whatever the budget: a smaller `index-cache` was
/// taken and silently raised; it is refused with the least that is honoured.
#[test]
fn an_index_cache_below_what_the_engine_keeps_is_refused_with_the_minimum() {
    for text in ["index_cache = 0", "index_cache = \"100K\""] {
        let file = parse_file(text).unwrap();
        let e = merge(&ServeArgs::default(), file).unwrap_err().to_string();
        assert!(
            e.starts_with("index-cache (") && e.contains("must be at least 110 KiB"),
            "{text}: {e}"
        );
    }
    let args = ServeArgs {
        index_cache: Some(MIN_INDEX_CACHE_BYTES),
        ..Default::default()
    };
    let cfg = merge(&args, FileConfig::default()).unwrap();
    assert_eq!(cfg.engine.index_cache_bytes, 110 << 10);
}

/// A setting given under both its spellings is refused naming both lines (toml said "line 1:
/// duplicate field `capacity_devices`", a line and a name the file may not have).
#[test]
fn a_setting_given_under_both_spellings_names_both_lines() {
    let text =
        "fast_size = \"64M\"\ncapacity_device = [\"c1.img\"]\n\ncapacity_devices = [\"c2.img\"]\n";
    let e = parse_file(text).unwrap_err().to_string();
    assert_eq!(
        e,
        "line 4: `capacity_devices` sets what `capacity_device` on line 2 already sets: give one of them"
    );
    let text = "catalog_files = [\"a.toml\"]\ncatalog = [\"b.toml\"]\n";
    let e = parse_file(text).unwrap_err().to_string();
    assert!(
        e.starts_with("line 2: `catalog` sets what `catalog_files` on line 1"),
        "{e}"
    );
}

/// A negative count is refused in words, not in Rust's type names.
#[test]
fn a_negative_count_is_refused_in_words() {
    let e = parse_file("max_connections = -1").unwrap_err().to_string();
    assert!(
        e.contains("line 1") && e.contains("expected a whole number, 0 or more"),
        "{e}"
    );
    assert!(!e.contains("usize"), "{e}");
}

/// A refused setting, a flag's or the config file's, is a usage error (exit 2) as clap's own
/// refusals are (`--fill-high 150%`); a file the settings name that cannot be read is a failed
/// start (exit 1). `--read-cache 0.95`, `--max-connections 0` and `--fill-low 0.8 --fill-high
/// 0.7` exited 1.
#[test]
fn refused_settings_are_usage_errors_and_unreadable_files_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let file = |text: &str| {
        let path = dir.path().join("strata.toml");
        std::fs::write(&path, text).unwrap();
        Some(path)
    };
    let refused = [
        ServeArgs {
            read_cache: Some("0.95".into()),
            ..Default::default()
        },
        ServeArgs {
            max_connections: Some(0),
            ..Default::default()
        },
        ServeArgs {
            fill_low: Some(0.8),
            fill_high: Some(0.7),
            ..Default::default()
        },
        ServeArgs {
            config: file("max_connections = 0\n"),
            ..Default::default()
        },
        ServeArgs {
            config: file("fill_high = \"150%\"\n"),
            ..Default::default()
        },
    ];
    for args in refused {
        let e = resolve(&args).unwrap_err();
        assert!(e.is::<crate::UsageError>(), "{args:?}: {e:#}");
    }
    let missing = dir.path().join("missing");
    let unreadable = [
        ServeArgs {
            config: Some(missing.clone()),
            ..Default::default()
        },
        ServeArgs {
            http_token_file: Some(missing),
            ..Default::default()
        },
    ];
    for args in unreadable {
        let e = resolve(&args).unwrap_err();
        assert!(!e.is::<crate::UsageError>(), "{args:?}: {e:#}");
        assert!(format!("{e:#}").starts_with("cannot read"), "{e:#}");
    }
}
