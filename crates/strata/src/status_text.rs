//! `strata status` for a terminal: the `/api/v1/status` document as a page an administrator
//! reads at a glance. Pure functions of the JSON, so they are tested without a daemon; a field
//! the daemon did not send shows as `-` rather than failing.
use serde_json::Value;

use crate::config::format_size;

/// Width of the write-log fill bar, in characters.
const BAR_WIDTH: usize = 40;
const SERVICE_LEVELS_MS: [u64; 5] = [1, 2, 5, 10, 30];

pub fn render(v: &Value) -> String {
    let mut out = String::new();
    out.push_str(&header(v));
    out.push_str(&workload(v));
    for g in v["disk_groups"].as_array().into_iter().flatten() {
        out.push_str(&disk_group(g));
    }
    out.push_str(&devices(v));
    out.push_str(&volumes(v));
    out.push_str(&warnings(v));
    out
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn bytes(v: &Value) -> String {
    v.as_u64().map_or_else(|| "-".into(), format_size)
}

/// "12.3 MiB/s", "0 B/s", "-".
pub fn rate(v: Option<f64>) -> String {
    let Some(x) = v.filter(|x| x.is_finite() && *x >= 0.0) else {
        return "-".into();
    };
    const UNITS: [&str; 5] = ["B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s"];
    let mut value = x;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} {}", UNITS[0])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn percent(v: Option<f64>) -> String {
    v.filter(|x| x.is_finite())
        .map_or_else(|| "-".into(), |x| format!("{:.1}%", x * 100.0))
}

fn millis(us: &Value) -> String {
    us.as_f64()
        .map_or_else(|| "-".into(), |us| format!("{:.2} ms", us / 1000.0))
}

/// "42s", "5m 03s", "2h 07m", "3d 04h".
pub fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s:02}s"),
        (0, _, _) => format!("{h}h {m:02}m"),
        _ => format!("{d}d {h:02}h"),
    }
}

/// Last second of the year 9999, the last date written with four digits.
const LAST_DATE_UNIX_S: u64 = 253_402_300_799;

/// A Unix time as a UTC calendar date, "2031-07-14"; "after 9999" beyond, as the dashboard says
/// it (a device written little projects its wear-out that far).
pub fn date(unix_s: u64) -> String {
    if unix_s > LAST_DATE_UNIX_S {
        return "after 9999".into();
    }
    // Days to civil date (Howard Hinnant's algorithm), valid for any day after 1970.
    let z = (unix_s / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

fn header(v: &Value) -> String {
    format!(
        "strata {}  node {}  up {}  io backend {}\nnbd {}  http {}  {} volume(s), {} NBD connection(s)\nread cache {} of the write log ({}: {})\n",
        text(&v["version"]),
        text(&v["state"]),
        v["uptime_s"].as_u64().map_or_else(|| "-".into(), duration),
        text(&v["io_backend"]),
        text(&v["nbd_listen"]),
        text(&v["http_listen"]),
        text(&v["volume_count"]),
        text(&v["nbd_connections_total"]),
        percent(v["read_cache"]["ratio"].as_f64()),
        text(&v["read_cache"]["setting"]),
        text(&v["read_cache"]["reason"]),
    )
}

fn workload(v: &Value) -> String {
    let l = &v["latest"];
    if l.is_null() {
        return "\nWORKLOAD\n  no sample yet (the sampler runs once a second)\n".into();
    }
    let iops = |k: &str| l[k].as_f64().map_or_else(|| "-".into(), |x| format!("{x:.0}"));
    let levels = match l["service_level_shares"].as_array() {
        Some(shares) => SERVICE_LEVELS_MS
            .iter()
            .zip(shares)
            .map(|(ms, s)| format!("<={ms}ms {}", percent(s.as_f64())))
            .collect::<Vec<_>>()
            .join("  "),
        None => "no requests in the last interval".into(),
    };
    format!(
        "\nWORKLOAD (last {:.0} s)\n  IOPS         {} read, {} write\n  throughput   {} read, {} write\n  latency      p50 {}  p99 {}  p99.9 {}\n  service      {}\n",
        l["interval_s"].as_f64().unwrap_or(1.0),
        iops("read_iops"),
        iops("write_iops"),
        rate(l["read_bytes_per_s"].as_f64()),
        rate(l["write_bytes_per_s"].as_f64()),
        millis(&l["latency_us_p50"]),
        millis(&l["latency_us_p99"]),
        millis(&l["latency_us_p999"]),
        levels,
    )
}

/// `[#######-----|---------------|-------]`: the fill, with the low and high marks as `|`.
pub fn fill_bar(fill: f64, low: f64, high: f64) -> String {
    let cell = |r: f64| ((r.clamp(0.0, 1.0) * BAR_WIDTH as f64).round() as usize).min(BAR_WIDTH);
    let (filled, lo, hi) = (cell(fill), cell(low), cell(high));
    let mut bar: Vec<char> = (0..BAR_WIDTH).map(|i| if i < filled { '#' } else { '-' }).collect();
    for mark in [lo, hi] {
        if let Some(c) = bar.get_mut(mark.min(BAR_WIDTH - 1)) {
            *c = '|';
        }
    }
    format!("[{}]", bar.into_iter().collect::<String>())
}

fn disk_group(g: &Value) -> String {
    let num = |k: &str| g[k].as_f64().unwrap_or(0.0);
    let (total, used) = (num("capacity_total_bytes"), num("capacity_used_bytes"));
    // Of the space data may take: a full tier still has its kept segments free (a daemon
    // from before `capacity_reserved_bytes` counts none).
    let reserved = num("capacity_reserved_bytes");
    let usable = total - reserved;
    let used_ratio = (usable > 0.0).then(|| (used / usable).min(1.0));
    // With fewer free than that, GC and the index are using what was kept for them.
    let segments = num("segments_total");
    let free = match segments > 0.0 {
        true => num("segments_free") * (total / segments),
        false => f64::INFINITY,
    };
    let kept = match reserved > 0.0 {
        true if free >= reserved => format!(
            ", {} of them kept for GC and the index",
            bytes(&g["capacity_reserved_bytes"])
        ),
        true => format!(
            ", all kept for GC and the index ({} when none is in use)",
            bytes(&g["capacity_reserved_bytes"])
        ),
        false => String::new(),
    };
    let of_usable = match reserved > 0.0 {
        true => " of what data may take",
        false => "",
    };
    let admission = match g["admission"].as_str() {
        Some("throttled") => "THROTTLED (writes paced to the destage rate)",
        Some("measuring") => "MEASURING (above the high mark: writes wait while the log has no room, and are paced once the destage rate is measured)",
        Some("waiting_for_room") => "WAITING (the log has no room: writes wait for the destager)",
        // A daemon from before `admission`.
        None if g["admission_throttled"].as_bool() == Some(true) => "THROTTLED (writes paced to the destage rate)",
        _ if g["capacity_full"].as_bool() == Some(true) => {
            "open until the log fills, then writes fail (the capacity tier takes nothing)"
        }
        _ => "open",
    };
    format!(
        "\nDISK GROUP {}  {}\n  write log    {} {} full ({} of {} in use, {} of it dead)  marks {:.0}% / {:.0}%\n  destage      {}, backlog {} (live data to write to the capacity tier), admission {}\n  capacity     {} of {} used ({}{}, {} of it live data), {} of {} segments free{}\n  reads        {} from the fast tier\n  gc           {} segment(s) cleaned, {} relocated\n",
        text(&g["id"]),
        text(&g["state"]),
        fill_bar(num("log_fill_ratio"), num("fill_ratio_low"), num("fill_ratio_high")),
        percent(g["log_fill_ratio"].as_f64()),
        bytes(&g["log_used_bytes"]),
        bytes(&g["log_capacity_bytes"]),
        bytes(&g["log_dead_bytes"]),
        num("fill_ratio_low") * 100.0,
        num("fill_ratio_high") * 100.0,
        rate(g["destage_rate_bytes_per_s"].as_f64()),
        bytes(&g["destage_backlog_bytes"]),
        admission,
        bytes(&g["capacity_used_bytes"]),
        bytes(&g["capacity_total_bytes"]),
        percent(used_ratio),
        of_usable,
        bytes(&g["capacity_live_bytes"]),
        text(&g["segments_free"]),
        text(&g["segments_total"]),
        kept,
        percent(g["fast_read_hit_ratio"].as_f64()),
        text(&g["gc_segments_cleaned_total"]),
        bytes(&g["gc_relocated_bytes_total"]),
    ) + &format!("  scrub        {}\n", scrub(&g["scrub"]))
}

/// "running, 1.2 GiB of about 2.8 GiB read", "clean (...)", "DAMAGE FOUND: ...".
fn scrub(s: &Value) -> String {
    if s.is_null() {
        return "-".into();
    }
    if s["running"].as_bool() == Some(true) {
        // No estimate (nothing stored but metadata): no "of about 0 B".
        if s["total_bytes"].as_u64().unwrap_or(0) == 0 {
            return format!("running, {} read", bytes(&s["progress_bytes"]));
        }
        return format!("running, {} of about {} read", bytes(&s["progress_bytes"]), bytes(&s["total_bytes"]));
    }
    let background = match s["background_interval_s"].as_u64() {
        Some(every) => format!("background every {}", duration(every)),
        None => "background scrub off".into(),
    };
    let r = &s["last_result"];
    let Some(finished) = r["finished_unix_s"].as_u64() else {
        return format!("not run yet ({background})");
    };
    let when = crate::client::utc_time(finished);
    // The last scrub may have checked one volume only: it says so.
    let only = match r["scope"].as_str() {
        Some(one) if one != "all" && !one.is_empty() => format!(", {one} only"),
        _ => String::new(),
    };
    if r["clean"].as_bool() == Some(true) {
        return format!("clean: {} checked{only}, finished {when} ({background})", bytes(&r["data_bytes_verified"]));
    }
    format!(
        "DAMAGE FOUND{only}: {} bad block(s), {} metadata copy(ies) repaired, {} damaged, finished {when}",
        text(&r["bad_blocks_total"]),
        text(&r["metadata_repaired_total"]),
        text(&r["metadata_damaged_total"]),
    )
}

/// The rates of one device in the latest sample.
fn device_rates<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v["latest"]["devices"]
        .as_array()?
        .iter()
        .find(|d| d["name"].as_str() == Some(name))
}

fn wear_out(w: &Value) -> String {
    if w["rated_endurance_bytes"].is_null() {
        return "no rating".into();
    }
    // `--wear-projection-after off` (a daemon before it had no such field).
    if w.get("projection_after_s").is_some_and(Value::is_null) {
        return "projection off".into();
    }
    match w["projected_wear_out_unix_s"].as_u64() {
        Some(t) if w["wears_out_before_warranty"].as_bool() == Some(true) => {
            format!("{} (before warranty!)", date(t))
        }
        Some(t) => date(t),
        // Projected only after --wear-projection-after of history (a day by default).
        None if w["bytes_written_total"].as_u64().unwrap_or(0) > 0 => "too early".into(),
        None => "not written yet".into(),
    }
}

/// The device's size, and the part its disk group uses when that is less (a device grown
/// since the group was formatted on it): drive writes per day are a share of that part.
fn device_size(d: &Value) -> String {
    let formatted = d["wear"]["formatted_size_bytes"].as_u64();
    match (d["size_bytes"].as_u64(), formatted) {
        (Some(size), Some(used)) if used < size => {
            format!("{} ({} used)", format_size(size), format_size(used))
        }
        _ => bytes(&d["size_bytes"]),
    }
}

fn devices(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let name = d["name"].as_str().unwrap_or("-");
            let r = device_rates(v, name);
            let w = &d["wear"];
            vec![
                name.to_string(),
                text(&d["tier"]),
                device_size(d),
                rate(r.and_then(|r| r["read_bytes_per_s"].as_f64())),
                rate(r.and_then(|r| r["write_bytes_per_s"].as_f64())),
                bytes(&w["bytes_written_total"]),
                w["drive_writes_per_day"].as_f64().map_or("-".into(), |x| format!("{x:.2}")),
                percent(w["endurance_used_ratio"].as_f64()),
                wear_out(w),
                text(&d["errors"]),
                text(&d["checksum_errors_total"]),
            ]
        })
        .collect();
    let head = ["NAME", "TIER", "SIZE", "READ", "WRITE", "WRITTEN", "DWPD", "ENDURANCE", "WEAR-OUT", "ERRORS", "CHECKSUM"];
    format!("\nDEVICES\n{}", indent(&table(&head, &rows)))
}

fn volumes(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| {
            vec![
                text(&x["name"]),
                bytes(&x["size_bytes"]),
                text(&x["policy"]["mode"]),
                percent(x["figures"]["fast_read_hit_ratio"].as_f64()),
                bytes(&x["fast_tier_bytes"]),
                bytes(&x["capacity_tier_bytes"]),
                text(&x["connections"]),
                text(&x["io"]["read_ops_total"]),
                text(&x["io"]["write_ops_total"]),
            ]
        })
        .collect();
    if rows.is_empty() {
        return "\nVOLUMES\n  none\n".into();
    }
    let head = ["NAME", "SIZE", "POLICY", "HIT", "ON FAST", "ON CAPACITY", "CONNS", "READS", "WRITES"];
    format!("\nVOLUMES\n{}", indent(&table(&head, &rows)))
}

fn warnings(v: &Value) -> String {
    let list: Vec<&str> = v["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if list.is_empty() {
        return "\nWARNINGS\n  none\n".into();
    }
    let lines: String = list.iter().map(|w| format!("  ! {w}\n")).collect();
    format!("\nWARNINGS\n{lines}")
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}

/// Left-aligned columns two spaces apart, trailing spaces trimmed.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let head: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&head).chain(rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, &w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status() -> Value {
        json!({
            "version": "0.1.0", "state": "running", "uptime_s": 3725, "io_backend": "io_uring",
            "nbd_listen": "127.0.0.1:10809", "http_listen": "127.0.0.1:9090",
            "volume_count": 1, "nbd_connections_total": 2,
            "latest": {
                "interval_s": 1.0, "read_iops": 1200.4, "write_iops": 300.0,
                "read_bytes_per_s": 4915200.0, "write_bytes_per_s": 1228800.0,
                "latency_us_p50": 210.0, "latency_us_p99": 1800.0, "latency_us_p999": 4200.0,
                "service_level_shares": [0.921, 0.98, 0.999, 1.0, 1.0],
                "devices": [{"name": "fast.img", "tier": "fast", "read_bytes_per_s": 0.0, "write_bytes_per_s": 2097152.0}]
            },
            "disk_groups": [{
                "id": "dg0", "state": "running", "log_fill_ratio": 0.5, "fill_ratio_low": 0.3,
                "fill_ratio_high": 0.7, "log_capacity_bytes": 268435456u64, "log_used_bytes": 134217728u64,
                "destage_rate_bytes_per_s": 1048576.0, "destage_backlog_bytes": 83886080u64,
                "log_dead_bytes": 50331648u64, "admission_throttled": true,
                "admission": "throttled", "capacity_total_bytes": 2147483648u64,
                "capacity_used_bytes": 1073741824u64, "capacity_live_bytes": 805306368u64,
                "capacity_reserved_bytes": 67108864u64, "segments_free": 128, "segments_total": 256,
                "fast_read_hit_ratio": 0.87, "gc_segments_cleaned_total": 3,
                "gc_relocated_bytes_total": 12582912u64
            }],
            "devices": [{
                "name": "fast.img", "tier": "fast", "size_bytes": 268435456u64, "errors": 0, "checksum_errors_total": 3,
                "wear": {"bytes_written_total": 1073741824u64, "drive_writes_per_day": 0.4213,
                         "rated_endurance_bytes": 1.0e15, "endurance_used_ratio": 0.001,
                         "projected_wear_out_unix_s": 1_941_926_400u64, "wears_out_before_warranty": false}
            }],
            "volumes": [{"name": "vol0", "size_bytes": 8589934592u64, "policy": {"mode": "cache"},
                         "fast_tier_bytes": 4096, "capacity_tier_bytes": 1048576, "connections": 2,
                         "io": {"read_ops_total": 10, "write_ops_total": 20}}],
            "warnings": ["the write log is 50% full"]
        })
    }

    fn status_with_scrub() -> Value {
        let mut v = status();
        v["disk_groups"][0]["scrub"] = json!({
            "running": false, "progress_bytes": 4096, "total_bytes": 4096,
            "background_interval_s": 604800, "background_rate_bytes_per_s": 67108864u64,
            "last_result": {"scope": "all", "started_unix_s": 1_700_000_000u64,
                            "finished_unix_s": 1_700_000_075u64, "data_bytes_verified": 4096,
                            "bad_blocks_total": 2, "metadata_repaired_total": 1,
                            "metadata_damaged_total": 0, "clean": false}
        });
        v
    }

    #[test]
    fn a_full_capacity_tier_says_when_writes_fail() {
        let mut v = status();
        v["disk_groups"][0]["admission_throttled"] = json!(false);
        v["disk_groups"][0]["admission"] = json!("open");
        v["disk_groups"][0]["capacity_full"] = json!(true);
        let page = render(&v);
        let want = "admission open until the log fills, then writes fail";
        assert!(page.contains(want), "missing {want:?} in\n{page}");
        v["disk_groups"][0]["capacity_full"] = json!(false);
        assert!(render(&v).contains("admission open\n"), "{}", render(&v));
    }

    /// Every admission state is named; above the high mark before a rate is measured (after
    /// a start) the line says so rather than "open".
    #[test]
    fn the_admission_line_names_the_state() {
        let mut v = status();
        for (state, want) in [
            ("measuring", "admission MEASURING (above the high mark"),
            ("waiting_for_room", "admission WAITING (the log has no room"),
            ("throttled", "admission THROTTLED"),
            ("open", "admission open\n"),
        ] {
            v["disk_groups"][0]["admission"] = json!(state);
            v["disk_groups"][0]["admission_throttled"] = json!(state != "open");
            let page = render(&v);
            assert!(page.contains(want), "{state}: missing {want:?} in\n{page}");
        }
        // A daemon from before the state: the flag alone.
        v["disk_groups"][0]
            .as_object_mut()
            .unwrap()
            .remove("admission");
        v["disk_groups"][0]["admission_throttled"] = json!(true);
        assert!(render(&v).contains("admission THROTTLED"), "{}", render(&v));
    }

    /// A device grown since its group was formatted shows both sizes: the DWPD beside it is a
    /// share of the smaller one.
    #[test]
    fn a_grown_device_shows_the_size_its_group_uses() {
        let mut v = status();
        v["devices"][0]["size_bytes"] = json!(512u64 << 20);
        v["devices"][0]["wear"]["formatted_size_bytes"] = json!(256u64 << 20);
        let page = render(&v);
        let dev = page
            .lines()
            .find(|l| l.trim_start().starts_with("fast.img"))
            .unwrap();
        assert!(dev.contains("512 MiB (256 MiB used)"), "{dev}");
        v["devices"][0]["wear"]["formatted_size_bytes"] = json!(512u64 << 20);
        let page = render(&v);
        let dev = page
            .lines()
            .find(|l| l.trim_start().starts_with("fast.img"))
            .unwrap();
        assert!(dev.contains("512 MiB") && !dev.contains("used)"), "{dev}");
    }

    /// With fewer segments free than are kept for GC and the index (GC is using them), the
    /// line does not say more is kept than is free (before: "9 of 255 segments free, 15 MiB
    /// of them kept" with 1 MiB segments).
    #[test]
    fn a_kept_reserve_in_use_is_not_called_free() {
        let mut v = status();
        let g = &mut v["disk_groups"][0];
        g["segments_free"] = json!(7);
        g["segments_total"] = json!(256);
        let page = render(&v);
        assert!(
            page.contains("7 of 256 segments free, all kept for GC and the index (64 MiB when none is in use)"),
            "{page}"
        );
    }

    #[test]
    fn the_page_has_every_section_with_its_figures() {
        let page = render(&status_with_scrub());
        for want in [
            "strata 0.1.0  node running  up 1h 02m  io backend io_uring",
            "IOPS         1200 read, 300 write",
            "throughput   4.7 MiB/s read, 1.2 MiB/s write",
            "latency      p50 0.21 ms  p99 1.80 ms  p99.9 4.20 ms",
            "<=1ms 92.1%  <=2ms 98.0%",
            "50.0% full (128 MiB of 256 MiB in use, 48 MiB of it dead)  marks 30% / 70%",
            "backlog 80 MiB (live data to write to the capacity tier), admission THROTTLED",
            "1 GiB of 2 GiB used (51.6% of what data may take, 768 MiB of it live data), 128 of 256 segments free, 64 MiB of them kept for GC and the index",
            "87.0% from the fast tier",
            "3 segment(s) cleaned, 12 MiB relocated",
            "2031-07-16",
            "! the write log is 50% full",
            "scrub        DAMAGE FOUND: 2 bad block(s), 1 metadata copy(ies) repaired, 0 damaged, finished 2023-11-14 22:14:35Z",
        ] {
            assert!(page.contains(want), "missing {want:?} in\n{page}");
        }
        let vol = page.lines().find(|l| l.trim_start().starts_with("vol0")).unwrap();
        assert!(vol.contains("8 GiB") && vol.contains("cache") && vol.contains("1 MiB"), "{vol}");
        let dev = page.lines().find(|l| l.trim_start().starts_with("fast.img")).unwrap();
        assert!(dev.contains("2.0 MiB/s") && dev.contains("0.42") && dev.contains("0.1%"), "{dev}");
        let cells: Vec<&str> = dev.split_whitespace().collect();
        assert_eq!(cells[cells.len() - 2..], ["0", "3"], "errors, then checksum failures: {dev}");
    }

    #[test]
    fn a_wear_out_not_yet_projected_names_no_wait() {
        // The wait is --wear-projection-after, which the status does not carry.
        let written = json!({"rated_endurance_bytes": 1.0e15, "bytes_written_total": 4096,
                             "projected_wear_out_unix_s": null});
        assert_eq!(wear_out(&written), "too early");
        let fresh = json!({"rated_endurance_bytes": 1.0e15, "bytes_written_total": 0});
        assert_eq!(wear_out(&fresh), "not written yet");
        assert_eq!(wear_out(&json!({"rated_endurance_bytes": null})), "no rating");
    }

    /// `--wear-projection-after off`: the column says the projection is off, not "too early",
    /// which would promise a date that never comes.
    #[test]
    fn a_wear_out_never_projected_says_the_projection_is_off() {
        let off = json!({"rated_endurance_bytes": 1.0e15, "bytes_written_total": 4096,
                         "projected_wear_out_unix_s": null, "projection_after_s": null});
        assert_eq!(wear_out(&off), "projection off");
        let waiting = json!({"rated_endurance_bytes": 1.0e15, "bytes_written_total": 4096,
                             "projected_wear_out_unix_s": null, "projection_after_s": 86_400});
        assert_eq!(wear_out(&waiting), "too early");
    }

    #[test]
    fn the_scrub_line_says_running_clean_or_not_run() {
        let running = json!({"running": true, "progress_bytes": 1u64 << 30, "total_bytes": 4u64 << 30});
        assert_eq!(scrub(&running), "running, 1 GiB of about 4 GiB read");
        let no_estimate = json!({"running": true, "progress_bytes": 8192u64, "total_bytes": 0u64});
        assert_eq!(scrub(&no_estimate), "running, 8 KiB read");
        let never = json!({"running": false, "background_interval_s": null, "last_result": null});
        assert_eq!(scrub(&never), "not run yet (background scrub off)");
        let clean = json!({"running": false, "background_interval_s": 604800,
            "last_result": {"finished_unix_s": 1_700_000_075u64, "data_bytes_verified": 1u64 << 20, "clean": true}});
        assert_eq!(scrub(&clean), "clean: 1 MiB checked, finished 2023-11-14 22:14:35Z (background every 7d 00h)");
        assert_eq!(scrub(&Value::Null), "-");
        // A scrub of one volume says so: damage found elsewhere before is not in its counts.
        let one = json!({"running": false, "background_interval_s": null,
            "last_result": {"scope": "db", "started_unix_s": 1_700_000_070u64,
                            "finished_unix_s": 1_700_000_075u64, "clean": false,
                            "data_bytes_verified": 4096u64, "bad_blocks_total": 1, "metadata_repaired_total": 0, "metadata_damaged_total": 0}});
        assert_eq!(
            scrub(&one),
            "DAMAGE FOUND, db only: 1 bad block(s), 0 metadata copy(ies) repaired, 0 damaged, finished 2023-11-14 22:14:35Z"
        );
        let last = serde_json::from_value(one["last_result"].clone()).unwrap();
        let warning = crate::api_scrub::warning(Some(&last)).expect("a warning");
        assert!(warning.starts_with("the scrub of db finished"), "{warning}");
        assert!(
            warning.ends_with(
                "(it checked db and its snapshots only; `strata scrub` checks everything)"
            ),
            "{warning}"
        );
    }

    #[test]
    fn missing_figures_show_as_dashes_not_failures() {
        let page = render(&json!({"version": "0.1.0"}));
        assert!(page.contains("no sample yet"), "{page}");
        assert!(page.contains("VOLUMES\n  none"), "{page}");
        assert!(page.contains("WARNINGS\n  none"), "{page}");
    }

    #[test]
    fn the_fill_bar_shows_fill_and_marks() {
        let bar = fill_bar(0.5, 0.3, 0.7);
        assert_eq!(bar.len(), BAR_WIDTH + 2);
        assert_eq!(bar.chars().filter(|&c| c == '|').count(), 2);
        assert_eq!(bar.chars().filter(|&c| c == '#').count(), 19, "{bar}");
        assert_eq!(fill_bar(1.5, 0.3, 0.7).chars().filter(|&c| c == '-').count(), 0);
    }

    #[test]
    fn units_and_dates() {
        assert_eq!(rate(Some(0.0)), "0 B/s");
        assert_eq!(rate(Some(1536.0)), "1.5 KiB/s");
        assert_eq!(rate(None), "-");
        assert_eq!(duration(42), "42s");
        assert_eq!(duration(303), "5m 03s");
        assert_eq!(duration(3 * 86_400 + 4 * 3600), "3d 04h");
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(951_782_400), "2000-02-29");
        assert_eq!(date(1_700_000_000), "2023-11-14");
        assert_eq!(date(LAST_DATE_UNIX_S), "9999-12-31");
    }

    #[test]
    fn a_wear_out_past_the_year_9999_reads_as_the_dashboard_has_it() {
        // 8 KiB written in a day on a device rated for 4.38 PB; the daemon caps the date at
        // 2^64 - 1 s.
        let far = json!({"rated_endurance_bytes": 4.38e15, "bytes_written_total": 8192,
                         "projected_wear_out_unix_s": u64::MAX});
        assert_eq!(wear_out(&far), "after 9999");
    }
}
