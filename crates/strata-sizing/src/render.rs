//! The output of `strata size`: a table for people, JSON for scripts. Rates print in MiB/s
//! (2^20 bytes/s), capacities of a design in TiB; device capacities as their makers state them
//! (decimal GB).
use std::fmt::Write;

use crate::catalog::{Catalog, Device};
use crate::formulas::{BYTES_PER_GB, BYTES_PER_MB, BYTES_PER_MIB};
use crate::plan::{DeviceLoad, RateSource};
use crate::Report;

const TIB: f64 = (1u64 << 40) as f64;

/// Figures this large (an absurd input, or a measured rate from something that is not a
/// daemon) print in scientific notation, so each stays within its table column.
const SCIENTIFIC_FROM: f64 = 1e7;

/// `v` with two decimals, or in scientific notation from `SCIENTIFIC_FROM`.
fn decimal(v: f64) -> String {
    match v.abs() >= SCIENTIFIC_FROM {
        true => format!("{v:.2e}"),
        false => format!("{v:.2}"),
    }
}

fn mib_s(bytes_per_s: f64) -> String {
    format!("{} MiB/s", decimal(bytes_per_s / BYTES_PER_MIB))
}

fn tib(bytes: f64) -> String {
    format!("{:.2} TiB", bytes / TIB)
}

/// A load as a percentage, on the same side of 100% as the check that reads it (a ratio
/// above 1 fails): 100.4% prints as "100.4%", not a failing "100%", and 99.6% as "99.6%".
fn pct(ratio: f64) -> String {
    let percent = ratio * 100.0;
    if percent >= SCIENTIFIC_FROM {
        return format!("{percent:.2e}%");
    }
    let over = ratio > 1.0;
    for decimals in 0..=3 {
        let text = format!("{percent:.decimals$}");
        let same_side =
            |shown: f64| (shown > 100.0) == over && (shown != 100.0 || percent == 100.0);
        if text.parse::<f64>().is_ok_and(same_side) {
            return format!("{text}%");
        }
    }
    if over { "over 100%" } else { "under 100%" }.into()
}

/// A count with thousands separators, to the nearest: 1,517.
fn count(v: f64) -> String {
    separated(v, v.round())
}

/// A ceiling as a count: rounded down, so the printed figure is still within it.
fn count_down(v: f64) -> String {
    separated(v, v.floor())
}

fn separated(v: f64, whole: f64) -> String {
    if !v.is_finite() {
        return "unlimited".into();
    }
    if whole.abs() >= 1e15 {
        return format!("{whole:.2e}");
    }
    let digits = format!("{whole:.0}");
    let (sign, digits) = digits
        .strip_prefix('-')
        .map_or(("", digits.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

fn size_label(bytes: u64) -> String {
    let kib = bytes / 1024;
    if bytes.is_multiple_of(1024) && kib < 1024 {
        format!("{kib} KiB")
    } else if bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} B")
    }
}

fn rating_label(d: &Device, sequential: bool) -> String {
    match (d.endurance, d.rated_dwpd(sequential)) {
        (Some(e), Some(dwpd)) => {
            let kind = if sequential && e.sequential_endurance_bytes.is_some() {
                " sequential"
            } else {
                ""
            };
            format!(
                "{}{kind} DWPD x {} years",
                trim_float(dwpd),
                trim_float(e.warranty_years)
            )
        }
        _ => "no write-endurance rating".into(),
    }
}

/// "0.2 DWPD (0.9 sequential) x 5 years".
fn list_rating(d: &Device) -> String {
    match (d.endurance, d.rated_dwpd(false), d.rated_dwpd(true)) {
        (Some(e), Some(random), Some(seq)) if e.sequential_endurance_bytes.is_some() => format!(
            "{} DWPD ({} seq) x {} years",
            trim_float(random),
            trim_float(seq),
            trim_float(e.warranty_years)
        ),
        _ => rating_label(d, false),
    }
}

fn trim_float(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// "70/30": the read and write shares in percent, with the decimals a share has (99.5/0.5),
/// as whole numbers would print 99.5% reads as "100/1".
fn mix_label(read_ratio: f64) -> String {
    format!(
        "{}/{}",
        trim_float(read_ratio * 100.0),
        trim_float((1.0 - read_ratio) * 100.0)
    )
}

fn device_line(d: &Device, per_host: u32, sequential: bool) -> String {
    format!(
        "{per_host} x {} per host ({} GB {}, {})",
        d.id,
        trim_float(d.capacity_bytes as f64 / BYTES_PER_GB),
        d.media.label(),
        rating_label(d, sequential)
    )
}

fn workload_section(out: &mut String, r: &Report) {
    let w = &r.workload;
    let mix = mix_label(w.read_ratio);
    match &w.source {
        RateSource::Estimate { iops_per_vm } => {
            let _ = writeln!(
                out,
                "Workload: {} VMs x {} IOPS, {mix} read/write, {} I/O (estimated)",
                w.vms,
                count(*iops_per_vm),
                size_label(w.block_size_bytes)
            );
        }
        RateSource::Measured { url } => {
            let _ = writeln!(
                out,
                "Workload: {} VMs; VM write rate MEASURED by the daemon at {url} (average host writes since it started);\n  {} IOPS in all ({} per VM) derived at {mix} read/write, {} I/O",
                w.vms,
                count(w.iops_avg),
                count(w.iops_avg / f64::from(w.vms.max(1))),
                size_label(w.block_size_bytes)
            );
        }
    }
    let e = &r.evaluation;
    let peak = format!("VM writes, peak (x{})", trim_float(w.peak_to_average));
    let _ = writeln!(
        out,
        "  {:<30}{}",
        "VM writes, average",
        mib_s(e.vm_write_bytes_per_s_avg)
    );
    let _ = writeln!(out, "  {peak:<30}{}", mib_s(e.vm_write_bytes_per_s_peak));
    let _ = writeln!(
        out,
        "  {:<30}{} logical, {} with protection\n",
        "capacity",
        tib(f64::from(w.vms) * w.capacity_per_vm_bytes as f64),
        tib(e.capacity_needed_bytes)
    );
}

fn design_section(out: &mut String, r: &Report) {
    let d = &r.design;
    let _ = writeln!(
        out,
        "Design: {} hosts, {}: write amplification {:.2}",
        d.hosts,
        d.protection.label(),
        r.evaluation.write_amplification
    );
    let _ = writeln!(
        out,
        "  cache     {}",
        device_line(&d.cache_device, d.cache_per_host, false)
    );
    let _ = writeln!(
        out,
        "  capacity  {}\n",
        device_line(&d.capacity_device, d.capacity_per_host, true)
    );
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| "not rated".into(), f)
}

/// How one row of the per-device table reads a load.
type Column = fn(&DeviceLoad) -> String;

fn loads_section(out: &mut String, r: &Report) {
    let (c, k) = (&r.evaluation.cache, &r.evaluation.capacity);
    let w = &r.workload;
    let rows: [(String, Column); 9] = [
        ("writes per device, average".into(), |l| {
            mib_s(l.write_bytes_per_s_avg)
        }),
        ("writes per device, peak".into(), |l| {
            mib_s(l.write_bytes_per_s_peak)
        }),
        ("drive writes per day".into(), |l| {
            decimal(l.drive_writes_per_day)
        }),
        ("rated drive writes per day".into(), |l| {
            opt(l.rated_drive_writes_per_day, trim_float)
        }),
        ("endurance rate (for the warranty)".into(), |l| {
            opt(l.endurance_write_bytes_per_s, mib_s)
        }),
        ("  = VM writes after protection".into(), |l| {
            opt(l.endurance_vm_write_bytes_per_s, mib_s)
        }),
        (
            format!(
                "  = IOPS at {}, {}",
                mix_label(w.read_ratio),
                size_label(w.block_size_bytes)
            ),
            |l| opt(l.endurance_vm_iops, count_down),
        ),
        ("average writes / endurance rate".into(), |l| {
            opt(l.endurance_load_ratio, pct)
        }),
        ("busy at peak".into(), |l| pct(l.utilization_peak)),
    ];
    let _ = writeln!(
        out,
        "  {:<36}{:>18}{:>18}",
        "per device", "cache", "capacity"
    );
    for (label, f) in rows {
        let _ = writeln!(out, "  {label:<36}{}{}", column(&f(c)), column(&f(k)));
    }
    out.push('\n');
}

/// A figure right-aligned in its 18-character column; one that does not fit still keeps two
/// spaces from the one before it.
fn column(figure: &str) -> String {
    match figure.chars().count() < 17 {
        true => format!("{figure:>18}"),
        false => format!("  {figure}"),
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "ok  "
    } else {
        "FAIL"
    }
}

fn checks_section(out: &mut String, r: &Report) {
    let e = &r.evaluation;
    let d = &r.design;
    let _ = writeln!(out, "Checks at {} hosts", e.hosts);
    let _ = writeln!(
        out,
        "  performance (peak)    {}  cache devices {} busy, capacity devices {} busy",
        verdict(e.checks.performance_ok),
        pct(e.cache.utilization_peak),
        pct(e.capacity.utilization_peak)
    );
    let _ = writeln!(
        out,
        "  endurance (average)   {}  cache devices {}, capacity devices {}",
        verdict(e.checks.endurance_ok),
        endurance_load(&e.cache, true),
        endurance_load(&e.capacity, e.cache.endurance_load_ratio.is_none())
    );
    let raw = e.capacity_usable_bytes / d.capacity_fill_max;
    let _ = writeln!(
        out,
        "  capacity              {}  {} needed, {} usable ({} of {} raw)",
        verdict(e.checks.capacity_ok),
        tib(e.capacity_needed_bytes),
        tib(e.capacity_usable_bytes),
        pct(d.capacity_fill_max),
        tib(raw)
    );
    let _ = writeln!(
        out,
        "  protection            {}  {} needs at least {} hosts\n",
        verdict(e.checks.protection_ok),
        d.protection.label(),
        d.protection.min_hosts()
    );
}

/// One tier's part of the endurance check's line ("at 74%"; the first share shown says of
/// what): a device without a rating has no share to show ("at not rated" read as a figure).
fn endurance_load(l: &DeviceLoad, say_of_what: bool) -> String {
    match l.endurance_load_ratio {
        None => "not rated (not checked)".to_string(),
        Some(r) if say_of_what => format!("at {} of their endurance rate", pct(r)),
        Some(r) => format!("at {}", pct(r)),
    }
}

fn smallest_section(out: &mut String, r: &Report) {
    let s = &r.smallest_cluster;
    let n = |h: Option<u32>| h.map_or_else(|| "unreachable".to_string(), |h| h.to_string());
    let each = format!(
        "performance {}, endurance {}, capacity {}, protection {}",
        n(s.performance_hosts),
        n(s.endurance_hosts),
        n(s.capacity_hosts),
        s.protection_hosts
    );
    match s.hosts {
        Some(h) => {
            let _ = writeln!(
                out,
                "Smallest cluster meeting all: {h} hosts ({} {}; {each})",
                s.binding.join(" and "),
                if s.binding.len() > 1 { "bind" } else { "binds" }
            );
        }
        None => {
            let _ = writeln!(
                out,
                "No cluster of up to {} hosts meets {} with these devices ({each})",
                crate::plan::MAX_HOSTS,
                s.binding.join(" and ")
            );
        }
    }
}

pub fn table(r: &Report) -> String {
    let mut out = String::new();
    workload_section(&mut out, r);
    design_section(&mut out, r);
    loads_section(&mut out, r);
    checks_section(&mut out, r);
    smallest_section(&mut out, r);
    out
}

pub fn json(r: &Report) -> String {
    // Serialising plain data structures cannot fail.
    let mut text = serde_json::to_string_pretty(r).unwrap_or_default();
    text.push('\n');
    text
}

pub fn device_list(catalog: &Catalog, json: bool) -> String {
    if json {
        let devices: Vec<&Device> = catalog.devices().collect();
        let mut text = serde_json::to_string_pretty(&serde_json::json!({ "devices": devices }))
            .unwrap_or_default();
        text.push('\n');
        return text;
    }
    let mut out = format!(
        "{:<22}{:<6}{:>9}  {:<30}{:>13}{:>22}  {}\n",
        "ID", "MEDIA", "GB", "ENDURANCE", "SEQ R/W MB/s", "4K R/W IOPS", "NAME"
    );
    for d in catalog.devices() {
        let _ = writeln!(
            out,
            "{:<22}{:<6}{:>9}  {:<30}{:>13}{:>22}  {}",
            d.id,
            d.media.label(),
            trim_float(d.capacity_bytes as f64 / BYTES_PER_GB),
            list_rating(d),
            format!(
                "{:.0}/{:.0}",
                d.seq_read_bytes_per_s / BYTES_PER_MB,
                d.seq_write_bytes_per_s / BYTES_PER_MB
            ),
            format!(
                "{}/{}",
                count(d.random_read_iops),
                count(d.random_write_iops)
            ),
            d.name
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_have_separators() {
        assert_eq!(count(1517.4), "1,517");
        assert_eq!(count(999.0), "999");
        assert_eq!(count(1_500_000.0), "1,500,000");
        assert_eq!(count(f64::INFINITY), "unlimited");
        assert_eq!(trim_float(3.0), "3");
        assert_eq!(trim_float(0.25), "0.25");
        assert_eq!(size_label(32768), "32 KiB");
        assert_eq!(size_label(4 << 20), "4 MiB");
        assert_eq!(count_down(1517.9), "1,517");
        assert_eq!(count_down(f64::INFINITY), "unlimited");
    }

    #[test]
    fn a_percentage_stays_on_the_side_of_100_its_check_does() {
        assert_eq!(pct(0.42), "42%");
        assert_eq!(pct(1.004), "100.4%");
        assert_eq!(pct(0.996), "99.6%");
        assert_eq!(pct(1.0), "100%");
        assert_eq!(pct(1.000_006), "100.001%");
        assert_eq!(pct(1.000_000_001), "over 100%");
        assert_eq!(pct(0.999_999_9), "under 100%");
        assert_eq!(pct(2.5), "250%");
        assert_eq!(pct(1.08e21), "1.08e23%");
    }

    /// Absurd figures (a measured rate from something that is not a daemon) print short, and
    /// a figure too wide for its column is still set apart from its neighbour.
    #[test]
    fn absurd_figures_keep_their_columns_apart() {
        assert_eq!(mib_s(1.0e30), "9.54e23 MiB/s");
        assert_eq!(mib_s(1024.0 * 1024.0 * 220.76), "220.76 MiB/s");
        assert_eq!(decimal(1.08e23), "1.08e23");
        assert_eq!(decimal(0.9), "0.90");
        assert_eq!(count(1.017e26), "1.02e26");
        assert_eq!(count(999_999_999_999_999.0), "999,999,999,999,999");
        assert_eq!(column("441.52 MiB/s"), "      441.52 MiB/s");
        assert_eq!(column("9999999.99 MiB/s"), "  9999999.99 MiB/s");
        assert_eq!(column("12345678901234567890"), "  12345678901234567890");
    }
}
