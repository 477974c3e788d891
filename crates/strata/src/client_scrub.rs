//! `strata scrub [VOLUME] [--rate SIZE]`: runs a scrub on the daemon and prints its report, as a
//! page or `--json`. The request lasts as long as the scrub, so it goes without a deadline;
//! meanwhile, on a terminal, the progress is polled and shown on stderr. Damage found ends the
//! command with exit status 3 (after the report), so that scripts can tell it from a failure.
//! `--detach` starts the scrub and returns at once (it runs on the daemon with nobody waiting,
//! a closed terminal does not stop it); `--last` prints the last finished scrub's report.
use std::io::{IsTerminal, Write};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use serde_json::{json, Value};

use super::Client;
use crate::api_scrub::{ScrubReportJson, ScrubStatusJson};
use crate::config::format_size;
use crate::status_text::{duration, table};

/// Exit status of `strata scrub` when it found damage.
pub const EXIT_DAMAGE_FOUND: u8 = 3;
/// How often the progress line is refreshed.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// The scrub ran and found damage: the one line `strata scrub` ends with on stderr.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DamageFound(pub String);

impl Client {
    pub fn scrub(
        &self,
        volume: Option<&str>,
        rate_bytes_per_s: Option<u64>,
        detach: bool,
    ) -> Result<()> {
        let mut body = serde_json::Map::new();
        if let Some(v) = volume {
            body.insert("volume".into(), json!(v));
        }
        if let Some(r) = rate_bytes_per_s {
            body.insert("rate_bytes_per_s".into(), json!(r));
        }
        if detach {
            body.insert("wait".into(), json!(false));
            let answer = self.call("POST", "/api/v1/scrub", Some(Value::Object(body)))?;
            return self.print(&answer, |_| {
                let scope = volume.map_or_else(|| "all".to_string(), str::to_string);
                println!(
                    "scrub of {} started; it runs on the daemon: its progress in `strata status`, \
                     its report with `strata scrub --last` once it ends, `strata scrub --cancel` \
                     stops it",
                    scope_text(&scope)
                );
                Ok(())
            });
        }
        let answer = self.showing_progress(|| {
            self.call_on(&self.patient_agent, "POST", "/api/v1/scrub", Some(Value::Object(body)))
        })?;
        let report: ScrubReportJson = serde_json::from_value(answer.clone())
            .map_err(|e| anyhow!("unexpected answer from the daemon: {e}"))?;
        self.print(&answer, |_| {
            print!("{}", render(&report));
            Ok(())
        })?;
        if report.clean {
            return Ok(());
        }
        Err(DamageFound(damage_line(&report)).into())
    }

    /// `strata scrub --last`: the last finished scrub's report (kept across restarts), with
    /// the exit status a scrub that found it would have had.
    pub fn last_scrub(&self) -> Result<()> {
        let answer = self.call("GET", "/api/v1/scrub", None)?;
        let status: ScrubStatusJson = serde_json::from_value(answer.clone())
            .map_err(|e| anyhow!("unexpected answer from the daemon: {e}"))?;
        let running = status
            .progress
            .running
            .then(|| progress_text(status.progress.progress_bytes, status.progress.total_bytes));
        let Some(report) = status.last else {
            let now = running.map_or_else(String::new, |r| format!(" (one runs: {r})"));
            return Err(anyhow!("no scrub has ended on this disk group yet{now}"));
        };
        self.print(&answer["last"], |_| {
            print!("{}", render(&report));
            if let Some(r) = running {
                println!("(another scrub runs now: {r})");
            }
            Ok(())
        })?;
        if report.clean {
            return Ok(());
        }
        Err(DamageFound(damage_line(&report)).into())
    }

    /// `strata scrub --cancel`: stops the running scrub (an error when none runs).
    pub fn cancel_scrub(&self) -> Result<()> {
        let answer = self.call("DELETE", "/api/v1/scrub", None)?;
        let status: ScrubStatusJson = serde_json::from_value(answer.clone())
            .map_err(|e| anyhow!("unexpected answer from the daemon: {e}"))?;
        self.print(&answer, |_| {
            if status.progress.running {
                println!("asked the scrub to stop; it is still running (see `strata status`)");
            } else {
                println!("the scrub stopped; the last result is still the previous scrub's");
            }
            Ok(())
        })
    }

    /// Runs `work` while a second thread shows the scrub's progress on stderr (a terminal only).
    fn showing_progress<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        let stderr = std::io::stderr();
        if !stderr.is_terminal() {
            return work();
        }
        let (done_tx, done_rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(PROGRESS_INTERVAL) {
                    if let Some(line) = self.progress_line() {
                        eprint!("\r\x1b[K{line}");
                        let _ = std::io::stderr().flush();
                    }
                }
                eprint!("\r\x1b[K");
            });
            let result = work();
            drop(done_tx);
            result
        })
    }

    fn progress_line(&self) -> Option<String> {
        // Not `call`: a daemon still starting is waited for (and said so) by the scrub's request.
        let v = self
            .call_once(&self.agent, "GET", "/api/v1/scrub", None)
            .ok()?;
        let s: ScrubStatusJson = serde_json::from_value(v).ok()?;
        s.progress.running.then(|| progress_text(s.progress.progress_bytes, s.progress.total_bytes))
    }
}

/// "scrubbing: 42% (1.2 GiB of 2.8 GiB read)"; the total is an estimate, so never past 99%.
fn progress_text(done_bytes: u64, total_bytes: u64) -> String {
    if total_bytes == 0 {
        return format!("scrubbing: {} read", format_size(done_bytes));
    }
    let percent = (done_bytes as f64 / total_bytes as f64 * 100.0).min(99.0);
    format!(
        "scrubbing: {percent:.0}% ({} of about {} read)",
        format_size(done_bytes),
        format_size(total_bytes)
    )
}

fn scope_text(scope: &str) -> String {
    if scope == "all" {
        "all volumes and snapshots".into()
    } else {
        format!("volume {scope} and its snapshots")
    }
}

/// The report for a terminal: what was checked, the bad blocks as a table, the metadata lists,
/// and a verdict.
pub fn render(r: &ScrubReportJson) -> String {
    let took = r.finished_unix_s.saturating_sub(r.started_unix_s);
    let mut out = format!(
        "scrub of {}: {} to {} ({})\nchecked      {} of data, {} metadata copies\n",
        scope_text(&r.scope),
        super::utc_time(r.started_unix_s),
        super::utc_time(r.finished_unix_s),
        duration(took),
        format_size(r.data_bytes_verified),
        r.metadata_copies_checked,
    );
    out.push_str(&bad_blocks(r));
    out.push_str(&list("repaired", &r.metadata_repaired));
    out.push_str(&list("damaged", &r.metadata_damaged));
    out.push_str(&format!("result       {}\n", verdict(r)));
    out
}

fn bad_blocks(r: &ScrubReportJson) -> String {
    if r.bad_blocks_total == 0 {
        return "bad blocks   none\n".into();
    }
    let listed = r.bad_blocks.len() as u64;
    let mut out = format!("bad blocks   {}", r.bad_blocks_total);
    if listed < r.bad_blocks_total {
        out.push_str(&format!(" (the first {listed} listed)"));
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = r
        .bad_blocks
        .iter()
        .map(|b| vec![b.volume.clone(), b.offset.to_string(), b.tier.clone(), b.problem.clone()])
        .collect();
    let t = table(&["VOLUME", "OFFSET", "TIER", "PROBLEM"], &rows);
    out.extend(t.lines().map(|l| format!("  {l}\n")));
    out
}

/// `repaired     none`, or the count then one indented line per item.
fn list(label: &str, items: &[String]) -> String {
    if items.is_empty() {
        return format!("{label:<12} none\n");
    }
    let mut out = format!("{label:<12} {} metadata copy(ies)\n", items.len());
    out.extend(items.iter().map(|i| format!("  {i}\n")));
    out
}

fn verdict(r: &ScrubReportJson) -> String {
    if r.clean {
        return "clean: nothing damaged".into();
    }
    let mut what = Vec::new();
    if r.bad_blocks_total > 0 {
        what.push(format!(
            "{} bad data block(s): reads of them fail with I/O errors; restore them from a backup",
            r.bad_blocks_total
        ));
    }
    if !r.metadata_damaged.is_empty() {
        what.push(format!("{} metadata structure(s) left damaged", r.metadata_damaged.len()));
    }
    if !r.metadata_repaired.is_empty() {
        what.push(format!(
            "{} metadata copy(ies) repaired from the good copy: check the devices",
            r.metadata_repaired.len()
        ));
    }
    format!("DAMAGE FOUND: {}", what.join("; "))
}

fn damage_line(r: &ScrubReportJson) -> String {
    format!(
        "the scrub of {} found damage: {} bad block(s), {} metadata copy(ies) repaired, {} metadata structure(s) damaged",
        scope_text(&r.scope),
        r.bad_blocks_total,
        r.metadata_repaired.len(),
        r.metadata_damaged.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api_scrub::BadBlockJson;

    fn report() -> ScrubReportJson {
        ScrubReportJson {
            scope: "all".into(),
            started_unix_s: 1_700_000_000,
            finished_unix_s: 1_700_000_075,
            data_bytes_verified: 96 << 20,
            metadata_copies_checked: 40,
            bad_blocks_total: 0,
            bad_blocks: Vec::new(),
            metadata_repaired: Vec::new(),
            metadata_damaged: Vec::new(),
            clean: true,
        }
    }

    #[test]
    fn a_clean_report_says_so() {
        let page = render(&report());
        for want in [
            "scrub of all volumes and snapshots: 2023-11-14 22:13:20Z to 2023-11-14 22:14:35Z (1m 15s)\n",
            "checked      96 MiB of data, 40 metadata copies\n",
            "bad blocks   none\n",
            "repaired     none\n",
            "damaged      none\n",
            "result       clean: nothing damaged\n",
        ] {
            assert!(page.contains(want), "missing {want:?} in\n{page}");
        }
    }

    #[test]
    fn damage_is_a_table_and_lists() {
        let bad = |volume: &str, offset, tier: &str| BadBlockJson {
            volume: volume.into(),
            offset,
            tier: tier.into(),
            problem: "checksum mismatch".into(),
        };
        let r = ScrubReportJson {
            scope: "db".into(),
            bad_blocks_total: 3,
            bad_blocks: vec![bad("db", 12288, "capacity"), bad("db@nightly", 209715200, "fast")],
            metadata_repaired: vec!["device /d/cap-a.img: superblock copy B rewritten from the other".into()],
            clean: false,
            ..report()
        };
        let page = render(&r);
        assert!(page.starts_with("scrub of volume db and its snapshots:"), "{page}");
        assert!(page.contains("bad blocks   3 (the first 2 listed)\n"), "{page}");
        let lines: Vec<&str> = page.lines().collect();
        let head = lines.iter().position(|l| l.trim_start().starts_with("VOLUME")).expect(&page);
        let col = lines[head].find("OFFSET").unwrap();
        assert!(lines[head + 1][col..].starts_with("12288 "), "{page}");
        assert!(lines[head + 2].contains("db@nightly") && lines[head + 2][col..].starts_with("209715200 "), "{page}");
        assert!(lines[head + 2].contains("fast"), "{page}");
        assert!(page.contains("repaired     1 metadata copy(ies)\n  device /d/cap-a.img: superblock copy B"), "{page}");
        assert!(page.contains("result       DAMAGE FOUND: 3 bad data block(s)"), "{page}");
        let line = damage_line(&r);
        assert!(!line.contains('\n'));
        assert!(line.contains("3 bad block(s), 1 metadata copy(ies) repaired, 0 metadata structure(s) damaged"), "{line}");
    }

    #[test]
    fn repaired_metadata_alone_is_damage_found() {
        let r = ScrubReportJson {
            metadata_repaired: vec!["checkpoint: copy A was damaged; both copies rewritten".into()],
            clean: false,
            ..report()
        };
        assert!(verdict(&r).starts_with("DAMAGE FOUND: 1 metadata copy(ies) repaired"), "{}", verdict(&r));
    }

    #[test]
    fn progress_never_claims_more_than_it_knows() {
        assert_eq!(progress_text(1 << 30, 4 << 30), "scrubbing: 25% (1 GiB of about 4 GiB read)");
        assert_eq!(progress_text(5 << 30, 4 << 30), "scrubbing: 99% (5 GiB of about 4 GiB read)");
        assert_eq!(progress_text(4096, 0), "scrubbing: 4 KiB read");
    }
}
