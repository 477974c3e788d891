use super::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write catalog");
    path
}

const USER_ENTRY: &str = r#"
[[device]]
id = "My-Cache"
name = "lab cache"
media = "tlc"
capacity_gb = 1000
tbw = 1825
warranty_years = 5
seq_read_mb_per_s = 3000
seq_write_mb_per_s = 1500
random_read_iops = 400000
random_write_iops = 100000
preferred_write_bytes = 4096
"#;

#[test]
fn builtin_catalog_has_the_devices_of_the_source_material() {
    let c = Catalog::builtin();
    let ids: Vec<&str> = c.devices().map(|d| d.id.as_str()).collect();
    for id in [
        "optane-p5800x-400g",
        "optane-p4800x-375g",
        "optane-p4800x-750g",
        "sas-800g-mu-3dwpd",
        "nvme-1600g-mu-3dwpd",
        "d7-p5510-3.84t",
        "d5-p4320-7.68t",
        "hdd-1.2t-10k-sas",
    ] {
        assert!(ids.contains(&id), "{id} missing from {ids:?}");
    }
    for d in c.devices() {
        assert!(d.source.is_some(), "{} has no source", d.id);
        assert_eq!(d.origin, "built-in");
    }
}

#[test]
fn builtin_ratings_convert_to_bytes() {
    let c = Catalog::builtin();
    let p5800x = c.get("optane-p5800x-400g").unwrap();
    assert_eq!(p5800x.capacity_bytes, 400_000_000_000);
    // 100 DWPD x 400 GB x 365 x 5 = 73 PB.
    let e = p5800x.endurance.unwrap();
    assert!((e.endurance_bytes - 73e15).abs() < 1.0, "{e:?}");
    assert_eq!(p5800x.media, MediaKind::Scm);
    // Section 3: 100 DWPD at 400 GB is about 16x the endurance of 3 DWPD at 800 GB.
    let sas = c.get("sas-800g-mu-3dwpd").unwrap().endurance.unwrap();
    let ratio = e.endurance_bytes / sas.endurance_bytes;
    assert!(
        (ratio - 100.0 * 400.0 / (3.0 * 800.0)).abs() < 1e-9 && ratio > 16.0,
        "{ratio}"
    );
    let qlc = c.get("d5-p4320-7.68t").unwrap();
    let qe = qlc.endurance.unwrap();
    assert!((qe.budget_bytes(false) - 7.68e12 * 0.2 * 365.0 * 5.0).abs() < 1.0);
    assert!((qe.budget_bytes(true) - 7.68e12 * 0.9 * 365.0 * 5.0).abs() < 1.0);
    assert!((qlc.rated_dwpd(true).unwrap() - 0.9).abs() < 1e-9);
    assert_eq!(c.get("hdd-1.2t-10k-sas").unwrap().endurance, None);
    assert!((c.get("sas-800g-mu-3dwpd").unwrap().seq_write_bytes_per_s - 1e9).abs() < 1e-3);
}

#[test]
fn user_file_adds_and_overrides_entries() {
    let dir = tempfile::tempdir().unwrap();
    let added = write(dir.path(), "add.toml", USER_ENTRY);
    let override_text = USER_ENTRY
        .replace("My-Cache", "optane-p5800x-400g")
        .replace("lab cache", "replaced");
    let replaced = write(dir.path(), "override.toml", &override_text);
    let c = Catalog::load(&[added.clone(), replaced]).unwrap();
    // Ids are case-insensitive.
    let mine = c.get("my-cache").unwrap();
    assert_eq!(mine.id, "my-cache");
    assert_eq!(mine.origin, added.display().to_string());
    // 1825 TBW over 5 years is 1 DWPD of 1 TB.
    assert!((mine.rated_dwpd(false).unwrap() - 1.0).abs() < 1e-9);
    assert_eq!(c.get("OPTANE-P5800X-400G").unwrap().name, "replaced");
    assert_eq!(
        c.devices().count(),
        Catalog::builtin().devices().count() + 1
    );
}

#[test]
fn malformed_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("syntax.toml", "[[device]\nid = ".to_string(), "syntax.toml"),
        (
            "unknown.toml",
            USER_ENTRY.replace("media = \"tlc\"", "media = \"tlc\"\ncolour = 1"),
            "colour",
        ),
        (
            "media.toml",
            USER_ENTRY.replace("\"tlc\"", "\"plc\""),
            "plc",
        ),
        (
            "both.toml",
            USER_ENTRY.replace("tbw = 1825", "tbw = 1825\ndwpd = 1"),
            "not both",
        ),
        (
            "years.toml",
            USER_ENTRY.replace("warranty_years = 5", ""),
            "warranty_years",
        ),
        (
            "negative.toml",
            USER_ENTRY.replace("capacity_gb = 1000", "capacity_gb = -1"),
            "capacity_gb",
        ),
        (
            "unit.toml",
            USER_ENTRY.replace("4096", "1000"),
            "multiple of 512",
        ),
        (
            "tiny.toml",
            USER_ENTRY.replace("capacity_gb = 1000", "capacity_gb = 1e-10"),
            "less than 1 MiB",
        ),
        ("twice.toml", format!("{USER_ENTRY}{USER_ENTRY}"), "twice"),
        ("id.toml", USER_ENTRY.replace("My-Cache", "my cache"), "id"),
    ];
    for (name, text, needle) in cases {
        let path = write(dir.path(), name, &text);
        let e = Catalog::load(&[path]).unwrap_err().to_string();
        assert!(e.contains(name), "{name}: {e}");
        assert!(e.contains(needle), "{name}: {e}");
        assert!(!e.contains('\n'), "{name}: not one line: {e}");
    }
    let missing = dir.path().join("missing.toml");
    let e = Catalog::load(&[missing]).unwrap_err().to_string();
    assert!(e.contains("missing.toml: no such file"), "{e}");
}

#[test]
fn unknown_ids_list_close_matches() {
    let c = Catalog::builtin();
    let e = c.get("optane-p5800x-40g").unwrap_err().to_string();
    assert!(e.contains("did you mean optane-p5800x-400g"), "{e}");
    let e = c.get("p4800x").unwrap_err().to_string();
    assert!(
        e.contains("optane-p4800x-375g") && e.contains("optane-p4800x-750g"),
        "{e}"
    );
    let e = c
        .get("zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz")
        .unwrap_err()
        .to_string();
    assert!(
        !e.contains("did you mean") && e.contains("--list-devices"),
        "{e}"
    );
}

#[test]
fn figures_beyond_any_device_are_refused() {
    let latency = "preferred_write_bytes = 4096\nread_latency_us = 1e300";
    let cases = [
        // An infinite endurance printed as null in JSON, which means "no rating".
        ("tbw = 1825", "tbw = 1e300", "tbw"),
        // Endurance rate so small that the load over it is infinite.
        ("tbw = 1825", "dwpd = 1e-320", "dwpd"),
        ("capacity_gb = 1000", "capacity_gb = 1e300", "capacity_gb"),
        (
            "warranty_years = 5",
            "warranty_years = 1e-300",
            "warranty_years",
        ),
        (
            "seq_read_mb_per_s = 3000",
            "seq_read_mb_per_s = 1e-320",
            "seq_read_mb_per_s",
        ),
        (
            "random_write_iops = 100000",
            "random_write_iops = 1e308",
            "random_write_iops",
        ),
        (
            "random_read_iops = 400000",
            "random_read_iops = nan",
            "random_read_iops",
        ),
        ("preferred_write_bytes = 4096", latency, "read_latency_us"),
    ];
    for (from, to, field) in cases {
        let text = USER_ENTRY.replace(from, to);
        let e = parse(&text, "t.toml").unwrap_err();
        assert!(e.contains(field) && e.contains("must be from"), "{to}: {e}");
    }
}

/// Every JSON null in `v`, by path.
fn nulls(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Null => out.push(path.to_string()),
        serde_json::Value::Object(m) => m
            .iter()
            .for_each(|(k, v)| nulls(v, &format!("{path}.{k}"), out)),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| nulls(v, &format!("{path}[{i}]"), out)),
        _ => {}
    }
}

/// A device with every figure at one end of its range.
fn corner_entry(id: &str, high: bool) -> String {
    let pick = |range: RangeInclusive<f64>| if high { *range.end() } else { *range.start() };
    format!(
        "[[device]]\nid = \"{id}\"\nname = \"corner\"\nmedia = \"tlc\"\n\
         capacity_gb = {:e}\ndwpd = {:e}\ndwpd_sequential = {:e}\nwarranty_years = {:e}\n\
         seq_read_mb_per_s = {:e}\nseq_write_mb_per_s = {:e}\n\
         random_read_iops = {:e}\nrandom_write_iops = {:e}\npreferred_write_bytes = 512\n",
        if high {
            *CAPACITY_GB_RANGE.end()
        } else {
            0.0011
        },
        pick(DWPD_RANGE),
        pick(DWPD_RANGE),
        pick(WARRANTY_YEARS_RANGE),
        pick(MB_PER_S_RANGE),
        pick(MB_PER_S_RANGE),
        pick(IOPS_RANGE),
        pick(IOPS_RANGE),
    )
}

#[test]
fn figures_at_the_ends_of_their_ranges_give_finite_reports() {
    use crate::plan::{Design, Workload};
    let text = format!(
        "{}{}",
        corner_entry("low", false),
        corner_entry("high", true)
    );
    let devices = parse(&text, "corners").unwrap();
    let tiny = Workload::estimated(1, 1e-300, 0.0, 512, 1, 1.0);
    let huge = Workload::estimated(u32::MAX, 1e8, 0.7, 16 << 20, u64::MAX, 1000.0);
    for w in [tiny, huge] {
        for (cache, capacity) in [(0, 1), (1, 0), (0, 0), (1, 1)] {
            let design = Design {
                hosts: 3,
                protection: crate::Protection::Mirror { ftt: 8 },
                cache_device: devices[cache].clone(),
                cache_per_host: 64,
                capacity_device: devices[capacity].clone(),
                capacity_per_host: 1024,
                capacity_fill_max: 1.0,
            };
            let report = crate::Report::new(w.clone(), design);
            let json = serde_json::to_value(&report.evaluation).unwrap();
            let mut found = Vec::new();
            nulls(&json, "evaluation", &mut found);
            assert!(found.is_empty(), "{cache}/{capacity}: null at {found:?}");
        }
    }
}

/// The catalog file example in docs/SIZING.md, as a reader copies it.
fn documented_entry() -> String {
    const DOC: &str = include_str!("../../../docs/SIZING.md");
    let start = DOC
        .find("```toml\n[[device]]")
        .expect("the [[device]] example");
    let body = &DOC[start + "```toml\n".len()..];
    body[..body.find("```").expect("its end")].to_string()
}

/// Every key of docs/SIZING.md's catalog example says whether it is required, and says it
/// truly: left out, a required key is refused and an optional one is not. An administrator
/// read `preferred_write_bytes` as optional, and the file was refused.
#[test]
fn the_documented_catalog_entry_says_which_keys_are_required() {
    let entry = documented_entry();
    parse(&entry, "SIZING.md").expect("the example as written");
    for line in entry.lines().filter(|l| l.contains(" = ")) {
        let key = line.split(" = ").next().unwrap_or("").trim();
        let comment = line.split_once('#').map_or("", |(_, c)| c.trim());
        let without: String = entry
            .lines()
            .filter(|l| *l != line)
            .map(|l| format!("{l}\n"))
            .collect();
        let left_out = parse(&without, "SIZING.md");
        if comment.starts_with("optional") {
            assert!(left_out.is_ok(), "{key} is optional, yet: {left_out:?}");
        } else if comment.starts_with("or:") {
            // The rating: dwpd or tbw (without dwpd_sequential, which goes with dwpd).
            let tbw: String = entry
                .replace(line, "tbw = 3504")
                .lines()
                .filter(|l| !l.starts_with("dwpd_sequential"))
                .map(|l| format!("{l}\n"))
                .collect();
            let rated = parse(&tbw, "SIZING.md");
            assert!(rated.is_ok(), "{key} or tbw: {rated:?}");
        } else {
            assert!(
                comment.starts_with("required"),
                "{key} says neither: {line:?}"
            );
            assert!(
                left_out.is_err(),
                "{key} is said required, yet left out it is taken"
            );
        }
    }
    let unrated: String = entry
        .lines()
        .filter(|l| !["dwpd", "warranty_years"].iter().any(|k| l.starts_with(k)))
        .map(|l| format!("{l}\n"))
        .collect();
    let devices = parse(&unrated, "SIZING.md").expect("an unrated device");
    assert_eq!(devices[0].endurance, None);
}
