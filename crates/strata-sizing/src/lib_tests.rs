use super::*;
use clap::Parser;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    size: SizeArgs,
}

fn args(extra: &[&str]) -> Result<SizeArgs, clap::Error> {
    let mut all = vec!["size"];
    all.extend_from_slice(extra);
    Cli::try_parse_from(all).map(|c| c.size)
}

const DESIGN: &[&str] = &[
    "--vms",
    "32",
    "--iops-per-vm",
    "1500",
    "--capacity-per-vm",
    "300G",
    "--hosts",
    "4",
    "--cache-device",
    "sas-800g-mu-3dwpd",
    "--capacity-device",
    "d5-p4320-7.68t",
    "--capacity-per-host",
    "2",
];

#[test]
fn defaults_are_a_70_30_32k_raid1_workload() {
    let a = args(DESIGN).unwrap();
    assert_eq!(a.read_pct, 70.0);
    assert_eq!(a.block_size, 32 * 1024);
    assert_eq!(a.protection, Protection::Mirror { ftt: 1 });
    assert_eq!(a.peak_to_average, 1.0);
    assert_eq!(a.cache_per_host, 1);
    assert_eq!(a.capacity_fill_max, 0.8);
}

#[test]
fn bad_flags_are_refused_by_the_parser() {
    let with = |flag: &str, value: &str| {
        let mut v: Vec<&str> = DESIGN.to_vec();
        v.extend([flag, value]);
        args(&v).map(|_| ()).unwrap_err().to_string()
    };
    assert!(with("--read-pct", "120").contains("out of range"));
    assert!(with("--protection", "raid5").contains("invalid protection"));
    assert!(with("--block-size", "12Q").contains("unknown unit"));
    assert!(with("--peak-to-average", "0.5").contains("out of range"));
    assert!(with("--from-metrics", "http://x").contains("cannot be used with"));
    // Required flags, unless listing devices or reading the rate from a daemon.
    assert!(args(&["--vms", "3"]).is_err());
    assert!(args(&["--list-devices"]).is_ok());
    let no_iops: Vec<&str> = DESIGN
        .iter()
        .copied()
        .filter(|a| *a != "--iops-per-vm" && *a != "1500")
        .collect();
    assert!(args(&no_iops).is_err());
    let mut measured = no_iops.clone();
    measured.extend(["--from-metrics", "http://127.0.0.1:1"]);
    assert!(args(&measured).is_ok());
}

#[test]
fn json_report_has_the_figures_scripts_need() {
    let text = run(&args(DESIGN).unwrap(), true).unwrap().text;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // 32 x 1500 x 0.3 x 32 KiB = 450 MiB/s.
    let vm = v["evaluation"]["vm_write_bytes_per_s_avg"]
        .as_f64()
        .unwrap();
    assert!((vm - 450.0 * 1_048_576.0).abs() < 1e-3, "{vm}");
    assert_eq!(v["evaluation"]["write_amplification"].as_f64(), Some(2.0));
    assert_eq!(v["evaluation"]["cache"]["count"].as_u64(), Some(4));
    let per_cache = v["evaluation"]["cache"]["write_bytes_per_s_avg"]
        .as_f64()
        .unwrap();
    assert!((per_cache - vm * 2.0 / 4.0).abs() < 1e-3, "{per_cache}");
    assert_eq!(
        v["evaluation"]["checks"]["endurance_ok"].as_bool(),
        Some(false)
    );
    assert_eq!(v["workload"]["source"]["kind"].as_str(), Some("estimate"));
    assert_eq!(v["design"]["protection"]["kind"].as_str(), Some("mirror"));
    assert_eq!(
        v["design"]["cache_device"]["id"].as_str(),
        Some("sas-800g-mu-3dwpd")
    );
    let hosts = v["smallest_cluster"]["hosts"].as_u64().unwrap();
    assert!(hosts > 4, "{hosts}");
    assert_eq!(
        v["smallest_cluster"]["binding"][0].as_str(),
        Some("endurance")
    );
}

#[test]
fn table_names_every_check_and_the_binding_constraint() {
    let text = run(&args(DESIGN).unwrap(), false).unwrap().text;
    for needle in [
        "VM writes, average            450.00 MiB/s",
        "drive writes per day",
        "endurance rate (for the warranty)",
        "performance (peak)",
        "endurance (average)   FAIL",
        "capacity              ok",
        "Smallest cluster meeting all:",
        "(endurance binds;",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn a_mix_with_decimals_is_printed_with_them() {
    let mut extra = DESIGN.to_vec();
    extra.extend(["--read-pct", "99.5"]);
    let text = run(&args(&extra).unwrap(), false).unwrap().text;
    assert!(text.contains("99.5/0.5 read/write"), "{text}");
    assert!(text.contains("IOPS at 99.5/0.5,"), "{text}");
    let text = run(&args(DESIGN).unwrap(), false).unwrap().text;
    assert!(text.contains("70/30 read/write"), "{text}");
}

#[test]
fn unknown_devices_and_unreachable_daemons_are_errors() {
    let mut v: Vec<&str> = DESIGN.to_vec();
    let i = v.iter().position(|a| *a == "sas-800g-mu-3dwpd").unwrap();
    v[i] = "sas-800g";
    let e = run(&args(&v).unwrap(), false).unwrap_err();
    // The command line named a device the catalog lacks: a usage error (exit 2).
    assert!(e.is_usage_error(), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("unknown device \"sas-800g\"") && e.contains("sas-800g-mu-3dwpd"),
        "{e}"
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let mut m: Vec<&str> = DESIGN
        .iter()
        .copied()
        .filter(|a| *a != "--iops-per-vm" && *a != "1500")
        .collect();
    m.extend(["--from-metrics", &url]);
    let e = run(&args(&m).unwrap(), false).unwrap_err();
    assert!(
        !e.is_usage_error(),
        "an unreachable daemon is an error: {e}"
    );
    let e = e.to_string();
    assert!(
        e.contains("cannot reach the daemon: connection refused"),
        "{e}"
    );
    let mut f: Vec<&str> = DESIGN
        .iter()
        .copied()
        .filter(|a| *a != "--iops-per-vm" && *a != "1500")
        .collect();
    f.extend(["--from-metrics", "https://example.invalid"]);
    let e = run(&args(&f).unwrap(), false).unwrap_err();
    assert!(e.is_usage_error(), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("--from-metrics https://example.invalid: the URL must start with http://"),
        "{e}"
    );
}

#[test]
fn device_list_shows_every_entry() {
    let a = args(&["--list-devices"]).unwrap();
    let text = run(&a, false).unwrap().text;
    for d in Catalog::builtin().devices() {
        assert!(text.contains(&d.id), "{} missing", d.id);
    }
    assert!(text.contains("0.2 DWPD (0.9 seq) x 5 years"), "{text}");
    let json: serde_json::Value = serde_json::from_str(&run(&a, true).unwrap().text).unwrap();
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), Catalog::builtin().devices().count());
    assert!(devices
        .iter()
        .all(|d| d["capacity_bytes"].as_u64().unwrap() > 0));
}

#[test]
fn a_read_only_mix_has_no_iops_ceiling_and_json_still_says_a_number() {
    let mut v: Vec<&str> = DESIGN.to_vec();
    v.extend(["--read-pct", "100"]);
    let text = run(&args(&v).unwrap(), true).unwrap().text;
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for tier in ["cache", "capacity"] {
        // Null means "not rated"; both devices are rated.
        let iops = &json["evaluation"][tier]["endurance_vm_iops"];
        assert_eq!(iops.as_f64(), Some(f64::MAX), "{tier}: {iops}");
    }
    let table = run(&args(&v).unwrap(), false).unwrap().text;
    assert!(table.contains("unlimited"), "{table}");
}

#[test]
fn the_check_lines_read_as_sentences_for_an_unrated_device_and_ftt_0() {
    let mut v: Vec<&str> = DESIGN.to_vec();
    let i = v.iter().position(|a| *a == "d5-p4320-7.68t").unwrap();
    v[i] = "hdd-1.2t-10k-sas";
    v.extend(["--protection", "ftt=0"]);
    let text = run(&args(&v).unwrap(), false).unwrap().text;
    let line = |start: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(start))
            .unwrap_or_else(|| panic!("no {start:?} line in\n{text}"))
            .to_string()
    };
    let endurance = line("endurance (average)");
    assert!(
        endurance.ends_with("of their endurance rate, capacity devices not rated (not checked)"),
        "{endurance}"
    );
    let design = line("Design:");
    assert!(design.contains("no redundancy, FTT=0 (1 copy)"), "{design}");
    assert!(!text.contains("RAID-1"), "{text}");
}
