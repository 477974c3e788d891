//! Parsers of the `strata size` flags: each returns a one-line reason clap prints as is.

/// An I/O size, exact: a block size that is not whole bytes is a typo, not an estimate.
pub fn parse_block_size(text: &str) -> Result<u64, String> {
    let bytes = strata_units::parse_size(text).map_err(|e| e.to_string())?;
    if !(512..=(16 << 20)).contains(&bytes) {
        return Err(format!(
            "block size {text} is out of range: use 512 bytes to 16M"
        ));
    }
    Ok(bytes)
}

/// A VM's capacity, an estimate: a fraction is rounded to the nearest byte (`1.3T`).
pub fn parse_capacity(text: &str) -> Result<u64, String> {
    match strata_units::parse_size_rounded(text).map_err(|e| e.to_string())? {
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

/// More IOPS than any one VM's disk does (a bound on what the figures must hold).
const MAX_IOPS_PER_VM: f64 = 1e8;

pub fn parse_iops(text: &str) -> Result<f64, String> {
    let v = parse_number(text, "IOPS")?;
    if v <= 0.0 {
        return Err(format!("IOPS per VM must be more than zero, got {text}"));
    }
    if v > MAX_IOPS_PER_VM {
        return Err(format!(
            "IOPS per VM {text} is beyond any device (at most {MAX_IOPS_PER_VM:e})"
        ));
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
        assert_eq!(parse_block_size("32K"), Ok(32 * 1024));
        assert_eq!(parse_block_size("4096"), Ok(4096));
        assert_eq!(parse_capacity("300G"), Ok(300 << 30));
        assert_eq!(parse_capacity("1.5GiB"), Ok(3 << 29));
        assert!(parse_block_size("12Q")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_capacity("lots").is_err());
        assert!(parse_capacity("99999999999P")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_block_size("256").is_err());
        assert!(parse_block_size("64M").is_err());
        assert!(parse_capacity("0").is_err());
    }

    #[test]
    fn a_capacity_rounds_a_fraction_and_a_block_size_does_not() {
        // 1.3 x 2^40 is 1,429,365,116,108.8 bytes.
        assert_eq!(parse_capacity("1.3T"), Ok(1_429_365_116_109));
        assert_eq!(parse_capacity("0.3K"), Ok(307));
        let e = parse_block_size("4.1K").unwrap_err();
        assert!(e.contains("not a whole number of bytes"), "{e}");
        assert_eq!(parse_block_size("1.5K"), Ok(1536));
        // One grammar for both: what the daemon refuses as text is refused here too.
        for bad in [".5T", "1.T", "1e3", "1 T B"] {
            assert!(
                parse_capacity(bad).unwrap_err().starts_with("invalid size"),
                "{bad}"
            );
            assert!(
                parse_block_size(bad)
                    .unwrap_err()
                    .starts_with("invalid size"),
                "{bad}"
            );
        }
        // Rounded down to nothing is no capacity.
        assert!(parse_capacity("0.1")
            .unwrap_err()
            .contains("more than zero"));
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
        // Beyond any device: the figures would be infinities.
        assert!(parse_iops("1e300").is_err());
        assert_eq!(parse_iops("2500"), Ok(2500.0));
    }
}
