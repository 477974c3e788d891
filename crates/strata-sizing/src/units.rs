//! Parsers of the `strata size` flags: each returns a one-line reason clap prints as is.

/// Sizes in binary units, as everywhere in Strata: 4096, 32K, 1.5G, 300GiB, 2T.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let number: f64 = s[..split].parse().map_err(|_| {
        format!(
            "invalid size {text:?}: expected a number with an optional unit such as 32K, 300G, 2T"
        )
    })?;
    let shift = match s[split..].trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        unit => {
            return Err(format!(
                "invalid size {text:?}: unknown unit {unit:?} (use K, M, G, T or P)"
            ))
        }
    };
    let bytes = number * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("invalid size {text:?}: too large"));
    }
    Ok(bytes.round() as u64)
}

pub fn parse_block_size(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    if !(512..=(16 << 20)).contains(&bytes) {
        return Err(format!(
            "block size {text} is out of range: use 512 bytes to 16M"
        ));
    }
    Ok(bytes)
}

pub fn parse_capacity(text: &str) -> Result<u64, String> {
    match parse_size(text)? {
        0 => Err(format!("capacity {text} must be more than zero")),
        bytes => Ok(bytes),
    }
}

fn parse_number(text: &str, what: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("invalid {what} {text:?}: expected a number"))?;
    if !v.is_finite() {
        return Err(format!("invalid {what} {text:?}: expected a finite number"));
    }
    Ok(v)
}

pub fn parse_iops(text: &str) -> Result<f64, String> {
    let v = parse_number(text, "IOPS")?;
    if v <= 0.0 {
        return Err(format!("IOPS per VM must be more than zero, got {text}"));
    }
    Ok(v)
}

pub fn parse_read_pct(text: &str) -> Result<f64, String> {
    let v = parse_number(text.trim().trim_end_matches('%'), "read percentage")?;
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("read percentage {text} is out of range 0..100"));
    }
    Ok(v)
}

pub fn parse_peak(text: &str) -> Result<f64, String> {
    let v = parse_number(text, "peak-to-average factor")?;
    if !(1.0..=1000.0).contains(&v) {
        return Err(format!(
            "peak-to-average factor {text} is out of range: use 1 (flat) to 1000"
        ));
    }
    Ok(v)
}

/// A ratio in (0, 1] ("0.8") or a percentage ("80%").
pub fn parse_fill(text: &str) -> Result<f64, String> {
    let s = text.trim();
    let v = match s.strip_suffix('%') {
        Some(p) => parse_number(p, "fill ratio")? / 100.0,
        None => parse_number(s, "fill ratio")?,
    };
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!(
            "fill ratio {text} is out of range: use a ratio in (0, 1] or a percentage like 80%"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_binary() {
        assert_eq!(parse_size("32K"), Ok(32 * 1024));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("300G"), Ok(300 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert!(parse_size("12Q").unwrap_err().contains("unknown unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999P")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_block_size("256").is_err());
        assert!(parse_block_size("64M").is_err());
        assert!(parse_capacity("0").is_err());
    }

    #[test]
    fn ranges_are_checked() {
        assert_eq!(parse_read_pct("70"), Ok(70.0));
        assert_eq!(parse_read_pct("70%"), Ok(70.0));
        assert!(parse_read_pct("120").is_err());
        assert!(parse_read_pct("-1").is_err());
        assert!(parse_peak("0.5").is_err());
        assert_eq!(parse_peak("2"), Ok(2.0));
        assert_eq!(parse_fill("80%"), Ok(0.8));
        assert_eq!(parse_fill("0.7"), Ok(0.7));
        assert!(parse_fill("0").is_err());
        assert!(parse_fill("150%").is_err());
        assert!(parse_iops("0").is_err());
        assert!(parse_iops("NaN").is_err());
    }
}
