//! The dashboard in a real browser: headless Chromium, driven over WebDriver, loads `/` from a
//! daemon that has an access token and a write load, and the charts must hold live data that
//! changes from one read to the next. A screenshot goes to target/dashboard.png for review.
use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::http::{background_load, get_json};
use common::webdriver::{chromium_binary, Browser};
use common::*;
use serde_json::Value;

/// Extra load time before the screenshot, so that it shows more than a few seconds of data.
const SCREENSHOT_AFTER: Duration = Duration::from_secs(12);

const CHARTS: [&str; 7] = [
    "chart-iops",
    "chart-tput",
    "chart-lat",
    "chart-sl",
    "chart-fill",
    "chart-destage",
    "chart-dev",
];

/// What the page shows right now, read from the DOM the charts render.
const READ_PAGE: &str = r#"
const charts = {};
for (const id of ["chart-iops", "chart-tput", "chart-lat", "chart-sl", "chart-fill", "chart-destage", "chart-dev"]) {
  const svg = document.querySelector(`#${id} svg`);
  if (!svg) { charts[id] = null; continue; }
  charts[id] = {
    points: Number(svg.dataset.points),
    last_t: Number(svg.dataset.lastT),
    last: JSON.parse(svg.dataset.last || "{}"),
    series: [...svg.querySelectorAll(".series")].map(e => e.getAttribute("points")),
    names: [...new Set([...svg.querySelectorAll(".series")].map(e => e.dataset.name))],
    dashed_lines: svg.querySelectorAll("line[stroke-dasharray]").length,
  };
}
const rows = id => [...document.querySelectorAll(`#${id} tbody tr`)].map(r => [...r.cells].map(c => c.textContent.trim()));
return {
  charts,
  updates: Number(document.body.dataset.updates),
  state: document.getElementById("state").textContent,
  live: document.getElementById("updated").textContent,
  kpi_iops: document.getElementById("k-iops").textContent,
  volumes: rows("volumes"),
  devices: rows("devices"),
  group: document.getElementById("dg").textContent,
};
"#;

fn target_dir() -> PathBuf {
    // CARGO_BIN_EXE_strata is target/<profile>/strata.
    PathBuf::from(STRATA_BIN)
        .parent()
        .and_then(|p| p.parent())
        .map(PathBuf::from)
        .expect("target directory")
}

fn chart<'a>(page: &'a Value, id: &str) -> &'a Value {
    let c = &page["charts"][id];
    assert!(c.is_object(), "chart {id} has no SVG: {page:#}");
    c
}

fn write_iops(page: &Value) -> f64 {
    chart(page, "chart-iops")["last"]["write"].as_f64().unwrap_or(0.0)
}

#[test]
fn the_dashboard_draws_live_changing_data_under_load() {
    if !require_tools(&["fio", "chromedriver"]) {
        return;
    }
    if chromium_binary().is_none() {
        assert!(!tools_are_mandatory(), "chromium is not installed (Debian package chromium)");
        eprintln!("!!!!!!!! SKIPPING TEST: chromium is not installed !!!!!!!!");
        return;
    }
    let token_dir = tempfile::tempdir().expect("tempdir");
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, "dashboard-token-00112233445566").expect("token");
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--http-token-file".into(), token_file.display().to_string()],
        ..Default::default()
    });
    let base = daemon.http_url();
    let _load = background_load(&daemon.nbd_uri(VOL0), 60, &daemon.scratch_dir());
    let loaded = wait_until(Duration::from_secs(30), || {
        let h = get_json(&format!("{base}/api/v1/history"));
        h["samples"].as_array().is_some_and(|s| {
            s.iter().filter(|x| x["write_iops"].as_f64() > Some(0.0)).count() >= 3
        })
    });
    assert!(loaded, "no write load in the daemon's history");

    let browser = Browser::start(1500, 1900);
    browser.goto(&format!("{base}/"));
    let mut first = Value::Null;
    let drawn = wait_until(Duration::from_secs(30), || {
        first = browser.eval(READ_PAGE);
        CHARTS.iter().all(|id| first["charts"][id]["points"].as_u64() >= Some(3))
            && write_iops(&first) > 0.0
            && first["volumes"].as_array().is_some_and(|v| !v.is_empty())
            && first["devices"].as_array().is_some_and(|d| d.len() == 2)
    });
    assert!(drawn, "the dashboard did not draw the load: {first:#}");

    std::thread::sleep(Duration::from_millis(2500));
    let second = browser.eval(READ_PAGE);
    for id in CHARTS {
        let (a, b) = (chart(&first, id), chart(&second, id));
        assert!(
            b["last_t"].as_f64() > a["last_t"].as_f64(),
            "{id} did not move on: {a} then {b}"
        );
    }
    let (a, b) = (chart(&first, "chart-iops"), chart(&second, "chart-iops"));
    assert_ne!(a["series"], b["series"], "the IOPS lines did not change");
    assert!(write_iops(&second) > 0.0, "{second:#}");
    assert!(second["updates"].as_u64() > first["updates"].as_u64(), "polling stopped");

    // The write-log chart draws the two marks; service levels are stacked bands; every device
    // has a read and a write line.
    assert_eq!(chart(&second, "chart-fill")["dashed_lines"], 2, "{second:#}");
    let fill = chart(&second, "chart-fill")["last"]["fill"].as_f64().expect("fill");
    assert!((0.0..=1.0).contains(&fill));
    assert!(chart(&second, "chart-sl")["series"].as_array().is_some_and(|s| !s.is_empty()));
    assert_eq!(chart(&second, "chart-dev")["names"].as_array().map(Vec::len), Some(4), "{second:#}");

    // The tables: the volume with its size, policy, hit ratio and space per tier; devices with wear.
    let vol0: Vec<String> = second["volumes"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r[0] == VOL0))
        .and_then(|r| serde_json::from_value(r.clone()).ok())
        .unwrap_or_else(|| panic!("no vol0 row: {second:#}"));
    assert_eq!(vol0[1], "8.00 GiB", "{vol0:?}");
    assert_eq!(vol0[2], "cache", "{vol0:?}");
    assert!(vol0[3] == "-" || vol0[3].ends_with('%'), "fast hit ratio: {vol0:?}");
    assert!(vol0[5] != "0 B" || vol0[6] != "0 B", "no space per tier: {vol0:?}");
    assert!(second["devices"][0][7].as_str().is_some_and(|s| !s.is_empty()));
    assert!(second["devices"][0][8].as_str().is_some_and(|s| !s.is_empty()));
    // Healthy devices show zero checksum failures (the last column).
    assert_eq!(second["devices"][0][10], "0", "{second:#}");
    assert_eq!(second["devices"][1][10], "0", "{second:#}");
    assert!(second["group"].as_str().is_some_and(|g| g.contains("Scrubnot run yet")), "{second:#}");
    assert_eq!(second["state"], "running");
    assert!(second["live"].as_str().is_some_and(|s| s.starts_with("live")), "{second:#}");

    // For the reviewer's screenshot, let the charts fill a little more of their minute.
    std::thread::sleep(SCREENSHOT_AFTER);
    let png = browser.screenshot();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    let path = target_dir().join("dashboard.png");
    std::fs::write(&path, &png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    eprintln!("dashboard screenshot: {}", path.display());
}
