//! The dashboard's rendering code run under node against a stub DOM: what a device's row says,
//! without a browser (the browser test, `tests/e2e_dashboard.rs`, only sees an unrated device).
use std::process::Command;

use serde_json::{json, Value};

const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// The page's definitions (formatting, charts, rendering): side-effect free, unlike polling.
fn rendering_code() -> &'static str {
    let from = DASHBOARD_HTML
        .find("// ---------- formatting")
        .expect("formatting section");
    let to = DASHBOARD_HTML
        .find("// ---------- polling")
        .expect("polling section");
    &DASHBOARD_HTML[from..to]
}

/// Whether node is there; a missing node fails the test where tools are mandatory.
fn have_node() -> bool {
    if Command::new("node").arg("--version").output().is_ok() {
        return true;
    }
    let mandatory =
        std::env::var_os("CI").is_some() || std::env::var_os("STRATA_REQUIRE_TOOLS").is_some();
    assert!(!mandatory, "node is not installed (Debian package nodejs)");
    eprintln!("!!!!!!!! SKIPPING TEST: node is not installed !!!!!!!!");
    false
}

/// The text of each cell of the devices table that `renderDevices` draws for `devices` (as
/// `/api/v1/devices` lists them); None without node.
fn device_rows(devices: Value) -> Option<Vec<Vec<String>>> {
    if !have_node() {
        return None;
    }
    let program = format!(
        "\"use strict\";\n\
         const nodes = {{}};\n\
         const document = {{ getElementById: id => nodes[id] || (nodes[id] = {{ tBodies: [{{}}], style: {{}} }}) }};\n\
         const st = {{ samples: [], devices: {devices} }};\n\
         {}\n\
         renderDevices();\n\
         console.log(document.getElementById(\"devices\").tBodies[0].innerHTML);\n",
        rendering_code()
    );
    let html = run_node(&program);
    let rows = html.split("</tr>").filter(|r| r.contains("<td"));
    Some(
        rows.map(|r| r.split("</td>").map(strip_tags).collect())
            .collect(),
    )
}

fn strip_tags(html: &str) -> String {
    let mut text = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.trim().to_string()
}

/// A rated fast device as `/api/v1/devices` lists it, with `wear` over the defaults.
fn rated_device(wear: Value) -> Value {
    let mut w = json!({
        "bytes_written_total": 8192, "first_use_unix_s": 1_700_000_000u64,
        "write_bytes_per_s_avg": 0.1, "write_bytes_per_s_recent": null, "drive_writes_per_day": 0.0,
        "model": "sas-800g-mu-3dwpd", "rated_endurance_bytes": 4.38e15, "endurance_used_ratio": 1.9e-12,
        "warranty_end_unix_s": 1_857_680_000u64, "projected_wear_out_unix_s": null,
        "wears_out_before_warranty": false
    });
    for (k, v) in wear.as_object().expect("an object") {
        w[k] = v.clone();
    }
    json!({"name": "/dev/fast", "tier": "fast", "disk_group": "dg0", "size_bytes": 800_000_000_000u64,
           "errors": 0, "checksum_errors_total": 0, "wear": w})
}

/// Column of the projected wear-out.
const WEAR_OUT: usize = 8;

#[test]
fn a_wear_out_past_the_year_9999_is_shown_not_thrown() {
    // 8 KiB written in a day on a device rated for 4.38 PB: wear-out in some 4.6e16 s, past
    // what a JavaScript Date holds; the daemon sends at most 2^64 - 1.
    let far = rated_device(json!({"projected_wear_out_unix_s": u64::MAX}));
    let near = rated_device(json!({"projected_wear_out_unix_s": 1_941_926_400u64}));
    let Some(rows) = device_rows(json!([far, near])) else {
        return;
    };
    assert!(rows[0][WEAR_OUT].starts_with("after 9999"), "{rows:?}");
    assert!(rows[1][WEAR_OUT].starts_with("2031-07-16"), "{rows:?}");
}

#[test]
fn a_written_device_not_yet_projected_is_too_early_as_in_strata_status() {
    // A day's bulk load in its first hour: written, not projected before a day of history.
    let loaded = rated_device(json!({"bytes_written_total": 100_000_000_000u64}));
    let fresh = rated_device(json!({"bytes_written_total": 0}));
    let Some(rows) = device_rows(json!([loaded, fresh])) else {
        return;
    };
    assert_eq!(rows[0][WEAR_OUT], "too early", "{rows:?}");
    assert_eq!(rows[1][WEAR_OUT], "not written yet", "{rows:?}");
}

#[test]
fn a_device_whose_projection_is_off_says_so_as_in_strata_status() {
    let off = rated_device(
        json!({"bytes_written_total": 100_000_000_000u64, "projection_after_s": null}),
    );
    let waiting = rated_device(
        json!({"bytes_written_total": 100_000_000_000u64, "projection_after_s": 86_400}),
    );
    let Some(rows) = device_rows(json!([off, waiting])) else {
        return;
    };
    assert_eq!(rows[0][WEAR_OUT], "projection off", "{rows:?}");
    assert_eq!(rows[1][WEAR_OUT], "too early", "{rows:?}");
}

/// What the page's code prints for the JavaScript expression `expr`; None without node.
fn shown(expr: &str) -> Option<String> {
    if !have_node() {
        return None;
    }
    let program = format!(
        "\"use strict\";\nconst st = {{ samples: [] }};\n{}\nconsole.log({expr});\n",
        rendering_code()
    );
    Some(run_node(&program).trim().to_string())
}

/// What `scrubText` says for a disk group's `scrub` part; None without node.
fn scrub_text(scrub: Value) -> Option<String> {
    shown(&format!("scrubText({scrub})"))
}

/// What `program` prints under node; it must succeed.
fn run_node(program: &str) -> String {
    let out = Command::new("node")
        .args(["-e", program])
        .output()
        .expect("run node");
    assert!(
        out.status.success(),
        "the dashboard failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn a_running_scrub_without_an_estimate_shows_what_it_read() {
    let Some(text) = scrub_text(json!({"running": true, "progress_bytes": 8192, "total_bytes": 0}))
    else {
        return;
    };
    assert_eq!(text, "running: 8.00 KiB read");
    let with = json!({"running": true, "progress_bytes": 1u64 << 30, "total_bytes": 4u64 << 30});
    let text = scrub_text(with).unwrap();
    assert!(
        text.starts_with("running: ") && text.contains(" of about "),
        "{text}"
    );
}

#[test]
fn sizes_just_short_of_a_unit_are_shown_in_the_next_one() {
    let cases = [
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        ((1 << 20) - 1, "1.00 MiB"),
        ((1 << 30) - 1, "1.00 GiB"),
        (10_485_759, "10.0 MiB"),
        (104_857_599, "100 MiB"),
        (1536, "1.50 KiB"),
    ];
    let exprs: Vec<String> = cases
        .iter()
        .map(|(b, _)| format!("fmtBytes({b})"))
        .collect();
    let Some(text) = shown(&exprs.join(" + \"\\n\" + ")) else {
        return;
    };
    let want: Vec<&str> = cases.iter().map(|(_, s)| *s).collect();
    assert_eq!(text.lines().collect::<Vec<_>>(), want);
}

/// A device grown since its group was formatted shows the part the group uses beside its size
/// (the DWPD cell is a share of that part); one of its formatted size shows its size alone.
#[test]
fn a_grown_device_shows_the_size_its_group_uses() {
    let grown = rated_device(json!({"formatted_size_bytes": 400_000_000_000u64}));
    let same = rated_device(json!({"formatted_size_bytes": 800_000_000_000u64}));
    let Some(rows) = device_rows(json!([grown, same])) else {
        return;
    };
    assert!(rows[0][2].ends_with("used)"), "{rows:?}");
    assert!(!rows[1][2].contains("used"), "{rows:?}");
}

/// How admission holds writes back, as the disk group's pill and the fill card word it.
#[test]
fn admission_states_are_named() {
    for (state, want) in [
        ("measuring", "measuring"),
        ("waiting_for_room", "waiting for room"),
        ("throttled", "throttled"),
    ] {
        let Some(text) = shown(&format!("admissionWord({{admission: \"{state}\"}})")) else {
            return;
        };
        assert_eq!(text, want);
    }
    // A daemon from before the state sends only the flag.
    assert_eq!(shown("admissionWord({})").as_deref(), Some("throttled"));
}
