//! `strata snapshot ...`: snapshots over the admin API, as a table or `--json`.
use anyhow::{bail, Result};
use serde_json::json;

use super::{path_segment, space_lines, Client};
use crate::api::SpaceJson;
use crate::api_snapshots::{SnapshotJson, SnapshotListJson};
use crate::config::format_size;
use crate::SnapshotCommand;

impl Client {
    pub fn snapshot(&self, cmd: SnapshotCommand) -> Result<()> {
        match cmd {
            SnapshotCommand::Create { volume, name } => {
                let path = format!(
                    "/api/v1/volumes/{}/snapshots",
                    path_segment("volume", &volume)?
                );
                let v = self.call("POST", &path, Some(json!({ "name": name })))?;
                self.print(&v, |v| {
                    let s: SnapshotJson = serde_json::from_value(v.clone())?;
                    println!(
                        "created snapshot {:?} of volume {:?} ({}): {} (read-only)",
                        s.name,
                        s.volume,
                        format_size(s.size_bytes),
                        s.export_uri
                    );
                    Ok(())
                })
            }
            SnapshotCommand::List { volume } => {
                let path = match &volume {
                    Some(vol) => {
                        format!("/api/v1/volumes/{}/snapshots", path_segment("volume", vol)?)
                    }
                    None => "/api/v1/snapshots".to_string(),
                };
                let v = self.call("GET", &path, None)?;
                self.print(&v, |v| {
                    let list: SnapshotListJson = serde_json::from_value(v.clone())?;
                    print!("{}", snapshot_table(&list.snapshots));
                    Ok(())
                })
            }
            SnapshotCommand::Info { volume, name } => {
                let v = self.call("GET", &one_path(&volume, &name)?, None)?;
                self.print(&v, |v| {
                    let s: SnapshotJson = serde_json::from_value(v.clone())?;
                    print!("{}", snapshot_info(&s));
                    Ok(())
                })
            }
            SnapshotCommand::Delete {
                volume,
                name,
                force,
            } => {
                let path = format!("{}?force={force}", one_path(&volume, &name)?);
                let v = self.call("DELETE", &path, None)?;
                self.print(&v, |_| {
                    println!("deleted snapshot {volume}@{name}");
                    Ok(())
                })
            }
        }
    }
}

/// The API path of one snapshot. An empty name would make the path the volume's list (with a
/// trailing slash), which the daemon answers as an unknown endpoint: refused here by name.
fn one_path(volume: &str, name: &str) -> Result<String> {
    if name.is_empty() {
        bail!("empty snapshot name: `strata snapshot list {volume}` shows the names");
    }
    Ok(format!(
        "/api/v1/volumes/{}/snapshots/{}",
        path_segment("volume", volume)?,
        path_segment("snapshot", name)?
    ))
}

pub fn snapshot_table(snapshots: &[SnapshotJson]) -> String {
    if snapshots.is_empty() {
        return "no snapshots\n".to_string();
    }
    let header = [
        "VOLUME",
        "SNAPSHOT",
        "SIZE",
        "CREATED",
        "EXCL FAST",
        "EXCL CAPACITY",
        "SHARED FAST",
        "SHARED CAPACITY",
        "CONNECTIONS",
        "EXPORT",
    ];
    let rows: Vec<Vec<String>> = snapshots
        .iter()
        .map(|s| {
            let bytes = |get: fn(&SpaceJson) -> u64| {
                s.space.as_ref().map_or("-".into(), |x| format_size(get(x)))
            };
            vec![
                s.volume.clone(),
                s.name.clone(),
                format_size(s.size_bytes),
                utc_time(s.created_unix_s),
                bytes(|x| x.exclusive_fast_bytes),
                bytes(|x| x.exclusive_capacity_bytes),
                bytes(|x| x.shared_fast_bytes),
                bytes(|x| x.shared_capacity_bytes),
                s.connections.to_string(),
                s.export_uri.clone(),
            ]
        })
        .collect();
    crate::status_text::table(&header, &rows)
}

pub fn snapshot_info(s: &SnapshotJson) -> String {
    format!(
        "snapshot:    {}\nvolume:      {}\nid:          {}\nsize:        {} ({} bytes)\ncreated:     {}\n{}connections: {}\nexport:      {} (read-only)\n",
        s.name,
        s.volume,
        s.id,
        format_size(s.size_bytes),
        s.size_bytes,
        utc_time(s.created_unix_s),
        s.space.as_ref().map_or(String::new(), space_lines),
        s.connections,
        s.export_uri
    )
}

/// `2026-11-22 10:31:02Z` from Unix seconds (UTC, proleptic Gregorian calendar).
pub fn utc_time(unix_s: u64) -> String {
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// (year, month, day) of a count of days since 1970-01-01: eras of 400 years (146,097 days)
/// starting on March 1st, so the leap day falls at the end of each year of the era.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_calendar_dates() {
        assert_eq!(utc_time(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc_time(951_782_400), "2000-02-29 00:00:00Z");
        assert_eq!(utc_time(1_700_000_000), "2023-11-14 22:13:20Z");
        assert_eq!(utc_time(4_107_542_399), "2100-02-28 23:59:59Z");
        assert_eq!(utc_time(4_107_542_400), "2100-03-01 00:00:00Z");
    }

    fn snap(volume: &str, name: &str) -> SnapshotJson {
        SnapshotJson {
            name: name.into(),
            volume: volume.into(),
            id: 7,
            size_bytes: 1 << 30,
            created_unix_s: 1_700_000_000,
            export_name: format!("{volume}@{name}"),
            export_uri: format!("nbd://127.0.0.1:10809/{volume}@{name}"),
            connections: 1,
            space: Some(SpaceJson {
                exclusive_fast_bytes: 4096,
                exclusive_capacity_bytes: 8 << 20,
                shared_fast_bytes: 0,
                shared_capacity_bytes: 1 << 20,
            }),
            io: Default::default(),
        }
    }

    #[test]
    fn table_shows_space_per_tier() {
        let t = snapshot_table(&[snap("db", "nightly"), snap("db", "weekly")]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        let col = lines[0].find("EXCL CAPACITY").unwrap();
        assert_eq!(&lines[1][col..col + 5], "8 MiB");
        assert!(lines[1].contains("2023-11-14 22:13:20Z"));
        assert!(lines[2].contains("nbd://127.0.0.1:10809/db@weekly"));
        assert_eq!(snapshot_table(&[]), "no snapshots\n");
        let unknown = SnapshotJson {
            space: None,
            ..snap("db", "new")
        };
        assert!(snapshot_table(&[unknown])
            .lines()
            .nth(1)
            .unwrap()
            .contains(" - "));
    }

    #[test]
    fn info_names_the_export_and_space() {
        let t = snapshot_info(&snap("db", "nightly"));
        assert!(t.contains("snapshot:    nightly\n"), "{t}");
        assert!(
            t.contains("exclusive:   4 KiB fast, 8 MiB capacity\n"),
            "{t}"
        );
        assert!(t.contains("shared:      0 B fast, 1 MiB capacity\n"), "{t}");
        assert!(t.contains("db@nightly (read-only)"), "{t}");
    }
}
